"""Tokenize documents and pack them into fixed-length samples (no padding).

The token stream is every document as [BOS] + tokens + [EOS], in dataset order; sample i is
tokens[i * (seq_len + 1) : (i + 1) * (seq_len + 1)], and the tail shorter than one sample is
dropped. The map-style (`pack_dataset`) and streaming (`stream_samples`) paths cut the stream
identically, so with shuffling off they produce the same samples in the same order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import datasets
import numpy as np

from data.tokenizer import documents_to_ids, token_dtype

# Bump when the token stream layout changes, so cached tokenizations are not reused.
_PACKING_VERSION = "docs-bos-eos-v1"
_TOKENIZE_BATCH = 1000


def _texts(batch, text_field: str) -> list[str]:
    return ["" if t is None else t for t in batch[text_field]]


def _ids_feature(dtype: np.dtype):
    value = datasets.Value(dtype.name)
    return datasets.List(value) if hasattr(datasets, "List") else datasets.Sequence(value)


def pack_dataset(ds: datasets.Dataset, tok, text_field: str, desc: str | None = None) -> np.ndarray:
    """All documents of a map-style dataset as one flat token array (uint16 or uint32).

    Tokenization goes through `Dataset.map`, so for datasets backed by files the result is
    cached next to them (keyed by the dataset's fingerprint, the tokenizer's vocabulary and
    the packing layout); in-memory datasets are tokenized in memory. The flat array costs
    2 or 4 bytes per token of host memory on every rank.
    """
    dtype = token_dtype(tok)
    fingerprint = hashlib.sha256(
        f"{ds._fingerprint}|{tok.fingerprint}|{dtype.name}|{text_field}|{_PACKING_VERSION}".encode()
    ).hexdigest()[:32]

    def tokenize(batch):
        return {"ids": documents_to_ids(tok, _texts(batch, text_field), dtype)}

    mapped = ds.map(
        tokenize,
        batched=True,
        batch_size=_TOKENIZE_BATCH,
        remove_columns=ds.column_names,
        features=datasets.Features({"ids": _ids_feature(dtype)}),
        new_fingerprint=fingerprint,
        desc=desc,
    )
    parts = [
        chunk.flatten().to_numpy(zero_copy_only=False) for chunk in mapped.data.column("ids").chunks
    ]
    if not parts:
        return np.empty(0, dtype=dtype)
    return np.concatenate(parts).astype(dtype, copy=False)


def stream_samples(
    ds: datasets.IterableDataset, tok, text_field: str, sample_len: int
) -> Iterator[np.ndarray]:
    """Packed samples of `sample_len` tokens from a stream of documents, in stream order."""
    dtype = token_dtype(tok)
    pending: list[np.ndarray] = []
    buffered = 0
    for batch in ds.iter(batch_size=_TOKENIZE_BATCH):
        for doc in documents_to_ids(tok, _texts(batch, text_field), dtype):
            pending.append(doc)
            buffered += len(doc)
            if buffered < sample_len:
                continue
            flat = np.concatenate(pending)
            n = len(flat) // sample_len
            yield from flat[: n * sample_len].reshape(n, sample_len)
            rest = flat[n * sample_len :]
            pending, buffered = [rest], len(rest)
