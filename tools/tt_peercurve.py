"""torchtitan custom import for the peer curve (docs/PEER_CURVE.md): this recipe's sample order.

    PYTHONPATH=<repo>/tools:<repo>/.peers:$PYTHONPATH torchrun ... -m torchtitan.train \
        --experimental.custom_import tt_peercurve --model.name llama3_same_order --model.flavor 80M ...

    python tools/tt_peercurve.py overrides 80M --seq-len 2048    # this recipe's model.* overrides
    python tools/tt_peercurve.py text /tmp/pc/text --bytes 17000000 --from stdlib torch
    python tools/tt_peercurve.py pack --dataset-path /tmp/pc/text --tokenizer /tmp/tt/tests/assets/tokenizer \
        --seq-len 2048 --cache /tmp/pc/tt-samples --check-ours     # (torchtitan importable)

Imported by torchtitan's trainer (v0.2.2: `Trainer.__init__` imports the custom module before
it looks up the train spec), this module

- imports the peers bundle's `tt_ext` (.peers/tt_ext.py: the Llama 3.2 1B shape as flavor
  "1B", untied, and the run-wide peak memory printed at exit),
- adds the flavors of PEER_SHAPES it lacks ("80M": a small Llama 3 whose vocabulary is the
  test tokenizer's, rounded up to 2,048), and
- registers the train spec `llama3_same_order`: torchtitan's own `llama3` spec with one part
  replaced, the data loader. Model, parallelism, mixed precision, optimizer, schedule,
  clipping, loss and the Hugging Face checkpoint load stay torchtitan's.

Why: both trainers pack the same way (every document as [BOS] + tokens + [EOS], in file
order, cut into samples of seq_len + 1 tokens), but they deal the samples out differently.
torchtitan's own text loader splits the *documents* between
the data-parallel ranks (rank r packs the r-th contiguous share of the file on its own) and
carries the unfinished sample across the end of the file into the next pass. This recipe
(data/loader.py, `data.shuffle=false`) packs the whole file into one stream, drops the tail
shorter than a sample, and gives global batch t the samples [t*G, (t+1)*G) of it, rank r the
rows [r*G/dp, (r+1)*G/dp) of those, the next pass starting again at sample 0. The loader here
hands each torchtitan rank exactly those rows, in that order (micro batches: consecutive
`training.local_batch_size` rows of the rank's share, as train.py splits them), so both
trainers see the same batch at every step.

`TT_PEERCURVE_SHIFT=0.5` starts the same order half a pass later: other batches at every
step (a torchtitan run on other data; the stage does not use it).

It reads the documents the way torchtitan's loader does (`training.dataset`,
`training.dataset_path`: a map-style dataset such as c4_test, or a folder with one JSON-lines
file such as `text` writes) and tokenizes with torchtitan's tokenizer
(`tokenizer.encode(text, add_bos=True, add_eos=True)`). With `TT_PEERCURVE_CACHE=<dir>` the
packed samples are kept there, keyed by the bytes of the data and tokenizer files and the
sample length, so that the runs of one call tokenize once: `pack` fills the entry ahead of
them (in parallel, and with `--check-ours` against this recipe's tokenizer as well).

The command line (`overrides`, `text`, `pack`) serves tests/gpu/suite.sh peercurve: this
recipe's overrides for a flavor, one JSON-lines file of Python source from the machine's own
installation (text that the runs do not repeat), and the packed samples.

Imported anywhere else (tests import `tools.tt_peercurve`), it registers nothing: the sample
order (`rank_sample_ids`), the packing (`pack_documents`) and the dataset class are plain code.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

#: The train spec this module registers inside torchtitan.
SPEC_NAME = "llama3_same_order"
#: Environment variable: start the order this share of a pass later (0.5: half a pass), for a
#: second torchtitan run on other batches (the spread of the reference; docs/PEER_CURVE.md).
SHIFT_ENV = "TT_PEERCURVE_SHIFT"
#: Environment variable: the folder of packed samples shared by the runs of a call.
CACHE_ENV = "TT_PEERCURVE_CACHE"
#: Bump when the packed samples' layout changes, so older entries are not read.
PACK_FORMAT = "tt-peercurve-samples-v1"


@dataclasses.dataclass(frozen=True)
class PeerShape:
    """A Llama 3 shape both trainers build: torchtitan's TransformerModelArgs (its FFN width
    from multiple_of and ffn_multiplier) and this recipe's model.* fields (ffn_dim given)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    multiple_of: int
    ffn_multiplier: float | None
    ffn_dim: int
    #: This recipe's config the overrides start from.
    ours_model: str
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5


#: The flavors of the peer curve. "1B" is .peers/tt_ext.py's (Llama 3.2 1B, untied, its
#: default vocabulary); "80M" is the stage's default: 12 blocks of width 768, 12 heads of 64,
#: 4 KV heads, FFN 2,048, and the test tokenizer's 2,004 ids in a vocabulary of 2,048 (78.7M
#: parameters), small enough that a run on one GPU reads ten million tokens in a minute or so.
PEER_SHAPES = {
    "80M": PeerShape(
        dim=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=4,
        vocab_size=2048,
        multiple_of=256,
        ffn_multiplier=None,
        ffn_dim=2048,
        ours_model="small",
    ),
    # The stage's smallest form on CPU (tests/test_peercurve.py), and a quick look on a GPU.
    "tiny": PeerShape(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=2048,
        multiple_of=64,
        ffn_multiplier=None,
        ffn_dim=192,
        ours_model="small",
    ),
    "1B": PeerShape(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=1024,
        ffn_multiplier=1.5,
        ffn_dim=8192,
        ours_model="llama3_1b",
    ),
}


def tt_ffn_dim(dim: int, multiple_of: int, multiplier: float | None) -> int:
    """torchtitan v0.2.2's FFN width (models/llama3 FeedForward, from 4 x dim): two thirds,
    times the multiplier, rounded up to a multiple of multiple_of."""
    hidden = int(2 * (4 * dim) / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def ours_overrides(flavor: str, seq_len: int) -> list[str]:
    """train.py's model overrides for `flavor` at this sample length: every field the shape
    fixes, untied, and RoPE scaled as torchtitan's default RoPEScalingArgs (factor 8, low 1,
    high 4, original 8192)."""
    s = PEER_SHAPES[flavor]
    out = [f"model={s.ours_model}"]
    if s.ours_model == "small":
        out.append(f"model.name=peer_{flavor}")
    out += [
        f"model.dim={s.dim}",
        f"model.n_layers={s.n_layers}",
        f"model.n_heads={s.n_heads}",
        f"model.n_kv_heads={s.n_kv_heads}",
        f"model.ffn_dim={s.ffn_dim}",
        f"model.vocab_size={s.vocab_size}",
        f"model.rope_theta={s.rope_theta}",
        f"model.norm_eps={s.norm_eps}",
        "model.tie_embeddings=false",
        "model.rope_scaling.factor=8.0",
        "model.rope_scaling.low_freq_factor=1.0",
        "model.rope_scaling.high_freq_factor=4.0",
        "model.rope_scaling.original_max_position_embeddings=8192",
    ]
    if s.ours_model == "small":
        out.append(f"model.max_seq_len={max(seq_len, 2048)}")
    return out


def rank_sample_ids(
    start: int,
    count: int,
    *,
    rank: int,
    dp: int,
    global_batch: int,
    n_samples: int,
    shift: int = 0,
) -> np.ndarray:
    """Indices into the packed samples of data-parallel rank `rank`'s samples number start ..
    start + count - 1 (counted from the run's first step): global batch t holds positions
    [t*G, (t+1)*G), the rank the L = G/dp positions from t*G + rank*L, and position p is
    sample (p + shift) mod n_samples (sequential order, every pass the same; shift 0 is this
    recipe's order, another shift the same order begun elsewhere)."""
    if global_batch % dp:
        raise ValueError(f"global batch {global_batch} is not divisible by dp {dp}")
    local = global_batch // dp
    k = np.arange(start, start + count, dtype=np.int64)
    batch, row = np.divmod(k, local)
    return (batch * global_batch + rank * local + row + shift) % n_samples


def pack_documents(documents: Iterable[list[int]], seq_len: int) -> np.ndarray:
    """The documents' ids (each already [BOS] + tokens + [EOS]) concatenated and cut into
    samples of seq_len + 1 tokens: an (n, seq_len + 1) int64 array, the tail dropped."""
    stream = np.fromiter((t for doc in documents for t in doc), dtype=np.int64)
    n = len(stream) // (seq_len + 1)
    return stream[: n * (seq_len + 1)].reshape(n, seq_len + 1)


class SameOrderDataset(IterableDataset, Stateful):
    """One data-parallel rank's samples of `samples` ((n, seq_len + 1) ids) in this recipe's
    order, endlessly; each item is torchtitan's ({"input": ids[:-1]}, ids[1:]). Its state is
    the number of samples it has handed out."""

    def __init__(
        self, samples: np.ndarray, *, rank: int, dp: int, global_batch: int, shift: int = 0
    ):
        if len(samples) < global_batch:
            raise ValueError(
                f"the data packs into {len(samples)} samples, fewer than one global batch "
                f"of {global_batch}"
            )
        self.samples = samples
        self.rank, self.dp, self.global_batch, self.shift = rank, dp, global_batch, shift
        self.taken = 0

    def __iter__(self) -> Iterator[tuple[dict, torch.Tensor]]:
        while True:
            (i,) = rank_sample_ids(
                self.taken,
                1,
                rank=self.rank,
                dp=self.dp,
                global_batch=self.global_batch,
                n_samples=len(self.samples),
                shift=self.shift,
            )
            self.taken += 1
            ids = torch.from_numpy(np.ascontiguousarray(self.samples[i]))
            yield {"input": ids[:-1]}, ids[1:]

    def state_dict(self) -> dict:
        return {"taken": self.taken}

    def load_state_dict(self, state_dict: dict) -> None:
        self.taken = int(state_dict["taken"])


def _files(path: str | Path) -> list[Path]:
    """The files a dataset or tokenizer path stands for: itself, or a folder's files (sorted,
    hidden ones left out)."""
    p = Path(path)
    if p.is_file():
        return [p]
    return sorted(
        f
        for f in p.rglob("*")
        if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
    )


def samples_key(dataset_path: str | Path, tokenizer_path: str | Path, seq_len: int) -> str:
    """The cache entry of packed samples: the bytes of every data and tokenizer file, the
    sample length and PACK_FORMAT."""
    h = hashlib.sha256(f"{PACK_FORMAT}|{seq_len}".encode())
    for root in (dataset_path, tokenizer_path):
        for f in _files(root):
            h.update(f"|{f.relative_to(root) if Path(root).is_dir() else f.name}|".encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:24]


def cached_samples(
    cache_dir: str | Path, key: str, make: Callable[[], np.ndarray]
) -> tuple[np.ndarray, bool]:
    """(samples, whether they came from the cache): the entry `key` of `cache_dir`, or
    make()'s samples, then stored there (written aside and renamed: a reader never sees half
    a file)."""
    path = Path(cache_dir) / f"{key}.npy"
    if path.is_file():
        return np.load(path), True
    samples = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{key}.tmp-{os.getpid()}.npy")
    np.save(tmp, samples)
    os.replace(tmp, path)
    return samples, False


_ENCODE: Callable[[str], list[int]] | None = None


def _encode_one(text: str) -> list[int]:
    return _ENCODE(text)


def encode_documents(
    texts: Sequence[str], encode: Callable[[str], list[int]], workers: int = 1
) -> list[list[int]]:
    """encode(text) of every text, in order; workers > 1: in that many forked processes."""
    if workers <= 1 or len(texts) < 2:
        return [encode(t) for t in texts]
    import multiprocessing

    global _ENCODE
    _ENCODE = encode
    try:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            return pool.map(_encode_one, texts, chunksize=max(1, len(texts) // (workers * 8)))
    finally:
        _ENCODE = None


def build_same_order_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite=True):
    """torchtitan's `build_dataloader_fn` for SPEC_NAME (same arguments as its
    build_text_dataloader; the order never ends, like its infinite loader)."""
    import datasets
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.hf_datasets.text_datasets import _validate_dataset
    from torchtitan.tools.logging import logger

    training = job_config.training
    path, load, text_of = _validate_dataset(training.dataset.lower(), training.dataset_path)

    def make() -> np.ndarray:
        docs = load(path)
        if not isinstance(docs, datasets.Dataset):
            raise ValueError(
                f"{SPEC_NAME}: training.dataset {training.dataset} is streamed; the same order "
                "needs a map-style dataset such as c4_test"
            )
        logger.info(f"{SPEC_NAME}: tokenizing {len(docs)} documents")
        encoded = (tokenizer.encode(text_of(d), add_bos=True, add_eos=True) for d in docs)
        return pack_documents(encoded, training.seq_len)

    cache = os.environ.get(CACHE_ENV)
    source = "tokenized here"
    if cache:
        key = samples_key(path, job_config.model.hf_assets_path, training.seq_len)
        samples, hit = cached_samples(cache, key, make)
        source = f"from {cache}/{key}.npy" if hit else f"tokenized here, kept in {cache}"
    else:
        samples = make()
    global_batch = training.global_batch_size
    if global_batch < 0:
        global_batch = training.local_batch_size * dp_world_size
    shift = round(float(os.environ.get(SHIFT_ENV, "0")) * len(samples))
    logger.info(
        f"{SPEC_NAME}: {len(samples)} samples of {training.seq_len + 1} tokens a pass "
        f"({source}), starting at sample {shift}; dp rank {dp_rank} of {dp_world_size} takes "
        f"rows {dp_rank * global_batch // dp_world_size}.. of each global batch of {global_batch}"
    )
    dataset = SameOrderDataset(
        samples, rank=dp_rank, dp=dp_world_size, global_batch=global_batch, shift=shift
    )
    kwargs = {**dataclasses.asdict(training.dataloader), "batch_size": training.local_batch_size}
    return ParallelAwareDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, **kwargs)


def register() -> None:
    """tt_ext's 1B flavor, the other PEER_SHAPES, and SPEC_NAME: torchtitan's llama3 spec
    with this loader."""
    import tt_ext  # noqa: F401  # the peers bundle's: flavor "1B", peak memory at exit
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

    for flavor, s in PEER_SHAPES.items():
        llama3_args.setdefault(
            flavor,
            TransformerModelArgs(
                dim=s.dim,
                n_layers=s.n_layers,
                n_heads=s.n_heads,
                n_kv_heads=s.n_kv_heads,
                vocab_size=s.vocab_size,
                multiple_of=s.multiple_of,
                ffn_dim_multiplier=s.ffn_multiplier,
                norm_eps=s.norm_eps,
                rope_theta=s.rope_theta,
            ),
        )
    spec = get_train_spec("llama3")
    register_train_spec(
        SPEC_NAME, dataclasses.replace(spec, build_dataloader_fn=build_same_order_dataloader)
    )


# --------------------------------------------------------------------------------------
# Command line (tests/gpu/suite.sh peercurve)

#: Folders never read for text: installed packages inside the standard library's folder, and
#: byte code.
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def source_root(name: str) -> Path:
    """The folder of a Python source: "stdlib" (this interpreter's standard library) or an
    installed package's folder, found without importing it."""
    if name == "stdlib":
        import sysconfig

        return Path(sysconfig.get_paths()["stdlib"])
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"text: {name!r} is neither stdlib nor an installed package")
    return Path(next(iter(spec.submodule_search_locations)))


def python_files(root: Path) -> Iterator[Path]:
    """Every .py file under root, depth first in sorted order (SKIP_DIRS left out)."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for name in sorted(files):
            if name.endswith(".py"):
                yield Path(folder) / name


def write_text(out_dir: Path, target_bytes: int, sources: Sequence[str]) -> dict:
    """out_dir/data.json: one JSON line {"text": ...} per Python file of `sources`, in order,
    until target_bytes of text. A file that is not UTF-8, is empty or holds "<|" (the text of a
    special token such as <|end_of_text|>, which the two trainers' tokenizers treat
    differently) is left out. Returns what was written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "data.json"
    digest, files, total = hashlib.sha256(), 0, 0
    with path.open("w", encoding="utf-8") as out:
        for name in sources:
            for f in python_files(source_root(name)):
                try:
                    text = f.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                if not text.strip() or "<|" in text:
                    continue
                line = json.dumps({"text": text}) + "\n"
                out.write(line)
                digest.update(line.encode())
                files += 1
                total += len(text.encode())
                if total >= target_bytes:
                    break
            if total >= target_bytes:
                break
    return {
        "path": str(path),
        "files": files,
        "bytes": total,
        "sha256": digest.hexdigest(),
        "sources": [f"{n}={source_root(n)}" for n in sources],
        "enough": total >= target_bytes,
    }


def pack_main(args) -> int:
    """Tokenize the dataset once with torchtitan's tokenizer and store its samples for each
    sample length (needs torchtitan importable); --check-ours: this recipe's tokenizer too,
    exit status 3 when a document's ids differ."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import _validate_dataset

    path, load, text_of = _validate_dataset(args.dataset, args.dataset_path)
    texts = [text_of(d) for d in load(path)]
    tok = HuggingFaceTokenizer(args.tokenizer)

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_bos=True, add_eos=True)

    ids = encode_documents(texts, encode, args.workers)
    tokens = sum(len(d) for d in ids)
    print(f"pack: {len(texts)} documents, {tokens:,} tokens (torchtitan's tokenizer)")
    for seq in args.seq_len:
        key = samples_key(path, args.tokenizer, seq)
        samples, hit = cached_samples(args.cache, key, lambda seq=seq: pack_documents(ids, seq))
        state = "already there" if hit else "written"
        print(f"pack: seq {seq}: {len(samples)} samples, {args.cache}/{key}.npy {state}")
    if not args.check_ours:
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from data.tokenizer import HFTokenizer, documents_to_ids, token_dtype

    ours = HFTokenizer(args.tokenizer)
    theirs_docs = ids
    ours_docs = documents_to_ids(ours, texts, token_dtype(ours))
    for i, (a, b) in enumerate(zip(theirs_docs, ours_docs)):
        if list(a) != b.tolist():
            print(
                f"pack: document {i} is tokenized differently by this recipe ({len(b)} ids) and "
                f"torchtitan ({len(a)} ids): the two runs would read different samples"
            )
            return 3
    print(f"pack: this recipe's tokenizer gives the same {tokens:,} tokens")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The peer curve's helpers (docs/PEER_CURVE.md).")
    sub = parser.add_subparsers(dest="command", required=True)
    o = sub.add_parser("overrides", help="print this recipe's model overrides for a flavor")
    o.add_argument("flavor", choices=sorted(PEER_SHAPES))
    o.add_argument("--seq-len", type=int, required=True)
    t = sub.add_parser("text", help="write DIR/data.json from Python source files")
    t.add_argument("out", type=Path, help="the folder (torchtitan's training.dataset_path)")
    t.add_argument("--bytes", type=int, required=True, help="stop after this much text")
    t.add_argument("--from", dest="sources", nargs="+", default=["stdlib"], metavar="SOURCE")
    t.add_argument("--info", type=Path, help="also write what was written as JSON")
    k = sub.add_parser("pack", help="torchtitan's tokenization of the data, into the cache")
    k.add_argument("--dataset", default="c4_test", help="torchtitan's dataset (its loader)")
    k.add_argument("--dataset-path", required=True)
    k.add_argument("--tokenizer", required=True, help="the tokenizer folder")
    k.add_argument("--seq-len", type=int, nargs="+", required=True)
    k.add_argument("--cache", required=True, help="the folder of TT_PEERCURVE_CACHE")
    k.add_argument("--workers", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 2)))
    k.add_argument("--check-ours", action="store_true", help="compare this recipe's tokens")
    args = parser.parse_args(argv)
    if args.command == "overrides":
        print(" ".join(ours_overrides(args.flavor, args.seq_len)))
        return 0
    if args.command == "text":
        info = write_text(args.out, args.bytes, args.sources)
        if args.info:
            args.info.write_text(json.dumps(info, indent=1) + "\n")
        print(
            f"text: {info['files']} files, {info['bytes']:,} bytes in {info['path']} "
            f"(sha256 {info['sha256'][:16]}; {', '.join(info['sources'])})"
            + ("" if info["enough"] else f": less than the {args.bytes:,} bytes asked for")
        )
        return 0
    return pack_main(args)


# Inside torchtitan's trainer (its train-spec registry is loaded): register. Anywhere else
# (the tests), nothing happens on import.
if "torchtitan.protocols.train_spec" in sys.modules:
    register()

if __name__ == "__main__":
    sys.exit(main())
