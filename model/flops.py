"""Model FLOPs of a training step, for MFU: the work the model really does on the step's data.

Weights: per token, a matmul with an (m x n) weight costs 2*m*n FLOPs forward and 4*m*n
backward, so training costs 6 * N_matmul per token, where N_matmul counts the weights used in
matmuls: Q, K, V, attention output, fc1 (gate and up), fc2 and the output head (the embedding
lookup is not a matmul; a tied head still is one).

Attention: per layer, each (query, key) pair a query attends to costs 2 * head_dim FLOPs for
its score and 2 * head_dim for its share of the weighted sum, per query head, forward; backward
costs twice that: 12 * n_heads * head_dim per pair and layer. A query attends to the keys at
or before it in its own document only, so a document (or, without document masking, a row) of
L tokens has L (L + 1) / 2 pairs, and a step's attention work is the sum over its documents:

    step_flops = 6 * N_matmul * tokens + 12 * n_layers * n_heads * head_dim * sum_d L_d (L_d + 1) / 2

Counting a causal s x s map per row instead (what the figure of a packed row would be without
document boundaries) overstates a document-masked step by up to the ratio of the row to its
documents, which is how a long window of short documents read above 100%. The documents are
the data's, before context parallelism splits and pads them: the padding is not model work.

MFU = step_flops / (step time x devices x peak FLOP/s per device). Recomputation (activation
checkpointing) is not counted either: MFU measures useful model FLOPs.
"""

from __future__ import annotations

import numpy as np

from model.config import ModelConfig

#: Dense bf16 peak TFLOP/s per device by GPU name substring (datasheet, no sparsity).
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "GB200": 2500.0,
    "A100": 312.0,
    "L40S": 362.0,
}


def matmul_params(cfg: ModelConfig) -> int:
    hd = cfg.head_dim
    attn = cfg.dim * (cfg.n_heads * hd) * 2 + cfg.dim * (cfg.n_kv_heads * hd) * 2
    mlp = 3 * cfg.dim * cfg.ffn_dim
    return cfg.n_layers * (attn + mlp) + cfg.dim * cfg.padded_vocab_size


def parameter_count(cfg: ModelConfig) -> int:
    """Every parameter of the model (either implementation), without building it: the matmul
    weights, the embedding unless the head shares it, and the RMSNorm weights (two per block
    and the final one)."""
    embedding = 0 if cfg.tie_embeddings else cfg.dim * cfg.padded_vocab_size
    return matmul_params(cfg) + embedding + (2 * cfg.n_layers + 1) * cfg.dim


def dense_flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs of the weight matmuls for one token."""
    return 6.0 * matmul_params(cfg)


def attention_flops_per_pair(cfg: ModelConfig) -> float:
    """Training FLOPs of attention for one (query, key) pair, all layers and heads."""
    return 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim


def causal_pairs(lengths) -> int:
    """(query, key) pairs of causal attention over segments of these lengths."""
    n = np.asarray(lengths, dtype=np.int64)
    return int((n * (n + 1) // 2).sum())


def batch_attention_pairs(shape: tuple[int, int], cu_seqlens=None) -> int:
    """Attention pairs of a (rows, seq) batch: per document when `cu_seqlens` (offsets of
    the documents over the row-major tokens, data.documents.Documents) is given, else per
    row (causal attention over the whole row)."""
    rows, seq = shape
    if cu_seqlens is None:
        return rows * causal_pairs([seq])
    return causal_pairs(np.diff(np.asarray(cu_seqlens, dtype=np.int64)))


def causal_row_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of rows of `seq_len` tokens with causal attention over the
    whole row: the most a token of such a row costs (documents inside the row cost less), for
    estimates made before any data is read."""
    return step_flops(cfg, seq_len, causal_pairs([seq_len])) / seq_len


def step_flops(cfg: ModelConfig, tokens: int, attention_pairs: int) -> float:
    """Model FLOPs of training on `tokens` tokens whose attention covers `attention_pairs`."""
    return dense_flops_per_token(cfg) * tokens + attention_flops_per_pair(cfg) * attention_pairs


def peak_tflops(device_name: str) -> float | None:
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return value
    return None
