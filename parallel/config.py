"""Parallel layout config (the `parallel` group)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelConfig:
    #: ddp | fsdp | hsdp | tp | fsdp_tp | hsdp_tp
    name: str = "fsdp"
    #: HSDP/DDP replication degree (replicas of the sharded model, e.g. one per node). The
    #: product dp_replicate x dp_shard x cp x tp must equal the world size; -1: what is left.
    dp_replicate: int = 1
    #: FSDP sharding degree (parameters sharded over dp_shard x cp ranks); -1: what is left of
    #: the world size.
    dp_shard: int = -1
    #: Tensor-parallel degree (within a node); must divide n_heads, n_kv_heads and ffn_dim.
    tp: int = 1
    #: Context parallelism: each sequence is split over this many ranks (load-balanced for
    #: causal attention: 2 x cp chunks, rank r holds chunks r and 2cp-1-r; parallel/cp.py).
    #: Parameters are not split along cp; FSDP shards them over dp_shard x cp.
    cp: int = 1
    #: TE's context-parallel communication: p2p (ring of K/V exchanges overlapped with
    #: attention) | all_gather (K/V gathered before attention) | a2a (heads exchanged,
    #: Ulysses-style) | a2a+p2p (hierarchical). The reference model always all-gathers K/V.
    cp_comm_type: str = "p2p"
    #: a2a+p2p only: ranks of each inner all-to-all group (consecutive cp ranks, e.g. one
    #: node's GPUs); the cp / cp_a2a_size groups exchange K/V in a p2p ring between them.
    cp_a2a_size: int | None = None
    #: FSDP2: free the all-gathered weights after forward (re-gather in backward). false: every
    #: block keeps its gathered weights, and with gradient accumulation through all micro
    #: batches of a step (one all-gather per block a step).
    reshard_after_forward: bool = True
    #: FSDP2 with reshard_after_forward=true: the last N blocks keep their gathered weights
    #: from forward to backward anyway, and through all micro batches of a step (no
    #: all-gather of theirs after the first micro batch; N blocks' gathered weights more
    #: memory at the peak). 0: only the last block, whose backward follows its forward at
    #: once. A finer step between true and false.
    keep_gathered_blocks: int = 0
    #: FSDP2 mixed precision: dtype of the all-gathered params (bf16 | fp16 | fp32).
    param_dtype: str = "bf16"
    #: FSDP2 mixed precision: dtype of the gradient reduction (fp32 | bf16 | fp16; bf16 is
    #: faster and changes the numerics).
    reduce_dtype: str = "fp32"
    #: TE tensor parallel: sequence-parallel norms/activations between the TP regions.
    sequence_parallel: bool = True
    #: Recompute activations in backward (parallel/ac.py): none | full (whole blocks) | mlp
    #: (each block's MLP only, the larger share of its activations) | selective (the MLP's
    #: norm, fc1 and SwiGLU only, TE's LayerNormMLP checkpoint: the cheapest recompute).
    activation_checkpointing: str = "none"
    #: Apply activation_checkpointing to every N-th block only (1: all blocks).
    activation_checkpointing_every: int = 1
    #: With gradient accumulation, when FSDP2 reduces gradients: micro_batch (after every
    #: micro batch's backward: sharded gradients only, the least memory) | step (once, after
    #: the last micro batch: each rank sums its unsharded gradients locally first, one full
    #: gradient copy per rank in the reduce dtype, one reduce-scatter per step instead of one
    #: per micro batch). Reduction order only: the sums agree to rounding.
    grad_reduce: str = "micro_batch"
    #: NCCL's streams at high CUDA priority (TORCH_NCCL_HIGH_PRIORITY=1, set by train.py
    #: before it creates its process groups), so communication kernels are scheduled ahead
    #: of the compute kernels they overlap with. No effect on gloo (CPU).
    nccl_high_priority: bool = False
    #: Seconds a collective waits for the other ranks before it fails (every process group,
    #: the checkpoint's gloo groups too; torch's defaults: 600 for NCCL, 1800 for gloo). A
    #: node or rank that died leaves the others waiting this long at most; then each node
    #: says so in one line and its trainers exit (docs/SLURM.md, A node dies). Longer than
    #: any step, save or evaluation: a rank waits in a collective while the others finish
    #: theirs.
    collective_timeout_s: int = 600

    def blocks_kept_gathered(self, n_layers: int) -> int:
        """How many of the last blocks keep their gathered weights from forward to backward:
        all of them without reshard_after_forward, else keep_gathered_blocks and at least the
        last one (apply_fsdp and the start-up memory estimate both read it here)."""
        if not self.reshard_after_forward:
            return n_layers
        return min(n_layers, max(1, self.keep_gathered_blocks))
