"""Bytes that parameters occupy on this rank, seeing through DTensor and quantized tensors; the
start-up estimates of a run's memory on a GPU and of its cost on this CPU."""

from __future__ import annotations

import torch

from model.config import ModelConfig
from model.flops import causal_row_flops_per_token, parameter_count
from runtime import format_duration, host_memory_gib, matmul_rate


def tensor_bytes(t: torch.Tensor) -> int:
    """Storage bytes of a tensor, summing the inner tensors of wrapper subclasses (DTensor's
    local shard; TE QuantizedTensors' data, transposes and scales) via __tensor_flatten__."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(
            tensor_bytes(inner)
            for name in names
            if isinstance(inner := getattr(t, name), torch.Tensor)
        )
    return t.numel() * t.element_size()


def local_numel(t: torch.Tensor) -> int:
    local = getattr(t, "_local_tensor", t)
    return local.numel()


def parameter_storage(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes, elements) of the parameters held by this rank."""
    params = list(model.parameters())
    return sum(tensor_bytes(p.data) for p in params), sum(local_numel(p) for p in params)


GiB = 2**30


def estimate_gpu_memory(
    mcfg,
    *,
    seq_len: int,
    micro_batch: int,
    shards: int,
    tp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = False,
    activation_checkpointing: str = "none",
    quantized_weights: bool = False,
    accumulating: bool = False,
    grad_reduce_step: bool = False,
    reduce_bytes: int = 4,
    kept_blocks: int = 1,
    moment_bytes: int = 4,
) -> dict[str, float]:
    """Peak GPU memory of one rank in GiB, by part, before anything is built (the start-up
    estimate of train.py). `shards`: the ranks one weight is split over (dp_shard x cp x tp).

    Parts: `states` (fp32 parameters or FP8 ones with fp32 masters, Adam's two moments of
    `moment_bytes` each (optim.moment_dtype), and the fp32 gradient shards: half of them, which
    fill in as the backward frees activations, or, when `accumulating` micro batches, all of
    them from the first micro batch's backward on, while later micro batches hold their
    activations; with `grad_reduce_step` the gradients are instead accumulated unsharded, split
    only by tp, in the reduce dtype of `reduce_bytes` bytes, and sharded after the last micro
    batch); `activations` of the micro batch's seq_len / cp tokens per rank (per block and
    token, bf16: the block input, the norms' and projections' inputs and outputs, 2 x (6 dim + 2
    kv_dim + 3 ffn_dim) bytes, with the mode's recomputation: `selective` keeps all but the
    MLP's fc1 and SwiGLU outputs, `mlp` all but the MLP's, `full` the block inputs plus one
    block's in recompute; tensor parallelism divides the head and FFN parts, and with sequence
    parallelism the rest); `weights` (two gathered bf16 blocks and the gathered embedding and
    head) and `buffers` (the loss's logit chunks). `kept_blocks`: the blocks whose gathered
    weights stay from their forward to their backward and through a step's micro batches
    (ParallelConfig.blocks_kept_gathered; 1, the last, by default): FP8 bytes with quantized
    weights, else bf16. Measured against it on H200s (seq 8192; llama3_1b micro batch 4 on one
    GPU): none 56.1 GiB (estimate 55.8), selective 29.1 (33.3), full 22.1 (23.1);
    llama3_8b micro batch 1 on two, global batch 8 (accumulating): bf16 none 99.2 (98.6), fp8_cs
    with quantized_init none 100.5 (102.3), selective 81.0 (82.0), full 72.5 (71.4), bf16 full
    67.1 (67.7); at global batch 128 with grad_reduce=step, fp32 reduction: fp8_cs +
    quantized_init 115.4 (117.3), bf16 114.1 (113.6); with bf16 reduction, every block kept
    gathered and optim.moment_dtype=bf16: fp8_cs + quantized_init 92.6 (93.1), the same with
    selective recomputation 73.1 (72.7), bf16 97.4 (95.8); tests/test_model.py holds the table."""
    from model.flops import parameter_count

    params = parameter_count(mcfg)
    h, layers, ffn = mcfg.dim, mcfg.n_layers, mcfg.ffn_dim
    kv = mcfg.n_kv_heads * mcfg.head_dim
    weight_bytes = (1 + 4) if quantized_weights else 4  # FP8 weight + fp32 master, or fp32
    if accumulating and grad_reduce_step:
        grads = reduce_bytes * params / tp  # unsharded, in the reduce dtype
    else:
        grads = (4 if accumulating else 2) * params / shards  # fp32 shards (all, or half)
    states = (weight_bytes + 2 * moment_bytes) * params / shards + grads
    tokens = micro_batch * seq_len / cp
    replicated = 2 * 6 * h / (tp if sequence_parallel else 1)  # dim-sized activations
    mlp_out = 2 * 3 * ffn / tp  # fc1 output (gate, up) and SwiGLU output
    split = 2 * 2 * kv / tp + mlp_out
    block = replicated + split  # bytes per token of one block
    if activation_checkpointing == "full":
        activations = tokens * (layers * 2 * h + block)
    elif activation_checkpointing == "mlp":
        activations = tokens * (layers * (block - mlp_out - 2 * 2 * h) + block)
    elif activation_checkpointing == "selective":
        activations = tokens * (layers * (block - mlp_out) + mlp_out)
    else:
        activations = tokens * layers * block
    gathered_bytes = 1 if kept_blocks > 1 and quantized_weights else 2  # FP8 or bf16
    block_weights = gathered_bytes * (h * (h + 2 * kv) + h * h + 3 * h * ffn) / tp
    heads = 1 if mcfg.tie_embeddings else 2
    gathered_blocks = min(layers, kept_blocks + 1)  # the kept ones and the one in flight
    weights = gathered_blocks * block_weights + 2 * heads * mcfg.padded_vocab_size * h / tp
    buffers = 2 * 4 * 2**28  # fp32 logits of a loss chunk and their gradient
    parts = dict(states=states, activations=activations, weights=weights, buffers=buffers)
    out = {k: v / GiB for k, v in parts.items()}
    out["total"] = sum(out.values())
    return out


#: A training step of the reference implementation on CPU takes about this many times its
#: FLOPs at `matmul_rate` (norms, attention, the loss, the optimizer and framework overhead
#: around the matrix products, and matrices smaller than the probe's). Measured on 2 shared
#: cores, one thread, load 2.2-2.6: model=tiny 0.67 s a step against 0.45 s of its FLOPs at the
#: probe's 52 GFLOP/s (1.5x); model=small about a minute a step on 2 cores (docs/INSTALL.md)
#: against 22 s at a 2-thread probe's ~100 GFLOP/s (2.7x). Good to a factor of 2.
CPU_STEP_OVERHEAD = 2.0

#: More fp32 FLOP/s than one core of any current CPU gives (one core of the 2-core test
#: machine: about 52 G): a model whose step is quick even at this rate needs no measurement.
CPU_CORE_FLOPS_MAX = 200e9

#: Above this estimated time per step, a CPU run says at start what it will cost and the way out.
SLOW_CPU_STEP_S = 5.0


def cpu_run_estimate(
    m: ModelConfig, train, seq: int, world_size: int, rate: float | None = None
) -> dict[str, float]:
    """Time per step and memory of a CPU run of model `m` on `world_size` processes (`train`:
    the train section, config.TrainConfig, for its batch; `seq`: data.seq_len), before anything
    is built: `step_s` = the step's training FLOPs (model/flops.py) per process at this CPU's
    measured matmul rate x CPU_STEP_OVERHEAD; `memory_gib` per process = fp32 weights,
    gradients and Adam's two moments (16 bytes a parameter, divided among FSDP's shards) plus
    the micro batch's fp32 activations (the block's saved tensors, and the logits with their
    gradient) and torch's own ~0.5 GiB."""
    tokens = train.global_batch_size * seq / world_size
    micro = (train.micro_batch_size or train.global_batch_size // world_size) * seq
    rate = rate or matmul_rate()
    step_s = causal_row_flops_per_token(m, seq) * tokens / rate * CPU_STEP_OVERHEAD
    kv = m.n_kv_heads * m.head_dim
    block = 4 * (6 * m.dim + 2 * kv + 3 * m.ffn_dim + 2 * m.n_heads * seq)  # per token, fp32
    activations = micro * (m.n_layers * block + 2 * 4 * m.padded_vocab_size)
    states = 16 * parameter_count(m) / world_size
    memory = states + activations + 0.5 * 2**30
    return {"step_s": step_s, "memory_gib": memory / 2**30, "rate": rate}


def cpu_note(
    m: ModelConfig, train, seq: int, world_size: int, threads: int, rate: float | None = None
) -> str | None:
    """The start-up line of a CPU run (`cpu_run_estimate`'s arguments) whose steps
    `cpu_run_estimate` puts above SLOW_CPU_STEP_S: what a step and the whole run (train.steps)
    will cost here, and the way out. None for a run that is quick enough (model=tiny)."""
    tokens = train.global_batch_size * seq / world_size
    fastest = CPU_CORE_FLOPS_MAX * threads / CPU_STEP_OVERHEAD  # no need to measure below it
    if causal_row_flops_per_token(m, seq) * tokens / fastest < SLOW_CPU_STEP_S:
        return None
    est = cpu_run_estimate(m, train, seq, world_size, rate)
    if est["step_s"] < SLOW_CPU_STEP_S:
        return None
    have = host_memory_gib()
    fits = ""
    if have:
        fits = (
            f", {'more' if est['memory_gib'] > have else 'less'} than this machine's {have:.0f} GiB"
        )
    step = format_duration(est["step_s"])
    total = format_duration(est["step_s"] * train.steps)
    check = "" if train.dry_run else ", to check this config train.dry_run=true"
    return (
        f"note: model={m.name} on this CPU: about {step} a step of "
        f"{train.global_batch_size} x {seq} tokens ({train.steps} steps: "
        f"about {total}) and {est['memory_gib']:.1f} GiB of memory per process{fits} (estimate "
        f"at {threads} thread{'s' if threads > 1 else ''}, {est['rate'] / 1e9:.0f} GFLOP/s "
        f"measured now); for a CPU run use model=tiny{check}, to train it a GPU "
        "(docs/INSTALL.md)"
    )
