"""recipes/ against the real TransformerEngine (2.20.2) on a Hopper GPU.

    source .device/setup.sh && python3 -m pytest -m gpu tests/gpu/test_recipes_gpu.py -q

Covers: TE recipe objects built from conf/recipe/*.yaml (all five, mxfp8 and nvfp4 included:
their objects and quantizers need no Blackwell kernel), the capability check on this GPU,
autocast forward/backward of TE modules for each sm_90 recipe, bf16 layers, quantized weights
of the expected class with FusedAdam fp32 masters seeded from the exact initial values, and
amax-reduction groups on real quantizers and quantized weights under FSDP2 (one rank).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from config import ConfigError, compose_config
from model import te_available
from recipes import (
    WEIGHT_TYPES,
    build_recipe,
    check_recipe,
    device_capability,
    runnable_recipes,
    set_weight_amax_groups,
    te_recipe_spec,
    weight_quantizers,
)
from tests.distributed import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not te_available(), reason="needs a CUDA GPU and TransformerEngine"),
]

ROOT = Path(__file__).resolve().parents[2]
SM90 = ("fp8_delayed", "fp8_cs", "fp8_block")
QUANTIZED = (*SM90, "mxfp8", "nvfp4")
DIM, FFN = 256, 512


def load_recipe(*overrides: str):
    return compose_config(overrides).recipe


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def seeded(shape, seed: int, std: float = 0.02) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=gen, device="cuda") * std


@pytest.fixture(scope="module")
def group():
    """A one-rank NCCL process group that is not the default one (so it is recognisable)."""
    started = not dist.is_initialized()
    if started:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield dist.new_group([0])
    if started:
        dist.destroy_process_group()


def te_weight_slots(te_recipe, mode="forward", n=6):
    from transformer_engine.pytorch.quantization import RecipeState

    return RecipeState.create(te_recipe, mode=mode, num_quantizers=n).make_quantizers()


# ---------------------------------------------------------------- recipe objects


@pytest.mark.parametrize("name", QUANTIZED)
def test_te_recipe_object_from_yaml(name):
    from transformer_engine.common import recipe as te_recipe_module

    recipe = build_recipe(load_recipe(f"recipe={name}"), n_layers=4)
    spec = te_recipe_spec(recipe.cfg)
    obj = recipe.te_recipe()
    assert type(obj) is getattr(te_recipe_module, spec.cls)
    assert recipe.te_recipe() is obj
    for key, value in spec.kwargs.items():
        got = getattr(obj, key)
        assert (got.name if key == "fp8_format" else got) == value, key
    for attr, params in spec.qparams.items():
        qp = getattr(obj, attr)
        assert (qp.power_2_scale, qp.amax_epsilon) == (params["power_2_scale"], 0.0)
    # The weight slot (index 1 of input/weight/output) gets the quantizer class we expect.
    fwd = te_weight_slots(obj)
    assert type(fwd[1]).__name__ == type(fwd[4]).__name__ == WEIGHT_TYPES[name][0]
    if name == "fp8_block":  # 128x128 weight blocks, 1x128 activation tiles, power-of-2 scales
        assert (fwd[1].block_scaling_dim, fwd[0].block_scaling_dim) == (2, 1)
        assert fwd[1].force_pow_2_scales is True
    if name == "nvfp4":  # TE's published NVFP4 training recipe
        grad = te_weight_slots(obj, mode="backward", n=4)
        assert (fwd[1].with_2d_quantization, fwd[1].with_rht) == (True, False)
        assert (fwd[0].with_rht, fwd[0].stochastic_rounding) == (True, False)
        assert (grad[0].with_rht, grad[0].stochastic_rounding) == (True, True)


def test_te_recipe_overrides():
    obj = build_recipe(load_recipe("recipe=fp8_block", "recipe.power_2_scale=false"), 2).te_recipe()
    assert obj.fp8_quant_fwd_weight.power_2_scale is False
    assert te_weight_slots(obj)[1].force_pow_2_scales is False
    overrides = (
        "recipe.disable_rht=true",
        "recipe.disable_stochastic_rounding=true",
        "recipe.disable_2d_quantization=true",
    )
    obj = build_recipe(load_recipe("recipe=nvfp4", *overrides), 2).te_recipe()
    assert not obj.fp4_quant_fwd_inp.random_hadamard_transform
    assert not obj.fp4_quant_bwd_grad.stochastic_rounding
    assert not obj.fp4_quant_fwd_weight.fp4_2d_quantization
    obj = build_recipe(
        load_recipe(
            "recipe=fp8_delayed",
            "recipe.amax_history_len=16",
            "recipe.amax_compute_algo=most_recent",
        ),
        2,
    ).te_recipe()
    assert (obj.amax_history_len, obj.amax_compute_algo) == (16, "most_recent")


# ---------------------------------------------------------------- capability check


def test_capability_check_on_this_gpu():
    import transformer_engine.pytorch as te

    device = torch.device("cuda", 0)
    gpu, capability = device_capability(device)
    assert (gpu, capability) == (torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
    for name in runnable_recipes(capability):
        check_recipe(load_recipe(f"recipe={name}"), "te", device)
    if capability >= (10, 0):
        pytest.skip("Blackwell GPU: mxfp8/nvfp4 run here")
    assert not te.is_mxfp8_available() and not te.is_nvfp4_available()  # TE agrees
    runs = ", ".join(runnable_recipes(capability))
    for name in ("mxfp8", "nvfp4"):
        with pytest.raises(ConfigError) as info:
            check_recipe(load_recipe(f"recipe={name}"), "te", device)
        assert str(info.value) == (
            f"recipe={name} needs compute capability >= 10.0 (Blackwell); this GPU is {gpu} "
            f"(sm_{capability[0]}{capability[1]}), which runs: {runs}"
        )


# ---------------------------------------------------------------- autocast


@pytest.mark.parametrize("name", SM90)
def test_autocast_forward_backward(name):
    import transformer_engine.pytorch as te

    recipe = build_recipe(load_recipe(f"recipe={name}", "recipe.bf16_layers=[1]"), n_layers=2)
    torch.manual_seed(0)
    layer = te.Linear(DIM, DIM, bias=False, params_dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(seeded((DIM, DIM), 1))
    x = torch.randn(64, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ref = x.detach().float() @ layer.weight.detach().float().t()
    errors = {}
    for layer_index in (0, 1, 0):  # twice as block 0: delayed scaling needs one amax update
        with recipe.autocast(), recipe.layer_autocast(layer_index):
            out = layer(x)
        out.float().square().sum().backward()
        errors[layer_index] = rel_err(out, ref)
    assert type(layer.quantizers["scaling_fwd"][1]).__name__ == WEIGHT_TYPES[name][0]
    # Block 0 computes in FP8 (visible error, still close); block 1 is a bf16 layer.
    assert 0.005 < errors[0] < 0.08, errors
    assert errors[1] < 0.005, errors
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all()


# ---------------------------------------------------------------- quantized weights + masters


def build_mlps(recipe, n_layers: int):
    import transformer_engine.pytorch as te

    layers = torch.nn.ModuleList()
    with recipe.quantized_init_context():
        for i in range(n_layers):
            with recipe.layer_init_context(i):
                layers.append(
                    te.LayerNormMLP(
                        DIM,
                        FFN,
                        bias=False,
                        normalization="RMSNorm",
                        activation="swiglu",
                        params_dtype=torch.bfloat16,
                        device="meta",
                    )
                )
    return layers


@torch.no_grad()
def seeded_init(model) -> dict[str, torch.Tensor]:
    """What model/init.py does: full values from a seed per parameter; returns them (fp32)."""
    from torch.distributed.tensor import DTensor

    values = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        full = torch.ones(p.shape, device="cuda") if p.ndim == 1 else seeded(p.shape, 100 + i)
        local = p.to_local() if isinstance(p, DTensor) else p
        local.copy_(full)  # one rank: the local shard is the full tensor
        values[name] = full
    return values


def forward_backward(model, recipe, x):
    with recipe.autocast():
        h = x
        for i, layer in enumerate(model):
            with recipe.layer_autocast(i):
                h = h + layer(h)
    h.float().square().mean().backward()


@pytest.mark.parametrize("name", SM90)
def test_quantized_init_weights_and_masters(name):
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.optimizers import FusedAdam

    recipe = build_recipe(
        load_recipe(f"recipe={name}", "recipe.quantized_init=true", "recipe.bf16_layers=[-1]"),
        n_layers=2,
    )
    model = build_mlps(recipe, 2)
    model.to_empty(device="cuda")
    values = seeded_init(model)
    assert recipe.quantize_weights(model) == 2  # fc1 + fc2 of block 0; block 1 is bf16
    quantized = {n: p for n, p in model.named_parameters() if isinstance(p, te.QuantizedTensor)}
    assert sorted(quantized) == ["0.fc1_weight", "0.fc2_weight"]
    for n, p in quantized.items():
        assert type(p).__name__ == recipe.weight_tensor_class == WEIGHT_TYPES[name][1]
        assert p.requires_grad
        assert torch.equal(p.get_high_precision_init_val(), values[n].bfloat16().cpu())
        assert rel_err(p.dequantize(), values[n]) < 0.08
    assert model[1].fc1_weight.dtype == torch.bfloat16
    assert not isinstance(model[1].fc1_weight, te.QuantizedTensor)
    # One byte per parameter (plus scales) instead of bf16's two: the transposed copy is
    # derived when a GEMM needs it, not stored (recipes/quantized.py _needs_columnwise_copy).
    w = quantized["0.fc1_weight"]
    bytes_per_param = sum(t.numel() * t.element_size() for t in _storage(w)) / w.numel()
    assert 1.0 <= bytes_per_param < 1.1, bytes_per_param

    optimizer = FusedAdam(model.parameters(), lr=1e-3, **recipe.fused_adam_kwargs())
    assert recipe.seed_master_weights(model, optimizer) == 2
    for n, p in quantized.items():
        master = optimizer.state[p]["master_param"]
        assert master.dtype == torch.float32
        assert torch.equal(master, values[n].bfloat16().float())  # the kept values, exactly
        assert p.get_high_precision_init_val() is None  # released
    x = torch.randn(2, 32, DIM, device="cuda", dtype=torch.bfloat16)
    forward_backward(model, recipe, x)
    before = {n: optimizer.state[p]["master_param"].clone() for n, p in quantized.items()}
    optimizer.step()
    for n, p in dict(model.named_parameters()).items():
        if n in quantized:
            assert type(p).__name__ == WEIGHT_TYPES[name][1]
            master = optimizer.state[p]["master_param"]
            assert not torch.equal(master, before[n])
            assert rel_err(p.dequantize(), master) < 0.08  # re-quantized from the master


def _storage(t) -> list[torch.Tensor]:
    """The low-precision buffers of a TE quantized tensor (data and scales, both usages)."""
    names = (
        "_data",
        "_transpose",
        "_scale_inv",
        "_rowwise_data",
        "_columnwise_data",
        "_rowwise_scale_inv",
        "_columnwise_scale_inv",
    )
    return [b for b in (getattr(t, n, None) for n in names) if isinstance(b, torch.Tensor)]


# ---------------------------------------------------------------- amax groups


def test_amax_groups_fp8_cs_under_fsdp2(group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformer_engine.pytorch.optimizers import FusedAdam

    recipe = build_recipe(load_recipe("recipe=fp8_cs", "recipe.quantized_init=true"), n_layers=1)
    model = build_mlps(recipe, 1)
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp_shard",))
    fully_shard(model[0], mesh=mesh)
    model.to_empty(device="cuda")
    values = seeded_init(model)
    # One rank: the policy asks for no reduction; the group is passed directly to test the path.
    assert recipe.weight_amax_group(group, group) is None
    assert recipe.quantize_weights(model, group) == 2
    refs = {r.name: r for r in weight_quantizers(model)}
    assert sorted(refs) == ["0.fc1_weight", "0.fc2_weight"]
    for n, ref in refs.items():
        param = dict(model.named_parameters())[n]
        assert isinstance(param, DTensor) and ref.tensor is param._local_tensor
        assert type(ref.tensor).__name__ == "Float8Tensor"
        assert type(ref.quantizer).__name__ == "Float8CurrentScalingQuantizer"
        assert ref.quantizer.with_amax_reduction and ref.quantizer.amax_reduction_group is group
        assert ref.tensor.amax_reduction_group is group
        assert rel_err(ref.tensor.dequantize(), values[n]) < 0.08

    optimizer = FusedAdam(model.parameters(), lr=1e-3, **recipe.fused_adam_kwargs())
    assert recipe.seed_master_weights(model, optimizer) == 2
    forward_backward(model, recipe, torch.randn(2, 32, DIM, device="cuda", dtype=torch.bfloat16))
    # TE's FSDP2 all-gather hook replaced the weights' group with FSDP's shard-mesh group ...
    assert all(r.tensor.amax_reduction_group is not group for r in weight_quantizers(model))
    # ... so the policy is re-applied before the step that re-quantizes from the masters.
    assert recipe.set_weight_amax_groups(model, group) == 4
    assert all(r.tensor.amax_reduction_group is group for r in weight_quantizers(model))
    optimizer.step()
    for r in weight_quantizers(model):
        master = optimizer.state[dict(model.named_parameters())[r.name]]["master_param"]
        assert rel_err(r.tensor.dequantize(), master.to_local()) < 0.08


@pytest.mark.parametrize("name, expected", [("nvfp4", 2), ("mxfp8", 0), ("fp8_block", 0)])
def test_amax_groups_on_quantizers_without_kernels(group, name, expected):
    """Module weight quantizers are built without running a kernel: check their class and
    that only the per-tensor-scaled ones take the group."""
    recipe = build_recipe(load_recipe(f"recipe={name}", "recipe.quantized_init=true"), 1)
    model = build_mlps(recipe, 1)
    refs = weight_quantizers(model)
    assert [type(r.quantizer).__name__ for r in refs] == [WEIGHT_TYPES[name][0]] * 2
    assert set_weight_amax_groups(model, group) == expected
    for r in refs:
        assert getattr(r.quantizer, "amax_reduction_group", None) is (group if expected else None)


# ---------------------------------------------------------------- FusedAdam FP8 transpose cache


def _stale_fp8_transposes(step) -> list[int]:
    """Train a delayed-scaling quantized te.Linear for 3 steps, calling step(optimizer) for
    each optimizer step; returns the steps after which the weight offered a cached FP8
    transpose that is not the transpose of its new bytes."""
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.optimizers import FusedAdam

    recipe = build_recipe(load_recipe("recipe=fp8_delayed", "recipe.quantized_init=true"), 1)
    with recipe.quantized_init_context():
        layer = te.Linear(DIM, DIM, bias=False, params_dtype=torch.bfloat16, device="cuda")
    w = layer.weight
    assert type(w).__name__ == "Float8Tensor"
    opt = FusedAdam(layer.parameters(), lr=0.05, **recipe.fused_adam_kwargs())
    x = torch.randn(64, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    stale = []
    for i in range(3):
        with recipe.autocast():
            out = layer(x)
        out.float().square().sum().backward()
        if i == 0:  # the backward built (and cached) the transpose of the current bytes
            assert w._transpose is not None and not w._transpose_invalid
        before = w._data.clone()
        step(opt)
        opt.zero_grad(set_to_none=True)
        assert not torch.equal(before, w._data), "the step must change the FP8 bytes"
        cached = w._transpose is not None and not w._transpose_invalid
        if cached and not torch.equal(w._transpose, w._data.t().contiguous()):
            stale.append(i)
    return stale


def test_fused_adam_fp8_step_leaves_no_stale_transpose():
    """Delayed-scaling quantized weights: FusedAdam's fused FP8 kernel rewrites the bytes in
    place. Whatever transpose the weight then offers to the next backward (on Hopper dgrad
    reads it) must be the transpose of the new bytes: with compat/te.py's fix it is; TE's own
    step (the wrapped one) leaves it stale, which is the gap the fix stands in for."""
    import compat
    from compat.te import unpatched_fused_adam_step

    compat.apply_all()
    original = unpatched_fused_adam_step()
    assert original is not None, "compat.apply_all() must wrap FusedAdam.step"
    assert _stale_fp8_transposes(lambda opt: original(opt)) != []  # TE alone: the gap
    assert _stale_fp8_transposes(lambda opt: opt.step()) == []  # with the fix
