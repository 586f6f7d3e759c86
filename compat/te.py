"""TransformerEngine gaps this recipe works around, each applied only where TE still has it.

| gap | upstream | detect | fix | test |
| --- | --- | --- | --- | --- |
| QuantizedTensor has no `untyped_storage`: FSDP2's `reset_sharded_param` after a DCP load compares storages and dereferences an invalid one | TE PR 2974 (in 2.20) | the class defines `untyped_storage` | `ensure_quantized_tensor_storage` | tests/gpu/test_checkpoint_gpu.py::test_untyped_storage_fix_needed_for_fsdp2_load |
| FusedAdam's fused FP8 kernel (delayed-scaling Float8Tensor parameters, master weights) rewrites the FP8 bytes in place but leaves the cached FP8 transpose valid; on Hopper the next backward's dgrad GEMM reads the transpose of the previous step's weights, so training drifts and a resume (fresh transpose) is not bitwise | none found (TE 2.20.2) | `fused_adam_leaves_stale_fp8_transpose`: one FusedAdam step on a 32x32 Float8Tensor | `ensure_fused_adam_fp8_cache_reset` | tests/gpu/test_recipes_gpu.py::test_fused_adam_fp8_step_leaves_no_stale_transpose |
| FSDP2 x tensor parallel: from the second all-gather on, torch passes the unsharded parameter as `out=` to `fsdp_post_all_gather`, and for a TP weight that is a DTensor (`'DTensor' object has no attribute '_quantizer'`); for a weight FSDP shards along dim 1 (fc1 under TP) the gathered buffer arrives viewed as (world x rows, cols / world) | TE PR 2713 (DTensor weights, unmerged) | per call: the wrapper acts only on a DTensor `out` or a buffer whose shape disagrees with `out` | `ensure_post_all_gather_dtensor_out` (`wrap_post_all_gather`) | tests/test_compat_te.py |
| FSDP2 dim-1 sharding of FP8 128x128-block weights | see compat/fsdp2.py | compat/fsdp2.py | `ensure_dim1_block_gather` | tests/test_compat_fsdp2.py |

Detection is by what the installed TE does or defines, never by its version number or its
source text. A probe that cannot decide (an exception inside it) applies the fix: every fix
here is harmless where TE no longer needs it (marking a cache stale only costs recomputing it;
the wrapper passes through arguments TE handles). Nothing here imports TE at module level: CPU
runs never touch it. The gaps that belong to checkpointing (DelayedScaling `_extra_state`,
FusedAdam optimizer states before TE PR 2795) are handled in checkpoint/te_state.py.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch.distributed.tensor import DTensor

from compat.fsdp2 import enable_dim1_block_gather

log = logging.getLogger(__name__)

_APPLIED: dict[str, bool] = {}


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


def fused_adam_leaves_stale_fp8_transpose() -> bool:
    """One FusedAdam step (fp32 masters) on a 32x32 delayed-scaling Float8Tensor that carries
    its transpose: True when the transpose still claims to be valid but is not the transpose
    of the new bytes. False on GPUs without FP8 (no such weights exist there)."""
    import transformer_engine.pytorch as te
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.optimizers import FusedAdam
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer
    from transformer_engine.pytorch.utils import is_non_tn_fp8_gemm_supported

    if not te.is_fp8_available():
        return False
    device = torch.device("cuda")
    quantizer = Float8Quantizer(
        torch.ones(1, device=device),
        torch.zeros(1, device=device),
        tex.DType.kFloat8E4M3,
        rowwise=True,
        columnwise=True,
    )
    gen = torch.Generator(device=device).manual_seed(0)
    weight = torch.nn.Parameter(quantizer(torch.randn(32, 32, device=device, generator=gen)))
    # What a backward leaves behind on GPUs whose FP8 GEMMs need it: the cached transpose.
    weight.update_usage(rowwise_usage=True, columnwise_usage=True)
    if weight._transpose is None or weight._transpose_invalid:
        if not is_non_tn_fp8_gemm_supported():
            raise RuntimeError("the probe's Float8Tensor has no cached transpose")
        return False  # this GPU's FP8 GEMMs never read a cached transpose
    weight.grad = torch.randn(32, 32, device=device, generator=gen, dtype=weight.dtype)
    optimizer = FusedAdam([weight], lr=0.5, master_weights=True, master_weight_dtype=torch.float32)
    before = weight._data.clone()
    optimizer.step()
    if torch.equal(before, weight._data):
        raise RuntimeError("the probe's FusedAdam step left the FP8 bytes unchanged")
    transpose = weight._transpose
    if transpose is None or weight._transpose_invalid:
        return False
    return not torch.equal(transpose, weight._data.t().contiguous())


def ensure_fused_adam_fp8_cache_reset() -> bool:
    """Wrap FusedAdam.step so the FP8 params it rewrote in place drop their cached transposes,
    where the probe shows TE's step does not. True if patched."""
    if "fused_adam_fp8_cache" in _APPLIED:
        return _APPLIED["fused_adam_fp8_cache"]
    try:
        needed = fused_adam_leaves_stale_fp8_transpose()
    except Exception as e:  # an inconclusive probe applies the (harmless) fix
        log.warning("compat.te: FusedAdam FP8 probe failed (%s); applying the cache reset", e)
        needed = True
    if needed:
        from transformer_engine.pytorch.optimizers import FusedAdam

        original = FusedAdam.step

        def step(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            reset_fp8_weight_caches(self)
            return out

        step.__wrapped__ = original
        FusedAdam.step = step
    _APPLIED["fused_adam_fp8_cache"] = needed
    return needed


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


# -- FP8 128x128 blocks sharded along dim 1 (compat/fsdp2.py) --------------------------------


def _block_layout(tensor) -> tuple[int, int]:
    # Float8BlockwiseQTensor with 128x128 blocks: rowwise scales (ceil(rows / 128), ceil(cols
    # / 128) padded to a multiple of 4), TE's Float8BlockQuantizer.get_scale_shape.
    return tensor._quantizer.block_len, 4


def ensure_dim1_block_gather() -> bool:
    """FP8 128x128-block weights sharded by FSDP2 along dim 1 (fc1 under TP)."""
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockwiseQTensor

    return enable_dim1_block_gather(Float8BlockwiseQTensor, _block_layout)
