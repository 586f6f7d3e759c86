"""parallelize(model, dims, pcfg, impl): apply a layout to a model built on the meta device.

Order (each step needs the previous one):

1. Tensor parallel (tp > 1). The reference model gets DTensor weights on the tp mesh plus
   forward hooks (parallel/tp.py); the TE model was constructed with tp_group/tp_size and
   its weights are wrapped as DTensors here (parallel/te_tp.py). Both give the same
   placements, so both save the same checkpoint. Must precede FSDP2: fully_shard reads the
   tp placements to shard further on the data-parallel dims.
2. Activation checkpointing (parallel/ac.py: none, full blocks or their MLPs, every N-th
   block), before fully_shard so the recomputed forward runs inside the block's FSDP unit.
3. FSDP2 units (parallel/fsdp.py): blocks, the untied embedding, the root, sharded over
   dp_shard x cp (TE's blocks get the cp group first: parallel/cp.py).

Amax-reduction groups of per-tensor-scaled weights are not set here: the quantized weights
exist only after materialization, so train.py hands `dims.weight_shard_group` (dp_shard x tp)
to the recipe (recipes/amax.py) after init and before each optimizer step.

Afterwards the caller materializes and initializes:
    model.to_empty(device=...); model.reset_buffers(); init_weights(model, cfg, seed)

Loss under TP: the model returns full logits as a plain tensor on every rank (the
vocab-parallel head output is all-gathered), so `F.cross_entropy(logits, labels)` is unchanged.
"""

from __future__ import annotations

from torch import nn

from parallel.ac import apply_activation_checkpointing
from parallel.config import ParallelConfig
from parallel.dims import ParallelDims
from parallel.fsdp import apply_fsdp


def _checkpoint_activations(model: nn.Module, pcfg: ParallelConfig, impl: str) -> None:
    apply_activation_checkpointing(
        model,
        pcfg.activation_checkpointing,
        pcfg.activation_checkpointing_every,
        impl=impl,
        recipe=getattr(model, "recipe", None),  # the TE model's precision recipe
    )


def parallelize(
    model: nn.Module, dims: ParallelDims, pcfg: ParallelConfig, impl: str, *, mixed_precision: bool
) -> nn.Module:
    if impl not in ("te", "torch"):
        raise ValueError(f"parallelize: impl must be resolved to 'te' or 'torch', got {impl!r}")
    if dims.mesh is None:
        # One process without a process group: nothing to shard or split.
        _checkpoint_activations(model, pcfg, impl)
        return model
    if dims.tp_enabled:
        if impl == "te":
            from parallel.te_tp import apply_te_tp

            apply_te_tp(
                model,
                dims.tp_mesh,
                sequence_parallel=dims.sequence_parallel,
                weight_mesh=dims.weight_shard_mesh,
            )
        else:
            from parallel.tp import apply_reference_tp

            apply_reference_tp(model, dims.tp_mesh)
    if dims.cp > 1 and impl == "te":
        # TE exchanges K/V over the cp group inside its attention; the reference model does
        # it in its own forward from the batch's parallel.cp.ContextShard.
        from parallel.cp import apply_te_cp

        apply_te_cp(model, dims, pcfg.cp_comm_type, pcfg.cp_a2a_size)
    _checkpoint_activations(model, pcfg, impl)
    apply_fsdp(model, dims, pcfg, mixed_precision=mixed_precision)
    return model
