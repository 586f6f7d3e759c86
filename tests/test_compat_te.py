"""compat/te.py's `wrap_post_all_gather` (TE PR 2713 stand-in), on CPU without TE.

From the second all-gather on, FSDP2 hands `fsdp_post_all_gather` the unsharded parameter as
`out=`. Two things then break TE's quantized tensors:
  - under tensor parallelism `out` is a DTensor, and TE reads `out._quantizer`
    ('DTensor' object has no attribute '_quantizer');
  - for a weight FSDP shards along dim 1 (fc1 under TP) the gathered buffer arrives viewed
    with dim-0 semantics, (world x rows, cols / world), and TE adopts it as `out`'s data, so
    the parameter takes that shape.
`te_like_post_all_gather` does what TE does with `out` (reads its quantizer, adopts the
buffer); the first test shows both failures without the wrapper and their absence with it,
the second checks what the wrapper hands over in each case.

Also `wrap_step_resetting_fp8_caches` (the FusedAdam fix's wrapper) against torch.optim's own
step wrapper, in both orders.
"""

from __future__ import annotations

import pytest
import torch

from compat.te import (
    wrap_post_all_gather,
    wrap_pre_all_gather_for_recompute,
    wrap_step_resetting_fp8_caches,
)
from tests.distributed import run_distributed

ROWS, COLS = 4, 6


def te_like_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
    """TE's Float8Tensor.fsdp_post_all_gather, reduced to what it does with its arguments:
    with `out` (the unsharded parameter, kept between all-gathers) it takes out's quantizer
    and makes the gathered buffer out's data; without, it builds a new tensor from it."""
    data = all_gather_outputs[0]
    if out is not None:
        out._quantizer = out._quantizer.copy()
        out._data = data
        return None
    gathered = data.clone()
    gathered._data, gathered._quantizer = data, self._quantizer.copy()
    return gathered, all_gather_outputs


class _Quantizer:
    def copy(self):
        return _Quantizer()


def _quantized(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor carrying the attributes TE's quantized tensors have."""
    t._quantizer, t._data = _Quantizer(), t
    return t


def _dim1_gathered(full: torch.Tensor, world: int = 2) -> torch.Tensor:
    """What torch hands over for a weight FSDP shards along dim 1 over `world` ranks: the
    row-major full bytes (chunk-cat), viewed with dim-0 semantics as (world x rows, cols /
    world)."""
    rows, cols = full.shape
    return full.reshape(-1).view(world * rows, cols // world)


def _upstream_failure_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    full = torch.arange(float(ROWS * COLS)).view(ROWS, COLS)
    owner = _quantized(torch.zeros(2, COLS))  # the sharded parameter whose method runs
    mesh = init_device_mesh("cpu", (1,))

    def tp_out():
        out = DTensor.from_local(torch.zeros(ROWS, COLS), mesh, [Shard(0)])
        _quantized(out._local_tensor)
        return out

    # Without the wrapper: a DTensor `out` has no quantizer ...
    with pytest.raises(AttributeError, match="'DTensor' object has no attribute '_quantizer'"):
        te_like_post_all_gather(owner, (full,), None, torch.float32, out=tp_out())
    # ... and a dim-1 gather leaves the parameter with the buffer's dim-0 shape.
    out = _quantized(torch.zeros(ROWS, COLS))
    te_like_post_all_gather(owner, (_dim1_gathered(full),), None, torch.float32, out=out)
    assert out._data.shape == (2 * ROWS, COLS // 2)

    # With it: both work, and the parameter's data is the full weight in its own shape.
    fixed = wrap_post_all_gather(te_like_post_all_gather)
    for gathered in (full, _dim1_gathered(full)):
        out = tp_out()
        assert fixed(owner, (gathered,), None, torch.float32, out=out) is None
        assert torch.equal(out._local_tensor._data, full)
        out = _quantized(torch.zeros(ROWS, COLS))
        fixed(owner, (gathered,), None, torch.float32, out=out)
        assert out._data.shape == (ROWS, COLS) and torch.equal(out._data, full)
    # The first all-gather (no `out`) passes through untouched.
    built, outputs = fixed(owner, (full,), None, torch.float32)
    assert torch.equal(built._data, full) and outputs[0] is full


def test_te_like_post_all_gather_fails_without_the_wrapper_and_works_with_it():
    run_distributed(_upstream_failure_worker, 1)


def _post_all_gather_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    seen = {}

    def te_like(self, outputs, metadata, dtype, *, out=None):
        seen["out"], seen["outputs"] = out, outputs
        return out, outputs

    wrapped = wrap_post_all_gather(te_like)
    full = torch.arange(24.0).view(4, 6)  # the weight: 4 rows x 6 columns
    # What torch hands over for a weight FSDP shards along dim 1 over 2 ranks: the row-major
    # full bytes (chunk-cat), viewed with dim-0 semantics as (2 x 4, 6 / 2).
    gathered = full.reshape(-1).view(8, 3)
    scales = torch.ones(5)
    local = torch.zeros(4, 6)
    out = DTensor.from_local(local, init_device_mesh("cpu", (1,)), [Shard(0)])
    wrapped(None, (gathered, scales), None, torch.float32, out=out)
    assert seen["out"] is out._local_tensor  # TE gets the local tensor of a TP DTensor
    assert seen["outputs"][0].shape == (4, 6) and torch.equal(seen["outputs"][0], full)
    assert seen["outputs"][1] is scales  # another size: unchanged
    wrapped(None, (full,), None, torch.float32, out=local)  # dim-0 sharding: already right
    assert seen["outputs"][0] is full
    wrapped(None, (gathered,), None, torch.float32)  # first all-gather: no out, untouched
    assert seen["out"] is None and seen["outputs"][0] is gathered


def test_post_all_gather_wrapper_takes_dtensor_out_and_dim1_gathers():
    run_distributed(_post_all_gather_worker, 1)


class Float8Quantizer:  # the class name reset_fp8_weight_caches looks for
    pass


def _fp8_like_param(resets: list) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.ones(2))
    p._quantizer = Float8Quantizer()
    p._reset_caches = lambda: resets.append(1)
    return p


@pytest.mark.parametrize("torch_hook_first", [True, False])
def test_step_wrapper_with_torch_optimizer_hook(torch_hook_first):
    """torch.optim wraps an optimizer class's step in its profiling hook (functools.wraps: it
    sets `__wrapped__`) when the first instance is built. The fix must be applied whether that
    happened before or after it, exactly once, and reset the caches once per step: a check of
    `hasattr(step, "__wrapped__")` took torch's hook for the fix and skipped it."""

    class Opt(torch.optim.SGD):
        pass

    if torch_hook_first:
        Opt([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        assert hasattr(Opt.step, "__wrapped__")  # torch's hook
    original = wrap_step_resetting_fp8_caches(Opt)
    resets: list = []
    p = _fp8_like_param(resets)
    opt = Opt([p], lr=0.1)  # the hook goes on now if it was not there
    assert wrap_step_resetting_fp8_caches(Opt) is original  # found, not wrapped twice
    for n in (1, 2):
        p.grad = torch.ones(2)
        opt.step()
        assert resets == [1] * n
    assert torch.allclose(p.detach(), torch.full((2,), 0.8))
    # The step it wrapped is the optimizer's own: no reset.
    p.grad = torch.ones(2)
    original(opt)
    assert resets == [1, 1]


# -- wrap_pre_all_gather_for_recompute: the backward gather of a recomputed forward ------------


def te_like_pre_all_gather(self, mesh, orig_size, stride, module, mp_policy):
    """TE 2.20's Float8Tensor.fsdp_pre_all_gather, reduced to its choice of copies: the FSDP2
    state of the module's unit says whether this gather is for backward and whether the unit
    reshards after forward; a resharding unit gathers the rowwise copy for forward and only
    the columnwise (transposed) one for backward."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    unit = module if hasattr(module, "_get_fsdp_state") else self._unit
    group = unit._get_fsdp_state()._fsdp_param_group
    if group._reshard_after_forward:
        backward = group._training_state == TrainingState.PRE_BACKWARD
        return (self,), (not backward, backward)
    return (self,), (True, True)


def _recompute_gather_worker(rank, world_size):
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    from parallel.ac import apply_activation_checkpointing

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.layernorm_mlp = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.layernorm_mlp(self.attn(x))

    model = nn.Module()
    model.layers = nn.ModuleList([Block(), Block()])
    apply_activation_checkpointing(model, "mlp", every=2)  # block 0's MLP only
    for block in model.layers:
        fully_shard(block, reshard_after_forward=True)
    tensor = torch.zeros(1)
    tensor._unit = model.layers[0]
    group = model.layers[0]._get_fsdp_state()._fsdp_param_group
    fixed = wrap_pre_all_gather_for_recompute(te_like_pre_all_gather)

    def usages(fn, module, state):
        with group.use_training_state(state):
            return fn(tensor, None, None, None, module, None)[1]

    mlp, attn = model.layers[0].layernorm_mlp, model.layers[0].attn
    # TE alone: the backward gather of the recomputed MLP has no rowwise copy (the gap).
    assert usages(te_like_pre_all_gather, mlp, TrainingState.PRE_BACKWARD) == (False, True)
    # With the wrapper: both copies for the recomputed module in backward ...
    assert usages(fixed, mlp, TrainingState.PRE_BACKWARD) == (True, True)
    assert group._reshard_after_forward is True  # ... and the unit's setting is restored;
    # unchanged in forward, for a module that is not recomputed, and in a block without AC.
    assert usages(fixed, mlp, TrainingState.FORWARD) == (True, False)
    assert usages(fixed, attn, TrainingState.PRE_BACKWARD) == (False, True)
    other = model.layers[1]
    tensor._unit = other
    with other._get_fsdp_state()._fsdp_param_group.use_training_state(TrainingState.PRE_BACKWARD):
        assert fixed(tensor, None, None, None, other.layernorm_mlp, None)[1] == (False, True)
    assert fixed.__wrapped__ is te_like_pre_all_gather


def test_recomputed_module_gathers_rowwise_copy_for_backward():
    run_distributed(_recompute_gather_worker, 1)
