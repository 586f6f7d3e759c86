"""Model shape config (the `model` group)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from errors import one_of, require

#: model.impl values.
IMPLS = ("auto", "te", "torch")


@dataclass
class RopeScalingConfig:
    """Llama-3 RoPE frequency scaling (HF `rope_type: llama3`)."""

    #: Divisor of the low RoPE frequencies (long wavelengths).
    factor: float = 8.0
    #: Wavelengths above original_max_position_embeddings / low_freq_factor are scaled fully.
    low_freq_factor: float = 1.0
    #: Wavelengths below original_max_position_embeddings / high_freq_factor are not scaled.
    high_freq_factor: float = 4.0
    #: Context length the frequencies were trained for before scaling (tokens).
    original_max_position_embeddings: int = 8192

    def validate(self) -> None:
        """Outside these ranges RoPE computes (no error) and trains a model whose positions
        are wrong or nan, which surfaces much later as a bad or non-finite loss."""
        require(
            math.isfinite(self.factor) and self.factor >= 1,
            f"model.rope_scaling.factor={self.factor} must be >= 1 (the long wavelengths are "
            "slowed down by it), or set model.rope_scaling=null for plain RoPE",
        )
        low, high = self.low_freq_factor, self.high_freq_factor
        require(
            0 < low < high and math.isfinite(high),
            f"model.rope_scaling: low_freq_factor={low} and high_freq_factor="
            f"{high} must satisfy 0 < low_freq_factor < high_freq_factor (the "
            "blend between them divides by their difference); Llama 3 uses 1 and 4",
        )
        require(
            self.original_max_position_embeddings > 0,
            "model.rope_scaling.original_max_position_embeddings="
            f"{self.original_max_position_embeddings} must be > 0 (Llama 3 uses 8192)",
        )


@dataclass
class ModelConfig:
    #: Name of the shape (conf/model/<name>.yaml); part of the default run.name.
    name: str = "tiny"
    #: "auto" picks TE when CUDA and transformer_engine are importable, else the reference.
    impl: str = "auto"
    #: Hidden size (width of the residual stream).
    dim: int = 128
    #: Transformer blocks.
    n_layers: int = 4
    #: Attention query heads; dim must be divisible by it (head_dim = dim / n_heads, even).
    n_heads: int = 4
    #: Key/value heads (grouped-query attention); must divide n_heads.
    n_kv_heads: int = 2
    #: Hidden size of the SwiGLU MLP.
    ffn_dim: int = 384
    #: Tokenizer vocabulary. The embedding and output head are padded up to
    #: a multiple of `pad_vocab_multiple` (FP8 GEMMs and TP need divisible shapes).
    vocab_size: int = 258
    #: Round the embedding and head rows up to a multiple of this (the padding rows are zero).
    pad_vocab_multiple: int = 128
    #: Longest sequence the model takes (RoPE table length); data.seq_len must not exceed it.
    max_seq_len: int = 2048
    #: RMSNorm epsilon.
    norm_eps: float = 1e-5
    #: RoPE base frequency.
    rope_theta: float = 500000.0
    #: Llama 3 RoPE frequency scaling (its fields below); null: plain RoPE.
    rope_scaling: RopeScalingConfig | None = field(default_factory=RopeScalingConfig)
    #: true: the output head reuses the embedding weight (Llama 3.2 1B); false: its own weight.
    tie_embeddings: bool = False
    #: Std of the normal init of linear and embedding weights; output projections
    #: (attention proj, fc2) are scaled by 1/sqrt(2 * n_layers).
    init_std: float = 0.02
    #: Start from Hugging Face weights instead of the seeded init: a local folder or a hub
    #: name (checkpoint/hf.py). Not read when the run resumes from a checkpoint.
    init_from: str | None = None
    #: true (conf/model/hf.yaml): dim, n_layers, heads, ffn_dim, vocab_size, norm_eps, RoPE,
    #: tie_embeddings and max_seq_len come from init_from's config.json at start-up; false:
    #: with init_from set, they must agree with it.
    shape_from_hf: bool = False

    def validate(self) -> None:
        """The model fields on their own (config.validate calls it); raises ConfigError."""
        one_of(self.impl, IMPLS, "model.impl")
        for name in (
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "ffn_dim",
            "vocab_size",
            "pad_vocab_multiple",
            "max_seq_len",
        ):
            require(getattr(self, name) > 0, f"model.{name}={getattr(self, name)} must be > 0")
        require(
            self.norm_eps > 0,
            f"model.norm_eps={self.norm_eps} must be > 0 (RMSNorm divides by it)",
        )
        require(
            self.init_std > 0,
            f"model.init_std={self.init_std} must be > 0 (the std of the normal weight init)",
        )
        require(
            self.dim % self.n_heads == 0,
            f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}",
        )
        require(
            self.n_heads % self.n_kv_heads == 0,
            f"model.n_heads={self.n_heads} must be divisible by model.n_kv_heads="
            f"{self.n_kv_heads} (GQA)",
        )
        require(
            self.head_dim % 2 == 0,
            f"model head_dim={self.head_dim} (dim/n_heads) must be even for RoPE",
        )
        # RoPE's fields: a value outside these ranges computes (no error) and trains a model
        # whose positions are wrong or nan, which surfaces much later as a bad or non-finite
        # loss.
        require(
            math.isfinite(self.rope_theta) and self.rope_theta > 1,
            f"model.rope_theta={self.rope_theta} must be a finite number > 1 (RoPE's base: the "
            "wavelengths are rope_theta^(2i/head_dim); Llama 3 uses 500000)",
        )
        if self.rope_scaling is not None:
            self.rope_scaling.validate()

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_multiple
        return (self.vocab_size + m - 1) // m * m


def block_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, int]]]:
    """The matrix weights of one transformer block (those TE quantizes): short name ->
    (parameter name inside the block, global shape), with the fused QKV and [gate; up] fc1."""
    hd = cfg.head_dim
    return {
        "qkv": (
            "self_attention.layernorm_qkv.weight",
            ((cfg.n_heads + 2 * cfg.n_kv_heads) * hd, cfg.dim),
        ),
        "proj": ("self_attention.proj.weight", (cfg.dim, cfg.n_heads * hd)),
        "fc1": ("layernorm_mlp.fc1_weight", (2 * cfg.ffn_dim, cfg.dim)),
        "fc2": ("layernorm_mlp.fc2_weight", (cfg.dim, cfg.ffn_dim)),
    }
