"""Data: the embedded corpus, Hugging Face datasets, tokenizers, packing, a resumable loader.

    tok = build_tokenizer(cfg.data, vocab_size=cfg.model.vocab_size)  # synthetic: ids only
    loader = build_loader(cfg.data, tok, global_batch_size=G, dp_rank=r, dp_size=dp)
    x = loader.next_batch()          # (G // dp, seq_len + 1); inputs x[:, :-1], labels x[:, 1:]
    docs = loader.boundaries(x[:, :-1])  # with data.document_mask: where its documents are
    ev = build_eval_batches(cfg.data, tok, batches=4, global_batch_size=G, dp_rank=r, dp_size=dp)
    loader.state_dict() / loader.load_state_dict(d)   # the global position, dp-size free

See data/loader.py for the sample-order contract that makes multi-rank runs and resumes exact,
and data/token_cache.py for the prepared, memory-mapped token files of data=hf
(tools/prepare_data.py).
"""

from data.config import DataConfig
from data.documents import DocumentBoundaries, Documents
from data.loader import (
    PackedLoader,
    StreamingLoader,
    build_data,
    build_eval_batches,
    build_loader,
)
from data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    SyntheticVocabulary,
    build_tokenizer,
    vocabulary_line,
)

__all__ = [
    "ByteTokenizer",
    "DataConfig",
    "DocumentBoundaries",
    "Documents",
    "HFTokenizer",
    "PackedLoader",
    "StreamingLoader",
    "SyntheticVocabulary",
    "build_data",
    "build_eval_batches",
    "build_loader",
    "build_tokenizer",
    "vocabulary_line",
]
