"""Train a Llama-style model with TransformerEngine (or the plain-PyTorch reference).

    python train.py                                   # tiny model, embedded corpus, CPU or 1 GPU
    python train.py --cfg job                         # print the composed config
    torchrun --nproc_per_node=8 train.py model=llama3_8b recipe=fp8_cs parallel=hsdp_tp \
        checkpoint=async data=hf data.path=HuggingFaceFW/fineweb-edu data.subset=sample-10BT

Setup runs in a fixed order; each step says why it sits where it does. Re-running the same
command resumes from the newest complete checkpoint in runs/<run.name>/. `train_step` is the
one training step; tests and tools call it too.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import AbstractContextManager, nullcontext

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

import compat
from checkpoint import CheckpointManager, TrainState, training_state
from checkpoint.preflight import prepare_run_dir
from config import Config, register_configs, validate, validate_batch
from data import build_loader, build_tokenizer
from errors import ConfigError
from logger import MetricsLogger
from model import build_model, init_weights, resolve_impl, te_available
from model.flops import flops_per_token, peak_tflops
from model.memory import parameter_storage
from optim import build_optimizer, build_scheduler, clip_grad_norm
from parallel import ParallelDims, parallelize
from profiling import StepProfiler
from recipes import Recipe, build_recipe, check_recipe, check_recipe_layout

register_configs()

#: Exit status after a checkpoint saved on a stop signal (Slurm's --signal or SIGTERM);
#: slurm/train.sbatch turns it into `scontrol requeue`.
EXIT_REQUEUE = 3


def check_config(cfg: Config, world_size: int, device: torch.device):
    """Everything that can be wrong with the config, checked before any expensive work."""
    validate(cfg)
    dims = ParallelDims(cfg.parallel, world_size)
    dims.validate_model(cfg.model)
    dims.validate_seq_len(cfg.data.seq_len)
    grad_accum = validate_batch(cfg, dims.dp_size)
    impl = resolve_impl(cfg.model.impl)
    if impl == "te" and not te_available():
        raise ConfigError(
            "model.impl=te needs a CUDA GPU and transformer_engine "
            "(pip install 'transformer-engine[pytorch]'); use model.impl=torch or auto"
        )
    check_recipe(cfg.recipe, impl, device)
    check_recipe_layout(cfg.recipe, cfg.model, world_size, dims.dp_shard, dims.tp)
    return dims, grad_accum, impl


def pick_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA GPU is visible; use train.device=auto")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def build_parallel_model(
    mcfg, impl: str, recipe: Recipe, dims: ParallelDims, device: torch.device, seed: int
):
    """Steps 3-5 of `run`. Returns the model and the amax-reduction group of its
    per-tensor-scaled weights (None: no reduction), for `Recipe.attach_optimizer`.

    3. Model on the meta device: no memory until the layout is known. The TE model gets the
       recipe (it is the one seam for precision).
    4. Parallelize from outside the model: TP first, then FSDP2 (order in parallel/).
    5. Materialize and initialize from the seed: same weights for every impl and layout.
       Quantized parameters are cast from those values afterwards, with per-tensor amax
       reduced over exactly the ranks that hold pieces of each weight (never dp_replicate).
    """
    te_kwargs = {}
    if impl == "te":
        te_kwargs = dict(
            recipe=recipe,
            tp_group=dims.tp_group,
            tp_size=dims.tp,
            sequence_parallel=dims.sequence_parallel,
        )
    with torch.device("meta"), recipe.quantized_init_context():
        model = build_model(mcfg, impl, **te_kwargs)
    model = parallelize(model, dims, dims.cfg, impl, mixed_precision=device.type == "cuda")
    model.to_empty(device=device)
    model.reset_buffers()
    init_weights(model, mcfg, seed)
    amax_group = recipe.prepare_weights(model, dims.weight_shard_group, dims.tp_group)
    return model, amax_group


def next_token_loss(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor):
    """Mean cross entropy of the next token over the labels that are not -100, computed by the
    model's head without materialising the logits (model/loss.py). The padding columns of the
    vocabulary are never targets and take no probability."""
    return model(inputs, labels=labels)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    grad_accum: int = 1,
    grad_clip: float = 0.0,
    scheduler=None,
    autocast: AbstractContextManager | None = None,
    loss_fn=next_token_loss,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on this rank's rows: forward and backward over `grad_accum` micro
    batches, clip, step, zero the gradients, advance the schedule. Returns (loss, grad_norm)
    as 0-d tensors on the device (no host sync): the loss is this rank's mean; the caller
    averages it over data-parallel ranks when it logs."""
    step_loss = torch.zeros((), device=inputs.device)
    for x, y in zip(inputs.chunk(grad_accum), labels.chunk(grad_accum)):
        with autocast if autocast is not None else nullcontext():
            loss = loss_fn(model, x, y)
        (loss / grad_accum).backward()
        step_loss += loss.detach() / grad_accum
    grad_norm = clip_grad_norm(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()
    return step_loss, grad_norm


class StopSignal:
    """Turns SIGUSR1 (Slurm's early warning) and SIGTERM (preemption) into a flag the loop
    checks at log steps (where it syncs anyway), so every rank stops after the same step and
    the checkpoint is written between steps, never inside one."""

    def __init__(self):
        self.received: int | None = None
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signum

    def agreed(self, device) -> bool:
        """All ranks stop at the same step if any rank got the signal."""
        flag = torch.tensor([float(self.received is not None)], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def run(cfg: Config) -> int:
    # Installed first so a stop signal during setup is not fatal; without checkpoints a stop
    # signal keeps its default meaning (terminate).
    stop = StopSignal() if cfg.checkpoint.mode != "none" else None
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = pick_device(cfg.train.device)

    # 1. Config check: one clear line for any bad input, before processes, GPUs or data.
    dims, grad_accum, impl = check_config(cfg, world_size, device)
    recipe = build_recipe(cfg.recipe, cfg.model.n_layers)
    tokenizer = build_tokenizer(cfg.data)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({tokenizer.vocab_size}); set model.vocab_size>={tokenizer.vocab_size}"
        )
    # The run directory: writable, room for a checkpoint, and locked by rank 0 (one run at a
    # time); checkpoint/preflight.py.
    run_dir, run_lock = prepare_run_dir(cfg, rank, world_size)

    # 2. Processes, mesh, and the fixes torch / TE need (compat/): the mesh object owns every
    #    process group; the fixes go in before anything builds a module.
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    dims.build_mesh(device.type)
    compat.apply_all()
    torch.manual_seed(cfg.train.seed + rank)  # per-rank stream; weights use their own seeds

    # 3-5. Model: meta build, parallelize, materialize, initialize, quantize.
    model, amax_group = build_parallel_model(cfg.model, impl, recipe, dims, device, cfg.train.seed)

    # 6. Optimizer and schedule (TE: FusedAdam; with quantized weights it keeps fp32 masters,
    #    seeded from the exact pre-quantization values).
    optimizer = build_optimizer(model, cfg.optim, impl, recipe.fused_adam_kwargs())
    recipe.attach_optimizer(model, optimizer, amax_group)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)

    # 7. Data: each data-parallel rank reads its rows of one global batch order.
    loader = build_loader(
        cfg.data,
        tokenizer,
        global_batch_size=cfg.train.global_batch_size,
        dp_rank=dims.dp_rank,
        dp_size=dims.dp_size,
    )

    # 8. Checkpoint resume, then the logger (it trims metrics to the resumed step and reuses
    #    the wandb id stored in the checkpoint).
    config_yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    train_state = TrainState(config_yaml=config_yaml)
    state = training_state(
        model, optimizer, scheduler, loader, train_state, te_recipe=recipe.te_recipe()
    )
    ckpt = CheckpointManager(
        cfg.checkpoint, run_dir, rank=rank, world_size=world_size, lock=run_lock
    )
    start_step = ckpt.resume(state)
    if rank == 0:
        (run_dir / "config.yaml").write_text(config_yaml)
    logger = MetricsLogger(
        cfg.logger,
        run_dir,
        rank=rank,
        run_name=cfg.run.name,
        config=OmegaConf.to_container(OmegaConf.structured(cfg)),
        tags=[cfg.model.name, cfg.recipe.name, cfg.parallel.name],
    )
    train_state.wandb_run_id = logger.start(start_step, train_state.wandb_run_id)
    n_params = sum(p.numel() for p in model.parameters())
    param_bytes, param_local_numel = parameter_storage(model)  # this rank's share, as stored
    logger.info(
        f"model {cfg.model.name} impl={impl} params={n_params / 1e6:.2f}M "
        f"param_mem={param_bytes / 2**30:.3f}GiB/rank recipe={recipe.name} "
        f"layout={cfg.parallel.name} {dims} device={device.type} grad_accum={grad_accum} "
        f"run_dir={run_dir}" + (f" resumed_from_step={start_step}" if start_step else "")
    )
    if start_step >= cfg.train.steps:
        logger.info(
            f"nothing to do: the checkpoint is at step {start_step} and train.steps="
            f"{cfg.train.steps}; raise train.steps to continue, or pass "
            "checkpoint.resume=none to start over"
        )

    # 9. Train.
    tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
    flops_tok = flops_per_token(cfg.model, cfg.data.seq_len)
    peak = cfg.train.peak_tflops or (
        peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    )
    # The compute dtype: bf16 on GPU (TE's quantized GEMMs come from the recipe, inside the
    # model); fp32 on CPU.
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None
    profiler = StepProfiler(cfg.train.profile_steps, run_dir, rank, device)
    t_last, step_last = time.perf_counter(), start_step
    model.train()
    for step in range(start_step + 1, cfg.train.steps + 1):
        profiler.begin(step)
        batch = loader.next_batch().to(device, non_blocking=True)
        loss, grad_norm = train_step(
            model,
            optimizer,
            batch[:, :-1],
            batch[:, 1:],
            grad_accum=grad_accum,
            grad_clip=cfg.optim.grad_clip,
            scheduler=scheduler,
            autocast=autocast,
        )
        train_state.step, train_state.tokens_seen = step, train_state.tokens_seen + tokens_per_step
        ckpt.observe_loss(step, loss)  # on device; checked before saves and at log steps
        if (trace := profiler.end(step)) is not None:
            logger.info(f"profile of steps {cfg.train.profile_steps} written to {trace}")

        stopping = False
        if step % cfg.train.log_every == 0 or step == cfg.train.steps:
            if dims.dp_group is not None:  # mean over data-parallel ranks (TP ranks agree)
                dist.all_reduce(loss, group=dims.dp_group)
                loss /= dims.dp_size
            # The one host sync per log step (loss and grad norm together); the clock is read
            # after it, so the interval covers the GPU work of its steps.
            loss_value, norm_value = torch.stack([loss.float(), grad_norm.float()]).tolist()
            now = time.perf_counter()
            tps = tokens_per_step * (step - step_last) / (now - t_last)
            logger.log(
                dict(
                    step=step,
                    loss=loss_value,
                    grad_norm=norm_value,
                    lr=scheduler.get_last_lr()[0],
                    tokens_seen=train_state.tokens_seen,
                    tokens_per_s=tps,
                    tokens_per_s_per_device=tps / world_size,
                    mfu=flops_tok * tps / world_size / (peak * 1e12) if peak else None,
                    mem_gb=peak_memory_gb(device),
                    param_bytes_per_param=param_bytes / param_local_numel,
                    **ckpt.stats(),
                )
            )
            ckpt.check_finite(step)  # a non-finite loss stops the run; nothing of it is saved
            t_last, step_last = time.perf_counter(), step
            # Checked where the loop syncs anyway: a stop lands within log_every steps.
            stopping = stop is not None and stop.agreed(device)

        ckpt.maybe_save(step, state, force=stopping)
        if stopping:
            logger.info(
                f"stop signal {stop.received}: checkpoint at step {step} saved; exiting "
                f"with status {EXIT_REQUEUE} for requeue"
            )
            ckpt.finish(step, state, save=False)
            logger.finish()
            return EXIT_REQUEUE
    ckpt.finish(cfg.train.steps, state)
    logger.finish()
    return 0


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(dcfg: DictConfig) -> None:
    try:
        cfg: Config = OmegaConf.to_object(dcfg)
        status = run(cfg)
    except ConfigError as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        status = 2
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(status)


if __name__ == "__main__":
    main()
