"""FP8 dot-product attention (`recipe.fp8_attention`): what TE 2.20 can train, and the
environment its attention recipe is read from.

Attention always runs in delayed scaling. Per-tensor current scaling quantizes Q, K and V with
one amax over the whole tensor, so a later position can change how an earlier one is rounded
(TE issue 3248): a causal model whose past depends on its future. Delayed scaling takes its
scales from the amax of earlier steps, so within a forward the past does not see the future.

- fp8_delayed: the run's own DelayedScaling recipe, with `fp8_dpa=True` (recipes/recipe.py
  `te_recipe_spec`), covers attention too.
- fp8_cs, mxfp8, nvfp4: the Linear layers keep the run's recipe (with `fp8_dpa=True`), and
  TE's DotProductAttention builds a DelayedScaling of its own when NVTE_DPA_FP8_RECIPE is
  "DelayedScaling" (`recipes.recipe.attention_recipe_spec`). TE reads that variable and the
  ones that shape its recipe once, when its attention modules are imported
  (dot_product_attention.py and multi_head_attention.py, module level), so train.py applies
  `attention_environment` before anything imports TE, all of them set explicitly: the config,
  not whatever the shell held, decides the run.

Nothing here imports TE; `check_fp8_attention` asks the device through the package's
`device_capability` / `cudnn_version` (tests monkeypatch them).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, MutableMapping

import torch

from errors import ConfigError
from recipes.config import RecipeConfig
from recipes.recipe import (
    ATTENTION_AMAX_COMPUTE_ALGO,
    ATTENTION_AMAX_HISTORY_LEN,
    ATTENTION_BORROWS_DELAYED,
    ATTENTION_REDUCE_AMAX,
    FP8_ATTENTION_RECIPES,
    device_capability,
    sm,
)

#: The TE modules that read the variables at import (TE 2.20.2).
DPA_MODULE = "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention"
MHA_MODULE = "transformer_engine.pytorch.attention.multi_head_attention"


def _flag(value) -> str:
    return "1" if value else "0"


#: Variable -> where an imported TE keeps what it read: (module, attribute, the value as the
#: variable would spell it).
_READ_AT_IMPORT = {
    "NVTE_DPA_FP8_RECIPE": [
        (DPA_MODULE, "_dpa_fp8_recipe", str),
        (MHA_MODULE, "_dpa_fp8_recipe", str),
    ],
    "NVTE_DPA_FP8_FORMAT": [(DPA_MODULE, "_dpa_fp8_format", lambda f: getattr(f, "name", str(f)))],
    "NVTE_DPA_FP8DS_AMAX_HISTLEN": [(DPA_MODULE, "_dpa_fp8ds_amax_histlen", str)],
    "NVTE_DPA_FP8DS_AMAX_ALGO": [(DPA_MODULE, "_dpa_fp8ds_amax_algo", str)],
    "NVTE_DPA_FP8DS_REDUCE_AMAX": [(DPA_MODULE, "_dpa_fp8ds_reduce_amax", _flag)],
    "NVTE_DPA_FP8_RECIPE_DPA": [(MHA_MODULE, "_dpa_fp8_recipe_dpa", _flag)],
    "NVTE_DPA_FP8_RECIPE_MHA": [(MHA_MODULE, "_dpa_fp8_recipe_mha", _flag)],
}
#: What NVTE_DPA_FP8_RECIPE may hold when only fp8_delayed recipes have fp8_attention: unset,
#: or "DelayedScaling" (TE then keeps the run's recipe for attention).
_DELAYED_KEEPS = ("", "DelayedScaling")


def attention_environment(cfgs: Iterable[RecipeConfig]) -> dict[str, str]:
    """The NVTE_DPA_* variables the recipes of a run (the first and each `recipe.switch`
    target) need: empty unless one of fp8_cs, mxfp8, nvfp4 has fp8_attention.

    NVTE_DPA_FP8_RECIPE=DelayedScaling makes TE's attention build its own DelayedScaling under
    those recipes, from NVTE_DPA_FP8DS_AMAX_HISTLEN (1: the scale of a step from the amax of the
    step before), _AMAX_ALGO (most_recent) and _REDUCE_AMAX (1: amax reduced over the
    autocast's group, so every rank uses one scale), and for nvfp4 (whose recipe has no FP8
    format) NVTE_DPA_FP8_FORMAT (recipe.fp8_format; HYBRID, TE's default, when no nvfp4 recipe
    has fp8_attention). NVTE_DPA_FP8_RECIPE_DPA / _MHA=0 (TE's defaults) tell
    MultiheadAttention that attention's output and gradient cross to the projection GEMM in
    bf16: only the attention itself runs in FP8."""
    cfgs = list(cfgs)
    borrowing = [c for c in cfgs if c.fp8_attention and c.name in ATTENTION_BORROWS_DELAYED]
    if not borrowing:
        return {}
    formats = list(dict.fromkeys(c.fp8_format for c in borrowing if c.name == "nvfp4"))
    if len(formats) > 1:
        raise ConfigError(
            f"recipe.fp8_attention=true with recipe=nvfp4 under recipe.fp8_format={formats[0]} "
            f"and {formats[1]} in one run: TE reads the FP8 format of nvfp4's attention once "
            "per process (NVTE_DPA_FP8_FORMAT); give every nvfp4 recipe of the run one "
            "recipe.fp8_format"
        )
    return {
        "NVTE_DPA_FP8_RECIPE": "DelayedScaling",
        "NVTE_DPA_FP8_FORMAT": formats[0] if formats else "HYBRID",
        "NVTE_DPA_FP8DS_AMAX_HISTLEN": str(ATTENTION_AMAX_HISTORY_LEN),
        "NVTE_DPA_FP8DS_AMAX_ALGO": ATTENTION_AMAX_COMPUTE_ALGO,
        "NVTE_DPA_FP8DS_REDUCE_AMAX": _flag(ATTENTION_REDUCE_AMAX),
        "NVTE_DPA_FP8_RECIPE_DPA": "0",
        "NVTE_DPA_FP8_RECIPE_MHA": "0",
    }


def _imported_values(name: str) -> list[str]:
    """What the TE modules imported in this process read from variable `name` (empty when
    none is imported, or the installed TE keeps no such attribute)."""
    out = []
    for module_name, attr, spell in _READ_AT_IMPORT[name]:
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, attr):
            out.append(spell(getattr(module, attr)))
    return out


def apply_attention_environment(
    cfgs: Iterable[RecipeConfig], environ: MutableMapping[str, str] | None = None
) -> dict[str, str]:
    """Set `attention_environment(cfgs)` in the environment (os.environ by default) before TE
    is imported; returns what it set. Raises ConfigError (one line) for a variable the
    environment already holds with another value, or a TE attention module imported before
    with another value (it never reads the variable again)."""
    env = os.environ if environ is None else environ
    cfgs = list(cfgs)
    attention = [c for c in cfgs if c.fp8_attention and c.name in FP8_ATTENTION_RECIPES]
    if not attention:
        return {}
    needed = attention_environment(cfgs)
    if not needed:  # fp8_delayed only: its own recipe, unless the variable redirects attention
        have = env.get("NVTE_DPA_FP8_RECIPE", "")
        if have not in _DELAYED_KEEPS:
            raise ConfigError(
                f"NVTE_DPA_FP8_RECIPE={have} is set in the environment, but "
                "recipe.fp8_attention=true with recipe=fp8_delayed runs attention under the "
                "recipe's own delayed scaling (a position's output never depends on later "
                "positions); unset NVTE_DPA_FP8_RECIPE"
            )
        held = [v for v in _imported_values("NVTE_DPA_FP8_RECIPE") if v not in _DELAYED_KEEPS]
        if held:
            raise ConfigError(
                f"TransformerEngine's attention was imported in this process with "
                f"NVTE_DPA_FP8_RECIPE={held[0]} (read once, at import), but "
                "recipe.fp8_attention=true with recipe=fp8_delayed runs attention under the "
                "recipe's own delayed scaling; start the run in a process without "
                "NVTE_DPA_FP8_RECIPE"
            )
        return {}
    name = next(c.name for c in attention if c.name in ATTENTION_BORROWS_DELAYED)
    for key, value in needed.items():
        have = env.get(key)
        if have is not None and have != value:
            raise ConfigError(
                f"{key}={have} is set in the environment, but recipe.fp8_attention=true with "
                f"recipe={name} runs attention in TE's delayed scaling and sets {key}={value} "
                f"itself (docs/PRECISION.md, FP8 attention); unset {key}"
            )
    for key, value in needed.items():
        held = [v for v in _imported_values(key) if v != value]
        if held:
            exports = " ".join(f"{k}={v}" for k, v in needed.items())
            raise ConfigError(
                f"TransformerEngine's attention was imported in this process before "
                f"recipe.fp8_attention=true with recipe={name} could set {key}={value} (TE reads "
                f"it once, at import, and holds {held[0]!r}); start the run in a fresh process, "
                f"or set {exports} before Python starts"
            )
    env.update(needed)
    return needed


def cudnn_version() -> tuple[int, int, int] | None:
    """The cuDNN that TE's attention runs (TE's own report when TE imports, else torch's), as
    (major, minor, patch); None without cuDNN. Tests monkeypatch it in this module."""
    try:
        from transformer_engine.pytorch import get_cudnn_version

        return tuple(int(x) for x in get_cudnn_version())
    except Exception:
        pass
    v = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if not v:
        return None
    return (v // 10000, v // 100 % 100, v % 100)  # cuDNN 9: major * 10000 + minor * 100 + patch


#: cuDNN from which TE 2.20 keeps FP8 fused attention in deterministic training
#: (get_attention_backend: disabled for determinism below it).
DETERMINISTIC_FP8_CUDNN = (9, 19, 0)


def check_fp8_attention(cfg: RecipeConfig, mcfg, data, deterministic: bool, device) -> None:
    """What TE 2.20 cannot train with recipe.fp8_attention, refused in one line before any
    work (check_recipe has refused bf16 and fp8_block, and a GPU that cannot run the recipe).
    mcfg: the model config (head_dim); data: the data config (document masking)."""
    if not (cfg.fp8_attention and cfg.name in FP8_ATTENTION_RECIPES):
        return
    # data=synthetic with whole_rows documents has no boundary inside a sample: the model
    # runs its causal (bshd) path on every batch.
    whole_rows = data.name == "synthetic" and data.doc_len_dist == "whole_rows"
    if data.document_mask and not whole_rows:
        raise ConfigError(
            "recipe.fp8_attention=true with data.document_mask=true: TE 2.20 runs FP8 "
            "attention on the bshd/sbhd layouts only, not the THD layout document masking "
            "uses; set data.document_mask=false (causal attention over each whole sample)"
        )
    if torch.device(device).type != "cuda":
        return
    gpu, capability = device_capability(device)
    capability = tuple(capability)
    if capability < (9, 0):
        raise ConfigError(
            f"recipe.fp8_attention=true needs compute capability >= 9.0 (Hopper: TE's FP8 "
            f"attention is cuDNN's fused attention, sm_90 and newer); this GPU is {gpu} "
            f"({sm(capability)}): drop recipe.fp8_attention"
        )
    if capability[0] == 9 and mcfg.head_dim != 128:
        raise ConfigError(
            f"recipe.fp8_attention=true with head_dim {mcfg.head_dim} (model.dim={mcfg.dim} / "
            f"model.n_heads={mcfg.n_heads}): on {sm(capability)} ({gpu}) TE trains FP8 "
            "attention with head_dim 128 only; use a model with head_dim 128 (llama3_3b, "
            "llama3_8b, llama3_70b) or drop recipe.fp8_attention"
        )
    if deterministic:
        version = cudnn_version()
        if version is None or tuple(version) < DETERMINISTIC_FP8_CUDNN:
            found = "no cuDNN" if version is None else "cuDNN " + ".".join(map(str, version))
            raise ConfigError(
                "train.deterministic=true with recipe.fp8_attention=true needs cuDNN >= 9.19 "
                f"(TE 2.20 has no deterministic FP8 attention backward before it); this run "
                f"has {found}: set train.deterministic=false, drop recipe.fp8_attention, or "
                "install cuDNN >= 9.19"
            )
