"""Data config (the `data` group)."""

from __future__ import annotations

from dataclasses import dataclass

from errors import require

#: data.name values.
SOURCES = ("embedded", "hf", "synthetic")
#: data.doc_len_dist values (data=synthetic).
DOC_LEN_DISTRIBUTIONS = ("fixed", "exponential", "lognormal", "whole_rows")


@dataclass
class DataConfig:
    #: embedded (Python stdlib source text, byte tokenizer, no download) | hf | synthetic
    #: (documents of random ids below model.vocab_size with lengths from data.doc_len /
    #: data.doc_len_dist, no tokenizer loaded: for speed measurements; nothing to learn)
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
    #: "byte" (built-in byte-level tokenizer) or an AutoTokenizer name/local path. Not used
    #: by data=synthetic (its ids need only model.vocab_size; nothing is loaded).
    tokenizer: str = "byte"
    #: Training sequence length (tokens per sample); packed, no padding.
    seq_len: int = 256
    #: Attention stays inside each document of a packed sample, and RoPE positions restart at
    #: each document (Llama 3's masking); false: causal over the whole sample, across
    #: document boundaries. The boundaries are found from the BOS/EOS tokens packing puts
    #: around every document (data/documents.py). docs/DOCUMENT_MASKING.md has the figures
    #: behind the default.
    document_mask: bool = True
    #: synthetic: document length in tokens (BOS and EOS included): the length, mean or
    #: least length as data.doc_len_dist says.
    doc_len: int = 2048
    #: synthetic: how document lengths are drawn. fixed: every document doc_len tokens |
    #: exponential: geometric, mean doc_len | lognormal: log-normal, mean doc_len, spread
    #: data.doc_len_sigma (long documents with a heavy tail, as in long-context corpora) |
    #: whole_rows: every document fills ceil(doc_len / (seq_len + 1)) whole samples, so it is
    #: at least as long as the sequence and no sample holds a document boundary (document
    #: masking then attends as causal attention over the sequence does).
    doc_len_dist: str = "fixed"
    #: synthetic lognormal: standard deviation of the natural log of the lengths (> 0); 1.0:
    #: median 0.61 x doc_len, one document in 20 longer than 3.1 x doc_len.
    doc_len_sigma: float = 1.0
    #: embedded: consecutive files of the corpus (in its order) joined into one document until
    #: it holds at least this many tokens (BOS and EOS included; a short rest joins the last
    #: one), for loss curves of long-context training. Joined files are not natural long
    #: documents: unrelated files follow each other inside one. 0: one document per file.
    min_doc_len: int = 0
    #: embedded: cap on corpus size in bytes. synthetic: the stream's length in tokens.
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

    def validate(self, *, max_seq_len: int, vocab_size: int, eval_every: int) -> None:
        """The data fields (config.validate calls it), with the three rules that bound them by
        other sections' values, passed in (model.max_seq_len, model.vocab_size, eval.every):
        they sit among the data rules so that the first failure is the one reported, in the
        order the rules have always run. Raises ConfigError."""
        require(self.seq_len > 0, f"data.seq_len={self.seq_len} must be > 0")
        require(
            self.seq_len <= max_seq_len,
            f"data.seq_len={self.seq_len} exceeds model.max_seq_len={max_seq_len}; "
            "raise model.max_seq_len or lower data.seq_len",
        )
        require(
            self.name in SOURCES,
            f"data.name={self.name!r} is not one of {', '.join(SOURCES)}",
        )
        if self.name == "synthetic":
            self._validate_synthetic(vocab_size, eval_every)
        require(
            self.min_doc_len >= 0,
            f"data.min_doc_len={self.min_doc_len} must be >= 0 (0: one document per file; N: "
            "files joined into documents of at least N tokens)",
        )
        require(
            self.min_doc_len == 0 or self.name == "embedded",
            f"data.min_doc_len={self.min_doc_len} joins the files of data=embedded, not "
            f"data={self.name}; set data.min_doc_len=0"
            + (
                " (long synthetic documents: data.doc_len_dist)" if self.name == "synthetic" else ""
            ),
        )
        require(
            self.name != "hf" or bool(self.path),
            "data.path is required with data=hf (a hub dataset name or local files)",
        )

    def _validate_synthetic(self, vocab_size: int, eval_every: int) -> None:
        require(self.doc_len >= 2, f"data.doc_len={self.doc_len} must be >= 2 (BOS and EOS)")
        require(
            self.doc_len_dist in DOC_LEN_DISTRIBUTIONS,
            f"data.doc_len_dist={self.doc_len_dist!r} is not one of "
            f"{', '.join(DOC_LEN_DISTRIBUTIONS)}; set data.doc_len_dist to one of them",
        )
        require(
            self.doc_len_dist != "lognormal" or self.doc_len_sigma > 0,
            f"data.doc_len_sigma={self.doc_len_sigma} must be > 0 with "
            "data.doc_len_dist=lognormal (the spread of the lengths' log; 1.0 is a heavy tail)",
        )
        require(
            vocab_size >= 3,
            f"model.vocab_size={vocab_size} is too small for data=synthetic (its ids are "
            "below model.vocab_size - 2, then BOS and EOS); set model.vocab_size >= 3",
        )
        require(
            eval_every == 0,
            "eval.every > 0 needs held-out documents, which data=synthetic has none of; set "
            "eval.every=0",
        )
