"""FSDP2 (fully_shard) units for both Llama implementations.

Units, innermost first (fully_shard must be applied bottom-up):

    layers.<i>                 one unit per transformer block
    embed                      its own unit, only when the output head is untied
    root                       norm, lm_head, and embed when tied

Why the embedding and the head sit in the root when tied: the head weight *is*
embed.weight, read by the root's forward after the blocks. A separate embed unit would
reshard that weight right after the embedding lookup, and the head would then see a shard.
The root unit stays gathered for the whole forward. The untied head is in the root too
because the reference model reads `lm_head.weight` in its own forward instead of calling the
module, so a separate lm_head unit would never be gathered by a forward hook.

Mesh: 1-D ("dp_shard",) gives FSDP; 2-D ("dp_replicate", "dp_shard") gives HSDP, and with
dp_shard == 1 plain replication (DDP: all-reduce, every rank holds full weights). Parameters
that tensor parallelism already made DTensors on the tp mesh are sharded further by FSDP2
on the same root mesh (2-D FSDP x TP; strided when both shard dim 0). Exception: fc1 under
TP is sharded by FSDP along dim 1 (parallel/tp.py `fsdp_shard_placement` says why).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from parallel.config import ParallelConfig
from parallel.dims import ParallelDims, dtype_of
from parallel.tp import fsdp_shard_placement


def mp_policy(pcfg: ParallelConfig, mixed_precision: bool) -> MixedPrecisionPolicy:
    if not mixed_precision:
        # Parameters are fp32 (CPU runs): gather and reduce them as they are.
        return MixedPrecisionPolicy()
    # cast_forward_inputs=False: FSDP2 would otherwise cast every floating-point argument of a
    # unit's forward to param_dtype, and the blocks are handed the RoPE angles (fp32, up to
    # max_seq_len x head_dim). In bf16 an angle near position p is off by up to p / 512
    # radians (a random rotation beyond a few hundred positions for the fast frequencies), and
    # TE's fused RoPE copies the bf16 table back to fp32 and keeps that copy for backward (4
    # GiB a step at llama3_8b). The blocks' hidden states are bf16 without the cast: they come
    # from the embedding, whose gathered weight is param_dtype.
    return MixedPrecisionPolicy(
        param_dtype=dtype_of(pcfg.param_dtype, "param_dtype"),
        reduce_dtype=dtype_of(pcfg.reduce_dtype, "reduce_dtype"),
        cast_forward_inputs=False,
    )


def gathered_units(model: nn.Module, pcfg: ParallelConfig) -> list[nn.Module]:
    """The FSDP2 units whose gathered weights are kept from forward to backward: the root
    (needed again right at the start of backward), the untied embedding without
    reshard_after_forward, and the last ParallelConfig.blocks_kept_gathered blocks (the last
    block's backward follows its forward at once). With gradient accumulation they stay
    gathered through all micro batches of a step (steps.train_step): the weights do not change
    until the optimizer step, and they are all gathered at the end of each forward anyway."""
    blocks = list(model.layers)
    units = blocks[len(blocks) - pcfg.blocks_kept_gathered(len(blocks)) :]
    if getattr(model, "lm_head", None) is not None and not pcfg.reshard_after_forward:
        units.append(model.embed)
    return [*units, model]


def apply_fsdp(
    model: nn.Module, dims: ParallelDims, pcfg: ParallelConfig, *, mixed_precision: bool
) -> nn.Module:
    mesh = dims.fsdp_mesh
    policy = mp_policy(pcfg, mixed_precision)
    common = {"mesh": mesh, "mp_policy": policy}
    if dims.tp_enabled:
        common["shard_placement_fn"] = fsdp_shard_placement
    kept = gathered_units(model, pcfg)

    def reshard(unit: nn.Module) -> bool:
        return not any(unit is k for k in kept)

    for block in model.layers:
        fully_shard(block, reshard_after_forward=reshard(block), **common)
    if getattr(model, "lm_head", None) is not None:
        fully_shard(model.embed, reshard_after_forward=reshard(model.embed), **common)
    fully_shard(model, reshard_after_forward=False, **common)
    return model
