"""Our parameter layout vs Hugging Face `LlamaForCausalLM`: names, rows and config.

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
need no permutation. Our embedding and head have `padded_vocab_size` rows, HF's `vocab_size`:
the padding rows are zeros on import and dropped on export. Tied models have no
lm_head.weight on our side; HF files of tied models may or may not carry one (ignored).

Every difference is a regrouping of rows (dim 0); columns always match. So one table,
`weight_layout(cfg)`, says for each of our parameters which rows of which HF tensor each run
of its rows holds (`Rows`), and both directions read it:

- import (`fill_from_hf`): write the part of a parameter that one rank holds, given the global
  indices of its local entries, reading only the HF rows (and columns) it covers. The reader
  is a function, so checkpoint/hf.py reads lazily from safetensors files and
  `from_hf_state_dict` from tensors in memory;
- export (`hf_tensor`): one HF tensor as the concatenation of our row runs that map to it.

File I/O (init_from, the export command) is in checkpoint/hf.py.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch
from torch.distributed.tensor import DTensor

from errors import ConfigError
from model.config import ModelConfig, RopeScalingConfig
from model.init import canonical_name
from parallel.indices import contiguous_runs

# (our suffix, HF suffix) inside one transformer block: the tensors that map one to one.
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
_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"

#: HF tensors that hold no weights of the model: RoPE caches of old checkpoints.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Rows:
    """Rows [start, start + count) of one of our parameters are rows
    [hf_start, hf_start + count) of the HF tensor `hf_name`; hf_name None: vocabulary padding
    (zeros on import, not exported)."""

    start: int
    count: int
    hf_name: str | None
    hf_start: int = 0


def our_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Global shape of each of our parameters (both implementations, any layout)."""
    hd, v = cfg.head_dim, cfg.padded_vocab_size
    block = {
        "self_attention.layernorm_qkv.layer_norm_weight": (cfg.dim,),
        _QKV: ((cfg.n_heads + 2 * cfg.n_kv_heads) * hd, cfg.dim),
        "self_attention.proj.weight": (cfg.dim, cfg.n_heads * hd),
        "layernorm_mlp.layer_norm_weight": (cfg.dim,),
        _FC1: (2 * cfg.ffn_dim, cfg.dim),
        "layernorm_mlp.fc2_weight": (cfg.dim, cfg.ffn_dim),
    }
    shapes = {"embed.weight": (v, cfg.dim)}
    for i in range(cfg.n_layers):
        shapes.update({f"layers.{i}.{k}": s for k, s in block.items()})
    shapes["norm.weight"] = (cfg.dim,)
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (v, cfg.dim)
    return shapes


def weight_layout(cfg: ModelConfig) -> dict[str, tuple[Rows, ...]]:
    """For each of our parameters, its rows as runs of HF tensor rows (in row order)."""
    hd, q_per_kv, ffn = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads, cfg.ffn_dim
    shapes = our_shapes(cfg)

    def vocab(hf_name: str) -> tuple[Rows, ...]:
        v, pad = cfg.vocab_size, cfg.padded_vocab_size - cfg.vocab_size
        return (Rows(0, v, hf_name),) + ((Rows(v, pad, None),) if pad else ())

    layout: dict[str, tuple[Rows, ...]] = {"embed.weight": vocab(_EMBED)}
    for i in range(cfg.n_layers):
        p, hp = f"layers.{i}.", f"model.layers.{i}."
        for ours, hf in _BLOCK_NAMES:
            layout[p + ours] = (Rows(0, shapes[p + ours][0], hp + hf),)
        qkv = []
        for g in range(cfg.n_kv_heads):  # group g: its query heads, key head g, value head g
            base = g * (q_per_kv + 2) * hd
            qkv += [
                Rows(base, q_per_kv * hd, hp + _Q, g * q_per_kv * hd),
                Rows(base + q_per_kv * hd, hd, hp + _K, g * hd),
                Rows(base + (q_per_kv + 1) * hd, hd, hp + _V, g * hd),
            ]
        layout[p + _QKV] = tuple(qkv)
        layout[p + _FC1] = (Rows(0, ffn, hp + _GATE), Rows(ffn, ffn, hp + _UP))
    layout["norm.weight"] = (Rows(0, cfg.dim, "model.norm.weight"),)
    if not cfg.tie_embeddings:
        layout["lm_head.weight"] = vocab(_HEAD)
    return layout


def hf_sources(cfg: ModelConfig) -> dict[str, list[tuple[str, Rows]]]:
    """The inverse table: each HF tensor -> [(our name, Rows)] in HF row order."""
    sources: dict[str, list[tuple[str, Rows]]] = {}
    for ours, runs in weight_layout(cfg).items():
        for r in runs:
            if r.hf_name is not None:
                sources.setdefault(r.hf_name, []).append((ours, r))
    for runs in sources.values():
        runs.sort(key=lambda x: x[1].hf_start)
    return sources


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of each HF tensor of the model (the names a LlamaForCausalLM file holds)."""
    shapes = our_shapes(cfg)
    return {
        hf: (sum(r.count for _, r in runs), *shapes[runs[0][0]][1:])
        for hf, runs in hf_sources(cfg).items()
    }


def is_ignored(hf_name: str) -> bool:
    return hf_name.endswith(IGNORED_SUFFIXES)


def check_hf_names(names, shapes: Mapping[str, tuple[int, ...]], cfg: ModelConfig, what: str):
    """`names` (the tensors an HF state dict or folder holds) against the model: one
    ConfigError naming missing and unexpected tensors. A tied model ignores lm_head.weight."""
    have = {n for n in names if not is_ignored(n)}
    if cfg.tie_embeddings:
        have.discard(_HEAD)
    missing, unexpected = sorted(set(shapes) - have), sorted(have - set(shapes))
    if missing or unexpected:
        raise ConfigError(
            f"{what} does not match the model config (missing: {missing[:4]}, unexpected: "
            f"{unexpected[:4]}); check model.n_layers / model.tie_embeddings against it"
        )


def check_shape(shape, want: tuple[int, ...], name: str) -> None:
    if tuple(shape) != tuple(want):
        raise ConfigError(
            f"{name} has shape {tuple(shape)}, the model config expects {tuple(want)}; "
            "check the model.* sizes against the checkpoint"
        )


#: get(hf_name, rows, cols) -> those rows (and columns; cols is None for 1-D tensors).
Reader = Callable[[str, slice, "slice | None"], torch.Tensor]


@torch.no_grad()
def fill_from_hf(
    out: torch.Tensor, runs: tuple[Rows, ...], index: list[torch.Tensor], get: Reader
) -> None:
    """Write into `out` the HF values of the entries it holds. `out` is all of one of our
    parameters or one rank's part of it; index[d] lists the global indices of its entries
    along dim d in local order (parallel/indices.py `local_global_indices` for a DTensor).
    Only the HF rows and columns that `out` covers are read, in contiguous blocks; values are
    cast to out's dtype and device."""
    col_runs = contiguous_runs(index[1]) if out.ndim == 2 else [None]
    for local_start, local_end, first in contiguous_runs(index[0]):
        last = first + (local_end - local_start)
        for r in runs:
            a, b = max(first, r.start), min(last, r.start + r.count)
            if a >= b:
                continue
            dst = slice(local_start + a - first, local_start + b - first)
            if r.hf_name is None:
                out[dst].zero_()
                continue
            src = slice(r.hf_start + a - r.start, r.hf_start + b - r.start)
            for c in col_runs:
                if c is None:
                    out[dst].copy_(get(r.hf_name, src, None))
                else:
                    c0, c1, g0 = c
                    out[dst, c0:c1].copy_(get(r.hf_name, src, slice(g0, g0 + c1 - c0)))


def hf_tensor(runs: list[tuple[str, Rows]], ours: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """One HF tensor from full tensors of ours: its row runs (an `hf_sources` entry), in order."""
    parts = [ours[name][r.start : r.start + r.count] for name, r in runs]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def to_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict (reference or TE model, full tensors or DTensors) -> HF LlamaForCausalLM.

    TE `_extra_state` entries and wrapper prefixes (torch.compile, activation checkpointing) are
    ignored. DTensors are gathered with full_tensor(), a collective: call it on every rank.
    Tensors that need no regrouping are returned as views of the input (not copied).
    """
    ours = {canonical_name(k): _full(v) for k, v in sd.items() if not k.endswith("_extra_state")}
    shapes = our_shapes(cfg)
    missing, unexpected = sorted(set(shapes) - set(ours)), sorted(set(ours) - set(shapes))
    if missing or unexpected:
        raise ConfigError(
            f"state dict does not match the model config (missing: {missing[:4]}, unexpected: "
            f"{unexpected[:4]}); check model.n_layers / model.tie_embeddings against it"
        )
    for k, s in shapes.items():
        check_shape(ours[k].shape, s, k)
    return {hf: hf_tensor(runs, ours) for hf, runs in hf_sources(cfg).items()}


def from_hf_state_dict(
    hf_sd: Mapping[str, torch.Tensor], cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """HF LlamaForCausalLM state dict -> ours (full tensors, the reference model's keys), through
    the same `fill_from_hf` that loads sharded models. Vocabulary padding rows are zeros."""
    shapes = hf_shapes(cfg)
    check_hf_names(hf_sd, shapes, cfg, "HF state dict")
    for k, s in shapes.items():
        check_shape(hf_sd[k].shape, s, k)

    def get(name, rows, cols):
        t = hf_sd[name][rows]
        return t if cols is None else t[:, cols]

    dtype, layout = hf_sd[_EMBED].dtype, weight_layout(cfg)
    out = {}
    for name, shape in our_shapes(cfg).items():
        out[name] = torch.empty(shape, dtype=dtype)
        fill_from_hf(out[name], layout[name], [torch.arange(s) for s in shape], get)
    return out


# ---------------------------------------------------------------------------------------------
# Config.


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


def hf_max_positions(cfg: ModelConfig) -> int:
    """config.json's max_position_embeddings: the model's max_seq_len, except where Llama-3
    RoPE scaling is on and max_seq_len does not exceed the scaling's
    original_max_position_embeddings (the tiny and small presets keep Llama 3's scaling on a
    short context). transformers requires original < max_position_embeddings for rope_type
    llama3 (else it warns on every load), since the scaling stretches an original context by
    `factor`; so that stretched context, original x factor, is written. The frequencies, in
    transformers as here, depend on the scaling fields only, not on this number."""
    s = cfg.rope_scaling
    if s is None or cfg.max_seq_len > s.original_max_position_embeddings:
        return cfg.max_seq_len
    return max(
        int(s.original_max_position_embeddings * s.factor), s.original_max_position_embeddings + 1
    )


def hf_config(
    cfg: ModelConfig,
    dtype: torch.dtype | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
):
    """A `transformers.LlamaConfig` describing the same model."""
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
        max_position_embeddings=hf_max_positions(cfg),
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.norm_eps,
        # rope_theta + rope_scaling are read by transformers 4.x and mapped to
        # rope_parameters by 5.x.
        rope_theta=float(cfg.rope_theta),
        rope_scaling=_rope_scaling_dict(cfg),
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
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


#: The model fields a Hugging Face config.json determines: `model=hf` takes them from it,
#: any other model config must agree with it (max_seq_len is taken, never compared: training
#: on shorter sequences than the model supports is fine).
HF_FIELDS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "vocab_size",
    "norm_eps",
    "rope_theta",
    "rope_scaling",
    "tie_embeddings",
)


def model_config_for_hf(cfg: ModelConfig, hf_json: Mapping) -> ModelConfig:
    """The model config to build for `cfg.init_from`, whose config.json is `hf_json`: with
    `shape_from_hf` (model=hf) the HF_FIELDS and max_seq_len are taken from it; otherwise they
    must agree with it (one ConfigError listing every difference)."""
    try:
        hf = model_config_from_hf(hf_json, name=cfg.name)
    except ConfigError as e:
        raise ConfigError(f"model.init_from={cfg.init_from}: {e}") from None
    if cfg.shape_from_hf:
        return replace(cfg, max_seq_len=hf.max_seq_len, **{f: getattr(hf, f) for f in HF_FIELDS})
    diffs = []
    for f in HF_FIELDS:
        ours, theirs = getattr(cfg, f), getattr(hf, f)
        if ours == theirs:
            continue
        if f == "rope_scaling" and ours is not None and theirs is not None:
            diffs += [
                f"model.{f}.{k}={v} (config.json: {w})"
                for k, v, w in ((k, getattr(ours, k), getattr(theirs, k)) for k in vars(ours))
                if v != w
            ]
        else:
            none = "null (no scaling)"
            diffs.append(
                f"model.{f}={none if ours is None else ours} "
                f"(config.json: {none if theirs is None else theirs})"
            )
    if diffs:
        raise ConfigError(
            f"model.init_from={cfg.init_from}: the model config differs from its config.json: "
            f"{', '.join(diffs)}; set those fields to config.json's values, or use model=hf to "
            "take the shape from config.json"
        )
    return cfg
