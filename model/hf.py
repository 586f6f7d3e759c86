"""Conversion between our checkpoint layout and Hugging Face `LlamaForCausalLM`.

Per block i, ours (model/llama.py) under `layers.i.`, HF's under `model.layers.i.`:

    self_attention.layernorm_qkv.layer_norm_weight    input_layernorm.weight
    self_attention.layernorm_qkv.weight (interleaved) self_attn.{q,k,v}_proj.weight
    self_attention.proj.weight                        self_attn.o_proj.weight
    layernorm_mlp.layer_norm_weight                   post_attention_layernorm.weight
    layernorm_mlp.fc1_weight = [gate; up]             mlp.{gate,up}_proj.weight (concatenated)
    layernorm_mlp.fc2_weight                          mlp.down_proj.weight

plus embed.weight, norm.weight, lm_head.weight <-> model.embed_tokens.weight,
model.norm.weight, lm_head.weight. Our QKV weight interleaves Q, K and V by KV group
(model/llama.py `interleave_qkv`); HF's query head h reads KV head h // (n_heads / n_kv_heads),
the same grouping, so the conversion only regroups rows. Both use rotate-half RoPE, so Q and K
need no permutation.
Our embedding and head have `padded_vocab_size` rows, HF's `vocab_size`: export drops the
padding rows, import fills them with zeros. Tied models have no lm_head.weight on either side
(HF ties it on load).

    cfg, sd = load_hf("path/to/Llama-3.2-1B")   # local HF dir -> (ModelConfig, our state dict)
    model.load_state_dict(sd, strict=False)     # strict=False: TE modules add _extra_state
    save_hf(model.state_dict(), cfg, "out/hf")  # safetensors (sharded) + config.json
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from errors import ConfigError
from model.config import ModelConfig, RopeScalingConfig
from model.init import canonical_name
from model.llama import interleave_qkv, split_qkv

# (our suffix, HF suffix) inside one transformer block, excluding the fused QKV and fc1.
_BLOCK_NAMES = (
    ("self_attention.layernorm_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("self_attention.proj.weight", "self_attn.o_proj.weight"),
    ("layernorm_mlp.layer_norm_weight", "post_attention_layernorm.weight"),
    ("layernorm_mlp.fc2_weight", "mlp.down_proj.weight"),
)
_QKV = "self_attention.layernorm_qkv.weight"
_Q, _K, _V = (f"self_attn.{x}_proj.weight" for x in "qkv")
_FC1 = "layernorm_mlp.fc1_weight"
_GATE, _UP = "mlp.gate_proj.weight", "mlp.up_proj.weight"


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _check_keys(got: set[str], want: set[str], what: str) -> None:
    missing, unexpected = sorted(want - got), sorted(got - want)
    if missing or unexpected:
        raise ConfigError(
            f"{what} does not match the model config (missing: {missing[:4]}, unexpected: "
            f"{unexpected[:4]}); check model.n_layers / model.tie_embeddings against the checkpoint"
        )


def _check_shape(t: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    if tuple(t.shape) != shape:
        raise ConfigError(
            f"{name} has shape {tuple(t.shape)}, the model config expects {shape}; "
            "check the model.* sizes against the checkpoint"
        )


def _our_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    hd, v = cfg.head_dim, cfg.padded_vocab_size
    block = {
        "self_attention.layernorm_qkv.layer_norm_weight": (cfg.dim,),
        _QKV: ((cfg.n_heads + 2 * cfg.n_kv_heads) * hd, cfg.dim),
        "self_attention.proj.weight": (cfg.dim, cfg.n_heads * hd),
        "layernorm_mlp.layer_norm_weight": (cfg.dim,),
        _FC1: (2 * cfg.ffn_dim, cfg.dim),
        "layernorm_mlp.fc2_weight": (cfg.dim, cfg.ffn_dim),
    }
    shapes = {"embed.weight": (v, cfg.dim), "norm.weight": (cfg.dim,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (v, cfg.dim)
    for i in range(cfg.n_layers):
        shapes.update({f"layers.{i}.{k}": s for k, s in block.items()})
    return shapes


def to_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict (reference or TE model, full tensors or DTensors) -> HF LlamaForCausalLM.

    TE `_extra_state` entries and wrapper prefixes (torch.compile, activation checkpointing) are
    ignored. DTensors are gathered with full_tensor(), a collective: call it on every rank.
    Tensors that need no reshaping are returned as they are (not copied).
    """
    ours = {canonical_name(k): _full(v) for k, v in sd.items() if not k.endswith("_extra_state")}
    shapes = _our_shapes(cfg)
    _check_keys(set(ours), set(shapes), "state dict")
    for k, s in shapes.items():
        _check_shape(ours[k], s, k)

    v = cfg.vocab_size
    out = {
        "model.embed_tokens.weight": ours["embed.weight"][:v],
        "model.norm.weight": ours["norm.weight"],
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = ours["lm_head.weight"][:v]
    for i in range(cfg.n_layers):
        p, hp = f"layers.{i}.", f"model.layers.{i}."
        for ours_name, hf_name in _BLOCK_NAMES:
            out[hp + hf_name] = ours[p + ours_name]
        q, k, v = split_qkv(ours[p + _QKV], cfg.n_heads, cfg.n_kv_heads)
        out[hp + _Q], out[hp + _K], out[hp + _V] = q, k, v
        gate, up = ours[p + _FC1].chunk(2, dim=0)
        out[hp + _GATE], out[hp + _UP] = gate, up
    return out


def from_hf_state_dict(
    hf_sd: Mapping[str, torch.Tensor], cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """HF LlamaForCausalLM state dict -> ours (the reference model's state_dict keys).

    Embedding / head rows beyond `cfg.vocab_size` are zeros. With tied embeddings a present
    lm_head.weight is ignored (HF keeps it as an alias of the embedding).
    """
    # Old checkpoints carry RoPE caches as buffers; they hold no weights.
    hf = {k: v for k, v in hf_sd.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_embeddings:
        hf.pop("lm_head.weight", None)
    want = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_embeddings:
        want.add("lm_head.weight")
    for i in range(cfg.n_layers):
        hp = f"model.layers.{i}."
        want.update(hp + hf_name for _, hf_name in _BLOCK_NAMES)
        want.update(hp + x for x in (_Q, _K, _V, _GATE, _UP))
    _check_keys(set(hf), want, "HF state dict")

    def padded(t: torch.Tensor, name: str) -> torch.Tensor:
        _check_shape(t, (cfg.vocab_size, cfg.dim), name)
        pad = t.new_zeros(cfg.padded_vocab_size - cfg.vocab_size, cfg.dim)
        return torch.cat([t, pad], dim=0)

    out = {"embed.weight": padded(hf["model.embed_tokens.weight"], "model.embed_tokens.weight")}
    for i in range(cfg.n_layers):
        p, hp = f"layers.{i}.", f"model.layers.{i}."
        for ours_name, hf_name in _BLOCK_NAMES:
            out[p + ours_name] = hf[hp + hf_name]
        _check_shape(hf[hp + _Q], (cfg.n_heads * cfg.head_dim, cfg.dim), hp + _Q)
        for name in (_K, _V):
            _check_shape(hf[hp + name], (cfg.n_kv_heads * cfg.head_dim, cfg.dim), hp + name)
        out[p + _QKV] = interleave_qkv(hf[hp + _Q], hf[hp + _K], hf[hp + _V], cfg.n_kv_heads)
        out[p + _FC1] = torch.cat([hf[hp + _GATE], hf[hp + _UP]], dim=0)
    out["norm.weight"] = hf["model.norm.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = padded(hf["lm_head.weight"], "lm_head.weight")
    for k, s in _our_shapes(cfg).items():
        _check_shape(out[k], s, k)
    return out


def _rope_scaling_dict(cfg: ModelConfig) -> dict | None:
    s = cfg.rope_scaling
    if s is None:
        return None
    return {
        "rope_type": "llama3",
        "factor": float(s.factor),
        "low_freq_factor": float(s.low_freq_factor),
        "high_freq_factor": float(s.high_freq_factor),
        "original_max_position_embeddings": int(s.original_max_position_embeddings),
    }


def hf_config(cfg: ModelConfig, dtype: torch.dtype | None = None):
    """A `transformers.LlamaConfig` describing the same model (no tokenizer ids are set)."""
    from transformers import LlamaConfig, PretrainedConfig

    kwargs = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.norm_eps,
        # rope_theta + rope_scaling are read by transformers 4.x and mapped to
        # rope_parameters by 5.x.
        rope_theta=float(cfg.rope_theta),
        rope_scaling=_rope_scaling_dict(cfg),
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=None,
        eos_token_id=None,
        architectures=["LlamaForCausalLM"],
    )
    if dtype is not None:
        # transformers 5 renamed torch_dtype to dtype.
        key = (
            "dtype"
            if "dtype" in inspect.signature(PretrainedConfig.__init__).parameters
            else "torch_dtype"
        )
        kwargs[key] = dtype
    return LlamaConfig(**kwargs)


def model_config_from_hf(hf_cfg, name: str = "hf") -> ModelConfig:
    """ModelConfig from a `LlamaConfig` or a config.json dict (transformers 4.x or 5.x format)."""
    d = hf_cfg if isinstance(hf_cfg, Mapping) else hf_cfg.to_dict()

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(f"HF config: {msg}")

    need(
        d.get("model_type", "llama") == "llama",
        f"model_type={d.get('model_type')!r} is not supported; only llama checkpoints convert",
    )
    need(
        d.get("hidden_act", "silu") == "silu",
        f"hidden_act={d.get('hidden_act')!r}; only silu (SwiGLU)",
    )
    need(
        not d.get("attention_bias", False) and not d.get("mlp_bias", False),
        "attention_bias / mlp_bias are set; this model has no biases",
    )
    dim, n_heads = d["hidden_size"], d["num_attention_heads"]
    head_dim = d.get("head_dim") or dim // n_heads
    need(
        head_dim * n_heads == dim,
        f"head_dim={head_dim} x num_attention_heads={n_heads} != hidden_size={dim}",
    )

    # transformers 5: rope_parameters holds rope_theta and the scaling;
    # 4.x: top-level rope_theta + rope_scaling.
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    need(
        rope_type in ("default", "llama3"),
        f"rope_type={rope_type!r} is not supported; use default or llama3",
    )
    scaling = None
    if rope_type == "llama3":
        scaling = RopeScalingConfig(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    return ModelConfig(
        name=name,
        dim=dim,
        n_layers=d["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=d.get("num_key_value_heads") or n_heads,
        ffn_dim=d["intermediate_size"],
        vocab_size=d["vocab_size"],
        max_seq_len=d.get("max_position_embeddings", 2048),
        norm_eps=float(d.get("rms_norm_eps", 1e-5)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        init_std=float(d.get("initializer_range", 0.02)),
    )


def _standalone(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor owning its storage: safetensors refuses views that share storage
    (vocab slices, gate/up halves); whole tensors are not copied again."""
    t = t.detach().cpu().contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def save_hf(
    model_sd: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    out_dir: str | os.PathLike,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write `out_dir` as an HF model directory: config.json + safetensors (sharded past 5 GiB).

    dtype: cast the weights (e.g. torch.bfloat16); None keeps them as they are.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_sd = to_hf_state_dict(model_sd, cfg)
    hf_sd = {k: _standalone(v.to(dtype) if dtype else v) for k, v in hf_sd.items()}
    first = next(iter(hf_sd.values()))
    hf_config(cfg, dtype=dtype or first.dtype).save_pretrained(out)

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in hf_sd.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(v.numel() * v.element_size() for v in hf_sd.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def load_hf(
    path: str | os.PathLike, name: str | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a local HF Llama directory -> (ModelConfig, state dict in our names), on CPU."""
    from safetensors.torch import load_file

    root = Path(path)
    if not (root / "config.json").is_file():
        raise ConfigError(f"{root} has no config.json; pass a local Hugging Face model directory")
    cfg = model_config_from_hf(
        json.loads((root / "config.json").read_text()), name=name or root.name
    )
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"{root} has no *.safetensors weights; convert .bin checkpoints to safetensors first"
        )
    hf_sd: dict[str, torch.Tensor] = {}
    for f in files:
        hf_sd.update(load_file(root / f, device="cpu"))
    return cfg, from_hf_state_dict(hf_sd, cfg)
