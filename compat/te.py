"""TransformerEngine gaps this recipe works around, each applied only where TE still has it.

| gap | upstream | detect | fix | test |
| --- | --- | --- | --- | --- |
| QuantizedTensor has no `untyped_storage`: FSDP2's `reset_sharded_param` after a DCP load compares storages and dereferences an invalid one | TE PR 2974 (in 2.20) | the class defines `untyped_storage` | `ensure_quantized_tensor_storage` | tests/gpu/test_checkpoint_gpu.py::test_untyped_storage_fix_needed_for_fsdp2_load |
| FusedAdam's fused FP8 kernel (delayed-scaling Float8Tensor parameters, master weights) rewrites the FP8 bytes in place but leaves the cached FP8 transpose valid; on Hopper the next backward's dgrad GEMM reads the transpose of the previous step's weights, so training drifts and a resume (fresh transpose) is not bitwise | none found (TE 2.20.2) | not probed at start-up (it takes an FP8 forward and backward); the test asserts the gap with TE's own step | `ensure_fused_adam_fp8_cache_reset` (harmless where TE resets the cache itself) | tests/gpu/test_recipes_gpu.py::test_fused_adam_fp8_step_leaves_no_stale_transpose |
| FSDP2 x tensor parallel: from the second all-gather on, torch passes the unsharded parameter as `out=` to `fsdp_post_all_gather`, and for a TP weight that is a DTensor (`'DTensor' object has no attribute '_quantizer'`); for a weight FSDP shards along dim 1 (fc1 under TP) the gathered buffer arrives viewed as (world x rows, cols / world) | TE PR 2713 (DTensor weights, unmerged) | per call: the wrapper acts only on a DTensor `out` or a buffer whose shape disagrees with `out` | `ensure_post_all_gather_dtensor_out` (`wrap_post_all_gather`) | tests/test_compat_te.py |
| FSDP2 + activation recomputation of quantized weights: with `reshard_after_forward`, TE's `fsdp_pre_all_gather` (Float8Tensor, 128x128-block FP8, MXFP8) gathers only the columnwise (transposed) copy for backward, but a block recomputed in backward runs its forward again and needs the rowwise copy: "Cannot generate FP8 data, even from FP8 data transpose" (any recompute mode, quantized_init, 2+ ranks) | none found (TE 2.20.2) | per call: acts only for modules parallel/ac.py marked as recomputed, in FSDP2's pre-backward state | `ensure_recompute_gathers_rowwise` (`wrap_pre_all_gather_for_recompute`) | tests/test_compat_te.py (real FSDP2 state on gloo), tests/gpu/test_ac_layouts_gpu.py (TE on 2 GPUs, the gap asserted with TE's own hook) |
| FSDP2 dim-1 sharding of FP8 128x128-block weights | see compat/fsdp2.py | compat/fsdp2.py | `ensure_dim1_block_gather` | tests/test_compat_fsdp2.py |

Detection is by what the installed TE does or defines, never by its version number or its
source text. Every fix here is harmless where TE no longer needs it (marking a cache stale
only costs recomputing it; the wrapper passes through arguments TE handles), and each test
asserts the gap with TE alone, so a TE release that closes one makes its test fail. Nothing here imports TE at module level: CPU
runs never touch it. The gaps that belong to checkpointing (DelayedScaling `_extra_state`,
FusedAdam optimizer states before TE PR 2795) are handled in checkpoint/te_state.py.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor

from compat.fsdp2 import enable_dim1_block_gather

log = logging.getLogger(__name__)

_APPLIED: dict[str, bool] = {}
#: `wrap_step_resetting_fp8_caches`'s wrappers -> the step each wrapped.
_WRAPPED_STEPS: dict[Callable, Callable] = {}


def te_importable() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available()


def _quantized_tensor_cls():
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

    return QuantizedTensor


# -- QuantizedTensor.untyped_storage (TE PR 2974) -------------------------------------------


def quantized_tensor_has_storage_fix() -> bool:
    return "untyped_storage" in vars(_quantized_tensor_cls())


def _empty_untyped_storage(self) -> torch.UntypedStorage:
    # The bytes live in the inner buffers; an empty storage never equals a real one, so FSDP2
    # re-records its sharded view after a load instead of dereferencing an invalid storage.
    return torch.UntypedStorage(0, device=self.device)


def ensure_quantized_tensor_storage() -> bool:
    """Give QuantizedTensor an empty `untyped_storage` when TE does not. True if patched."""
    if quantized_tensor_has_storage_fix():
        return _APPLIED.get("storage", False)
    _quantized_tensor_cls().untyped_storage = _empty_untyped_storage
    _APPLIED["storage"] = True
    return True


# -- FusedAdam and the FP8 transpose cache ---------------------------------------------------


def reset_fp8_weight_caches(optimizer: torch.optim.Optimizer) -> int:
    """Mark the cached FP8 transposes of the optimizer's delayed-scaling Float8Tensor params
    stale (what an in-place update must do); they are rebuilt from the new bytes when next
    used. Returns how many params were marked."""
    count = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            local = p._local_tensor if isinstance(p, DTensor) else p
            quantizer = getattr(local, "_quantizer", None)
            if type(quantizer).__name__ == "Float8Quantizer" and hasattr(local, "_reset_caches"):
                local._reset_caches()
                count += 1
    return count


def _step_before_wrapper(cls: type) -> Callable | None:
    """The step `wrap_step_resetting_fp8_caches` wrapped for `cls` (None: not wrapped)."""
    fn = cls.step
    while fn is not None:
        if fn in _WRAPPED_STEPS:
            return _WRAPPED_STEPS[fn]
        fn = getattr(fn, "__wrapped__", None)
    return None


def wrap_step_resetting_fp8_caches(cls: type) -> Callable:
    """Make `cls.step` mark the optimizer's FP8 params' cached transposes stale after every
    step (once: a second call finds the wrapper). Returns the step it wrapped. The wrapper is
    found by identity along the `__wrapped__` chain: torch.optim wraps `step` in its profiling
    hook on the first optimizer built (functools.wraps, which copies `__wrapped__` and any
    marker attribute), before or after this."""
    found = _step_before_wrapper(cls)
    if found is not None:
        return found
    original = cls.step

    @functools.wraps(original)  # keeps torch's `hooked` mark: no second profiling hook
    def step(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        reset_fp8_weight_caches(self)
        return out

    _WRAPPED_STEPS[step] = original
    cls.step = step
    return original


def ensure_fused_adam_fp8_cache_reset() -> bool:
    """Wrap FusedAdam.step so the FP8 params it rewrote in place drop their cached transposes.
    Applied whenever TE is present: seeing the gap takes an FP8 forward and backward under
    te.autocast (the backward builds the cache), too much global FP8 state for a start-up
    probe; tests/gpu/test_recipes_gpu.py runs exactly that with TE's own step
    (`unpatched_fused_adam_step`) and asserts the gap, so that test fails the day TE resets
    the cache itself. True if patched (now or before)."""
    from transformer_engine.pytorch.optimizers import FusedAdam

    wrap_step_resetting_fp8_caches(FusedAdam)
    return True


def unpatched_fused_adam_step() -> Callable | None:
    """TE's own FusedAdam.step, as it was before `ensure_fused_adam_fp8_cache_reset` (None
    before that)."""
    from transformer_engine.pytorch.optimizers import FusedAdam

    return _step_before_wrapper(FusedAdam)


# -- fsdp_post_all_gather with a DTensor `out` (TE PR 2713) ----------------------------------


def _subclasses(cls: type) -> list[type]:
    found, todo = [], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return found


def wrap_post_all_gather(fn):
    """fsdp_post_all_gather that (1) takes a DTensor `out` by handing `fn` its local tensor and
    (2) gives `fn` each gathered buffer in the shape of `out` when they hold the same number of
    elements: torch views the gathered buffers with dim-0 semantics, (world * rows, cols /
    world) for a weight FSDP shards along dim 1 (fc1 under TP), although the bytes already are
    the row-major full tensor (torch's chunk-cat); TE would otherwise give the parameter that
    shape from the second all-gather on. Other arguments pass unchanged, so the wrapper is a
    no-op wherever TE and torch handle the call themselves."""

    def post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        if isinstance(out, DTensor):
            out = out._local_tensor
        if out is not None:
            shape = out.shape
            all_gather_outputs = tuple(
                t.view(shape) if t.numel() == out.numel() and t.shape != shape else t
                for t in all_gather_outputs
            )
        return fn(self, all_gather_outputs, metadata, param_dtype, out=out)

    post_all_gather._compat_patched = True
    post_all_gather.__wrapped__ = fn
    return post_all_gather


def ensure_post_all_gather_dtensor_out() -> list[str]:
    """Wrap every quantized tensor class's fsdp_post_all_gather (wrap_post_all_gather).
    Returns the names of the classes wrapped now."""
    import transformer_engine.pytorch  # noqa: F401  (defines every quantized tensor class)

    patched = []
    for cls in _subclasses(_quantized_tensor_cls()):
        fn = vars(cls).get("fsdp_post_all_gather")
        if fn is None or getattr(fn, "_compat_patched", False):
            continue
        cls.fsdp_post_all_gather = wrap_post_all_gather(fn)
        patched.append(cls.__name__)
    return patched


# -- FSDP2's backward all-gather for a recomputed forward ---------------------------------

#: Set by parallel/ac.py on every module whose forward runs again in backward: a weakref to
#: the FSDP2 unit (the block) that owns its parameters.
RECOMPUTE_UNIT_ATTR = "_recompute_fsdp_unit"


def mark_recomputed(target, unit) -> None:
    """Mark `target` and its submodules as recomputed in backward inside FSDP2 unit `unit`.
    A weakref, set with object.__setattr__: a module attribute would register the unit as a
    child of its own submodule."""
    import weakref

    ref = weakref.ref(unit)
    for module in target.modules():
        object.__setattr__(module, RECOMPUTE_UNIT_ATTR, ref)


def recompute_param_group(module):
    """The FSDP2 parameter group about to be gathered for a backward that recomputes
    `module`'s forward, or None (not marked, not in backward, or not resharded: then TE's
    own choice already keeps both copies)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    ref = getattr(module, RECOMPUTE_UNIT_ATTR, None)
    unit = ref() if ref is not None else None
    if unit is None or not hasattr(unit, "_get_fsdp_state"):
        return None
    group = unit._get_fsdp_state()._fsdp_param_group
    if group is None or not getattr(group, "_reshard_after_forward", False):
        return None
    return group if group._training_state == TrainingState.PRE_BACKWARD else None


@contextmanager
def _kept_after_forward(group):
    """`group` reads as a unit that keeps its weights after forward, for the length of one
    call. torch 2.13 derives `_reshard_after_forward` from `post_forward_mesh_info` (a
    property); older releases store the flag itself."""
    if isinstance(getattr(type(group), "_reshard_after_forward", None), property):
        saved, group.post_forward_mesh_info = group.post_forward_mesh_info, None
        try:
            yield
        finally:
            group.post_forward_mesh_info = saved
    else:
        group._reshard_after_forward = False
        try:
            yield
        finally:
            group._reshard_after_forward = True


def wrap_pre_all_gather_for_recompute(fn):
    """fsdp_pre_all_gather that, for a module recomputed in backward, runs `fn` as if its
    unit kept its weights after forward: TE then asks for the rowwise copy (the recomputed
    forward's GEMMs) as well as the columnwise one (the backward's), exactly what it does for
    a unit that does not reshard. Float8Tensor and 128x128-block FP8 gather the same bytes
    either way (the transpose is made locally); MXFP8 gathers both copies. Memory: the rowwise
    copy of one unit's weights (plus the prefetched one) while it runs backward."""

    def pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        group = recompute_param_group(module)
        if group is None:
            return fn(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy)
        with _kept_after_forward(group):
            return fn(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy)

    pre_all_gather._compat_patched = True
    pre_all_gather.__wrapped__ = fn
    return pre_all_gather


def ensure_recompute_gathers_rowwise() -> list[str]:
    """Wrap every quantized tensor class's fsdp_pre_all_gather
    (wrap_pre_all_gather_for_recompute). Returns the names of the classes wrapped now."""
    import transformer_engine.pytorch  # noqa: F401  (defines every quantized tensor class)

    patched = []
    for cls in _subclasses(_quantized_tensor_cls()):
        fn = vars(cls).get("fsdp_pre_all_gather")
        if fn is None or getattr(fn, "_compat_patched", False):
            continue
        cls.fsdp_pre_all_gather = wrap_pre_all_gather_for_recompute(fn)
        patched.append(cls.__name__)
    return patched


def unpatched_pre_all_gather(cls: type):
    """`cls`'s fsdp_pre_all_gather as TE defines it (the gap's GPU test)."""
    fn = vars(cls)["fsdp_pre_all_gather"]
    return getattr(fn, "__wrapped__", fn)


# -- FP8 128x128 blocks sharded along dim 1 (compat/fsdp2.py) --------------------------------


def _block_layout(tensor) -> tuple[int, int]:
    # Float8BlockwiseQTensor with 128x128 blocks: rowwise scales (ceil(rows / 128), ceil(cols
    # / 128) padded to a multiple of 4), TE's Float8BlockQuantizer.get_scale_shape.
    return tensor._quantizer.block_len, 4


def ensure_dim1_block_gather() -> bool:
    """FP8 128x128-block weights sharded by FSDP2 along dim 1 (fc1 under TP)."""
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockwiseQTensor

    return enable_dim1_block_gather(Float8BlockwiseQTensor, _block_layout)
