"""Amax-reduction policy for weights of per-tensor-scaled recipes (fp8_cs, nvfp4).

Policy: a weight quantized with one per-tensor scale (FP8 current scaling; NVFP4's second-level
scale) reduces its amax over exactly the ranks that hold pieces of that weight: the flattened
dp_shard x tp group (`ParallelDims.weight_shard_group`), never dp_replicate (replicas hold the
same values; reducing over them only costs time). Then every FSDP shard of a weight, and every
TP slice, is cast with the scale that the full weight would get on one GPU, so an FSDP2
all-gather of FP8 shards equals the FP8 cast of the full weight, whatever the layout.

What TE 2.20.2 does by itself (read in the released wheel's sources):
- module/base.py:1853-1863, TransformerEngineBaseModule.reset_parameters: for a DTensor
  parameter whose quantizer is a Float8CurrentScalingQuantizer, NVFP4Quantizer or
  HybridQuantizer, sets `quantizer.amax_reduction_group` to
  `device_mesh.get_group(mesh_dim="shard")` when the parameter's mesh has more than one dim
  (else the whole mesh) and `quantizer.with_amax_reduction = True`. Our mesh names its dims
  dp_replicate / dp_shard / tp, so on HSDP or FSDP x TP meshes that lookup fails (there is no
  dim literally named "shard"), and on FSDP x TP it would leave tp out. recipes/quantized.py
  quantizes weights itself, with the group from our mesh, instead of calling reset_parameters.
- tensor/float8_tensor.py:968 (Float8Tensor.fsdp_pre_all_gather, current scaling only) and
  tensor/nvfp4_tensor.py:595 (NVFP4Tensor.fsdp_pre_all_gather): on every FSDP2 all-gather, set
  the *tensor's* `amax_reduction_group` (class attribute default None, float8_tensor.py:473,
  nvfp4_tensor.py:439) to `mesh.get_group()` of FSDP's 1-D shard mesh, i.e. dp_shard only.
- float8_tensor.py:300-304 (Float8CurrentScalingQuantizer.update_quantized), :1185
  (Float8Tensor._set_data) and nvfp4_tensor.py:217-221 (NVFP4Quantizer.update_quantized): an
  in-place re-quantization (FusedAdam's `param.quantize_(master)` after each step, `copy_` into
  a quantized parameter) uses the destination tensor's `amax_reduction_group` on a throwaway
  copy of the quantizer; quantized_tensor.py:443-447 strips the group from a new tensor's own
  quantizer, so the group lives on module quantizers and on tensors, never on `t._quantizer`.
- Module quantizers: `module.quantizers["scaling_fwd"]` (base.py:906), indexed by the
  parameter's `module.param_init_meta[name].fp8_meta_index` (module/_common.py:241). The
  quantizer classes that reduce amax carry `with_amax_reduction` and `amax_reduction_group`
  (float8_tensor.py:222/252-253, nvfp4_tensor.py:122/163-164); block-scaled quantizers have
  neither. A DebugQuantizer wraps the real one as `parent_quantizer` (module/_common.py:20-32).

Which group (`weight_amax_group`): with quantized_init the stored weights are sharded over
dp_shard x tp, so that is the group. Without it, FSDP2 all-gathers the high-precision weight over
dp_shard before the module's weight quantizer casts it at each forward, so only tp splits the
weight being cast: the tp group gives the same scale as one GPU, and adding dp_shard would only
add an all-reduce of identical values to every weight cast. A one-rank group means no reduction.

So `set_weight_amax_groups` must run (1) after quantized weights exist and before anything
re-quantizes them (our seeded init, a checkpoint load), and (2) before every optimizer step,
because each FSDP2 all-gather resets the tensors' group to dp_shard only, which drops tp. The
module weight quantizers (used at every forward when weights are not quantized_init) exist only
after the first forward under autocast unless the model was built with quantized_init:
`create_weight_quantizers` (Recipe.init_weight_quantizers, at start-up) makes them up front so
the group holds from step 1. The per-step call is a loop over the TE weights (attribute writes
only, no communication).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@dataclass
class WeightQuantizer:
    """One TE weight parameter, its module's weight quantizer, and its local tensor."""

    module_name: str
    param_name: str
    quantizer: object | None
    tensor: torch.Tensor

    @property
    def name(self) -> str:
        return f"{self.module_name}.{self.param_name}" if self.module_name else self.param_name


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    return param._local_tensor if isinstance(param, DTensor) else param


def _reducing(quantizer):
    """The quantizer that performs the cast if it supports amax reduction, else None."""
    target = getattr(quantizer, "parent_quantizer", quantizer)
    return target if target is not None and hasattr(target, "with_amax_reduction") else None


def weight_quantizers(model: torch.nn.Module) -> list[WeightQuantizer]:
    """Every TE weight parameter (those with an fp8_meta_index) with its weight quantizer.

    The quantizer is None while the module has not created its quantizers yet (a module built
    without quantized_init creates them at its first forward under autocast).
    """
    found = []
    for module_name, module in model.named_modules():
        meta = getattr(module, "param_init_meta", None)
        quantizers = getattr(module, "quantizers", None)
        if not isinstance(meta, dict) or not isinstance(quantizers, dict):
            continue
        fwd = quantizers.get("scaling_fwd") or []
        for param_name, param in module.named_parameters(recurse=False):
            index = getattr(meta.get(param_name), "fp8_meta_index", None)
            if index is None:
                continue
            quantizer = fwd[index] if index < len(fwd) else None
            found.append(WeightQuantizer(module_name, param_name, quantizer, local_tensor(param)))
    return found


def create_weight_quantizers(model: torch.nn.Module) -> int:
    """Inside an enabled te.autocast: give every TE module that owns quantizable weights its
    quantizers, through the call its forward makes first (`init_fp8_metadata`, with the GEMM
    count its forward passes: 2 for LayerNormMLP, else 1). Modules that have them are skipped.
    Returns how many modules were set up."""
    count = 0
    for module in model.modules():
        meta = getattr(module, "param_init_meta", None)
        init = getattr(module, "init_fp8_metadata", None)
        if not isinstance(meta, dict) or init is None or getattr(module, "fp8_initialized", False):
            continue
        if not any(getattr(m, "fp8_meta_index", None) is not None for m in meta.values()):
            continue
        num_gemms = getattr(module, "num_gemms", None)
        if not isinstance(num_gemms, int):
            num_gemms = 2 if type(module).__name__ == "LayerNormMLP" else 1
        init(num_gemms=num_gemms)
        count += 1
    return count


def tensor_uses_amax_reduction(tensor: torch.Tensor) -> bool:
    """A quantized weight whose in-place re-quantization honours a tensor-level group."""
    return (
        hasattr(type(tensor), "amax_reduction_group")
        and _reducing(getattr(tensor, "_quantizer", None)) is not None
    )


def set_weight_amax_groups(model: torch.nn.Module, group) -> int:
    """Point every per-tensor weight quantizer, and every such quantized weight, at `group`.

    group: the process group over dp_shard x tp (the mesh object owns it). Returns how many
    quantizers and tensors were set; block-scaled and bf16 weights are left alone.
    """
    count = 0
    for ref in weight_quantizers(model):
        target = _reducing(ref.quantizer)
        if target is not None:
            target.with_amax_reduction = group is not None
            target.amax_reduction_group = group
            count += 1
        if tensor_uses_amax_reduction(ref.tensor):
            ref.tensor.amax_reduction_group = group
            count += 1
    return count


def _group_size(group) -> int:
    return dist.get_world_size(group)


def weight_amax_group(recipe, weight_shard_group, tp_group):
    """The group the weight quantizers of `recipe` reduce amax over, or None for no reduction.

    weight_shard_group: the ranks holding pieces of one stored weight (dp_shard x tp);
    tp_group: the tensor-parallel group. Both come from the mesh object.
    """
    if not recipe.needs_weight_amax_group:
        return None
    group = weight_shard_group if recipe.quantized_init else tp_group
    if group is None or _group_size(group) == 1:
        return None
    return group
