"""Tokenize documents and pack them into fixed-length samples (no padding).

The token stream is every document as [BOS] + tokens + [EOS], in dataset order; sample i is
tokens[i * (seq_len + 1) : (i + 1) * (seq_len + 1)], and the tail shorter than one sample is
dropped. The map-style (`pack_dataset`) and streaming (`stream_samples`) paths cut the stream
identically, so with shuffling off they produce the same samples in the same order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from data.documents import document_starts
from data.tokenizer import documents_to_ids, token_dtype

if TYPE_CHECKING:  # imported where used: `datasets` (with pandas, pyarrow) costs ~1 s to import
    import datasets

# Bump when the token stream layout changes, so cached tokenizations are not reused.
PACKING_VERSION = "docs-bos-eos-v1"
_TOKENIZE_BATCH = 1000


def _texts(batch, text_field: str) -> list[str]:
    return ["" if t is None else t for t in batch[text_field]]


def _ids_feature(dtype: np.dtype):
    import datasets

    value = datasets.Value(dtype.name)
    return datasets.List(value) if hasattr(datasets, "List") else datasets.Sequence(value)


def stream_key(ds: datasets.Dataset, tok, text_field: str) -> str:
    """Identity of a dataset's packed token stream: dataset, tokenizer, dtype, field, layout.

    Names the tokenized Arrow cache of `pack_dataset` and the prepared token cache
    (data/token_cache.py). The sample length is not part of it: samples are cut from the one
    stream when they are read.
    """
    dtype = token_dtype(tok)
    return hashlib.sha256(
        f"{ds._fingerprint}|{tok.fingerprint}|{dtype.name}|{text_field}|{PACKING_VERSION}".encode()
    ).hexdigest()[:32]


def tokenize_dataset(
    ds: datasets.Dataset,
    tok,
    text_field: str,
    *,
    desc: str | None = None,
    num_proc: int | None = None,
    cache_file_name: str | None = None,
) -> datasets.Dataset:
    """`Dataset.map` to one `ids` column: each document as [BOS] + tokens + [EOS].

    Written to `cache_file_name` when given, else next to a file-backed dataset (keyed by
    `stream_key`), else kept in memory. `num_proc` > 1 tokenizes contiguous shards in worker
    processes; the shards are concatenated in order, so the result does not depend on it.
    """
    import datasets

    dtype = token_dtype(tok)

    def tokenize(batch):
        return {"ids": documents_to_ids(tok, _texts(batch, text_field), dtype)}

    return ds.map(
        tokenize,
        batched=True,
        batch_size=_TOKENIZE_BATCH,
        remove_columns=ds.column_names,
        features=datasets.Features({"ids": _ids_feature(dtype)}),
        new_fingerprint=stream_key(ds, tok, text_field),
        num_proc=num_proc if num_proc and num_proc > 1 else None,
        cache_file_name=cache_file_name,
        desc=desc,
    )


def token_chunks(tokenized: datasets.Dataset, dtype: np.dtype) -> Iterator[np.ndarray]:
    """The flat token stream of `tokenize_dataset`'s result, one Arrow chunk at a time."""
    for chunk in tokenized.data.column("ids").chunks:
        flat = chunk.flatten().to_numpy(zero_copy_only=False)
        if len(flat):
            yield np.ascontiguousarray(flat, dtype=dtype)


def pack_dataset(ds: datasets.Dataset, tok, text_field: str, desc: str | None = None) -> np.ndarray:
    """All documents of a map-style dataset as one flat token array (uint16 or uint32), in memory.

    Tokenization goes through `Dataset.map`, so for datasets backed by files the result is
    cached next to them (keyed by `stream_key`); in-memory datasets are tokenized in memory.
    The flat array costs 2 or 4 bytes per token of host memory in every process that calls
    this: the loader uses it for data=embedded only, and memory-maps a prepared token cache
    (data/token_cache.py) for data=hf, which holds exactly these tokens.
    """
    dtype = token_dtype(tok)
    parts = list(token_chunks(tokenize_dataset(ds, tok, text_field, desc=desc), dtype))
    if not parts:
        return np.empty(0, dtype=dtype)
    return np.concatenate(parts)


def join_documents(docs: Iterable[np.ndarray], tok, min_len: int) -> Iterator[np.ndarray]:
    """Consecutive packed documents ([BOS] ids [EOS]) joined into documents of at least
    `min_len` tokens, in order: the EOS and BOS between two joined documents are dropped, so
    the boundary rule (data/documents.py) sees one document. A rest shorter than `min_len` at
    the end joins the last document (the only one shorter: the input is shorter than
    `min_len`). Lazy, one joined document ahead."""
    head = 0 if tok.bos_id is None else 1

    def joined(group: list[np.ndarray]) -> np.ndarray:
        if len(group) == 1:
            return group[0]
        inner = [d[head:-1] for d in group[1:-1]]
        return np.concatenate([group[0][:-1], *inner, group[-1][head:]])

    ready, group, size = None, [], 0
    for doc in docs:
        size += len(doc) - (head + 1 if group else 0)
        group.append(doc)
        if size >= min_len:
            if ready is not None:
                yield ready
            ready, group, size = joined(group), [], 0
    if group:
        ready = joined(group if ready is None else [ready, *group])
    if ready is not None:
        yield ready


def split_documents(tokens: np.ndarray, tok) -> list[np.ndarray]:
    """A packed token stream cut into its documents (the boundary rule of data/documents.py)."""
    starts = np.flatnonzero(document_starts(tokens[None, :], tok.bos_id, tok.eos_id)[0])
    return np.split(tokens, starts[1:])


def stream_samples(
    ds: datasets.IterableDataset, tok, text_field: str, sample_len: int, min_doc_len: int = 0
) -> Iterator[np.ndarray]:
    """Packed samples of `sample_len` tokens from a stream of documents, in stream order;
    with `min_doc_len`, consecutive documents joined to that length first (join_documents)."""
    dtype = token_dtype(tok)
    docs = (
        doc
        for batch in ds.iter(batch_size=_TOKENIZE_BATCH)
        for doc in documents_to_ids(tok, _texts(batch, text_field), dtype)
    )
    if min_doc_len:
        docs = join_documents(docs, tok, min_doc_len)
    pending: list[np.ndarray] = []
    buffered = 0
    for doc in docs:
        pending.append(doc)
        buffered += len(doc)
        if buffered < sample_len:
            continue
        flat = np.concatenate(pending)
        n = len(flat) // sample_len
        yield from flat[: n * sample_len].reshape(n, sample_len)
        rest = flat[n * sample_len :]
        pending, buffered = [rest], len(rest)
