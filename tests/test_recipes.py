"""Precision recipes without TE: config checks and their messages, the capability table, the
config -> TE recipe mapping, contexts, amax groups, quantized weights and FusedAdam masters.

The fakes below mirror TransformerEngine 2.20.2 attribute names, read in the released wheel
(transformer_engine/pytorch/...):
- module/base.py:906 `module.quantizers = {"scaling_fwd": [...], "scaling_bwd": [...]}`,
  :910 `module.param_init_meta[name]` (a module/_common.py:234 `_ParameterInitMeta` whose
  `fp8_meta_index` (line 241) indexes scaling_fwd), :911 `module.primary_weights_in_fp8`.
- tensor/float8_tensor.py:222/252-253 and tensor/nvfp4_tensor.py:122/163-164: per-tensor
  quantizers carry `with_amax_reduction` and `amax_reduction_group`; Float8BlockQuantizer and
  MXFP8Quantizer carry neither. module/_common.py:29 unwraps `parent_quantizer` (DebugQuantizer).
- float8_tensor.py:473 / nvfp4_tensor.py:439: class attribute `amax_reduction_group = None` on
  the quantized tensor; the tensor keeps a copy of its quantizer as `_quantizer`.
- quantized_tensor.py:575 `Quantizer.set_usage(rowwise=, columnwise=)`, `.internal`, and
  `quantizer(tensor)` returning a QuantizedTensor that has `dequantize()`.
- module/base.py:94-112: `get_high_precision_init_val()` / `clear_high_precision_init_val()`.
- optimizers/fused_adam.py:358/456: FusedAdam.set_scaled_state(param, "master_param", value),
  initialize_state(param, store_param_remainders), `.master_weights`, `.state`.
The real classes are exercised by tests/gpu/test_recipes_gpu.py.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import recipes
from config import ConfigError, compose_config
from model.config import ModelConfig
from recipes import (
    RecipeConfig,
    apply_attention_environment,
    attention_environment,
    attention_recipe_spec,
    build_recipe,
    check_bf16_layers,
    check_fp8_attention,
    check_recipe,
    master_weight_kwargs,
    quantize_weights,
    resolve_bf16_layers,
    runnable_recipes,
    seed_master_weights,
    set_weight_amax_groups,
    te_recipe_spec,
    weight_quantizers,
)
from tests.fake_te import FakeQuantizedTensor

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)
H100 = "NVIDIA H100 80GB HBM3"


def fake_gpu(monkeypatch, name: str, capability: tuple[int, int]) -> None:
    for module in (recipes.recipe, recipes.attention):  # check_recipe, check_fp8_attention
        monkeypatch.setattr(module, "device_capability", lambda device: (name, capability))


def error_of(cfg: RecipeConfig, impl: str = "te", device: torch.device = CUDA) -> str:
    with pytest.raises(ConfigError) as info:
        check_recipe(cfg, impl, device)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


# ---------------------------------------------------------------- checks and their messages


def test_reference_impl_runs_bf16_only():
    assert error_of(RecipeConfig(name="fp8_cs"), impl="torch", device=CUDA) == (
        "recipe=fp8_cs needs the TE implementation (model.impl=te) and a CUDA GPU; "
        "the reference implementation runs bf16 only: use recipe=bf16, or model.impl=te with "
        "TE installed (make setup-gpu)"
    )
    check_recipe(RecipeConfig(name="bf16"), "torch", CPU)


@pytest.mark.parametrize("impl", ["te", "torch"])
def test_cpu_needs_te_and_gpu(impl):
    """On CPU the way out is recipe=bf16 (named), whichever implementation was asked for."""
    assert error_of(RecipeConfig(name="fp8_delayed"), impl=impl, device=CPU) == (
        "recipe=fp8_delayed needs TransformerEngine and a CUDA GPU; this run is on CPU, "
        "which runs recipe=bf16 only: use recipe=bf16 here, or run on a GPU with TE "
        "(make setup-gpu)"
    )


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_blackwell_recipes_fail_on_hopper(monkeypatch, name):
    fake_gpu(monkeypatch, H100, (9, 0))
    assert error_of(RecipeConfig(name=name)) == (
        f"recipe={name} needs compute capability >= 10.0 (Blackwell); this GPU is "
        f"NVIDIA H100 80GB HBM3 (sm_90), which runs: bf16, fp8_delayed, fp8_cs, fp8_block"
    )


def test_capability_messages_for_other_gpus(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))
    assert error_of(RecipeConfig(name="fp8_cs")) == (
        "recipe=fp8_cs needs compute capability >= 8.9 (Ada); this GPU is "
        "NVIDIA A100-SXM4-80GB (sm_80), which runs: bf16"
    )
    fake_gpu(monkeypatch, "NVIDIA L40S", (8, 9))
    assert error_of(RecipeConfig(name="fp8_block")) == (
        "recipe=fp8_block needs compute capability >= 9.0 (Hopper); this GPU is "
        "NVIDIA L40S (sm_89), which runs: bf16, fp8_delayed, fp8_cs"
    )
    fake_gpu(monkeypatch, "NVIDIA RTX PRO 6000", (12, 0))
    assert error_of(RecipeConfig(name="mxfp8")) == (
        "recipe=mxfp8 needs compute capability < 12.0 (TE does not run it on sm_120 and newer "
        "yet); this GPU is NVIDIA RTX PRO 6000 (sm_120), which runs: bf16, fp8_delayed, "
        "fp8_cs, fp8_block, nvfp4"
    )
    fake_gpu(monkeypatch, "Tesla V100", (7, 0))
    assert error_of(RecipeConfig(name="bf16")) == (
        "recipe=bf16 needs compute capability >= 8.0 (Ampere); this GPU is Tesla V100 (sm_70), "
        "which runs: none of them"
    )


def test_runnable_gpu_recipes_pass(monkeypatch):
    fake_gpu(monkeypatch, H100, (9, 0))
    for name in ("bf16", "fp8_delayed", "fp8_cs", "fp8_block"):
        check_recipe(RecipeConfig(name=name, quantized_init=name != "bf16"), "te", CUDA)
    fake_gpu(monkeypatch, "NVIDIA B200", (10, 0))
    for name in ("mxfp8", "nvfp4"):
        check_recipe(RecipeConfig(name=name), "te", CUDA)


def test_te_own_verdict_is_reported(monkeypatch):
    fake_gpu(monkeypatch, H100, (9, 0))
    monkeypatch.setattr(
        recipes.recipe,
        "te_support",
        lambda name: (
            False,
            "FP8 block scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9.",
        ),
    )
    assert error_of(RecipeConfig(name="fp8_block")) == (
        "recipe=fp8_block is not available on NVIDIA H100 80GB HBM3 (sm_90): FP8 block scaled "
        "GEMM requires compute capability 9.0 or higher and CUDA >= 12.9."
    )
    # TE's verdict is only asked for the TE implementation.
    check_recipe(RecipeConfig(name="bf16"), "torch", CUDA)


@pytest.mark.parametrize(
    "cfg, message",
    [
        (
            RecipeConfig(name="fp4"),
            "recipe.name='fp4' is not one of bf16, fp8_delayed, fp8_cs, fp8_block, mxfp8, nvfp4",
        ),
        (
            RecipeConfig(name="bf16", quantized_init=True),
            "recipe.quantized_init=true has no effect with recipe=bf16 (nothing is quantized); "
            "drop recipe.quantized_init or pick a quantized recipe",
        ),
        (
            RecipeConfig(name="fp8_cs", fp8_format="E5M2"),
            "recipe.fp8_format='E5M2' is not one of HYBRID, E4M3 (TE does not train in pure E5M2)",
        ),
        (
            RecipeConfig(name="fp8_delayed", amax_compute_algo="mean"),
            "recipe.amax_compute_algo='mean' is not one of max, most_recent",
        ),
        (
            RecipeConfig(name="fp8_delayed", amax_history_len=0),
            "recipe.amax_history_len=0 must be >= 1",
        ),
        (
            RecipeConfig(name="fp8_block", x_block_scaling_dim=3),
            "recipe.x_block_scaling_dim=3 must be 1 (1x128 tiles) or 2 (128x128 blocks)",
        ),
        (
            RecipeConfig(name="fp8_block", x_block_scaling_dim=2, w_block_scaling_dim=2),
            "recipe.x_block_scaling_dim and recipe.w_block_scaling_dim are both 2: TE has no "
            "2D-by-2D block GEMM; set one of them to 1",
        ),
        (
            RecipeConfig(name="bf16", fp8_attention=True),
            "recipe.fp8_attention=true has no effect with recipe=bf16 (nothing runs in FP8); "
            "drop recipe.fp8_attention or pick an FP8 recipe (fp8_delayed, fp8_cs, mxfp8, nvfp4)",
        ),
        (
            RecipeConfig(name="fp8_block", fp8_attention=True),
            "recipe.fp8_attention=true with recipe=fp8_block: TE 2.20 has no FP8 attention for "
            "FP8 block scaling (Float8BlockScaling); drop recipe.fp8_attention, or use "
            "recipe=fp8_delayed or fp8_cs",
        ),
        (
            # nvfp4's attention takes recipe.fp8_format (NVTE_DPA_FP8_FORMAT): checked then.
            RecipeConfig(name="nvfp4", fp8_attention=True, fp8_format="E5M2"),
            "recipe.fp8_format='E5M2' is not one of HYBRID, E4M3 (TE does not train in pure E5M2)",
        ),
    ],
)
def test_bad_fields(cfg, message):
    # Field errors come first, before any question about the device.
    assert error_of(cfg, device=CPU) == message


def test_runnable_recipes_per_capability():
    assert runnable_recipes((8, 0)) == ["bf16"]
    assert runnable_recipes((8, 9)) == ["bf16", "fp8_delayed", "fp8_cs"]
    assert runnable_recipes((9, 0)) == ["bf16", "fp8_delayed", "fp8_cs", "fp8_block"]
    assert runnable_recipes((10, 0)) == list(recipes.RECIPES)
    assert runnable_recipes((10, 3)) == list(recipes.RECIPES)
    assert runnable_recipes((12, 0)) == ["bf16", "fp8_delayed", "fp8_cs", "fp8_block", "nvfp4"]


# ---------------------------------------------------------------- bf16 layers


def test_bf16_layers_resolution():
    assert resolve_bf16_layers([0, -1], 4) == frozenset({0, 3})
    assert resolve_bf16_layers([3, -1, -4], 4) == frozenset({0, 3})
    assert resolve_bf16_layers([], 4) == frozenset()
    recipe = build_recipe(RecipeConfig(name="nvfp4", bf16_layers=[0, -1]), n_layers=6)
    assert recipe.bf16_layer_ids == frozenset({0, 5})
    assert [recipe.is_bf16_layer(i) for i in range(6)] == [True, False, False, False, False, True]
    assert recipe.is_bf16_layer(-1)
    # bf16 runs every layer in bf16 anyway: no layer is singled out.
    assert not build_recipe(RecipeConfig(name="bf16", bf16_layers=[0]), 4).is_bf16_layer(0)


@pytest.mark.parametrize("layers, bad", [([0, 4], 4), ([-5], -5)])
def test_bf16_layers_out_of_range(layers, bad):
    cfg = RecipeConfig(name="fp8_cs", bf16_layers=layers)
    expected = (
        f"recipe.bf16_layers={layers} has index {bad} outside model.n_layers=4; use "
        "0..3, or -4..-1 to count from the end"
    )
    for call in (lambda: check_bf16_layers(cfg, 4), lambda: build_recipe(cfg, 4)):
        with pytest.raises(ConfigError) as info:
            call()
        assert str(info.value) == expected


# ---------------------------------------------------------------- config -> TE recipe

#: TE 2.20.2 published defaults (transformer_engine/common/recipe/__init__.py), as the
#: constructor keywords and QParams we pass. The conf/recipe/*.yaml files must reproduce them.
TE_DEFAULTS = {
    "bf16": None,
    "fp8_delayed": (
        "DelayedScaling",
        {"fp8_format": "HYBRID", "amax_history_len": 1024, "amax_compute_algo": "max", "margin": 0},
        {},
    ),
    "fp8_cs": ("Float8CurrentScaling", {"fp8_format": "HYBRID"}, {}),
    "fp8_block": (
        "Float8BlockScaling",
        {
            "fp8_format": "E4M3",
            "x_block_scaling_dim": 1,
            "w_block_scaling_dim": 2,
            "grad_block_scaling_dim": 1,
        },
        {
            role: {"power_2_scale": True, "amax_epsilon": 0.0}
            for role in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")
        },
    ),
    "mxfp8": ("MXFP8BlockScaling", {"fp8_format": "E4M3"}, {}),
    "nvfp4": (
        "NVFP4BlockScaling",
        {
            "disable_rht": False,
            "disable_stochastic_rounding": False,
            "disable_2d_quantization": False,
        },
        {},
    ),
}


def load_recipe(*overrides: str) -> RecipeConfig:
    return compose_config(overrides).recipe


@pytest.mark.parametrize("name", list(TE_DEFAULTS))
def test_yaml_reproduces_te_defaults(name):
    cfg = load_recipe(f"recipe={name}")
    assert cfg.name == name
    spec = te_recipe_spec(cfg)
    expected = TE_DEFAULTS[name]
    if expected is None:
        assert spec is None
    else:
        assert (spec.cls, spec.kwargs, spec.qparams) == expected


def test_overrides_reach_te_kwargs():
    spec = te_recipe_spec(
        load_recipe(
            "recipe=fp8_delayed",
            "recipe.amax_history_len=16",
            "recipe.amax_compute_algo=most_recent",
            "recipe.margin=1",
        )
    )
    assert spec.kwargs == {
        "fp8_format": "HYBRID",
        "amax_history_len": 16,
        "amax_compute_algo": "most_recent",
        "margin": 1,
    }
    spec = te_recipe_spec(load_recipe("recipe=fp8_block", "recipe.power_2_scale=false"))
    assert {qp["power_2_scale"] for qp in spec.qparams.values()} == {False}
    spec = te_recipe_spec(load_recipe("recipe=nvfp4", "recipe.disable_rht=true"))
    assert spec.kwargs["disable_rht"] is True
    assert load_recipe("recipe=nvfp4", "recipe.bf16_layers=[0,-1]").bf16_layers == [0, -1]


# ---------------------------------------------------------------- contexts


class Calls:
    """Stands in for te.autocast / te.quantized_model_init and records their arguments."""

    def __init__(self):
        self.autocast, self.init = [], []

    def install(self, monkeypatch):
        from recipes import recipe as module

        monkeypatch.setattr(module, "build_te_recipe", lambda spec: SimpleNamespace(spec=spec))
        monkeypatch.setattr(
            module,
            "_te_autocast",
            lambda enabled, recipe, group: (
                self.autocast.append((enabled, recipe, group)) or nullcontext()
            ),
        )
        monkeypatch.setattr(
            module,
            "_te_quantized_model_init",
            lambda enabled, recipe, keep: (
                self.init.append((enabled, recipe, keep)) or nullcontext()
            ),
        )
        return self


def test_bf16_contexts_are_noops(monkeypatch):
    calls = Calls().install(monkeypatch)
    recipe = build_recipe(RecipeConfig(name="bf16"), 4)
    assert not recipe.is_quantized and not recipe.quantized_init
    assert recipe.te_recipe() is None
    for ctx in (
        recipe.autocast(),
        recipe.layer_autocast(0),
        recipe.quantized_init_context(),
        recipe.layer_init_context(0),
    ):
        assert isinstance(ctx, nullcontext)
    assert calls.autocast == calls.init == []
    assert recipe.fused_adam_kwargs() == {}
    assert recipe.weight_quantizer_class is None and recipe.weight_tensor_class is None


def test_quantized_contexts(monkeypatch):
    calls = Calls().install(monkeypatch)
    recipe = build_recipe(RecipeConfig(name="fp8_cs", quantized_init=True, bf16_layers=[-1]), 4)
    te_recipe = recipe.te_recipe()
    assert te_recipe.spec == te_recipe_spec(recipe.cfg) and recipe.te_recipe() is te_recipe
    group = object()
    with recipe.autocast(amax_group=group):
        for i in range(4):
            with recipe.layer_autocast(i):
                pass
    # Only the bf16 layer (3) opens a disabled autocast; all use one recipe object.
    assert calls.autocast == [
        (True, te_recipe, group),
        (False, te_recipe, None),
    ]
    with recipe.quantized_init_context():
        for i in range(4):
            with recipe.layer_init_context(i):
                pass
    assert calls.init == [
        (True, te_recipe, True),
        (False, te_recipe, False),
    ]
    assert (recipe.weight_quantizer_class, recipe.weight_tensor_class) == (
        "Float8CurrentScalingQuantizer",
        "Float8Tensor",
    )
    assert recipe.needs_weight_amax_group


def test_quantized_init_off_keeps_weights_high_precision(monkeypatch):
    calls = Calls().install(monkeypatch)
    recipe = build_recipe(RecipeConfig(name="fp8_block", bf16_layers=[0]), 2)
    assert isinstance(recipe.quantized_init_context(), nullcontext)
    assert isinstance(recipe.layer_init_context(0), nullcontext)
    assert recipe.weight_tensor_class is None
    assert recipe.weight_quantizer_class == "Float8BlockQuantizer"
    assert not recipe.needs_weight_amax_group
    with recipe.layer_autocast(0):
        pass
    assert calls.autocast == [(False, recipe.te_recipe(), None)]
    assert recipe.fused_adam_kwargs() == {}


def test_master_weight_kwargs():
    recipe = build_recipe(RecipeConfig(name="fp8_cs", quantized_init=True), 2)
    assert master_weight_kwargs(recipe) == {
        "master_weights": True,
        "master_weight_dtype": torch.float32,
        "store_param_remainders": False,
        "capturable": False,
    }
    assert recipe.fused_adam_kwargs() == master_weight_kwargs(recipe)


# ---------------------------------------------------------------- fakes shaped like TE


class Float8CurrentScalingQuantizer:
    """Fake of TE's class of this name (NVFP4Quantizer alike): an amax-reducing quantizer.

    Named like TE's because recipes/quantized.py decides by class name which quantizers can
    skip the columnwise copy."""

    def __init__(self):
        self.with_amax_reduction = False
        self.amax_reduction_group = None
        self.rowwise_usage = self.columnwise_usage = None
        self.internal = True
        self.cast_groups = []  # amax group in force at each cast

    def set_usage(self, *, rowwise=None, columnwise=None):
        self.rowwise_usage, self.columnwise_usage = rowwise, columnwise

    def copy(self):
        return copy.copy(self)

    def __call__(self, tensor):
        self.cast_groups.append(self.amax_reduction_group if self.with_amax_reduction else None)
        own = self.copy()  # TE strips the group from the new tensor's own quantizer
        own.with_amax_reduction, own.amax_reduction_group = False, None
        return FakeQuantizedTensor(tensor.to(torch.bfloat16).float(), own)


class MXFP8Quantizer(Float8CurrentScalingQuantizer):
    """Fake of TE's MXFP8Quantizer (Float8BlockQuantizer alike): no amax reduction attributes."""

    def __init__(self):
        super().__init__()
        del self.with_amax_reduction, self.amax_reduction_group

    def __call__(self, tensor):
        return FakeQuantizedTensor(tensor.to(torch.bfloat16).float(), self.copy())


class FakeDebugQuantizer:
    """debug/pytorch/debug_quantization.py DebugQuantizer: casts through `parent_quantizer`."""

    def __init__(self, parent):
        self.parent_quantizer = parent
        self.internal = True

    def set_usage(self, **usage):
        self.parent_quantizer.set_usage(**usage)

    def __call__(self, tensor):
        return self.parent_quantizer(tensor)


class FakeTEModule(torch.nn.Module):
    """A TE module: weights with an fp8_meta_index, a norm weight without one."""

    def __init__(self, quantizers, primary_weights_in_fp8=True, n_weights=1):
        super().__init__()
        self.quantizers = {"scaling_fwd": quantizers, "scaling_bwd": []}
        self.param_init_meta = {}
        self.primary_weights_in_fp8 = primary_weights_in_fp8
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(8))
        self.param_init_meta["layer_norm_weight"] = SimpleNamespace(fp8_meta_index=None)
        for i in range(n_weights):
            name = f"fc{i + 1}_weight"
            self.register_parameter(name, torch.nn.Parameter(torch.randn(8, 8)))
            # TE's GEMM<i>_WEIGHT slot: input, weight, output per GEMM.
            self.param_init_meta[name] = SimpleNamespace(fp8_meta_index=3 * i + 1)


def fwd_quantizers(make, n_gemms=1):
    return [make() for _ in range(3 * n_gemms)]


def quantized_model():
    """cs: per-tensor (with a debug wrapper on one), block: block-scaled, hp: a bf16 layer."""
    cs_q = fwd_quantizers(Float8CurrentScalingQuantizer, 2)
    cs_q[4] = FakeDebugQuantizer(cs_q[4])
    model = torch.nn.ModuleDict(
        {
            "cs": FakeTEModule(cs_q, n_weights=2),
            "block": FakeTEModule(fwd_quantizers(MXFP8Quantizer)),
            "hp": FakeTEModule(
                fwd_quantizers(Float8CurrentScalingQuantizer), primary_weights_in_fp8=False
            ),
            "plain": torch.nn.Linear(8, 8),
        }
    )
    return model, cs_q


# ---------------------------------------------------------------- amax groups


def test_weight_quantizers_lists_te_weights():
    model, cs_q = quantized_model()
    refs = {ref.name: ref for ref in weight_quantizers(model)}
    assert sorted(refs) == ["block.fc1_weight", "cs.fc1_weight", "cs.fc2_weight", "hp.fc1_weight"]
    assert refs["cs.fc1_weight"].quantizer is cs_q[1]
    assert refs["cs.fc2_weight"].quantizer is cs_q[4]
    assert refs["cs.fc1_weight"].tensor is model["cs"].fc1_weight
    # A module that has not created its quantizers yet (first forward pending).
    model["hp"].quantizers["scaling_fwd"] = []
    assert {r.name: r.quantizer for r in weight_quantizers(model)}["hp.fc1_weight"] is None


def test_set_weight_amax_groups_on_quantizers_and_tensors():
    model, cs_q = quantized_model()
    assert quantize_weights(model) == 3  # cs (2) and block (1); hp is a bf16 layer
    group = object()
    # cs: 2 quantizers + 2 tensors; hp: its quantizer (used at forward, weights stay bf16).
    assert set_weight_amax_groups(model, group) == 5
    for q in (cs_q[1], cs_q[4].parent_quantizer, model["hp"].quantizers["scaling_fwd"][1]):
        assert q.with_amax_reduction is True and q.amax_reduction_group is group
    for w in (model["cs"].fc1_weight, model["cs"].fc2_weight):
        assert w.amax_reduction_group is group
    # Untouched: activation slots, block-scaled quantizers and tensors, non-TE modules.
    assert cs_q[0].amax_reduction_group is None and not cs_q[0].with_amax_reduction
    assert not hasattr(model["block"].quantizers["scaling_fwd"][1], "amax_reduction_group")
    assert "amax_reduction_group" not in vars(model["block"].fc1_weight)
    # None switches reduction off again.
    assert set_weight_amax_groups(model, None) == 5
    assert (
        cs_q[1].with_amax_reduction is False and model["cs"].fc1_weight.amax_reduction_group is None
    )


def test_attach_optimizer_reapplies_groups_before_each_step():
    """The amax group goes back on before every optimizer step, through a step pre-hook; a
    pre-hook that returns anything but None makes torch raise in step() (as the counting
    set_weight_amax_groups once did under fp8_cs + TP)."""
    model, cs_q = quantized_model()
    quantize_weights(model)
    group = object()
    recipe = build_recipe(RecipeConfig(name="fp8_cs"), 2)
    params = [torch.nn.Parameter(torch.ones(2))]
    opt = torch.optim.SGD(params, lr=0.1)
    recipe.attach_optimizer(model, opt, group)
    for _ in range(2):
        set_weight_amax_groups(model, None)  # what FSDP2's all-gather hook does
        params[0].grad = torch.ones(2)
        opt.step()
        assert cs_q[1].amax_reduction_group is group
        assert model["cs"].fc1_weight.amax_reduction_group is group
    assert torch.allclose(params[0].detach(), torch.full((2,), 0.8))


def test_recipe_sets_groups_only_for_per_tensor_recipes():
    model, cs_q = quantized_model()
    group = object()
    assert build_recipe(RecipeConfig(name="fp8_block"), 2).set_weight_amax_groups(model, group) == 0
    assert (
        build_recipe(RecipeConfig(name="fp8_delayed"), 2).set_weight_amax_groups(model, group) == 0
    )
    assert cs_q[1].amax_reduction_group is None
    assert build_recipe(RecipeConfig(name="nvfp4"), 2).set_weight_amax_groups(model, group) == 3
    assert cs_q[1].amax_reduction_group is group


def test_weight_amax_group_choice(monkeypatch):
    from recipes import amax

    sizes = {}
    monkeypatch.setattr(amax, "_group_size", lambda group: sizes[group])
    shard_x_tp, tp = "dp_shard x tp", "tp"
    sizes.update({shard_x_tp: 8, tp: 2})

    def group_for(**cfg):
        return build_recipe(RecipeConfig(**cfg), 2).weight_amax_group(shard_x_tp, tp)

    # Stored quantized weights are sharded over dp_shard x tp; bf16 weights are gathered over
    # dp_shard before the cast, so only tp splits them.
    assert group_for(name="fp8_cs", quantized_init=True) == shard_x_tp
    assert group_for(name="nvfp4", quantized_init=True) == shard_x_tp
    assert group_for(name="fp8_cs") == tp
    for name in ("bf16", "fp8_delayed", "fp8_block", "mxfp8"):
        assert group_for(name=name) is None
    assert group_for(name="fp8_block", quantized_init=True) is None
    sizes[tp] = 1  # nothing to reduce over
    assert group_for(name="fp8_cs") is None
    assert build_recipe(RecipeConfig(name="fp8_cs"), 2).weight_amax_group(shard_x_tp, None) is None


# ---------------------------------------------------------------- quantized weights + masters


def test_quantize_weights_casts_with_group_and_keeps_values():
    model, cs_q = quantized_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    group = object()
    assert quantize_weights(model, amax_group=group) == 3
    for name in ("cs.fc1_weight", "cs.fc2_weight", "block.fc1_weight"):
        module, pname = name.split(".")
        w = getattr(model[module], pname)
        assert isinstance(w, torch.nn.Parameter) and isinstance(w, FakeQuantizedTensor)
        assert w.requires_grad
        # The exact pre-quantization values are kept (on CPU) for the optimizer's masters.
        assert torch.equal(w.get_high_precision_init_val(), before[name])
        assert torch.equal(w.dequantize(), before[name].to(torch.bfloat16).float())
    # The per-tensor quantizers reduced over the group at the cast, and their tensors keep it.
    assert cs_q[1].cast_groups == [group] and cs_q[4].parent_quantizer.cast_groups == [group]
    # Per-tensor FP8 stores only rowwise data (TE derives the transpose); MXFP8 needs both.
    assert (cs_q[1].rowwise_usage, cs_q[1].columnwise_usage, cs_q[1].internal) == (
        True,
        False,
        False,
    )
    block_q = model["block"].quantizers["scaling_fwd"][1]
    assert (block_q.rowwise_usage, block_q.columnwise_usage) == (True, True)
    assert model["cs"].fc1_weight.amax_reduction_group is group
    assert "amax_reduction_group" not in vars(model["block"].fc1_weight)
    # The bf16 layer, norm weights and non-TE modules are untouched.
    for name in ("hp.fc1_weight", "cs.layer_norm_weight", "plain.weight"):
        module, pname = name.split(".", 1)
        assert type(getattr(model[module], pname)) is torch.nn.Parameter
    assert quantize_weights(model, amax_group=group) == 0  # already quantized


def test_recipe_quantize_weights_only_with_quantized_init():
    model, cs_q = quantized_model()
    assert build_recipe(RecipeConfig(name="fp8_cs"), 2).quantize_weights(model, object()) == 0
    group = object()
    # Block scaling: no amax group even when one is given.
    model2, _ = quantized_model()
    assert (
        build_recipe(RecipeConfig(name="fp8_block", quantized_init=True), 2).quantize_weights(
            model2, group
        )
        == 3
    )
    assert model2["cs"].quantizers["scaling_fwd"][1].cast_groups == [None]


class FakeFusedAdam:
    """FusedAdam's master-weight API (optimizers/fused_adam.py:358, 456)."""

    def __init__(self, params, master_weights=True):
        self.param_groups = [{"params": list(params)}]
        self.state = defaultdict(dict)
        self.master_weights = master_weights

    def initialize_state(self, param, store_param_remainders):
        assert store_param_remainders is False
        local = param.dequantize() if hasattr(param, "dequantize") else param.detach()
        self.state[param].update(
            exp_avg=torch.zeros_like(local),
            exp_avg_sq=torch.zeros_like(local),
            master_param=local.float().clone(),
        )

    def set_scaled_state(self, param, state_name, unscaled_state):
        assert unscaled_state.dtype == torch.float32
        self.state[param][state_name] = unscaled_state.clone()

    def get_unscaled_state(self, param, state_name):
        return self.state[param][state_name]


class FakeBlockTensor(FakeQuantizedTensor):
    """A block-scaled quantized tensor (row-wise scales); quantize_ casts like the fake
    quantizers (through bf16)."""

    _rowwise_scale_inv = None

    def quantize_(self, src):
        self.as_subclass(torch.Tensor).copy_(src.to(torch.bfloat16).float())
        return self


def test_requantize_from_masters_rebuilds_block_scaled_weights_only():
    """After a load, block-scaled weights become the cast of their masters (what FusedAdam's
    step writes); per-tensor FP8 weights and plain ones keep what was loaded."""
    from recipes.quantized import requantize_from_masters

    loaded = torch.full((4, 4), 7.0)  # whatever the checkpoint load left in the parameters
    block = FakeBlockTensor(loaded.clone(), None)
    per_tensor = FakeQuantizedTensor(loaded.clone(), None)
    plain = torch.nn.Parameter(loaded.clone())
    optimizer = FakeFusedAdam([block, per_tensor, plain])
    masters = {}
    for i, p in enumerate((block, per_tensor, plain)):
        masters[i] = torch.randn(4, 4, generator=torch.Generator().manual_seed(i))
        optimizer.set_scaled_state(p, "master_param", masters[i])
    assert requantize_from_masters(optimizer) == 1
    assert torch.equal(block.as_subclass(torch.Tensor), masters[0].to(torch.bfloat16).float())
    assert torch.equal(per_tensor.as_subclass(torch.Tensor), loaded)
    assert torch.equal(plain.detach(), loaded)
    optimizer.master_weights = False  # no masters: nothing to rebuild from
    assert requantize_from_masters(optimizer) == 0


def test_seed_master_weights_from_kept_values():
    model, _ = quantized_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    quantize_weights(model)
    params = dict(model.named_parameters())
    optimizer = FakeFusedAdam(p for n, p in params.items() if n != "block.fc1_weight")
    assert seed_master_weights(optimizer, model) == 2
    for name in ("cs.fc1_weight", "cs.fc2_weight"):
        master = optimizer.state[params[name]]["master_param"]
        assert master.dtype == torch.float32 and torch.equal(master, before[name])
        # Exactly the seeded values, not the dequantized (bf16-rounded) weight.
        assert not torch.equal(master, params[name].dequantize())
        assert set(optimizer.state[params[name]]) == {"exp_avg", "exp_avg_sq", "master_param"}
    # Kept values are released everywhere, also for parameters outside the optimizer.
    for name in ("cs.fc1_weight", "cs.fc2_weight", "block.fc1_weight"):
        assert params[name].get_high_precision_init_val() is None
    assert params["block.fc1_weight"] not in optimizer.state
    # Every parameter of the optimizer has its full state, quantized or not: a checkpoint
    # load only fills states that exist, so a partial state would drop moments on resume.
    for p in optimizer.param_groups[0]["params"]:
        assert set(optimizer.state[p]) == {"exp_avg", "exp_avg_sq", "master_param"}
    # ... and the per-group step count FusedAdam keeps, which a resume must restore too.
    assert all(group["step"] == 0 for group in optimizer.param_groups)
    assert seed_master_weights(optimizer, model) == 0


def test_seed_master_weights_from_value_fn():
    model, _ = quantized_model()
    quantize_weights(model, keep_high_precision=False)
    optimizer = FakeFusedAdam(model.parameters())
    seen = []

    def value_fn(name, param):
        seen.append(name)
        return torch.full(param.shape, 0.5, dtype=torch.float64)

    assert seed_master_weights(optimizer, model, value_fn) == 3
    assert sorted(seen) == ["block.fc1_weight", "cs.fc1_weight", "cs.fc2_weight"]
    master = optimizer.state[model["cs"].fc1_weight]["master_param"]
    assert master.dtype == torch.float32 and torch.equal(master, torch.full((8, 8), 0.5))
    # No masters without master_weights (FusedAdam would not use them).
    assert (
        seed_master_weights(
            FakeFusedAdam(model.parameters(), master_weights=False), model, value_fn
        )
        == 0
    )


def test_recipe_seed_master_weights_only_with_quantized_init():
    model, _ = quantized_model()
    quantize_weights(model)
    optimizer = FakeFusedAdam(model.parameters())
    assert build_recipe(RecipeConfig(name="fp8_cs"), 2).seed_master_weights(model, optimizer) == 0
    assert model["cs"].fc1_weight.get_high_precision_init_val() is not None
    recipe = build_recipe(RecipeConfig(name="fp8_cs", quantized_init=True), 2)
    assert recipe.seed_master_weights(model, optimizer) == 3


def test_block_scaled_quantized_weights_on_every_layout():
    """fp8_block quantized weights run on every 4-process layout (compat/fsdp2.py handles FSDP2's
    one-rank mesh and fc1's dim-1 shards); MXFP8 / NVFP4 are refused only where FSDP shards
    fc1 along dim 1; shards that split a scale block are refused with the weight named."""
    from model.config import block_weight_shapes
    from recipes import check_recipe_layout

    # The GPU matrix model's block weights.
    mcfg = block_weight_shapes(ModelConfig(dim=512, n_heads=8, n_kv_heads=4, ffn_dim=1536))
    layouts = {
        "ddp": (1, 1),
        "fsdp": (4, 1),
        "hsdp": (2, 1),
        "tp": (1, 4),
        "fsdp_tp": (2, 2),
        "hsdp_tp": (1, 2),
    }  # (dp_shard, tp) on 4 processes
    for dp_shard, tp in layouts.values():
        check_recipe_layout(
            RecipeConfig(name="fp8_block", quantized_init=True), mcfg, 4, dp_shard, tp
        )
    for name in ("mxfp8", "nvfp4"):
        cfg = RecipeConfig(name=name, quantized_init=True)
        with pytest.raises(ConfigError) as err:
            check_recipe_layout(cfg, mcfg, 4, dp_shard=2, tp=2)
        msg = str(err.value)
        assert "\n" not in msg and f"recipe={name}" in msg and "parallel.tp=2" in msg
        for dp_shard, tp in ((1, 4), (4, 1), (1, 1)):  # no dim-1 all-gather: fine
            check_recipe_layout(cfg, mcfg, 4, dp_shard, tp)
        check_recipe_layout(RecipeConfig(name=name), mcfg, 4, 2, 2)  # bf16 weights
    for dp_shard, tp in layouts.values():  # one all-gather tensor (FP8 per-tensor scale)
        check_recipe_layout(RecipeConfig(name="fp8_cs", quantized_init=True), mcfg, 4, dp_shard, tp)

    # tiny: proj has 128 rows, 64 per shard on 2 ranks: half a 128x128 FP8 block, a whole
    # 32-wide MXFP8 block.
    tiny = block_weight_shapes(compose_config(["model=tiny"]).model)
    block = RecipeConfig(name="fp8_block", quantized_init=True)
    with pytest.raises(ConfigError) as err:
        check_recipe_layout(block, tiny, 2, dp_shard=2, tp=1)
    msg = str(err.value)
    assert "\n" not in msg and "proj weight" in msg and "shards of 64 rows" in msg
    assert "128-wide scale block" in msg
    check_recipe_layout(RecipeConfig(name="mxfp8", quantized_init=True), tiny, 2, 2, 1)
    check_recipe_layout(block, tiny, 2, dp_shard=1, tp=1)  # ddp: nothing sharded
    check_recipe_layout(block, tiny, 1, dp_shard=1, tp=1)  # one process
    # What FSDP splits: fc1 along its columns under TP, everything else along dim 0.
    from parallel.tp import fsdp_shard_extents

    assert fsdp_shard_extents(mcfg, dp_shard=2, tp=2) == {
        "qkv": ("rows", 512, 256),
        "proj": ("rows", 512, 256),
        "fc1": ("columns", 512, 256),
        "fc2": ("rows", 512, 256),
    }
    assert fsdp_shard_extents(mcfg, dp_shard=4, tp=1)["fc1"] == ("rows", 3072, 768)

    # Settings TE's all-gather cannot take, refused before any work.
    with pytest.raises(ConfigError, match="recipe.w_block_scaling_dim=2"):
        check_recipe_layout(
            RecipeConfig(
                name="fp8_block", quantized_init=True, w_block_scaling_dim=1, x_block_scaling_dim=1
            ),
            mcfg,
            2,
            2,
            1,
        )
    with pytest.raises(ConfigError, match="recipe.disable_2d_quantization=false"):
        check_recipe_layout(
            RecipeConfig(name="nvfp4", quantized_init=True, disable_2d_quantization=True),
            mcfg,
            2,
            1,
            1,
        )


# ---------------------------------------------------------------- FP8 attention

#: What a run with FP8 attention under fp8_cs / mxfp8 / nvfp4 sets before TE is imported.
ATTENTION_ENV = {
    "NVTE_DPA_FP8_RECIPE": "DelayedScaling",
    "NVTE_DPA_FP8_FORMAT": "HYBRID",
    "NVTE_DPA_FP8DS_AMAX_HISTLEN": "1",
    "NVTE_DPA_FP8DS_AMAX_ALGO": "most_recent",
    "NVTE_DPA_FP8DS_REDUCE_AMAX": "1",
    "NVTE_DPA_FP8_RECIPE_DPA": "0",
    "NVTE_DPA_FP8_RECIPE_MHA": "0",
}
CS_ATTENTION = RecipeConfig(name="fp8_cs", fp8_attention=True)
DELAYED_ATTENTION = RecipeConfig(name="fp8_delayed", fp8_attention=True)


def test_fp8_attention_reaches_te_as_fp8_dpa():
    for name in ("fp8_delayed", "fp8_cs", "mxfp8", "nvfp4"):
        off, on = (te_recipe_spec(RecipeConfig(name=name, fp8_attention=a)) for a in (False, True))
        assert "fp8_dpa" not in off.kwargs
        assert (on.cls, on.kwargs) == (off.cls, {**off.kwargs, "fp8_dpa": True}), name
    spec = te_recipe_spec(load_recipe("recipe=fp8_cs", "recipe.fp8_attention=true"))
    assert spec.kwargs == {"fp8_format": "HYBRID", "fp8_dpa": True}


def test_attention_recipe_is_the_delayed_scaling_te_builds_for_attention(monkeypatch):
    """fp8_cs, mxfp8, nvfp4: TE's DotProductAttention builds DelayedScaling(fp8_format,
    amax_history_len=1, amax_compute_algo="most_recent", fp8_dpa, fp8_mha, reduce_amax=True)
    (its NVTE_DPA_FP8DS_* defaults, set explicitly); fp8_delayed: attention keeps the run's."""
    assert attention_recipe_spec(DELAYED_ATTENTION) is None
    assert attention_recipe_spec(RecipeConfig(name="fp8_cs")) is None
    for name, fmt in (("fp8_cs", "HYBRID"), ("mxfp8", "E4M3"), ("nvfp4", "E4M3")):
        spec = attention_recipe_spec(RecipeConfig(name=name, fp8_attention=True, fp8_format=fmt))
        assert (spec.cls, spec.kwargs) == (
            "DelayedScaling",
            {
                "fp8_format": fmt,
                "amax_history_len": 1,
                "amax_compute_algo": "most_recent",
                "reduce_amax": True,
                "fp8_dpa": True,
                "fp8_mha": False,
            },
        )
    Calls().install(monkeypatch)
    cs = build_recipe(CS_ATTENTION, 2)
    attention = cs.attention_te_recipe()
    assert cs.fp8_attention and attention.spec == attention_recipe_spec(CS_ATTENTION)
    assert cs.attention_te_recipe() is attention and attention is not cs.te_recipe()
    delayed = build_recipe(DELAYED_ATTENTION, 2)
    assert delayed.fp8_attention and delayed.attention_te_recipe() is None
    assert not build_recipe(RecipeConfig(name="fp8_cs"), 2).fp8_attention


def test_attention_environment_per_recipe():
    assert attention_environment([RecipeConfig(name="fp8_cs")]) == {}
    assert attention_environment([DELAYED_ATTENTION]) == {}  # its own recipe: nothing to set
    for name in ("fp8_cs", "mxfp8", "nvfp4"):
        assert attention_environment([RecipeConfig(name=name, fp8_attention=True)]) == ATTENTION_ENV
    # nvfp4's recipe has no FP8 format: its attention takes recipe.fp8_format.
    nvfp4 = RecipeConfig(name="nvfp4", fp8_attention=True, fp8_format="E4M3")
    assert attention_environment([nvfp4]) == {**ATTENTION_ENV, "NVTE_DPA_FP8_FORMAT": "E4M3"}
    # A switch target counts like the first recipe.
    assert attention_environment([RecipeConfig(name="fp8_delayed"), CS_ATTENTION]) == ATTENTION_ENV
    with pytest.raises(ConfigError) as info:
        attention_environment([nvfp4, RecipeConfig(name="nvfp4", fp8_attention=True)])
    assert str(info.value) == (
        "recipe.fp8_attention=true with recipe=nvfp4 under recipe.fp8_format=E4M3 and HYBRID in "
        "one run: TE reads the FP8 format of nvfp4's attention once per process "
        "(NVTE_DPA_FP8_FORMAT); give every nvfp4 recipe of the run one recipe.fp8_format"
    )


def test_apply_attention_environment_and_its_conflicts():
    env: dict[str, str] = {}
    assert apply_attention_environment([CS_ATTENTION], env) == ATTENTION_ENV == env
    # Again (a dry run, a sweep's next job): the same values pass.
    assert apply_attention_environment([CS_ATTENTION], env) == ATTENTION_ENV == env
    env = {"PATH": "/bin"}
    assert apply_attention_environment([RecipeConfig(name="fp8_cs")], env) == {}
    assert apply_attention_environment([DELAYED_ATTENTION], env) == {} and env == {"PATH": "/bin"}
    # A value the user set that the run would change: one line naming it, nothing set.
    env = {"NVTE_DPA_FP8DS_AMAX_HISTLEN": "16"}
    with pytest.raises(ConfigError) as info:
        apply_attention_environment([CS_ATTENTION], env)
    assert str(info.value) == (
        "NVTE_DPA_FP8DS_AMAX_HISTLEN=16 is set in the environment, but "
        "recipe.fp8_attention=true with recipe=fp8_cs runs attention in TE's delayed scaling "
        "and sets NVTE_DPA_FP8DS_AMAX_HISTLEN=1 itself (docs/PRECISION.md, FP8 attention); "
        "unset NVTE_DPA_FP8DS_AMAX_HISTLEN"
    )
    assert env == {"NVTE_DPA_FP8DS_AMAX_HISTLEN": "16"}
    # fp8_delayed: attention runs under the recipe's own delayed scaling, unless the variable
    # sends it elsewhere (current scaling: the past would depend on the future).
    apply_attention_environment([DELAYED_ATTENTION], {"NVTE_DPA_FP8_RECIPE": "DelayedScaling"})
    with pytest.raises(ConfigError) as info:
        apply_attention_environment(
            [DELAYED_ATTENTION], {"NVTE_DPA_FP8_RECIPE": "Float8CurrentScaling"}
        )
    assert str(info.value) == (
        "NVTE_DPA_FP8_RECIPE=Float8CurrentScaling is set in the environment, but "
        "recipe.fp8_attention=true with recipe=fp8_delayed runs attention under the recipe's "
        "own delayed scaling (a position's output never depends on later positions); unset "
        "NVTE_DPA_FP8_RECIPE"
    )


def test_attention_environment_after_te_was_imported(monkeypatch):
    """TE's attention modules read the variables once, at import: one imported before the
    run could set them is refused in one line, with the way out."""
    import sys

    from recipes.attention import DPA_MODULE, MHA_MODULE

    dpa = SimpleNamespace(
        _dpa_fp8_recipe="",
        _dpa_fp8_format=SimpleNamespace(name="HYBRID"),  # TE keeps a Format member
        _dpa_fp8ds_amax_histlen=1,
        _dpa_fp8ds_amax_algo="most_recent",
        _dpa_fp8ds_reduce_amax=True,
    )
    mha = SimpleNamespace(_dpa_fp8_recipe="", _dpa_fp8_recipe_dpa=False, _dpa_fp8_recipe_mha=False)
    monkeypatch.setitem(sys.modules, DPA_MODULE, dpa)
    monkeypatch.setitem(sys.modules, MHA_MODULE, mha)
    env: dict[str, str] = {}
    with pytest.raises(ConfigError) as info:
        apply_attention_environment([CS_ATTENTION], env)
    exports = " ".join(f"{k}={v}" for k, v in ATTENTION_ENV.items())
    assert str(info.value) == (
        "TransformerEngine's attention was imported in this process before "
        "recipe.fp8_attention=true with recipe=fp8_cs could set "
        "NVTE_DPA_FP8_RECIPE=DelayedScaling (TE reads it once, at import, and holds ''); start "
        f"the run in a fresh process, or set {exports} before Python starts"
    )
    assert env == {}
    assert apply_attention_environment([DELAYED_ATTENTION], env) == {}  # TE's default is its
    # Imported after the variables were set (an exported environment): the same values.
    dpa._dpa_fp8_recipe = mha._dpa_fp8_recipe = "DelayedScaling"
    assert apply_attention_environment([CS_ATTENTION], env) == ATTENTION_ENV
    mha._dpa_fp8_recipe_mha = True
    with pytest.raises(ConfigError, match=r"set NVTE_DPA_FP8_RECIPE_MHA=0 .* holds '1'"):
        apply_attention_environment([CS_ATTENTION], {})
    dpa._dpa_fp8_recipe = "Float8CurrentScaling"
    with pytest.raises(ConfigError) as info:
        apply_attention_environment([DELAYED_ATTENTION], {})
    assert str(info.value).startswith(
        "TransformerEngine's attention was imported in this process with "
        "NVTE_DPA_FP8_RECIPE=Float8CurrentScaling (read once, at import)"
    )


def test_check_config_sets_the_attention_environment_before_te(monkeypatch):
    """train.check_config applies the variables before anything imports TE (its first step
    after the config's own rules), so a refused run has set them too: harmless, it ends."""
    import os

    from train import check_config

    for key in ATTENTION_ENV:  # restored (removed) after the test
        monkeypatch.setenv(key, "-")
        monkeypatch.delenv(key)
    cfg = compose_config(["recipe=fp8_cs", "recipe.fp8_attention=true"])
    with pytest.raises(ConfigError, match=r"^recipe=fp8_cs needs TransformerEngine and a CUDA"):
        check_config(cfg, 1, CPU)
    assert {k: os.environ.get(k) for k in ATTENTION_ENV} == ATTENTION_ENV


MODEL_128 = ModelConfig(dim=256, n_heads=2, n_kv_heads=1)  # head_dim 128
MODEL_64 = ModelConfig(dim=256, n_heads=4, n_kv_heads=2)  # head_dim 64 (llama3_1b's)


def attention_error(cfg, mcfg=MODEL_128, data=None, deterministic=False) -> str:
    from data.config import DataConfig

    data = data if data is not None else DataConfig(document_mask=False)
    with pytest.raises(ConfigError) as info:
        check_fp8_attention(cfg, mcfg, data, deterministic, CUDA)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_fp8_attention_refusals(monkeypatch):
    from data.config import DataConfig

    fake_gpu(monkeypatch, H100, (9, 0))
    causal = DataConfig(document_mask=False)
    # Documents: TE 2.20's FP8 attention has no THD layout (synthetic data too, unless no
    # sample holds a document boundary).
    message = (
        "recipe.fp8_attention=true with data.document_mask=true: TE 2.20 runs FP8 attention on "
        "the bshd/sbhd layouts only, not the THD layout document masking uses; set "
        "data.document_mask=false (causal attention over each whole sample)"
    )
    assert attention_error(CS_ATTENTION, data=DataConfig()) == message
    assert attention_error(CS_ATTENTION, data=DataConfig(name="synthetic")) == message
    rows = DataConfig(name="synthetic", doc_len_dist="whole_rows")
    check_fp8_attention(CS_ATTENTION, MODEL_128, rows, False, CUDA)
    # sm_90 trains FP8 attention with head_dim 128 only.
    assert attention_error(DELAYED_ATTENTION, MODEL_64) == (
        "recipe.fp8_attention=true with head_dim 64 (model.dim=256 / model.n_heads=4): on sm_90 "
        "(NVIDIA H100 80GB HBM3) TE trains FP8 attention with head_dim 128 only; use a model "
        "with head_dim 128 (llama3_3b, llama3_8b, llama3_70b) or drop recipe.fp8_attention"
    )
    for cfg in (CS_ATTENTION, DELAYED_ATTENTION):
        check_fp8_attention(cfg, MODEL_128, causal, False, CUDA)
    # Without fp8_attention nothing here applies.
    check_fp8_attention(RecipeConfig(name="fp8_cs"), MODEL_64, DataConfig(), True, CUDA)
    # Below sm_90 there is no FP8 fused attention; Blackwell takes other head sizes.
    fake_gpu(monkeypatch, "NVIDIA L40S", (8, 9))
    assert attention_error(DELAYED_ATTENTION) == (
        "recipe.fp8_attention=true needs compute capability >= 9.0 (Hopper: TE's FP8 attention "
        "is cuDNN's fused attention, sm_90 and newer); this GPU is NVIDIA L40S (sm_89): drop "
        "recipe.fp8_attention"
    )
    fake_gpu(monkeypatch, "NVIDIA B200", (10, 0))
    check_fp8_attention(
        RecipeConfig(name="mxfp8", fp8_attention=True), MODEL_64, causal, False, CUDA
    )
    # Deterministic FP8 attention backward: cuDNN >= 9.19.
    fake_gpu(monkeypatch, H100, (9, 0))
    monkeypatch.setattr(recipes.attention, "cudnn_version", lambda: (9, 10, 2))
    assert attention_error(CS_ATTENTION, deterministic=True) == (
        "train.deterministic=true with recipe.fp8_attention=true needs cuDNN >= 9.19 (TE 2.20 "
        "has no deterministic FP8 attention backward before it); this run has cuDNN 9.10.2: set "
        "train.deterministic=false, drop recipe.fp8_attention, or install cuDNN >= 9.19"
    )
    monkeypatch.setattr(recipes.attention, "cudnn_version", lambda: None)
    assert "this run has no cuDNN:" in attention_error(CS_ATTENTION, deterministic=True)
    monkeypatch.setattr(recipes.attention, "cudnn_version", lambda: (9, 19, 0))
    check_fp8_attention(CS_ATTENTION, MODEL_128, causal, True, CUDA)
    # On CPU the recipe itself is refused first (check_recipe); nothing asks the device here.
    check_fp8_attention(CS_ATTENTION, MODEL_64, causal, True, CPU)
