"""Data config (the `data` group)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DataConfig:
    #: embedded (Python stdlib source text, byte tokenizer, no download) | hf | synthetic
    #: (documents of random tokens with lengths from data.doc_len / data.doc_len_dist: for
    #: benchmarks of document masking; nothing to learn)
    name: str = "embedded"
    #: hf: a hub dataset name, or local files/dir (jsonl, json, parquet, txt; globs allowed).
    path: str | None = None
    #: hf: dataset config name (e.g. "sample-10BT").
    subset: str | None = None
    #: hf: the split to train on.
    split: str = "train"
    #: hf: the column that holds each document's text.
    text_field: str = "text"
    #: hf: read the dataset as a stream (no download or token cache first; shuffled within
    #: data.shuffle_buffer documents).
    streaming: bool = False
    #: "byte" (built-in byte-level tokenizer) or an AutoTokenizer name/local path.
    tokenizer: str = "byte"
    #: Training sequence length (tokens per sample); packed, no padding.
    seq_len: int = 256
    #: Attention stays inside each document of a packed sample, and RoPE positions restart at
    #: each document (Llama 3's masking); false: causal over the whole sample, across
    #: document boundaries. The boundaries are found from the BOS/EOS tokens packing puts
    #: around every document (data/documents.py). docs/DOCUMENT_MASKING.md has the figures
    #: behind the default.
    document_mask: bool = True
    #: synthetic: mean document length in tokens (BOS and EOS included), and how lengths are
    #: drawn: fixed (every document doc_len tokens) | exponential (geometric, mean doc_len).
    doc_len: int = 2048
    #: synthetic: fixed | exponential (see doc_len).
    doc_len_dist: str = "fixed"
    #: embedded: cap on corpus size in bytes.
    max_bytes: int = 8_000_000
    #: Seed of the sample order (independent of the model seed).
    shuffle_seed: int = 0
    #: false: samples in corpus order (same order every epoch; streaming == non-streaming).
    shuffle: bool = True
    #: hf streaming: documents in the shuffle buffer (streams cannot be shuffled globally).
    shuffle_buffer: int = 10_000
    #: hf: datasets cache (downloads) and, under <cache_dir>/te-llama-tokens, the prepared
    #: token cache (tools/prepare_data.py); null = the Hugging Face datasets cache
    #: ($HF_DATASETS_CACHE, by default ~/.cache/huggingface/datasets).
    cache_dir: str | None = None
    #: Held-out data for the validation loss (used only with eval.every > 0). hf: a split of
    #: the dataset (e.g. "validation"); training data is then left as it is.
    eval_split: str | None = None
    #: Without data.eval_split: this share of the documents is held out of training (and
    #: evaluated on): document i (dataset order, 0-based) is held out when
    #: floor((i + 1) * fraction) > floor(i * fraction), i.e. evenly spread, deterministic.
    #: Only while eval.every > 0: with evaluation off, training reads every document.
    eval_fraction: float = 0.01
    #: hf non-streaming: processes that tokenize when preparing the token cache (datasets.map
    #: num_proc). The result does not depend on it.
    num_proc: int = 1
