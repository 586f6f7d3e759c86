"""Train a Llama-style model with TransformerEngine (or the plain-PyTorch reference).

    python train.py                                   # tiny model, embedded corpus, CPU or 1 GPU
    python train.py --cfg job                         # print the composed config
    python train.py -m optim.lr=1e-3,3e-3             # a sweep: one run directory per job
    torchrun --nproc_per_node=8 train.py model=llama3_8b recipe=fp8_cs parallel=hsdp_tp \
        checkpoint=async data=hf data.path=HuggingFaceFW/fineweb-edu data.subset=sample-10BT

Setup runs in a fixed order; each step says why it sits where it does. Re-running the same
command resumes from the newest complete checkpoint in runs/<run.name>/, after comparing its
config with the checkpoint's (config.check_resume). `train_step` is the one training step
and `evaluate` the held-out loss; tests and tools call them too, and `launch` runs this file
in a subprocess.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.fsdp import FSDPModule

import compat
import sweep
from checkpoint import CheckpointManager, TrainState, training_state
from checkpoint.hf import (
    from_rank0,
    hf_weight_files,
    load_hf_weights,
    read_hf_config,
    resolve_init_from,
)
from checkpoint.manager import resumes
from config import (
    Change,
    Config,
    check_experiment_overrides,
    check_resume,
    register_configs,
    validate,
    validate_batch,
)
from data import build_eval_batches, build_loader, build_tokenizer
from errors import ConfigError
from logger import MetricsLogger, check_logger_config, format_duration
from model import ModelConfig, build_model, init_weights, resolve_impl, te_available
from model.flops import flops_per_token, peak_tflops
from model.hf import model_config_for_hf
from model.memory import parameter_storage
from optim import apply_config, build_optimizer, build_scheduler, clip_grad_norm
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
    check_logger_config(cfg.logger)
    return dims, grad_accum, impl


def pick_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA GPU is visible; use train.device=auto")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def model_source(cfg: Config, run_dir: Path) -> tuple[ModelConfig, Path | None]:
    """Step 2 of `run`: the model config to build, and the Hugging Face folder to load its
    weights from (None: the seeded init).

    With model.init_from set, its config.json gives the shape (model=hf) or must agree with
    the model config (model/hf.py `model_config_for_hf`). Resume wins: when the run will load a
    checkpoint (checkpoint/manager.py `resumes`: checkpoint.resume is a path, or auto and the
    run's checkpoint directory holds a complete one) the HF weights are neither fetched nor
    loaded, only config.json is read; init_from is used when the run starts at step 0. Rank 0
    decides and fetches first; the others wait for it (checkpoint/hf.py)."""
    m = cfg.model
    if not m.init_from:
        if m.shape_from_hf:
            raise ConfigError(
                "model=hf takes the model shape from model.init_from; set "
                "model.init_from=<Hugging Face folder or hub name>"
            )
        return m, None
    resuming = from_rank0(lambda: resumes(cfg.checkpoint, run_dir))
    folder = resolve_init_from(m.init_from, weights=not resuming)
    mcfg = model_config_for_hf(m, read_hf_config(folder))
    if resuming:
        return mcfg, None
    hf_weight_files(folder)  # present before anything is built
    return mcfg, folder


def build_parallel_model(
    mcfg,
    impl: str,
    recipe: Recipe,
    dims: ParallelDims,
    device: torch.device,
    seed: int,
    init_from: Path | None = None,
):
    """Steps 5-7 of `run`. Returns the model and the amax-reduction group of its
    per-tensor-scaled weights (None: no reduction), for `Recipe.attach_optimizer`.

    5. Model on the meta device: no memory until the layout is known. The TE model gets the
       recipe (it is the one seam for precision).
    6. Parallelize from outside the model: TP first, then FSDP2 (order in parallel/).
    7. Materialize and initialize from the seed (same weights for every impl and layout), or
       load the Hugging Face weights of `init_from` (each rank reads the entries it holds).
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
    if init_from is not None:
        load_hf_weights(model, mcfg, init_from)
    else:
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


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: torch.Tensor,
    *,
    micro_batches: int = 1,
    autocast: AbstractContextManager | None = None,
    dp_group=None,
    loss_fn=next_token_loss,
) -> float:
    """Mean next-token loss over this rank's rows of the held-out `batches` (batches, rows,
    seq_len+1), forward only, `micro_batches` forwards per batch as in training and under
    the same autocast; averaged over the data-parallel ranks (equal rows everywhere, no
    masked labels, so the mean of means is the global mean)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for batch in batches:
        batch = batch.to(device, non_blocking=True)
        for rows in batch.chunk(micro_batches):
            with autocast if autocast is not None else nullcontext():
                total += loss_fn(model, rows[:, :-1], rows[:, 1:]).float()
    total /= len(batches) * micro_batches
    # Without a backward, FSDP2 units that keep their weights gathered after forward (the
    # root, the last block) would stay gathered: leave them sharded, as a training step does.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    if dp_group is not None:
        dist.all_reduce(total, group=dp_group)
        total /= dist.get_world_size(dp_group)
    model.train(was_training)
    return total.item()


def record_config(run_dir: Path, config_yaml: str, start_step: int, accepted: list[Change]):
    """<run_dir>/config.yaml is this segment's config; configs/segment-<start step>.yaml keeps
    every segment's (a fresh start moves an earlier timeline's configs/ aside, a second
    segment from the same step keeps the first one's file under another name: nothing is
    overwritten). Returns the segment file."""
    configs = run_dir / "configs"
    stamp = int(time.time())
    if start_step == 0 and configs.is_dir() and any(configs.iterdir()):
        configs.rename(run_dir / f"configs.{stamp}")
    configs.mkdir(exist_ok=True)
    header = f"# segment from step {start_step}, started {time.strftime('%Y-%m-%d %H:%M:%S')}"
    if accepted:
        header += "; accepted changes: " + "; ".join(map(str, accepted))
    segment = configs / f"segment-{start_step:07d}.yaml"
    if segment.exists():
        segment.rename(configs / f"segment-{start_step:07d}.{stamp}.yaml")
    segment.write_text(header + "\n" + config_yaml)
    (run_dir / "config.yaml").write_text(config_yaml)
    return segment


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

    # 1. Processes. The group comes before the config check because step 2 runs on rank 0
    #    first (a download) and decides the model shape the check needs.
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

    # 2. Model source: Hugging Face weights (model.init_from) unless the run resumes from a
    #    checkpoint; their config.json fills (model=hf) or checks the model config.
    run_dir = Path(cfg.run.root) / cfg.run.name
    cfg.model, hf_weights = model_source(cfg, run_dir)

    # 3. Config check: one clear line for any bad input, before GPU memory or data.
    dims, grad_accum, impl = check_config(cfg, world_size, device)
    recipe = build_recipe(cfg.recipe, cfg.model.n_layers)
    tokenizer = build_tokenizer(cfg.data)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({tokenizer.vocab_size}); set model.vocab_size>={tokenizer.vocab_size}"
        )

    # 4. Mesh, and the fixes torch / TE need (compat/): the mesh object owns every process
    #    group; the fixes go in before anything builds a module.
    dims.build_mesh(device.type)
    compat.apply_all()
    torch.manual_seed(cfg.train.seed + rank)  # per-rank stream; weights use their own seeds

    # 5-7. Model: meta build, parallelize, materialize, initialize (or load init_from), quantize.
    model, amax_group = build_parallel_model(
        cfg.model, impl, recipe, dims, device, cfg.train.seed, init_from=hf_weights
    )

    # 8. Optimizer and schedule (TE: FusedAdam; with quantized weights it keeps fp32 masters,
    #    seeded from the exact pre-quantization values).
    optimizer = build_optimizer(model, cfg.optim, impl, recipe.fused_adam_kwargs())
    recipe.attach_optimizer(model, optimizer, amax_group)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)

    # 9. Data: each data-parallel rank reads its rows of one global batch order. With
    #    evaluation on, the held-out documents (data.eval_fraction) leave the training data
    #    unless data.eval_split names a split of their own.
    say = print if rank == 0 else (lambda *a, **k: None)
    t_data = time.perf_counter()
    say(f"data: preparing data={cfg.data.name} (seq_len {cfg.data.seq_len})", flush=True)
    evaluating = cfg.eval.every > 0
    loader = build_loader(
        cfg.data,
        tokenizer,
        global_batch_size=cfg.train.global_batch_size,
        dp_rank=dims.dp_rank,
        dp_size=dims.dp_size,
        hold_out=evaluating and cfg.data.eval_split is None,
    )
    epoch = f"{loader.samples_per_epoch:,} samples per epoch" if loader.samples_per_epoch else ""
    eval_batches = None
    if evaluating:
        eval_batches = build_eval_batches(
            cfg.data,
            tokenizer,
            batches=cfg.eval.batches,
            global_batch_size=cfg.train.global_batch_size,
            dp_rank=dims.dp_rank,
            dp_size=dims.dp_size,
        )
        epoch += f"; eval: {cfg.eval.batches} held-out batches every {cfg.eval.every} steps"
    say(f"data: ready in {time.perf_counter() - t_data:.1f}s ({epoch or 'streaming'})", flush=True)

    # 10. Run directory, checkpoint resume, logger (in that order: the logger trims metrics
    #     to the resumed step and reuses the wandb id stored in the checkpoint).
    run_dir.mkdir(parents=True, exist_ok=True)
    #    The checkpoint's config is compared with this one as soon as it is read, before any
    #    other part loads and before anything in the run directory changes.
    config_yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    accepted: list[Change] = []

    def compare_config(loaded: TrainState) -> None:
        accepted[:] = check_resume(
            loaded.saved_config_yaml, config_yaml, cfg.resume.accept, loaded.step
        )

    train_state = TrainState(config_yaml=config_yaml, on_load=compare_config)
    state = training_state(
        model, optimizer, scheduler, loader, train_state, te_recipe=recipe.te_recipe()
    )
    ckpt = CheckpointManager(cfg.checkpoint, run_dir, rank=rank, world_size=world_size)
    start_step = ckpt.resume(state)
    if start_step:
        apply_config(optimizer, scheduler, cfg.optim)  # accepted optim changes take effect
    if rank == 0 and start_step < cfg.train.steps:  # a segment that trains: record it
        segment = record_config(run_dir, config_yaml, start_step, accepted)
        if accepted:
            print(
                f"config: resuming step {start_step} with accepted changes: "
                f"{'; '.join(map(str, accepted))} (recorded in {segment})",
                flush=True,
            )
    logger = MetricsLogger(
        cfg.logger,
        run_dir,
        rank=rank,
        run_name=cfg.run.name,
        config=OmegaConf.to_container(OmegaConf.structured(cfg)),
        tags=[cfg.model.name, cfg.recipe.name, cfg.parallel.name],
        total_steps=cfg.train.steps,
    )
    train_state.wandb_run_id = logger.start(start_step, train_state.wandb_run_id)
    n_params = sum(p.numel() for p in model.parameters())
    param_bytes, param_local_numel = parameter_storage(model)  # this rank's share, as stored
    logger.info(
        f"model {cfg.model.name} impl={impl} params={n_params / 1e6:.2f}M "
        f"param_mem={param_bytes / 2**30:.3f}GiB/rank recipe={recipe.name} "
        f"layout={cfg.parallel.name} {dims} device={device.type} grad_accum={grad_accum} "
        f"run_dir={run_dir}"
        + (f" init_from={cfg.model.init_from}" if hf_weights is not None else "")
        + (f" resumed_from_step={start_step}" if start_step else "")
    )
    if device.type == "cpu" and n_params > 20e6:  # measured: model=small, 2 cores, 5 GB RSS
        logger.info("note: slow on CPU (model=small: ~1 min/step on 2 cores; model=tiny: 0.25 s)")
    if start_step >= cfg.train.steps:
        logger.info(
            f"nothing to do: the checkpoint is at step {start_step} and train.steps="
            f"{cfg.train.steps}; raise train.steps to continue (README, Resume: keep the LR "
            "schedule with optim.schedule_steps, or stretch it with resume.accept=[train.steps]),"
            " or pass checkpoint.resume=none to start over"
        )

    # 11. Train.
    tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
    flops_tok = flops_per_token(cfg.model, cfg.data.seq_len)
    peak = cfg.train.peak_tflops or (
        peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    )
    # The compute dtype: bf16 on GPU (TE's quantized GEMMs come from the recipe, inside the
    # model); fp32 on CPU.
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None
    profiler = StepProfiler(cfg.train.profile_steps, run_dir, rank, device)
    t_start = t_last = time.perf_counter()
    step_last, eval_s, eval_total_s, eval_interval_s = start_step, 0.0, 0.0, 0.0
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
        if (trace := profiler.end(step)) is not None:
            logger.info(f"profile of steps {cfg.train.profile_steps} written to {trace}")

        stopping = False
        evaluating_now = eval_batches is not None and (
            step % cfg.eval.every == 0 or step == cfg.train.steps
        )
        val_loss = None
        if evaluating_now:
            t_eval = time.perf_counter()
            val_loss = evaluate(
                model,
                eval_batches,
                micro_batches=grad_accum,
                autocast=autocast,
                dp_group=dims.dp_group,
            )
            eval_s = time.perf_counter() - t_eval
            eval_total_s += eval_s
            eval_interval_s += eval_s
        if step % cfg.train.log_every == 0 or step == cfg.train.steps or evaluating_now:
            if dims.dp_group is not None:  # mean over data-parallel ranks (TP ranks agree)
                dist.all_reduce(loss, group=dims.dp_group)
                loss /= dims.dp_size
            # The one host sync per log step (loss and grad norm together); the clock is read
            # after it, so the interval covers the GPU work of its steps.
            loss_value, norm_value = torch.stack([loss.float(), grad_norm.float()]).tolist()
            now = time.perf_counter()
            # Step time without evaluations; the ETA adds the evaluations still to come.
            step_time = (now - t_last - eval_interval_s) / (step - step_last)
            train_s = now - t_start - eval_total_s
            evals_left = 0
            if eval_batches is not None:
                evals_left = cfg.train.steps // cfg.eval.every - step // cfg.eval.every
                evals_left += step < cfg.train.steps and cfg.train.steps % cfg.eval.every != 0
            eta = (cfg.train.steps - step) * train_s / (step - start_step) + evals_left * eval_s
            tps = tokens_per_step / step_time
            logger.log(
                dict(
                    step=step,
                    loss=loss_value,
                    val_loss=val_loss,
                    grad_norm=norm_value,
                    lr=scheduler.get_last_lr()[0],
                    tokens_seen=train_state.tokens_seen,
                    tokens_per_s=tps,
                    tokens_per_s_per_device=tps / world_size,
                    mfu=flops_tok * tps / world_size / (peak * 1e12) if peak else None,
                    mem_gb=peak_memory_gb(device),
                    param_bytes_per_param=param_bytes / param_local_numel,
                    step_time_s=step_time,
                    eta_s=eta,
                    eval_s=eval_s if evaluating_now else None,
                    **ckpt.stats(),
                )
            )
            t_last, step_last, eval_interval_s = time.perf_counter(), step, 0.0
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
    if start_step < cfg.train.steps:
        logger.info(
            f"done: step {cfg.train.steps} in {format_duration(time.perf_counter() - t_start)}"
        )
    return 0


def launch(
    overrides: list[str],
    *,
    nproc: int = 1,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess:
    """Run this file with the Hydra `overrides` in a new process from the repository root,
    under `torchrun --standalone --nproc_per_node=<nproc>` when nproc > 1; stdout and stderr
    are captured as text. `env` adds to (or replaces in) this process's environment. For
    commands and test harnesses that need whole runs, each in a fresh interpreter."""
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    here = Path(__file__).resolve()
    return subprocess.run(
        [*cmd, here.name, *overrides],
        cwd=here.parent,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


#: Exit status of each Hydra job this process ran (a multirun runs several, in order).
STATUSES: list[int] = []


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(dcfg: DictConfig) -> int:
    """One Hydra job. Returns its status (and records it in STATUSES) instead of exiting, so a
    multirun goes on to its next job; `cli` turns the statuses into the exit status."""
    rank0 = int(os.environ.get("RANK", 0)) == 0
    if EXIT_REQUEUE in STATUSES:  # a stop signal ended an earlier job of this sweep
        STATUSES.append(EXIT_REQUEUE)
        return EXIT_REQUEUE
    try:
        named = sweep.multirun_run_name(dcfg.run.name)
        if named is not None:
            dcfg.run.name, num = named
            if rank0:
                print(f"sweep job {num}: run.name={dcfg.run.name}", flush=True)
        cfg: Config = OmegaConf.to_object(dcfg)
        status = run(cfg)
    except ConfigError as e:
        if rank0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        status = 2
    STATUSES.append(status)
    return status


def exit_status(statuses: list[int]) -> int:
    """0 when every job succeeded; else the failing jobs' status when they agree, else 1."""
    failed = sorted({s for s in statuses if s != 0})
    return 0 if not failed else failed[0] if len(failed) == 1 else 1


def cli(argv: list[str]) -> int:
    """`python train.py [hydra flags] [overrides]`: checks `experiment=` against the presets
    before Hydra composes (the group is optional, so Hydra would run without a misspelled
    preset), runs the job(s) and returns the exit status (a multirun fails if any job did)."""
    rank0 = int(os.environ.get("RANK", 0)) == 0
    try:
        check_experiment_overrides(sweep.override_args(argv))
    except ConfigError as e:
        if rank0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    sys.argv = [sys.argv[0], *sweep.cli_args(argv)]
    try:
        main()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if len(STATUSES) > 1 and rank0:
        print(f"sweep: {len(STATUSES)} jobs, exit statuses {STATUSES}", flush=True)
    return exit_status(STATUSES)


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
