"""Tensor parallel for the TE implementation (model/te_llama.py): DTensor weights on TE modules.

TE does the tensor-parallel math and communication inside each block (the model is built
with tp_group / tp_size / sequence_parallel, so QKV and fc1 are column-parallel, proj and fc2
row-parallel, and each module holds only its local shard). What TE 2.20.2 lacks is DTensor
parameters (TE PR 2713, `set_device_mesh`, is not merged): FSDP2 and DCP must see global
shapes. `set_te_device_mesh` wraps each local TE weight as a DTensor on the tp mesh with the
placements of parallel/tp.py (the same as the reference model's, so checkpoints are shared),
and installs `use_local_weights` so TE's forward receives the local tensor and its gradient
flows back into the DTensor parameter. Once TE has `set_device_mesh`, that module method is
used instead and only fc1's placement is corrected (see `set_te_device_mesh`).

Embedding and output head: DTensor (vocab-parallel, Shard(0)) with our own communication,
not TE. The embedding is a plain nn.Embedding (TE has no embedding module) and the head
must be able to reuse the embedding weight when tied, so both are sharded the same way by
the same code for both implementations; the logits are all-gathered into full logits.

Sequence parallel: TE runs the blocks on sequence shards in its "sbhd" layout. The embedding
output is reduce-scattered along the sequence (dim 1 of (B, S, D)), and the final norm's
output is all-gathered along the sequence before the head. Norm weights applied to sequence
shards (layer_norm_weight in the blocks, the final norm) get partial gradients on each rank;
Megatron all-reduces them separately, here their grad placement is Partial and FSDP2 reduces
them. Without sequence parallel TE all-reduces the norm's input gradient itself, so those
gradients are already complete (Replicate).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from parallel.tp import (
    FC1,
    _distribute_module_params,
    column_output_input,
    head_weight_local,
    local_to_dtensor_param,
    placement_for,
    use_local_weights,
    vocab_parallel_embedding,
)

SEQUENCE_DIM = 1  # of the (B, S, D) tensors outside the blocks


def set_te_device_mesh(
    module: nn.Module, prefix: str, tp_mesh, *, weight_mesh=None, sequence_parallel: bool
) -> None:
    """Makes the direct parameters of one TE module DTensors on `tp_mesh`. The one place that
    knows whether TE can do it itself."""
    if hasattr(module, "set_device_mesh"):
        module.set_device_mesh(tp_mesh=tp_mesh, weight_mesh=weight_mesh)
        # TE's own placement for fc1 is plain Shard(0), which would make the global layout of
        # [gate; up] depend on tp (docs/ARCHITECTURE.md, decision 1): re-describe the same local data.
        for name, p in list(module.named_parameters(recurse=False)):
            want = placement_for(f"{prefix}.{name}")
            if isinstance(p, DTensor) and want == FC1 and p.placements != (FC1,):
                module._parameters[name] = local_to_dtensor_param(p.to_local(), tp_mesh, FC1)
        return
    grad_placements = {}
    for name, p in list(module.named_parameters(recurse=False)):
        placement = placement_for(f"{prefix}.{name}")
        module._parameters[name] = local_to_dtensor_param(p, tp_mesh, placement)
        if sequence_parallel and placement == Replicate():
            grad_placements[name] = Partial()
    use_local_weights(module, grad_placements)


def apply_te_tp(model: nn.Module, tp_mesh, *, sequence_parallel: bool, weight_mesh=None) -> None:
    tp = tp_mesh.size()
    if getattr(model, "tp_size", 1) != tp:
        raise ValueError(
            f"TE model was built with tp_size={getattr(model, 'tp_size', 1)} but the "
            f"mesh has tp={tp}; pass tp_group=dims.tp_group to build_model"
        )
    # The model was built with the flag (ParallelDims.sequence_parallel); the hooks must agree.
    sp = bool(getattr(model, "sequence_parallel", False))
    if sp != sequence_parallel:
        raise ValueError(
            f"TE model sequence_parallel={sp} but parallel.sequence_parallel="
            f"{sequence_parallel}; build the model with the config's value"
        )
    group = tp_mesh.get_group()
    seq_dim = SEQUENCE_DIM if sp else None

    _distribute_module_params(model.embed, tp_mesh, "embed")
    vocab_parallel_embedding(model.embed, group, sequence_dim=seq_dim)
    use_local_weights(model.embed)

    for i, layer in enumerate(model.layers):
        for sub_name, sub in layer.named_modules():
            if next(sub.parameters(recurse=False), None) is None:
                continue
            prefix = f"layers.{i}.{sub_name}" if sub_name else f"layers.{i}"
            set_te_device_mesh(sub, prefix, tp_mesh, weight_mesh=weight_mesh, sequence_parallel=sp)

    _distribute_module_params(model.norm, tp_mesh, "norm")
    use_local_weights(model.norm, {"weight": Partial()} if sp else None)
    column_output_input(model.norm, group, sequence_dim=seq_dim)
    if model.lm_head is not None:
        _distribute_module_params(model.lm_head, tp_mesh, "lm_head")
    head_weight_local(model, group)
