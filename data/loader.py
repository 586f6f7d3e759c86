"""The resumable, data-parallel-aware loader.

There is ONE global sample order, independent of the number of ranks: global batch t is
samples [t*G, (t+1)*G) of it (G = train.global_batch_size) and data-parallel rank r takes rows
[r*G/dp, (r+1)*G/dp). One process with G rows and two with G/2 rows see the same global batch,
and the state (global samples consumed, epoch) means the same thing at every dp size, so a
checkpoint saved at dp=4 resumes at dp=2 with no sample skipped or repeated.

Map-style (embedded, hf non-streaming): every rank reads the same packed token array; epoch e
is a permutation of all samples seeded by (data.shuffle_seed, e). A global batch may straddle
two epochs: the order is simply the concatenation of the epochs' permutations. data=embedded
(a few MB, built in about a second) is packed in memory by every rank; data=hf is tokenized
once into the token cache (data/token_cache.py, tools/prepare_data.py) and memory-mapped
read-only, so a rank's private memory does not grow with the corpus.

Streaming (hf, data.streaming=true): the order is the stream order (documents optionally
buffer-shuffled with data.shuffle_seed, reshuffled per epoch through `set_epoch`). Every rank
reads and tokenizes the whole stream and keeps its own rows, and resuming re-reads the current
epoch of the stream from its start up to the saved position: exact, but the skip costs time
proportional to the position within the epoch.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from data.config import DataConfig
from data.documents import DocumentBoundaries
from data.packing import join_documents, pack_dataset, split_documents, stream_samples
from data.sources import (
    check_text_field,
    corpus_fingerprint,
    embedded_dataset,
    eval_documents,
    hf_dataset,
    quiet_datasets,
    synthetic_summary,
    synthetic_tokens,
    training_documents,
)
from data.token_cache import load_tokens
from data.tokenizer import vocabulary_line
from errors import ConfigError


class _Position:
    """Shared bookkeeping: the batch layout and the (dp-size independent) position."""

    def __init__(
        self,
        seq_len: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        order: str,
        more_data_hint: str,
    ):
        self.seq_len = seq_len
        self.sample_len = seq_len + 1
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // dp_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.order = order
        self._more_data_hint = more_data_hint
        self.samples_consumed = 0
        self.epoch = 0
        self.epoch_start = 0
        self.samples_per_epoch: int | None = None
        #: data.document_mask's boundary rule, set by build_loader (None: no masking).
        self.boundaries: DocumentBoundaries | None = None

    def _too_small(self, n: int) -> Exception:
        return ConfigError(
            f"data: the dataset packs into {n} samples of data.seq_len+1={self.sample_len} "
            f"tokens, fewer than one global batch (train.global_batch_size="
            f"{self.global_batch_size}); {self._more_data_hint}, or lower data.seq_len or "
            "train.global_batch_size"
        )

    def state_dict(self) -> dict:
        """Plain ints/strings, identical on every rank (DCP keeps one copy)."""
        return {
            "samples_consumed": int(self.samples_consumed),
            "epoch": int(self.epoch),
            "epoch_start": int(self.epoch_start),
            "samples_per_epoch": -1
            if self.samples_per_epoch is None
            else int(self.samples_per_epoch),
            "seq_len": int(self.seq_len),
            "order": str(self.order),
        }

    def _check_compatible(self, state: dict) -> None:
        if int(state["seq_len"]) != self.seq_len:
            raise ConfigError(
                f"data.seq_len={self.seq_len} does not match the checkpoint's data position "
                f"(seq_len={int(state['seq_len'])}); resume with data.seq_len="
                f"{int(state['seq_len'])}"
            )
        if str(state["order"]) != self.order:
            raise ConfigError(
                f"data sample order {self.order!r} does not match the checkpoint's "
                f"{str(state['order'])!r}; resume with the same data.shuffle, "
                "data.shuffle_seed, data.shuffle_buffer and data.streaming"
            )
        saved_n = int(state["samples_per_epoch"])
        if (
            saved_n >= 0
            and self.samples_per_epoch is not None
            and saved_n != self.samples_per_epoch
        ):
            raise ConfigError(
                f"data: the dataset packs into {self.samples_per_epoch} samples per epoch but "
                f"the checkpoint's had {saved_n}: the data changed (data.path, data.tokenizer, "
                "data.max_bytes, or the Python version for data=embedded); resume with the "
                "same data"
            )


class PackedLoader(_Position):
    """Map-style loader over a flat token array (in memory or memory-mapped)."""

    def __init__(self, tokens: np.ndarray, *, shuffle: bool, shuffle_seed: int, **layout):
        order = f"shuffled(seed={shuffle_seed})" if shuffle else "sequential"
        super().__init__(order=order, **layout)
        n = len(tokens) // self.sample_len
        if n < self.global_batch_size:
            raise self._too_small(n)
        self.samples_per_epoch = n
        self._samples = tokens[: n * self.sample_len].reshape(n, self.sample_len)
        self._shuffle = shuffle
        self._seed = shuffle_seed
        self._perms: dict[int, np.ndarray] = {}

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            # A batch touches at most two epochs; keep only those.
            for old in [e for e in self._perms if e < epoch - 1]:
                del self._perms[old]
            rng = np.random.default_rng([self._seed, epoch])
            self._perms[epoch] = rng.permutation(self.samples_per_epoch)
        return self._perms[epoch]

    def sample_ids(self, start: int, count: int) -> np.ndarray:
        """Indices into the packed samples of global positions [start, start + count)."""
        pos = np.arange(start, start + count, dtype=np.int64)
        if not self._shuffle:
            return pos % self.samples_per_epoch
        epochs, within = np.divmod(pos, self.samples_per_epoch)
        ids = np.empty(count, dtype=np.int64)
        for e in np.unique(epochs):
            mask = epochs == e
            ids[mask] = self._permutation(int(e))[within[mask]]
        return ids

    def next_batch(self) -> torch.Tensor:
        start = self.samples_consumed + self.dp_rank * self.local_batch_size
        rows = self._samples[self.sample_ids(start, self.local_batch_size)]
        self.samples_consumed += self.global_batch_size
        self.epoch, _ = divmod(self.samples_consumed, self.samples_per_epoch)
        self.epoch_start = self.epoch * self.samples_per_epoch
        return torch.from_numpy(rows.astype(np.int64))

    def load_state_dict(self, state: dict) -> None:
        self._check_compatible(state)
        self.samples_consumed = int(state["samples_consumed"])
        self.epoch, _ = divmod(self.samples_consumed, self.samples_per_epoch)
        self.epoch_start = self.epoch * self.samples_per_epoch


class StreamingLoader(_Position):
    """Loader over an `IterableDataset`: global order = stream order, epochs restart it."""

    def __init__(
        self, epoch_samples: Callable[[int], Iterator[np.ndarray]], *, order: str, **layout
    ):
        super().__init__(order=order, **layout)
        self._epoch_samples = epoch_samples
        self._it: Iterator[np.ndarray] | None = None

    def _open_epoch(self) -> Iterator[np.ndarray]:
        it = self._epoch_samples(self.epoch)
        skip = self.samples_consumed - self.epoch_start
        if skip and sum(1 for _ in itertools.islice(it, skip)) < skip:
            raise ConfigError(
                f"data: the stream ended before the checkpoint's position ({skip} samples into "
                f"epoch {self.epoch}): the data changed since the checkpoint; resume with the "
                "same data"
            )
        return it

    def _next_sample(self) -> np.ndarray:
        while True:
            if self._it is None:
                self._it = self._open_epoch()
            sample = next(self._it, None)
            if sample is not None:
                self.samples_consumed += 1
                return sample
            n = self.samples_consumed - self.epoch_start
            if n < self.global_batch_size:
                raise self._too_small(n)
            self.samples_per_epoch = n
            self.epoch += 1
            self.epoch_start = self.samples_consumed
            self._it = None

    def next_batch(self) -> torch.Tensor:
        first = self.dp_rank * self.local_batch_size
        rows = []
        for i in range(self.global_batch_size):
            sample = self._next_sample()
            if first <= i < first + self.local_batch_size:
                rows.append(sample)
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def load_state_dict(self, state: dict) -> None:
        self._check_compatible(state)
        self.samples_consumed = int(state["samples_consumed"])
        self.epoch = int(state["epoch"])
        self.epoch_start = int(state["epoch_start"])
        if int(state["samples_per_epoch"]) >= 0:
            self.samples_per_epoch = int(state["samples_per_epoch"])
        self._it = None  # reopened lazily at the saved position


def joined_stream(tokens: np.ndarray, tok, min_doc_len: int) -> np.ndarray:
    """data.min_doc_len: the packed corpus with consecutive files joined into documents of at
    least min_doc_len tokens (data/packing.py join_documents)."""
    docs = list(join_documents(split_documents(tokens, tok), tok, min_doc_len))
    if len(docs[0]) < min_doc_len:
        raise ConfigError(
            f"data.min_doc_len={min_doc_len} is more than the whole corpus ({len(tokens):,} "
            "tokens); lower data.min_doc_len or raise data.max_bytes"
        )
    return np.concatenate(docs)


def build_loader(
    cfg: DataConfig,
    tok,
    *,
    global_batch_size: int,
    dp_rank: int,
    dp_size: int,
    hold_out: bool = False,
) -> PackedLoader | StreamingLoader:
    """This rank's loader; `next_batch()` gives its (G/dp, seq_len+1) rows of the next batch.
    `hold_out`: leave out the documents held out for evaluation (data.eval_fraction; see
    `build_eval_batches`). `loader.boundaries` is the tokenizer's document-boundary rule
    (inputs -> data.documents.Documents) with data.document_mask, else None: the documents
    of a batch are read from its own tokens, so the order and the resume position are the
    same with masking on or off."""
    layout = dict(global_batch_size=global_batch_size, dp_rank=dp_rank, dp_size=dp_size)
    loader = _build_loader(cfg, tok, **layout, hold_out=hold_out)
    loader.boundaries = DocumentBoundaries(tok.bos_id, tok.eos_id) if cfg.document_mask else None
    return loader


def _build_loader(
    cfg: DataConfig, tok, *, global_batch_size: int, dp_rank: int, dp_size: int, hold_out: bool
) -> PackedLoader | StreamingLoader:
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
    if global_batch_size <= 0 or global_batch_size % dp_size:
        raise ConfigError(
            f"train.global_batch_size={global_batch_size} must be a positive multiple of the "
            f"data-parallel size {dp_size}; change one of them"
        )
    if cfg.seq_len <= 0:
        raise ConfigError(f"data.seq_len={cfg.seq_len} must be > 0")
    layout = dict(
        seq_len=cfg.seq_len, global_batch_size=global_batch_size, dp_rank=dp_rank, dp_size=dp_size
    )

    order = dict(shuffle=cfg.shuffle, shuffle_seed=cfg.shuffle_seed)
    if cfg.name == "embedded":
        with quiet_datasets():
            ds = embedded_dataset(cfg)
            tokens = pack_dataset(training_documents(ds, cfg) if hold_out else ds, tok, "text")
        if cfg.min_doc_len:
            tokens = joined_stream(tokens, tok, cfg.min_doc_len)
        return PackedLoader(tokens, **order, more_data_hint="raise data.max_bytes", **layout)
    if cfg.name == "synthetic":
        tokens = synthetic_tokens(cfg, tok)
        return PackedLoader(tokens, **order, more_data_hint="raise data.max_bytes", **layout)
    if cfg.name != "hf":
        raise ConfigError(f"data.name={cfg.name!r} is not one of embedded, hf, synthetic")

    ds = hf_dataset(cfg)
    check_text_field(ds, cfg)
    if hold_out:
        ds = training_documents(ds, cfg)
    hint = "add data (data.path)"
    if not cfg.streaming:
        # Tokenized once into the token cache (by whichever process gets its lock; the others
        # wait) and memory-mapped: a batch copies only its rows.
        tokens, _, _ = load_tokens(cfg, ds, tok)
        return PackedLoader(tokens, **order, more_data_hint=hint, **layout)

    if cfg.shuffle and cfg.shuffle_buffer <= 0:
        raise ConfigError(
            f"data.shuffle_buffer={cfg.shuffle_buffer} must be > 0 with data.streaming=true and "
            "data.shuffle=true; raise it or set data.shuffle=false"
        )
    order = (
        f"buffer-shuffled(seed={cfg.shuffle_seed},buffer={cfg.shuffle_buffer})"
        if cfg.shuffle
        else "sequential"
    )

    def epoch_samples(epoch: int) -> Iterator[np.ndarray]:
        stream = ds
        if cfg.shuffle:
            stream = ds.shuffle(seed=cfg.shuffle_seed, buffer_size=cfg.shuffle_buffer)
            stream.set_epoch(epoch)  # effective seed = shuffle_seed + epoch
        return stream_samples(stream, tok, cfg.text_field, cfg.seq_len + 1)

    loader = StreamingLoader(epoch_samples, order=order, more_data_hint=hint, **layout)
    # Fail at setup rather than at the first step. Packing the unshuffled stream gives the
    # same number of samples (same tokens), and reads only the first documents.
    probe = stream_samples(ds, tok, cfg.text_field, cfg.seq_len + 1)
    found = sum(1 for _ in itertools.islice(probe, global_batch_size))
    if found < global_batch_size:
        raise loader._too_small(found)
    return loader


def build_eval_batches(
    cfg: DataConfig, tok, *, batches: int, global_batch_size: int, dp_rank: int, dp_size: int
) -> torch.Tensor:
    """This rank's rows of the held-out batches, (batches, G/dp, seq_len+1): the first
    batches * G samples packed from the held-out documents (`eval_documents`) in order, no
    shuffle, so every evaluation and every resume reads the same set. Sample k of batch b is
    packed sample b*G + k; rank r takes rows [r*G/dp, (r+1)*G/dp) as in training. Only as
    many documents as the batches need are tokenized."""
    needed = batches * global_batch_size
    with quiet_datasets():
        docs = eval_documents(cfg)
        samples = stream_samples(docs, tok, cfg.text_field, cfg.seq_len + 1, cfg.min_doc_len)
        samples = list(itertools.islice(samples, needed))
    if len(samples) < needed:
        source = (
            f"data.eval_split={cfg.eval_split}"
            if cfg.eval_split
            else f"data.eval_fraction={cfg.eval_fraction} of the documents"
        )
        raise ConfigError(
            f"eval: the held-out data ({source}) packs into {len(samples)} samples of "
            f"data.seq_len+1={cfg.seq_len + 1} tokens, fewer than eval.batches x "
            f"train.global_batch_size = {needed}; lower eval.batches, or hold out more data"
        )
    local = global_batch_size // dp_size
    rows = np.stack(samples).reshape(batches, global_batch_size, cfg.seq_len + 1)
    return torch.from_numpy(rows[:, dp_rank * local : (dp_rank + 1) * local].astype(np.int64))


def source_note(cfg: DataConfig, tok) -> str:
    """What build_data's first line adds after the sequence length: synthetic documents and
    that no tokenizer was loaded, or the joining of files (data.min_doc_len); else nothing."""
    if cfg.name == "synthetic":
        return f"; {synthetic_summary(cfg)}; {vocabulary_line(cfg, tok)}"
    if cfg.min_doc_len:
        return f"; consecutive files joined into documents of >= {cfg.min_doc_len:,} tokens"
    return ""


def build_data(
    cfg: DataConfig,
    tok,
    *,
    global_batch_size: int,
    dp_rank: int,
    dp_size: int,
    eval_batches: int = 0,
    log=print,
) -> tuple[PackedLoader | StreamingLoader, torch.Tensor | None]:
    """The training loader and, with eval_batches > 0, this rank's held-out batches; `log`
    gets a line before (preparing) and after (ready, how long, how many samples). With
    evaluation on, the held-out documents (data.eval_fraction) leave the training data unless
    data.eval_split names a split of their own."""
    t0 = time.perf_counter()
    # data=embedded names its exact corpus (the Python release and a hash of its files), so a
    # run's output tells another corpus from other arithmetic.
    what = corpus_fingerprint(cfg) or f"data={cfg.name}"
    log(f"data: preparing {what} (seq_len {cfg.seq_len}{source_note(cfg, tok)})")
    layout = dict(global_batch_size=global_batch_size, dp_rank=dp_rank, dp_size=dp_size)
    loader = build_loader(cfg, tok, **layout, hold_out=eval_batches > 0 and cfg.eval_split is None)
    held_out = None
    what = f"{loader.samples_per_epoch:,} samples per epoch" if loader.samples_per_epoch else ""
    if eval_batches > 0:
        held_out = build_eval_batches(cfg, tok, batches=eval_batches, **layout)
        what += f"; {eval_batches} held-out batches"
    log(f"data: ready in {time.perf_counter() - t0:.1f}s ({what or 'streaming'})")
    return loader, held_out
