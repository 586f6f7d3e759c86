"""Precision recipes: config -> TE recipe object, autocast and quantized-init contexts, checks.

Everything TE-specific is imported inside the function that needs it, so this module (and the
early config check) works on machines without TransformerEngine or CUDA. The pure parts (the
capability table, the config -> TE keyword mapping, bf16-layer resolution) are plain data.

Field names and defaults follow TE 2.20.2, transformer_engine/common/recipe/__init__.py:
DelayedScaling(margin, fp8_format, amax_history_len, amax_compute_algo), Float8CurrentScaling
(fp8_format), Float8BlockScaling(fp8_format, x/w/grad_block_scaling_dim; its per-tensor-role
QParams(power_2_scale, amax_epsilon) are class attributes, not constructor fields, so they are
set on the instance after construction), MXFP8BlockScaling(fp8_format), NVFP4BlockScaling
(disable_rht, disable_stochastic_rounding, disable_2d_quantization); each of them but
Float8BlockScaling takes fp8_dpa (FP8 dot-product attention, recipe.fp8_attention). Several TE
defaults are read from NVTE_* environment variables; every field we configure is passed
explicitly, so the recorded config, not the environment, decides the run (the variables TE
reads for its attention recipe are set from the config too: recipes/attention.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from errors import ConfigError
from parallel.tp import fsdp_shard_extents
from recipes.config import RecipeConfig

#: Recipe name -> lowest compute capability that runs it (TE 2.20.2 quantization.py:
#: _compute_fp8_support, _compute_fp8_block_scaling_support, _compute_mxfp8_support,
#: _compute_nvfp4_support). Listing order is the order `runnable_recipes` reports.
SUPPORTED: dict[str, tuple[int, int]] = {
    "bf16": (8, 0),
    "fp8_delayed": (8, 9),
    "fp8_cs": (8, 9),
    "fp8_block": (9, 0),
    "mxfp8": (10, 0),
    "nvfp4": (10, 0),
}
#: Capabilities from which TE 2.20.2 refuses a recipe again (MXFP8 is not yet supported for
#: all GEMM layouts on sm_120+).
UNSUPPORTED_FROM: dict[str, tuple[int, int]] = {"mxfp8": (12, 0)}
RECIPES = tuple(SUPPORTED)
ARCHITECTURES = {(8, 0): "Ampere", (8, 9): "Ada", (9, 0): "Hopper", (10, 0): "Blackwell"}

#: Per-tensor-scaled recipes whose weight quantizers must reduce amax over the ranks that
#: hold pieces of one weight (recipes/amax.py). Block-scaled recipes have no global scale.
PER_TENSOR_CURRENT_SCALED = frozenset({"fp8_cs", "nvfp4"})

#: Recipe -> (weight quantizer class, quantized parameter class) in TE 2.20.2
#: (transformer_engine.pytorch.tensor.*). With quantized_init the weights of TE modules are
#: instances of the second class; otherwise they stay in the model's dtype and the first class
#: quantizes them at every forward.
WEIGHT_TYPES: dict[str, tuple[str, str]] = {
    "fp8_delayed": ("Float8Quantizer", "Float8Tensor"),
    "fp8_cs": ("Float8CurrentScalingQuantizer", "Float8Tensor"),
    "fp8_block": ("Float8BlockQuantizer", "Float8BlockwiseQTensor"),
    "mxfp8": ("MXFP8Quantizer", "MXFP8Tensor"),
    "nvfp4": ("NVFP4Quantizer", "NVFP4Tensor"),
}

FP8_FORMATS = ("HYBRID", "E4M3")  # TE asserts against pure E5M2 training
AMAX_COMPUTE_ALGOS = ("max", "most_recent")

#: Recipes that run dot-product attention in FP8 with recipe.fp8_attention (TE's `fp8_dpa`).
#: TE 2.20's Float8BlockScaling asserts that FP8 attention is unsupported.
FP8_ATTENTION_RECIPES = ("fp8_delayed", "fp8_cs", "mxfp8", "nvfp4")
#: Of those, the ones whose own scaling is not delayed: their attention runs under the
#: delayed-scaling recipe TE builds for attention (recipes/attention.py).
ATTENTION_BORROWS_DELAYED = ("fp8_cs", "mxfp8", "nvfp4")


def sm(capability: tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def device_capability(device: torch.device) -> tuple[str, tuple[int, int]]:
    """(GPU name, (major, minor)). The one place that asks the driver; tests monkeypatch it."""
    return torch.cuda.get_device_name(device), tuple(torch.cuda.get_device_capability(device))


def recipe_runs_on(name: str, capability: tuple[int, int]) -> bool:
    upper = UNSUPPORTED_FROM.get(name)
    return tuple(capability) >= SUPPORTED[name] and (upper is None or tuple(capability) < upper)


def runnable_recipes(capability: tuple[int, int]) -> list[str]:
    return [name for name in RECIPES if recipe_runs_on(name, capability)]


def _requirement(name: str, capability: tuple[int, int]) -> str:
    """The bound `capability` misses, as the error message states it."""
    low = SUPPORTED[name]
    if tuple(capability) < low:
        return f">= {low[0]}.{low[1]} ({ARCHITECTURES[low]})"
    high = UNSUPPORTED_FROM[name]
    return f"< {high[0]}.{high[1]} (TE does not run it on {sm(high)} and newer yet)"


def te_support(name: str) -> tuple[bool, str]:
    """TE's own availability verdict (it also checks CUDA / cuBLASLt versions, e.g. CUDA >= 12.9
    for FP8 block scaling). (True, "") when TE is not importable: the table check is all we have."""
    checks = {
        "fp8_delayed": "is_fp8_available",
        "fp8_cs": "is_fp8_available",
        "fp8_block": "is_fp8_block_scaling_available",
        "mxfp8": "is_mxfp8_available",
        "nvfp4": "is_nvfp4_available",
    }
    if name not in checks:
        return True, ""
    try:
        import transformer_engine.pytorch as te
    except Exception:
        return True, ""
    ok, reason = getattr(te, checks[name])(return_reason=True)
    return bool(ok), str(reason)


def _check_fields(cfg: RecipeConfig) -> None:
    """Field values TE would reject with an assert deep inside recipe construction."""
    name = cfg.name
    # nvfp4's own TE recipe has no fp8_format; its FP8 attention takes this one.
    fp8_format_used = name in ("fp8_delayed", "fp8_cs", "fp8_block", "mxfp8") or (
        name == "nvfp4" and cfg.fp8_attention
    )
    if fp8_format_used and cfg.fp8_format not in FP8_FORMATS:
        raise ConfigError(
            f"recipe.fp8_format={cfg.fp8_format!r} is not one of "
            f"{', '.join(FP8_FORMATS)} (TE does not train in pure E5M2)"
        )
    if name == "fp8_delayed":
        if cfg.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ConfigError(
                f"recipe.amax_compute_algo={cfg.amax_compute_algo!r} is not one "
                f"of {', '.join(AMAX_COMPUTE_ALGOS)}"
            )
        if cfg.amax_history_len < 1:
            raise ConfigError(f"recipe.amax_history_len={cfg.amax_history_len} must be >= 1")
        if cfg.margin < 0:
            raise ConfigError(f"recipe.margin={cfg.margin} must be >= 0")
    if name == "fp8_block":
        dims = {
            "x_block_scaling_dim": cfg.x_block_scaling_dim,
            "w_block_scaling_dim": cfg.w_block_scaling_dim,
            "grad_block_scaling_dim": cfg.grad_block_scaling_dim,
        }
        for key, value in dims.items():
            if value not in (1, 2):
                raise ConfigError(
                    f"recipe.{key}={value} must be 1 (1x128 tiles) or 2 (128x128 blocks)"
                )
        two_d = [key for key, value in dims.items() if value == 2]
        if len(two_d) > 1:
            raise ConfigError(
                f"recipe.{two_d[0]} and recipe.{two_d[1]} are both 2: TE has no "
                "2D-by-2D block GEMM; set one of them to 1"
            )


def check_recipe(cfg: RecipeConfig, impl: str, device: torch.device) -> None:
    """Everything about the recipe that can be checked before any work. Raises ConfigError.

    impl is the resolved model implementation ('te' or 'torch'); device is where the run goes.
    Layer indices need the model shape: see check_bf16_layers.
    """
    name = cfg.name
    if name not in SUPPORTED:
        raise ConfigError(f"recipe.name={name!r} is not one of {', '.join(RECIPES)}")
    if name == "bf16" and cfg.quantized_init:
        raise ConfigError(
            "recipe.quantized_init=true has no effect with recipe=bf16 (nothing "
            "is quantized); drop recipe.quantized_init or pick a quantized recipe"
        )
    if cfg.fp8_attention and name == "bf16":
        raise ConfigError(
            "recipe.fp8_attention=true has no effect with recipe=bf16 (nothing runs in FP8); "
            "drop recipe.fp8_attention or pick an FP8 recipe (fp8_delayed, fp8_cs, mxfp8, nvfp4)"
        )
    if cfg.fp8_attention and name not in FP8_ATTENTION_RECIPES:
        raise ConfigError(
            f"recipe.fp8_attention=true with recipe={name}: TE 2.20 has no FP8 attention for "
            "FP8 block scaling (Float8BlockScaling); drop recipe.fp8_attention, or use "
            "recipe=fp8_delayed or fp8_cs"
        )
    _check_fields(cfg)
    if name != "bf16" and device.type != "cuda":
        raise ConfigError(
            f"recipe={name} needs TransformerEngine and a CUDA GPU; this run is on CPU, which "
            "runs recipe=bf16 only: use recipe=bf16 here, or run on a GPU with TE (make setup-gpu)"
        )
    if name != "bf16" and impl != "te":
        raise ConfigError(
            f"recipe={name} needs the TE implementation (model.impl=te) and a "
            "CUDA GPU; the reference implementation runs bf16 only: use recipe=bf16, or "
            "model.impl=te with TE installed (make setup-gpu)"
        )
    if device.type != "cuda":
        return
    gpu, capability = device_capability(device)
    if not recipe_runs_on(name, capability):
        runs = ", ".join(runnable_recipes(capability)) or "none of them"
        raise ConfigError(
            f"recipe={name} needs compute capability "
            f"{_requirement(name, capability)}; this GPU is {gpu} "
            f"({sm(capability)}), which runs: {runs}"
        )
    if impl == "te":
        ok, reason = te_support(name)
        if not ok:
            raise ConfigError(
                f"recipe={name} is not available on {gpu} ({sm(capability)}): {reason.strip()}"
            )


#: Recipes whose quantized weights FSDP2 all-gathers as several tensors (data + block scales).
MULTI_TENSOR_WEIGHTS = ("fp8_block", "mxfp8", "nvfp4")


def _weight_block(cfg: RecipeConfig) -> int:
    """Length of a weight's scale block along the dim FSDP shards (TE's block sizes)."""
    return {"fp8_block": 128, "mxfp8": 32, "nvfp4": 16}[cfg.name]


def check_recipe_layout(
    cfg: RecipeConfig, shapes: dict, world_size: int, dp_shard: int, tp: int
) -> None:
    """Recipe x layout x model combinations that cannot work (`shapes`: the model's block
    weights, model/config.py's `block_weight_shapes`). Raises ConfigError.

    All concern quantized weights that FSDP2 all-gathers as several tensors (data + block
    scales) on more than one process. FSDP2's one-rank shard mesh and the dim-1 sharding of fc1
    under TP need the fixes in compat/fsdp2.py; the second exists for FP8 128x128
    blocks only, so MXFP8 / NVFP4 are refused where FSDP shards fc1 along dim 1. Each FSDP
    shard must hold whole scale blocks, or the all-gathered scales do not describe the weight.
    """
    if not (cfg.quantized_init and cfg.name in MULTI_TENSOR_WEIGHTS and world_size > 1):
        return
    fix = "or use recipe.quantized_init=false"
    if cfg.name == "fp8_block" and cfg.w_block_scaling_dim != 2:
        raise ConfigError(
            f"recipe=fp8_block with recipe.quantized_init=true on {world_size} processes needs "
            f"recipe.w_block_scaling_dim=2 (TE all-gathers only 128x128-block weights); set it, "
            f"{fix}"
        )
    if cfg.name == "nvfp4" and cfg.disable_2d_quantization:
        raise ConfigError(
            f"recipe=nvfp4 with recipe.quantized_init=true on {world_size} processes needs "
            f"recipe.disable_2d_quantization=false (TE derives the all-gathered weight's "
            f"transpose from 2-D blocks); set it, {fix}"
        )
    if dp_shard == 1:
        return  # nothing is all-gathered
    if tp > 1 and cfg.name != "fp8_block":
        raise ConfigError(
            f"recipe={cfg.name} with recipe.quantized_init=true does not combine with "
            f"parallel.tp={tp} and parallel.dp_shard={dp_shard}: FSDP2 shards fc1 along dim 1 "
            f"under tensor parallelism, and only FP8 128x128 blocks are regrouped after that "
            f"all-gather; use parallel.dp_shard=1 or parallel.tp=1, {fix}"
        )
    block = _weight_block(cfg)
    for name, (axis, size, shard) in fsdp_shard_extents(shapes, dp_shard, tp).items():
        if size % dp_shard or shard % block:
            raise ConfigError(
                f"recipe={cfg.name} with recipe.quantized_init=true: FSDP2 splits the {size} "
                f"{axis} of each {name} weight (tp-local, parallel.tp={tp}) over "
                f"parallel.dp_shard={dp_shard}, giving shards of {size / dp_shard:g} {axis}; each "
                f"must be a multiple of the {block}-wide scale block. Change model.dim / "
                f"n_heads / ffn_dim or the degrees, {fix}"
            )


def resolve_bf16_layers(indices: Iterable[int], n_layers: int) -> frozenset[int]:
    """Block indices, negative ones counted from the end, as a set of 0..n_layers-1. Raises
    ConfigError for an index outside the model."""
    indices = [int(i) for i in indices]
    bad = [i for i in indices if not -n_layers <= i < n_layers]
    if bad:
        raise ConfigError(
            f"recipe.bf16_layers={indices} has index {bad[0]} "
            f"outside model.n_layers={n_layers}; use 0..{n_layers - 1}, or "
            f"-{n_layers}..-1 to count from the end"
        )
    return frozenset(i % n_layers for i in indices)


def check_bf16_layers(cfg: RecipeConfig, n_layers: int) -> None:
    resolve_bf16_layers(cfg.bf16_layers, n_layers)


@dataclass(frozen=True)
class TERecipeSpec:
    """What `build_te_recipe` passes to TE: plain data, so it is testable without TE.

    cls: class name in transformer_engine.common.recipe; kwargs: constructor keywords, with
    FP8 formats as Format member names; qparams: instance attributes set to QParams(**value)
    after construction (TE keeps Float8BlockScaling's QParams as class attributes).
    """

    cls: str
    kwargs: dict[str, Any]
    qparams: dict[str, dict[str, Any]] = field(default_factory=dict)


def te_recipe_spec(cfg: RecipeConfig) -> TERecipeSpec | None:
    """Config -> TE recipe class and arguments; None for bf16. With recipe.fp8_attention the
    recipe also asks for FP8 dot-product attention (`fp8_dpa`; check_recipe refuses it for
    fp8_block, whose TE recipe asserts against it)."""
    spec = _te_recipe_spec(cfg)
    if spec is not None and cfg.fp8_attention and cfg.name in FP8_ATTENTION_RECIPES:
        spec = replace(spec, kwargs={**spec.kwargs, "fp8_dpa": True})
    return spec


def _te_recipe_spec(cfg: RecipeConfig) -> TERecipeSpec | None:
    name = cfg.name
    if name == "bf16":
        return None
    if name == "fp8_delayed":
        return TERecipeSpec(
            "DelayedScaling",
            {
                "fp8_format": cfg.fp8_format,
                "amax_history_len": cfg.amax_history_len,
                "amax_compute_algo": cfg.amax_compute_algo,
                "margin": cfg.margin,
            },
        )
    if name == "fp8_cs":
        return TERecipeSpec("Float8CurrentScaling", {"fp8_format": cfg.fp8_format})
    if name == "fp8_block":
        qp = {"power_2_scale": cfg.power_2_scale, "amax_epsilon": 0.0}
        return TERecipeSpec(
            "Float8BlockScaling",
            {
                "fp8_format": cfg.fp8_format,
                "x_block_scaling_dim": cfg.x_block_scaling_dim,
                "w_block_scaling_dim": cfg.w_block_scaling_dim,
                "grad_block_scaling_dim": cfg.grad_block_scaling_dim,
            },
            {
                role: dict(qp)
                for role in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")
            },
        )
    if name == "mxfp8":
        return TERecipeSpec("MXFP8BlockScaling", {"fp8_format": cfg.fp8_format})
    if name == "nvfp4":
        return TERecipeSpec(
            "NVFP4BlockScaling",
            {
                "disable_rht": cfg.disable_rht,
                "disable_stochastic_rounding": cfg.disable_stochastic_rounding,
                "disable_2d_quantization": cfg.disable_2d_quantization,
            },
        )
    raise ConfigError(f"recipe.name={name!r} is not one of {', '.join(RECIPES)}")


#: The delayed scaling of attention under fp8_cs, mxfp8 and nvfp4 with recipe.fp8_attention:
#: TE 2.20's DotProductAttention.init_fp8_metadata builds DelayedScaling(fp8_format,
#: amax_history_len, amax_compute_algo, fp8_dpa, fp8_mha, reduce_amax) from
#: NVTE_DPA_FP8DS_AMAX_HISTLEN, NVTE_DPA_FP8DS_AMAX_ALGO and NVTE_DPA_FP8DS_REDUCE_AMAX (its
#: defaults, which recipes/attention.py sets explicitly): the scale of each step comes from the
#: amax of the step before, reduced over the autocast's amax group.
ATTENTION_AMAX_HISTORY_LEN = 1
ATTENTION_AMAX_COMPUTE_ALGO = "most_recent"
ATTENTION_REDUCE_AMAX = True


def attention_recipe_spec(cfg: RecipeConfig) -> TERecipeSpec | None:
    """The DelayedScaling TE builds for attention under fp8_cs, mxfp8 or nvfp4 with
    recipe.fp8_attention, field for field (TE's recipes are dataclasses: a load that hands
    attention modules an equal recipe is kept by their next forward). Its fp8_format is the
    run recipe's (fp8_cs, mxfp8), or NVTE_DPA_FP8_FORMAT for nvfp4, which recipes/attention.py
    sets to recipe.fp8_format. None when attention runs under the run's own recipe
    (fp8_delayed) or not in FP8."""
    if not (cfg.fp8_attention and cfg.name in ATTENTION_BORROWS_DELAYED):
        return None
    return TERecipeSpec(
        "DelayedScaling",
        {
            "fp8_format": cfg.fp8_format,
            "amax_history_len": ATTENTION_AMAX_HISTORY_LEN,
            "amax_compute_algo": ATTENTION_AMAX_COMPUTE_ALGO,
            "reduce_amax": ATTENTION_REDUCE_AMAX,
            "fp8_dpa": True,
            "fp8_mha": False,
        },
    )


def build_te_recipe(spec: TERecipeSpec):
    from transformer_engine.common import recipe as te_recipe

    kwargs = dict(spec.kwargs)
    if "fp8_format" in kwargs:
        kwargs["fp8_format"] = te_recipe.Format[kwargs["fp8_format"]]
    obj = getattr(te_recipe, spec.cls)(**kwargs)
    for attr, params in spec.qparams.items():
        setattr(obj, attr, te_recipe.QParams(**params))
    return obj


def _te_autocast(enabled: bool, recipe, group) -> AbstractContextManager:
    import transformer_engine.pytorch as te

    return te.autocast(enabled=enabled, recipe=recipe, amax_reduction_group=group)


def _te_quantized_model_init(enabled: bool, recipe, preserve: bool) -> AbstractContextManager:
    import transformer_engine.pytorch as te

    return te.quantized_model_init(
        enabled=enabled, recipe=recipe, preserve_high_precision_init_val=preserve
    )


class Recipe:
    """The one seam for precision: built once from the config, asked by the model and trainer.

    bf16 is a recipe too: every context is a no-op and te_recipe() is None.
    """

    def __init__(self, cfg: RecipeConfig, n_layers: int):
        self.cfg = cfg
        self.name: str = cfg.name
        self.n_layers = n_layers
        self.bf16_layer_ids: frozenset[int] = resolve_bf16_layers(cfg.bf16_layers, n_layers)
        self._te_recipe = None
        self._attention_te_recipe = None

    def __repr__(self) -> str:
        return (
            f"Recipe({self.name}, quantized_init={self.quantized_init}, "
            f"bf16_layers={sorted(self.bf16_layer_ids)}, fp8_attention={self.fp8_attention})"
        )

    @property
    def is_quantized(self) -> bool:
        return self.name != "bf16"

    @property
    def quantized_init(self) -> bool:
        return self.is_quantized and bool(self.cfg.quantized_init)

    @property
    def needs_weight_amax_group(self) -> bool:
        """Per-tensor current scaling: weight shards must agree on one amax (recipes/amax.py)."""
        return self.name in PER_TENSOR_CURRENT_SCALED

    @property
    def weight_quantizer_class(self) -> str | None:
        return WEIGHT_TYPES[self.name][0] if self.is_quantized else None

    @property
    def weight_tensor_class(self) -> str | None:
        """Class of TE weights built with quantized_init (None: weights stay high precision)."""
        return WEIGHT_TYPES[self.name][1] if self.quantized_init else None

    def is_bf16_layer(self, layer_index: int) -> bool:
        return self.is_quantized and layer_index % self.n_layers in self.bf16_layer_ids

    def te_spec(self) -> TERecipeSpec | None:
        return te_recipe_spec(self.cfg)

    def te_recipe(self):
        """The TE recipe object, built once: TE keys its per-module state on the recipe, so every
        context below must hand it the same object."""
        if not self.is_quantized:
            return None
        if self._te_recipe is None:
            self._te_recipe = build_te_recipe(self.te_spec())
        return self._te_recipe

    @property
    def fp8_attention(self) -> bool:
        """Dot-product attention runs in FP8 (recipe.fp8_attention), always delayed-scaled."""
        return self.name in FP8_ATTENTION_RECIPES and bool(self.cfg.fp8_attention)

    def attention_te_recipe(self):
        """The DelayedScaling TE's attention modules hold in their fp8_meta under fp8_cs, mxfp8
        or nvfp4 with fp8_attention (`attention_recipe_spec`), built once; the checkpoint
        loads their scales with it (checkpoint/te_state.py). None otherwise: under fp8_delayed
        attention keeps the run's recipe, `te_recipe()`."""
        spec = attention_recipe_spec(self.cfg)
        if spec is None:
            return None
        if self._attention_te_recipe is None:
            self._attention_te_recipe = build_te_recipe(spec)
        return self._attention_te_recipe

    def autocast(self, enabled: bool = True, amax_group=None) -> AbstractContextManager:
        """Forward context. amax_group only matters for fp8_delayed (TE reduces the amax history
        of every tensor over it at autocast exit); None means all ranks, TE's default."""
        if not self.is_quantized:
            return nullcontext()
        return _te_autocast(enabled, self.te_recipe(), amax_group)

    def layer_autocast(self, layer_index: int) -> AbstractContextManager:
        """Around block `layer_index` inside `autocast`: turns quantized compute off for
        bf16_layers (TE remembers the choice for the block's backward). The TE model enters it
        around each block."""
        if not self.is_bf16_layer(layer_index):
            return nullcontext()
        return _te_autocast(False, self.te_recipe(), None)

    def quantized_init_context(
        self, preserve_high_precision_init_val: bool = True
    ) -> AbstractContextManager:
        """Around model construction: TE modules built inside hold quantized weights."""
        if not self.quantized_init:
            return nullcontext()
        return _te_quantized_model_init(True, self.te_recipe(), preserve_high_precision_init_val)

    def layer_init_context(self, layer_index: int) -> AbstractContextManager:
        """Around building block `layer_index` (inside `quantized_init_context`): bf16_layers
        get high-precision weights. The TE model enters it around each block's construction."""
        if not (self.quantized_init and self.is_bf16_layer(layer_index)):
            return nullcontext()
        return _te_quantized_model_init(False, self.te_recipe(), False)

    # Quantized parameters and FusedAdam master weights (recipes/quantized.py).
    def fused_adam_kwargs(self) -> dict:
        from recipes.quantized import master_weight_kwargs

        return master_weight_kwargs(self)

    def quantize_weights(self, model: torch.nn.Module, amax_group=None) -> int:
        if not self.quantized_init:
            return 0
        from recipes.quantized import quantize_weights

        return quantize_weights(model, amax_group if self.needs_weight_amax_group else None)

    def seed_master_weights(
        self, model: torch.nn.Module, optimizer, value_fn: Callable | None = None
    ) -> int:
        if not self.quantized_init:
            return 0
        from recipes.quantized import seed_master_weights

        return seed_master_weights(optimizer, model, value_fn)

    def weight_amax_group(self, weight_shard_group, tp_group):
        """See recipes/amax.py: dp_shard x tp with quantized_init, else tp; None if no reduction."""
        from recipes.amax import weight_amax_group

        return weight_amax_group(self, weight_shard_group, tp_group)

    def init_weight_quantizers(self, model: torch.nn.Module, group) -> int:
        """Create the TE modules' quantizers now, as their first forward under autocast would,
        and apply `group` to the per-tensor weight quantizers. Without it the first step of a
        run, and the first step after every resume, would cast tensor-parallel weight slices
        with per-slice scales (the group is otherwise set before each optimizer step, after the
        quantizers exist): not the one-GPU scale, and not what the uninterrupted run did. With
        quantized_init TE builds the quantizers at construction; only the group is applied."""
        if self.needs_weight_amax_group and group is not None and not self.quantized_init:
            from recipes.amax import create_weight_quantizers

            with self.autocast():
                create_weight_quantizers(model)
        return self.set_weight_amax_groups(model, group)

    def prepare_weights(self, model: torch.nn.Module, weight_shard_group, tp_group):
        """After the model is materialized and initialized: cast quantized_init weights from
        their initial values and give the per-tensor weight quantizers the amax-reduction
        group of the layout (recipes/amax.py). Returns that group (None: no reduction), which
        `attach_optimizer` needs."""
        group = self.weight_amax_group(weight_shard_group, tp_group)
        self.quantize_weights(model, group)
        self.init_weight_quantizers(model, group)
        return group

    def attach_optimizer(self, model: torch.nn.Module, optimizer, amax_group) -> None:
        """Seed FusedAdam's fp32 masters from the exact initial values (quantized_init), and
        re-apply `amax_group` before every optimizer step (an optimizer step pre-hook): FSDP2's
        all-gather hook resets the quantized weights' group to the dp_shard group, and FusedAdam
        re-quantizes the updated masters with the group the weights hold."""
        self.seed_master_weights(model, optimizer)
        if self.needs_weight_amax_group and amax_group is not None:

            def before_step(_optimizer, _args, _kwargs) -> None:  # a pre-hook returns None
                self.set_weight_amax_groups(model, amax_group)

            optimizer.register_step_pre_hook(before_step)

    def set_weight_amax_groups(self, model: torch.nn.Module, group) -> int:
        """Apply `group` (from weight_amax_group) to the per-tensor weight quantizers and
        quantized weights; no-op for other recipes or group None. Call after quantize_weights
        and before every optimizer.step() (FSDP2's all-gather hook resets the weights' group)."""
        if not self.needs_weight_amax_group or group is None:
            return 0
        from recipes.amax import set_weight_amax_groups

        return set_weight_amax_groups(model, group)


def build_recipe(cfg: RecipeConfig, n_layers: int) -> Recipe:
    check_bf16_layers(cfg, n_layers)
    return Recipe(cfg, n_layers)
