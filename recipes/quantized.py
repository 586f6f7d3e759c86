"""Quantized parameters (recipe.quantized_init) and their fp32 master weights in TE FusedAdam.

With quantized_init, TE modules built inside `te.quantized_model_init` keep only low-precision
weights (Float8Tensor, Float8BlockwiseQTensor, MXFP8Tensor, NVFP4Tensor), so FSDP2 all-gathers
1-byte (or 4-bit) data. The optimizer then owns the precision: FusedAdam(master_weights=True)
keeps an fp32 master per parameter, updates it, and re-quantizes the parameter from it after
each step (TE 2.20.2 optimizers/fused_adam.py:895-897, `param.quantize_(master)`).

TE's own flow (examples/pytorch/quantized_model_init/fully_shard.py) is: build on meta inside
quantized_model_init(preserve_high_precision_init_val=True), fully_shard, call each module's
reset_parameters() (which materializes, runs TE's init function and quantizes, keeping the
pre-quantization values on CPU behind `param.get_high_precision_init_val()`), then seed the
FusedAdam masters from those values with `initialize_state` + `set_scaled_state(param,
"master_param", value)` and release them with `param.clear_high_precision_init_val()`.

We keep that contract but not reset_parameters: our weights come from the seed (model/init.py)
and our mesh has no dim named "shard" (recipes/amax.py explains why that breaks TE's lookup).
So the trainer materializes and initializes plain weights as for any recipe, then
`quantize_weights` casts each TE weight with its module's weight quantizer (group from our
mesh), attaching the exact pre-quantization values the same way TE does, and
`seed_master_weights` moves them into FusedAdam. Without FusedAdam's masters seeded this way it
would initialize them by dequantizing the low-precision weights (fused_adam.py:477), losing
the seeded values' precision.

Checkpoint layout: parameter names do not change. Quantized weights are saved by DCP as TE
QuantizedTensor objects (their raw low-precision bytes and scales; TE 2.20 stages them to CPU
without dequantizing); the fp32 values that matter for resuming are the optimizer's
`master_param` states, saved as DTensors next to exp_avg / exp_avg_sq. After a load,
block-scaled weights are cast again from those masters (`requantize_from_masters`). Every TE module also
has a `<module>._extra_state` entry: an empty uint8 tensor for the stateless recipes (fp8_cs,
fp8_block, mxfp8, nvfp4) and pickled scale / amax history for fp8_delayed.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MethodType

import torch
from torch.distributed.tensor import DTensor

from recipes.amax import _reducing, local_tensor, tensor_uses_amax_reduction


def master_weight_kwargs(recipe) -> dict:
    """Keyword arguments for te.optimizers.FusedAdam (names as in TE 2.20.2 fused_adam.py).

    quantized_init: fp32 masters, kept whole (store_param_remainders only applies to bf16
    parameters and would change what seed_master_weights writes), not capturable (the
    post-step re-quantization of block-scaled weights cannot be captured in a CUDA graph).
    Otherwise: {} (parameters are stored in high precision and are their own masters).
    """
    if not recipe.quantized_init:
        return {}
    return {
        "master_weights": True,
        "master_weight_dtype": torch.float32,
        "store_param_remainders": False,
        "capturable": False,
    }


def _get_hp(tensor: torch.Tensor) -> torch.Tensor | None:
    return getattr(tensor, "_high_precision_init_val", None)


def _clear_hp(tensor: torch.Tensor) -> None:
    if hasattr(tensor, "_high_precision_init_val"):
        del tensor._high_precision_init_val


def attach_high_precision_init_val(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """TE's contract (module/base.py:94-112): attribute plus get/clear methods on the tensor."""
    tensor._high_precision_init_val = value
    tensor.get_high_precision_init_val = MethodType(_get_hp, tensor)
    tensor.clear_high_precision_init_val = MethodType(_clear_hp, tensor)


def _is_quantized(tensor: torch.Tensor) -> bool:
    # Duck-typed so this module imports without TE: TE's QuantizedTensor carries a quantizer.
    return hasattr(tensor, "_quantizer") and hasattr(tensor, "dequantize")


def _needs_columnwise_copy(quantizer) -> bool:
    """Whether the cast must also produce the columnwise (transposed) copy of a weight.

    TE derives it from the rowwise data when a GEMM needs it for per-tensor FP8 and for 2-D
    (128x128) FP8 blocks, but not for 1-D blocks (MXFP8, NVFP4, 1x128 FP8 blocks), whose scales
    run along the other axis. Storing only what cannot be derived keeps FP8 weights at one byte
    per parameter, which is also all that FSDP2 all-gathers for them.
    """
    kind = type(getattr(quantizer, "parent_quantizer", quantizer)).__name__
    if kind in ("Float8Quantizer", "Float8CurrentScalingQuantizer"):
        return False
    if kind == "Float8BlockQuantizer":
        return getattr(quantizer, "block_scaling_dim", 1) != 2
    return True


@torch.no_grad()
def quantize_weights(
    model: torch.nn.Module, amax_group=None, keep_high_precision: bool = True
) -> int:
    """Cast the materialized, initialized weights of TE modules built under quantized_init.

    For every parameter with an fp8_meta_index in a module whose `primary_weights_in_fp8` is set
    (bf16_layers and the head, built outside quantized_model_init, are skipped), quantizes the
    local tensor (the DTensor's local shard) with the module's weight quantizer, re-wraps it as
    a DTensor with the same mesh and placements, and swaps the parameter in (FSDP2 picks up the
    new parameter object at its lazy init, as it does after TE's reset_parameters). amax_group
    (dp_shard x tp) is applied to per-tensor quantizers before the cast and to the new tensor.
    The pre-quantization values go to CPU behind get_high_precision_init_val(). Returns the
    number of weights quantized. Call before building the optimizer.
    """
    count = 0
    for module in model.modules():
        if not getattr(module, "primary_weights_in_fp8", False):
            continue
        meta = module.param_init_meta
        fwd = module.quantizers["scaling_fwd"]
        for name, param in list(module.named_parameters(recurse=False)):
            index = getattr(meta.get(name), "fp8_meta_index", None)
            local = local_tensor(param)
            if index is None or _is_quantized(local):
                continue
            quantizer = fwd[index]
            quantizer.set_usage(rowwise=True, columnwise=_needs_columnwise_copy(quantizer))
            quantizer.internal = False
            reducing = _reducing(quantizer)
            if reducing is not None and amax_group is not None:
                reducing.with_amax_reduction = True
                reducing.amax_reduction_group = amax_group
            high_precision = local.detach().to("cpu", copy=True) if keep_high_precision else None
            new = quantizer(local.detach())
            if isinstance(param, DTensor):
                new = DTensor.from_local(
                    new,
                    device_mesh=param.device_mesh,
                    placements=param.placements,
                    shape=param.size(),
                    stride=param.stride(),
                )
            setattr(module, name, torch.nn.Parameter(new, requires_grad=param.requires_grad))
            # Wrapping (Parameter, DTensor.from_local) makes new tensor objects: tag the final one.
            final = local_tensor(getattr(module, name))
            if amax_group is not None and tensor_uses_amax_reduction(final):
                final.amax_reduction_group = amax_group
            if high_precision is not None:
                attach_high_precision_init_val(final, high_precision)
            count += 1
    return count


def seed_master_weights(
    optimizer,
    model: torch.nn.Module,
    value_fn: Callable[[str, torch.nn.Parameter], torch.Tensor] | None = None,
) -> int:
    """Set FusedAdam's fp32 master of each quantized parameter to its high-precision value, then
    release that value. Returns how many masters were set.

    value_fn(name, param) -> this rank's high-precision values of `param` (same shape as its
    local tensor); by default the values kept by quantize_weights or TE's reset_parameters
    (get_high_precision_init_val()). Parameters without such a value keep FusedAdam's default
    (initialized from the parameter at the first step). Call once, right after building the
    optimizer and before loading a checkpoint (a resume overwrites the masters anyway).
    """
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    # Build the state of EVERY parameter now, as FusedAdam would at its first step: loading a
    # checkpoint through DCP only fills the state entries an optimizer already has, so a
    # partly built state would silently drop the others' moments on resume.
    if optimizer.master_weights:
        for group in optimizer.param_groups:
            group.setdefault("step", 0)  # FusedAdam counts steps per group; 0 = none taken
            for p in group["params"]:
                if len(optimizer.state[p]) == 0:
                    optimizer.initialize_state(p, store_param_remainders=False)
    count = 0
    for name, param in model.named_parameters():
        local = local_tensor(param)
        getter = getattr(local, "get_high_precision_init_val", None)
        if value_fn is not None:
            value = value_fn(name, param) if _is_quantized(local) else None
        else:
            value = getter() if getter is not None else None
        if value is not None and id(param) in in_optimizer and optimizer.master_weights:
            optimizer.set_scaled_state(
                param, "master_param", value.to(device=local.device, dtype=torch.float32)
            )
            count += 1
        clear = getattr(local, "clear_high_precision_init_val", None)
        if clear is not None:
            clear()
    return count


def _is_block_scaled(tensor: torch.Tensor) -> bool:
    # FP8 blocks, MXFP8, NVFP4 keep row-wise scales; per-tensor FP8 (Float8Tensor) one scale.
    return _is_quantized(tensor) and hasattr(tensor, "_rowwise_scale_inv")


@torch.no_grad()
def requantize_from_masters(optimizer) -> int:
    """Rebuild each block-scaled quantized parameter from its fp32 master, as FusedAdam's step
    does for them (fused_adam.py:895-897, `quantize_(master)`), so the result is the bytes the
    uninterrupted run holds. Call after loading a checkpoint; returns how many were rebuilt.

    Their loaded bytes cannot be trusted: fc1 under TP is stored as two row blocks (checkpoint/
    planners.py) and TE dequantizes a partial slice of a block-scaled tensor, so that load lands in
    a temporary; a run resumed on another layout may also cut other blocks. Per-tensor FP8
    weights load their bytes exactly and are left alone (FusedAdam casts those in its fused
    kernel, which for delayed scaling also feeds the amax history).
    """
    if not getattr(optimizer, "master_weights", False):
        return 0
    count = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            local = local_tensor(param)
            if _is_block_scaled(local) and "master_param" in optimizer.state.get(param, {}):
                local.quantize_(optimizer.get_unscaled_state(param, "master_param"))
                count += 1
    return count
