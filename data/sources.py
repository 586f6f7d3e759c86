"""Where documents come from: the embedded corpus and Hugging Face `datasets` (hub or local).

Both return a `datasets.Dataset` (or `IterableDataset` when streaming) with a text column;
tokenization and packing happen in data/packing.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import hashlib
import os
import platform
import re
import sysconfig
from typing import TYPE_CHECKING

import numpy as np

from data.config import DataConfig
from data.tokenizer import token_dtype
from errors import ConfigError, one_line

if TYPE_CHECKING:  # imported where used: `datasets` (with pandas, pyarrow) costs ~1 s to import
    import datasets

# --- embedded corpus ---------------------------------------------------------------------

# Tests are skipped: they are a large, repetitive share of the stdlib and some are
# deliberately malformed (bad encodings, syntax errors).
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def stdlib_documents(max_bytes: int) -> tuple[list[str], list[str]]:
    """(relative paths, texts) of the stdlib's *.py files in sorted walk order, <= max_bytes.

    The last file is cut so the corpus holds exactly min(max_bytes, available) UTF-8 bytes
    (give or take a split multi-byte character). The content depends on the Python version,
    down to the patch release (`corpus_fingerprint` tells corpora apart).
    """
    paths, texts = _stdlib_documents(max_bytes)
    return list(paths), list(texts)


def corpus_fingerprint(cfg: DataConfig) -> str | None:
    """A short name of the exact corpus data=embedded trains on, recorded in every checkpoint
    and compared on resume: the Python version whose standard library it is built from and a
    hash of its files' names and contents. None for the other sources (their identity is
    their config: data.path, data.subset, ...; synthetic data is made from its data fields)."""
    if cfg.name != "embedded" or cfg.max_bytes <= 0:
        return None
    paths, texts = _stdlib_documents(cfg.max_bytes)
    h = hashlib.sha256()
    for path, text in zip(paths, texts):
        h.update(path.encode() + b"\0" + text.encode("utf-8") + b"\0")
    return (
        f"data=embedded from Python {platform.python_version()} ({len(paths)} files, "
        f"sha256 {h.hexdigest()[:16]})"
    )


@functools.lru_cache(maxsize=2)
def _stdlib_documents(max_bytes: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """stdlib_documents, read once per process (the fingerprint and the dataset share it)."""
    root = sysconfig.get_paths()["stdlib"]
    paths, texts, remaining = [], [], max_bytes
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py") or name.startswith("test_"):
                continue
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                raw = f.read(remaining + 4)
            text = raw.decode("utf-8", errors="replace")
            encoded = text.encode("utf-8")
            if len(encoded) > remaining:
                text = encoded[:remaining].decode("utf-8", errors="ignore")
            if not text:
                continue
            paths.append(os.path.relpath(full, root))
            texts.append(text)
            remaining -= len(text.encode("utf-8"))
            if remaining <= 0:
                return tuple(paths), tuple(texts)
    return tuple(paths), tuple(texts)


def embedded_dataset(cfg: DataConfig) -> datasets.Dataset:
    """The Python standard library's own source as a `datasets.Dataset` (columns path, text).

    Built in memory on every call (about a second for 8 MB): nothing is downloaded, nothing is
    stored in the repo, and no cache can go stale.
    """
    if cfg.max_bytes <= 0:
        raise ConfigError(f"data.max_bytes={cfg.max_bytes} must be > 0")
    paths, texts = stdlib_documents(cfg.max_bytes)
    if not texts:
        raise ConfigError(
            f"data=embedded found no Python source under {sysconfig.get_paths()['stdlib']!r}; "
            "use data=hf with data.path=<your text files>"
        )
    import datasets

    return datasets.Dataset.from_dict({"path": paths, "text": texts})


# --- synthetic documents -----------------------------------------------------------------


def synthetic_lengths(cfg: DataConfig, rng: np.random.Generator) -> np.ndarray:
    """data=synthetic's document lengths in tokens (BOS and EOS included), in stream order,
    enough of them for data.max_bytes tokens (data.doc_len_dist):

    - fixed: every document data.doc_len;
    - exponential: 1 + geometric(1 / (doc_len - 1)), at least 2, mean doc_len;
    - lognormal: exp(N(ln(doc_len) - sigma^2 / 2, sigma^2)) rounded, so the mean is doc_len
      and the median doc_len x exp(-sigma^2 / 2) (sigma = data.doc_len_sigma); raised to 2
      and cut at data.max_bytes (a longer document is cut by the stream's end anyway);
    - whole_rows: every document ceil(doc_len / (seq_len + 1)) x (seq_len + 1), whole samples
      of the loader (it cuts sample i at i x (seq_len + 1)), so no sample holds a boundary.

    Drawn in batches of 2 x max_bytes / doc_len from `rng` until they reach max_bytes (in
    practice one batch, which for fixed and exponential is what earlier versions drew).
    """
    if cfg.doc_len_dist == "whole_rows":
        row = cfg.seq_len + 1
        length = -(-cfg.doc_len // row) * row
        return np.full(-(-cfg.max_bytes // length), length, dtype=np.int64)
    count = -(-cfg.max_bytes // cfg.doc_len) * 2
    parts, total = [], 0
    while total < cfg.max_bytes:
        if cfg.doc_len_dist == "fixed":
            part = np.full(count, cfg.doc_len, dtype=np.int64)
        elif cfg.doc_len_dist == "exponential":  # 2 + (geometric - 1): BOS and EOS, mean doc_len
            part = 1 + rng.geometric(1 / max(cfg.doc_len - 1, 1), size=count)
        elif cfg.doc_len_dist == "lognormal":
            sigma = cfg.doc_len_sigma
            drawn = rng.lognormal(np.log(cfg.doc_len) - sigma**2 / 2, sigma, size=count)
            part = np.clip(np.rint(drawn), 2, cfg.max_bytes).astype(np.int64)
        else:
            raise ConfigError(
                f"data.doc_len_dist={cfg.doc_len_dist!r} is not one of fixed, exponential, "
                "lognormal, whole_rows; set data.doc_len_dist to one of them"
            )
        parts.append(part)
        total += int(part.sum())
    lengths = np.concatenate(parts)
    return lengths[: np.searchsorted(np.cumsum(lengths), cfg.max_bytes) + 1]


def synthetic_tokens(cfg: DataConfig, tok) -> np.ndarray:
    """data=synthetic: a token stream of data.max_bytes tokens packed as every corpus is
    ([BOS] ids [EOS] per document), ids drawn uniformly from the ordinary ids (those below
    the smallest special id: `SyntheticVocabulary`'s model.vocab_size - 2, the byte
    tokenizer's 256) and document lengths from `synthetic_lengths`. A function of the data
    fields (the generator seeded by data.doc_len), so every rank and every resume builds the
    same stream; made for throughput measurements at a known document length."""
    if cfg.max_bytes <= 0:
        raise ConfigError(f"data.max_bytes={cfg.max_bytes} must be > 0")
    rng = np.random.default_rng([7, cfg.doc_len])
    lengths = synthetic_lengths(cfg, rng)
    ends = np.cumsum(lengths)
    specials = {tok.eos_id} | ({tok.bos_id} if tok.bos_id is not None else set())
    ordinary = min(specials)  # the byte tokenizer's and Llama's specials follow the ordinary ids
    tokens = rng.integers(0, ordinary, size=int(ends[-1]), dtype=np.int64)
    starts = ends - lengths
    tokens[ends - 1] = tok.eos_id
    if tok.bos_id is not None:
        tokens[starts] = tok.bos_id
    return tokens[: cfg.max_bytes].astype(token_dtype(tok))


def synthetic_summary(cfg: DataConfig) -> str:
    """data=synthetic's document lengths in words, for the data log line."""
    d = cfg.doc_len_dist
    if d == "whole_rows":
        rows = -(-cfg.doc_len // (cfg.seq_len + 1))
        return (
            f"documents of {rows} whole sample{'s' * (rows > 1)} "
            f"({rows * (cfg.seq_len + 1):,} tokens; no boundary inside a sample)"
        )
    if d == "lognormal":
        return f"documents of log-normal length, mean {cfg.doc_len:,}, sigma {cfg.doc_len_sigma}"
    if d == "exponential":
        return f"documents of geometric length, mean {cfg.doc_len:,}"
    return f"documents of {cfg.doc_len:,} tokens"


# --- Hugging Face datasets ---------------------------------------------------------------

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".lz4")
_LOCAL_PREFIXES = ("/", "./", "../", "~", ".\\", "..\\")


def _builder_for(path: str) -> str | None:
    """datasets builder for a file name, looking through one compression suffix."""
    stem = path.lower()
    for suffix in _COMPRESSION:
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    return _BUILDERS.get(os.path.splitext(stem)[1])


#: What a hub dataset name can be: `name` or `owner/name` (letters, digits, `_ . -`).
_HUB_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?")


def _looks_local(path: str) -> bool:
    """A path, not a hub name: `/`, `./`, `~` ahead, a data file's extension, a trailing
    slash, what no hub name can be (`a/b/c`, spaces), or a folder that exists ahead of it."""
    if path.startswith(_LOCAL_PREFIXES) or _builder_for(path) is not None:
        return True
    if path.endswith(("/", "\\")) or not _HUB_NAME.fullmatch(path):
        return True
    parent = os.path.dirname(os.path.expanduser(path))
    return bool(parent) and os.path.isdir(parent)


def resolve_local_files(path: str) -> list[str] | None:
    """Sorted data files for a local file, directory (recursive) or glob; None = a hub name."""
    expanded = os.path.expanduser(path)
    supported = "/".join(sorted(_BUILDERS))
    if glob.has_magic(expanded):
        files = sorted(f for f in glob.glob(expanded, recursive=True) if os.path.isfile(f))
        if not files:
            raise ConfigError(f"data.path={path!r} matched no files; fix the pattern")
        unsupported = [f for f in files if _builder_for(f) is None]
        if unsupported:
            raise ConfigError(
                f"data.path={path!r} matched {unsupported[0]!r}, which is not {supported}; "
                "narrow the pattern"
            )
        return files
    if os.path.isdir(expanded):
        files = sorted(
            f
            for f in glob.glob(os.path.join(expanded, "**", "*"), recursive=True)
            if os.path.isfile(f) and _builder_for(f) is not None
        )
        if not files:
            raise ConfigError(
                f"data.path={path!r} is a directory without {supported} files; "
                "point data.path at your data files"
            )
        return files
    if os.path.isfile(expanded):
        if _builder_for(expanded) is None:
            raise ConfigError(
                f"data.path={path!r} is not a {supported} file; convert it or use one of those"
            )
        return [expanded]
    if _looks_local(path):
        raise ConfigError(
            f"data.path={path!r} does not exist (relative paths start at {os.getcwd()}); give "
            f"an existing file, directory or glob of {supported} files, or a hub dataset name"
        )
    return None


def _maybe_cached(name: str, cache_dir: str | None) -> bool:
    """Whether the hub cache or the datasets cache may hold dataset `name` (a look at their
    folders' names only: a false yes leaves the decision to `datasets`)."""
    from huggingface_hub import constants

    home = os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface"))
    datasets_cache = cache_dir or os.environ.get("HF_DATASETS_CACHE", f"{home}/datasets")
    short = name.rsplit("/", 1)[-1].lower()
    for folder in (constants.HF_HUB_CACHE, os.path.expanduser(datasets_cache)):
        try:
            if any(short in entry.lower() for entry in os.listdir(folder)):
                return True
        except OSError:
            pass
    return False


def check_source(cfg: DataConfig) -> None:
    """The data source's own input, before the tokenizer and anything built (one line on
    failure): with data=hf, a local data.path must exist and hold files of a known type, and a
    hub name that is not cached must be reachable: refused at once when downloads are off or
    the hub's host cannot be reached (rather than half a minute of retries)."""
    if cfg.name != "hf" or not cfg.path or resolve_local_files(cfg.path) is not None:
        return
    if _maybe_cached(cfg.path, cfg.cache_dir):
        return
    from huggingface_hub import constants

    from data.tokenizer import hub_offline, hub_unreachable

    if hub_offline():
        why = "downloads are off (HF_HUB_OFFLINE=1)"
    elif (reason := hub_unreachable(constants.ENDPOINT)) is not None:
        why = f"{constants.ENDPOINT} cannot be reached ({reason})"
    else:
        return
    raise ConfigError(
        f"data.path={cfg.path!r} is no local file or folder (relative paths start at "
        f"{os.getcwd()}) and, as a hub dataset name, is not in the local cache while {why}; "
        "give an existing file, directory or glob of data files, or download the dataset "
        "where there is network"
    )


@contextlib.contextmanager
def quiet_datasets():
    """No datasets progress bars inside: for work that takes about a second (the embedded
    corpus) or is no download (local files, which `load_dataset` would show as "Downloading
    data", in carriage-return updates that fill a log file)."""
    import datasets

    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if enabled:
            datasets.enable_progress_bars()


def hf_dataset(cfg: DataConfig) -> datasets.Dataset | datasets.IterableDataset:
    """`load_dataset` on local files (builder chosen by extension) or a hub dataset name.

    Non-streaming downloads and prepares the whole split (Arrow files, memory-mapped); for
    hub datasets larger than the local disk use data.streaming=true.
    """
    if not cfg.path:
        raise ConfigError("data.path is required with data=hf (a hub dataset name or local files)")
    import datasets

    files = resolve_local_files(cfg.path)
    if files is not None:
        builders = sorted({_builder_for(f) for f in files})
        if len(builders) > 1:
            raise ConfigError(
                f"data.path={cfg.path!r} mixes file types ({', '.join(builders)}); "
                "use files of one type"
            )
        # One .txt file is one document (like the embedded corpus), not one line.
        extra = {"sample_by": "document"} if builders[0] == "text" else {}
        try:
            with quiet_datasets():
                return datasets.load_dataset(
                    builders[0],
                    data_files={cfg.split: files},
                    split=cfg.split,
                    streaming=cfg.streaming,
                    cache_dir=cfg.cache_dir,
                    **extra,
                )
        except Exception as e:
            raise ConfigError(
                f"data.path={cfg.path!r} could not be read as {builders[0]} ({one_line(e)}); "
                "fix or convert the files"
            ) from None
    try:
        return datasets.load_dataset(
            cfg.path, cfg.subset, split=cfg.split, streaming=cfg.streaming, cache_dir=cfg.cache_dir
        )
    except Exception as e:
        raise ConfigError(
            f"data.path={cfg.path!r} is not a local path and could not be loaded from the hub "
            f"({one_line(e)}); check the name, data.subset, data.split, network or HF_TOKEN"
        ) from None


def check_text_field(ds, cfg: DataConfig) -> None:
    """Fail early, naming the columns that exist, when data.text_field is not one of them."""
    columns = ds.column_names
    if columns is None:  # streaming without known features: look at the first row
        first = next(iter(ds), None)
        columns = [] if first is None else list(first)
    if cfg.text_field not in columns:
        raise ConfigError(
            f"data.text_field={cfg.text_field!r} is not a column of the dataset; available: "
            f"{', '.join(columns) or '(none: the dataset is empty)'}; set data.text_field"
        )


# --- held-out documents (eval.every > 0) -------------------------------------------------


def held_out_mask(n: int, fraction: float) -> np.ndarray:
    """Which of documents 0..n-1 are held out: i where floor((i + 1) * f) > floor(i * f), so
    floor(n * f) documents evenly spread (f = 0.01: 99, 199, ...). Fixed by the index alone."""
    i = np.arange(n, dtype=np.float64)
    return np.floor((i + 1) * fraction) > np.floor(i * fraction)


def is_held_out(i: int, fraction: float) -> bool:
    """`held_out_mask` for one index (streams: documents arrive one by one)."""
    return bool(np.floor((i + 1) * fraction) > np.floor(i * fraction))


def _selection(ds: datasets.Dataset, keep: np.ndarray, tag: str, fraction: float):
    # A fingerprint from the parent's and the rule (no hash of the index list): the token
    # cache keys on it, so the same documents always find the same entry.
    fingerprint = hashlib.sha256(f"{ds._fingerprint}|{tag}|{fraction!r}".encode()).hexdigest()
    return ds.select(np.flatnonzero(keep), new_fingerprint=fingerprint[:32])


def training_documents(ds, cfg: DataConfig):
    """`ds` without the documents held out for evaluation (data.eval_fraction)."""
    import datasets

    f = cfg.eval_fraction
    if isinstance(ds, datasets.IterableDataset):
        return ds.filter(lambda _, i: not is_held_out(i, f), with_indices=True)
    return _selection(ds, ~held_out_mask(len(ds), f), "train-without-held-out", f)


def eval_documents(cfg: DataConfig):
    """The held-out documents: the split data.eval_split (hf), else the documents
    `training_documents` leaves out, in dataset order."""
    if cfg.eval_split:
        if resolve_local_files(cfg.path) is not None:
            raise ConfigError(
                f"data.eval_split={cfg.eval_split!r} names a split of a hub dataset, but "
                f"data.path={cfg.path!r} is local files (one split); use data.eval_split=null "
                "and data.eval_fraction"
            )
        ds = hf_dataset(dataclasses.replace(cfg, split=cfg.eval_split))
        check_text_field(ds, cfg)
        return ds
    import datasets

    ds = embedded_dataset(cfg) if cfg.name == "embedded" else hf_dataset(cfg)
    check_text_field(ds, cfg)
    f = cfg.eval_fraction
    if isinstance(ds, datasets.IterableDataset):
        return ds.filter(lambda _, i: is_held_out(i, f), with_indices=True)
    return _selection(ds, held_out_mask(len(ds), f), "held-out", f)
