"""Model FLOPs per trained token, for MFU.

Per token, a matmul with an (m x n) weight costs 2*m*n FLOPs forward and 4*m*n backward,
so training costs 6 * N_matmul, where N_matmul counts the weights used in matmuls: Q, K, V,
attention output, fc1 (gate and up), fc2 and the output head (the embedding lookup is not a
matmul; a tied head still is one). Attention scores and the weighted sum add, per layer and
token, 2 * 2 * s * n_heads * head_dim forward for a full s x s map; causal masking halves it
(only s/2 keys on average), and backward doubles it twice more (x3 total):

    flops_per_token = 6 * N_matmul + 6 * n_layers * seq_len * n_heads * head_dim

MFU = flops_per_token * tokens_per_second_per_device / peak_flops_per_device.
Recomputation (activation checkpointing) is not counted: MFU measures useful model FLOPs.
"""

from __future__ import annotations

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


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    attention = 6 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim
    return 6.0 * matmul_params(cfg) + attention


def peak_tflops(device_name: str) -> float | None:
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return value
    return None
