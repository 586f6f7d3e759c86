"""Train a Llama-style model with TransformerEngine (or the plain-PyTorch reference).

    python train.py                                   # tiny model, embedded corpus, CPU or 1 GPU
    python train.py --cfg job                         # print the composed config
    python train.py -m optim.lr=1e-3,3e-3             # a sweep: one run directory per job
    torchrun --nproc_per_node=8 train.py model=llama3_8b recipe=fp8_cs parallel=hsdp_tp \
        checkpoint=async data=hf data.path=HuggingFaceFW/fineweb-edu data.subset=sample-10BT

Setup runs in a fixed order; each step says why it sits where it does. Re-running the same
command resumes from the newest complete checkpoint in runs/<run.name>/, after comparing its
config with the checkpoint's (config.SegmentConfig). One training step is steps.train_step,
the held-out loss steps.evaluate; tests and tools call them too (runtime.launch runs this file
in a subprocess).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import gc
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.distributed as dist
import yaml
from omegaconf import DictConfig, OmegaConf

import compat
import sweep
from checkpoint import CheckpointManager, TrainState, store, training_state
from checkpoint.hf import load_hf_weights, model_source
from checkpoint.manager import (
    checkpoint_root,
    close_open,
)
from checkpoint.preflight import (
    check_locks,
    check_run_dir,
    estimate_checkpoint_bytes,
    prepare_run_dir,
    remove_created,
)
from config import (
    Config,
    SegmentConfig,
    check_experiment_overrides,
    config_changes,
    config_warnings,
    register_configs,
    validate,
    validate_batch,
    validate_tp_split,
)
from data import build_data, build_tokenizer, vocabulary_line
from data.sources import check_source, corpus_fingerprint
from divergence import Divergence
from errors import ConfigError
from logger import MetricsLogger, StepClock, check_logger_config
from model import build_model, init_weights, resolve_impl, te_available
from model.config import block_weight_shapes
from model.flops import peak_tflops, step_flops
from model.memory import cpu_note, estimate_gpu_memory, parameter_storage
from optim import apply_config, build_optimizer, build_scheduler
from overrides import check_flags, check_overrides
from parallel import ParallelDims, parallelize
from parallel.cp import check_cp, token_align
from parallel.dims import DTYPES
from parallel.fsdp import gathered_units
from profiling import StepProfiler
from recipes import (
    Recipe,
    apply_attention_environment,
    attention_environment,
    build_recipe,
    check_bf16_layers,
    check_fp8_attention,
    check_recipe,
    check_recipe_layout,
)
from recipes.switch import label, recipe_for_step, resolve_switches
from runlog import read_metrics
from runtime import (
    EXIT_INTERRUPTED,
    EXIT_REQUEUE,
    GcSchedule,
    StopSignal,
    allocator_retries,
    apply_cpu_threads,
    apply_determinism,
    apply_nccl_priority,
    check_determinism,
    collective_timeout,
    deterministic_env,
    end_process_group,
    exit_status,
    format_duration,
    launcher_pid,
    lost_peer_line,
    out_of_memory_line,
    peak_memory_gb,
    pick_device,
    pin_cpu_arithmetic,
    register_stack_dump,
    report_error,
    to_device,
)
from steps import BatchLayout, evaluate, train_step

register_configs()


def check_config(cfg: Config, world_size: int, device: torch.device):
    """Everything that can be wrong with the config, checked before any expensive work."""
    validate(cfg)
    # FP8 attention under fp8_cs / mxfp8 / nvfp4: TE reads its attention recipe from NVTE_DPA_*
    # variables once, when its attention modules are imported, so they are set here, before
    # anything imports TE (resolve_impl below is the first); recipes/attention.py.
    recipes_of_run = run_recipes(cfg)
    apply_attention_environment(recipes_of_run)
    check_source(cfg.data)  # data=hf: the local path exists (the tokenizer comes next)
    dims = ParallelDims(cfg.parallel, world_size)
    validate_tp_split(cfg.model, dims.tp)
    dims.validate_seq_len(cfg.data.seq_len)
    grad_accum = validate_batch(cfg, dims.dp_size)
    impl = resolve_impl(cfg.model.impl)
    if impl == "te" and not te_available():
        raise ConfigError(
            "model.impl=te needs a CUDA GPU and transformer_engine "
            "(pip install 'transformer-engine[pytorch]'); use model.impl=torch or auto"
        )
    if cfg.optim.moment_dtype != "fp32" and impl != "te":
        raise ConfigError(
            f"optim.moment_dtype={cfg.optim.moment_dtype} needs TE's FusedAdam (model.impl=te); "
            "the reference implementation's torch AdamW keeps fp32 moments: set it to fp32"
        )
    p = cfg.parallel
    check_cp(dims.cp, dims.tp, p.cp_comm_type, impl, cfg.model, p.cp_a2a_size)
    check_determinism(cfg.train.deterministic, impl, cfg.data.document_mask, device)
    # Every recipe of the run: the first, and each one `recipe.switch` changes to.
    for i, rcfg in enumerate(recipes_of_run):
        try:
            check_recipe(rcfg, impl, device)
            check_fp8_attention(rcfg, cfg.model, cfg.data, cfg.train.deterministic, device)
            # FSDP shards each weight over dp_shard x cp.
            shapes = block_weight_shapes(cfg.model)
            check_recipe_layout(rcfg, shapes, world_size, dims.dp_shard * dims.cp, dims.tp)
            check_bf16_layers(rcfg, cfg.model.n_layers)
        except ConfigError as e:
            if i == 0:
                raise
            raise ConfigError(f"recipe.switch[{i - 1}] (to {label(rcfg)}): {e}") from None
    check_logger_config(cfg.logger)
    return dims, grad_accum, impl


def memory_estimate_line(cfg: Config, dims: ParallelDims, grad_accum: int, device) -> str:
    """The start-up estimate of a GPU's peak memory (model/memory.py), against the GPU's."""
    p = cfg.parallel
    est = estimate_gpu_memory(
        cfg.model,
        seq_len=cfg.data.seq_len,
        micro_batch=cfg.train.global_batch_size // dims.dp_size // grad_accum,
        shards=dims.dp_shard * dims.cp * dims.tp,
        tp=dims.tp,
        cp=dims.cp,
        sequence_parallel=dims.sequence_parallel,
        activation_checkpointing=p.activation_checkpointing,
        quantized_weights=cfg.recipe.quantized_init,
        accumulating=grad_accum > 1,
        grad_reduce_step=p.grad_reduce == "step",
        reduce_bytes=DTYPES[p.reduce_dtype].itemsize,
        kept_blocks=p.blocks_kept_gathered(cfg.model.n_layers),
        moment_bytes=DTYPES[cfg.optim.moment_dtype].itemsize,
    )
    parts = ", ".join(f"{k} {v:.1f}" for k, v in est.items() if k != "total")
    line = f"memory: about {est['total']:.1f} GiB per GPU ({parts})"
    if device is None or torch.device(device).type != "cuda":
        return line + " (estimate for a GPU; no GPU here)"
    have = torch.cuda.get_device_properties(device).total_memory / 2**30
    line += f" of {have:.0f} GiB"
    if est["total"] > have:
        line += (
            "; likely more than the GPU has: raise parallel.cp or parallel.dp_shard, lower "
            "train.micro_batch_size, or recompute more (parallel.activation_checkpointing)"
        )
    return line


def schedule_steps(cfg: Config) -> int:
    return cfg.optim.schedule_steps or cfg.train.steps


def run_recipes(cfg: Config) -> list:
    """Every recipe config of the run: the first, and each one `recipe.switch` changes to."""
    return [cfg.recipe, *(s.recipe for s in resolve_switches(cfg.recipe, schedule_steps(cfg)))]


def build_training(cfg: Config, rcfg, impl: str, dims: ParallelDims, device, init_from=None):
    """Steps 5-8 of `run` for the recipe config `rcfg`: (recipe, model, optimizer, schedule).
    A recipe switch calls it again (then loads the switch step's checkpoint)."""
    recipe = build_recipe(rcfg, cfg.model.n_layers)
    model, amax_group = build_parallel_model(
        cfg.model, impl, recipe, dims, device, cfg.train.seed, init_from=init_from
    )
    # 8. Optimizer and schedule (TE: FusedAdam; with quantized weights it keeps fp32 masters,
    #    seeded from the exact pre-quantization values).
    optimizer = build_optimizer(model, cfg.optim, impl, recipe.fused_adam_kwargs())
    recipe.attach_optimizer(model, optimizer, amax_group)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    return recipe, model, optimizer, scheduler


def checkpointed_state(model, optimizer, scheduler, loader, train_state, recipe, log):
    """What a checkpoint holds (checkpoint/state.py), under this recipe."""
    return training_state(
        model,
        optimizer,
        scheduler,
        loader,
        train_state,
        te_recipe=recipe.te_recipe(),
        recipe=recipe,
        log=log,
    )


def switch_recipe(cfg: Config, rcfg, step: int, impl, dims, device, ckpt, loader, train_state, say):
    """The recipe switch after `step` (docs/RECIPE_SWITCH.md), once the caller dropped the old
    model and optimizer: the new recipe's model, optimizer and schedule are built and load the
    checkpoint of `step`, as a run resumed from it would (the same code: the run goes on exactly
    as that resumed run)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    recipe, model, optimizer, scheduler = build_training(cfg, rcfg, impl, dims, device)
    state = checkpointed_state(model, optimizer, scheduler, loader, train_state, recipe, say)
    ckpt.reload(step, state)
    apply_config(optimizer, scheduler, cfg.optim)
    model.train()
    return recipe, model, optimizer, scheduler, state


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
    model = meta_parallel_model(mcfg, impl, recipe, dims, device)
    model.to_empty(device=device)
    model.reset_buffers()
    if init_from is not None:
        load_hf_weights(model, mcfg, init_from)
    else:
        init_weights(model, mcfg, seed)
    amax_group = recipe.prepare_weights(model, dims.weight_shard_group, dims.tp_group)
    return model, amax_group


def meta_parallel_model(mcfg, impl: str, recipe: Recipe, dims: ParallelDims, device):
    """Steps 5-6 of `run`: the model built on the meta device and parallelized (no memory
    yet); the dry run stops here."""
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
    return parallelize(model, dims, dims.cfg, impl, mixed_precision=device.type == "cuda")


def resume_plan(cfg: Config, run_dir: Path, segment: SegmentConfig, rank: int, world_size: int):
    """(line, step): what a start of this config would do about the run's checkpoints: the
    decision of `CheckpointManager.plan_resume` itself, made by a reading manager (mode none:
    nothing is moved, locked or loaded; the data files are not hashed). A refusal is the
    ConfigError a real start raises, on every rank. Call on every rank."""
    accepted = []

    def check(saved_yaml: str, step: int) -> None:
        accepted[:] = segment.check(saved_yaml, step)

    reader = CheckpointManager(
        dataclasses.replace(cfg.checkpoint, mode="none"),
        run_dir,
        rank=rank,
        world_size=world_size,
        corpus=corpus_fingerprint(cfg.data) if rank == 0 else None,
    )
    try:
        step = reader.plan_resume(
            segment.yaml, check=check, accept_corpus=segment.accepts("data.corpus")
        )
        path = reader.planned_path
    finally:
        reader.close()
    if path is None:
        if str(cfg.checkpoint.resume) == "none":
            moved = (
                " (its checkpoints would be moved aside)" if store.newest_step(reader.root) else ""
            )
            return f"resume: checkpoint.resume=none: starts fresh at step 0 in {run_dir}{moved}", 0
        state = "exists" if run_dir.is_dir() else "would be created"
        line = f"resume: no checkpoint in {reader.root}; starts fresh at step 0 ({run_dir} {state})"
        return line, 0
    line = f"resume: from {path} (step {step})"
    if accepted:
        line += f" with accepted changes: {'; '.join(map(str, accepted))}"
    if step >= cfg.train.steps:
        line += f"; nothing to train: train.steps={cfg.train.steps}"
    return line, step


def run_dir_args(cfg: Config) -> tuple:
    """What checkpoint/preflight.py checks the run directory with: run.root, run.name, the
    checkpoint and model sections, recipe.quantized_init (the checkpoints' size)."""
    return cfg.run.root, cfg.run.name, cfg.checkpoint, cfg.model, cfg.recipe.quantized_init


def nothing_to_do(run_dir: Path, step: int, steps: int) -> str:
    return (
        f"nothing to do: {run_dir} is at step {step} and train.steps={steps}; to train "
        f"further, extend this run with train.steps=N resume.accept=[train.steps] (N > {step}), "
        "or start a separate run with run.name=NAME"
    )


#: What a dry run leaves to the real start (it reads nothing and leaves nothing written).
DRY_RUN_UNCHECKED = (
    "not checked: the data itself (files read, tokenized, cached), the model's real memory and "
    "speed (built on the meta device only), a checkpoint-sized write (the directories are "
    "checked by an empty probe, removed again, and by free space), communication between "
    "processes"
)


def dry_run(cfg: Config, dims, grad_accum, impl, device, run_dir: Path, tokenizer, say):
    """`train.dry_run=true`: every check `run` makes before training (the run directory's
    permissions and free space, the run lock, the resume decision: the same refusals), then a
    summary and what was not checked; returns the exit status (0). Nothing is written and no
    data is read."""
    run_dir, run_dir_line = check_run_dir(*run_dir_args(cfg), dims.world_size)
    lock_line = check_locks(cfg.checkpoint, run_dir) if dims_rank() == 0 else None
    segment = SegmentConfig(OmegaConf.to_yaml(OmegaConf.structured(cfg)), cfg.resume.accept)
    plan, step = resume_plan(cfg, run_dir, segment, dims_rank(), dims.world_size)
    _say_cpu_cost(cfg, dims.world_size, device, say)
    rcfg = recipe_for_step(cfg.recipe, step + 1, schedule_steps(cfg))  # recipe.switch
    dims.build_mesh(device.type)
    compat.apply_all()
    model = meta_parallel_model(
        cfg.model, impl, build_recipe(rcfg, cfg.model.n_layers), dims, device
    )
    n_params = sum(p.numel() for p in model.parameters())
    ckpt_bytes = estimate_checkpoint_bytes(cfg.model, cfg.recipe.quantized_init)
    c = cfg.checkpoint
    saves = f"keeps the last {c.keep_last}" if c.mode != "none" else "checkpoint=none: none saved"
    say("dry run: the config is valid; nothing is trained, read or written")
    say(f"mesh: {dims} on {device.type}, grad_accum={grad_accum}")
    say(
        f"model: {cfg.model.name} impl={impl} params={n_params / 1e6:.2f}M recipe={label(rcfg)} "
        f"(built on the meta device and parallelized: layout={cfg.parallel.name})"
    )
    say(memory_estimate_line(cfg, dims, grad_accum, device))
    say(
        f"checkpoint: about {ckpt_bytes / 2**30:.2f} GiB each on disk ({saves}) in "
        f"{checkpoint_root(c, run_dir)}"
    )
    say(
        f"data: data={cfg.data.name} seq_len={cfg.data.seq_len} global batch "
        f"{cfg.train.global_batch_size} sequences, {vocabulary_line(cfg.data, tokenizer)}"
    )
    say(run_dir_line)
    say(lock_line)
    say(plan)
    say(DRY_RUN_UNCHECKED)
    return 0


class _EvalOnlyCheck:
    """on_load of an evaluation-only load: the model's shape is checked by the checkpoint
    manager and the precision plan loads across recipes; the changes that alter what the
    evaluation computes are kept to be said (not refused: evaluating a checkpoint under another
    setting is a legitimate question)."""

    def __init__(self, current_yaml: str):
        self.current, self.changes, self.saved = current_yaml, [], None

    def __call__(self, loaded) -> None:
        self.saved = loaded.saved_config_yaml
        if self.saved:
            skip = ("optim.", "train.", "data.eval_fraction", "recipe.switch")
            self.changes = [
                c
                for c in config_changes(self.saved, self.current)
                if not c.free and not c.path.startswith(skip)
            ]


def eval_only(cfg: Config, dims, grad_accum, impl, device, run_dir, tokenizer, say) -> int:
    """`train.eval_only=true`: load the run's newest checkpoint (or checkpoint.resume=PATH)
    into the model, print the held-out loss over eval.batches batches, save nothing."""
    # mode none: the manager only reads (no partial checkpoint cleaned, nothing moved aside).
    read_only = dataclasses.replace(cfg.checkpoint, mode="none")
    ckpt = CheckpointManager(read_only, run_dir, rank=dims_rank(), world_size=dims.world_size)
    step = ckpt.plan_resume()
    if ckpt.planned_path is None:
        ckpt.close()
        raise ConfigError(
            f"train.eval_only: no checkpoint in {checkpoint_root(cfg.checkpoint, run_dir)}; "
            "train this run first, or give one with checkpoint.resume=PATH"
        )
    _say_cpu_cost(cfg, dims.world_size, device, say)
    rcfg = recipe_for_step(cfg.recipe, step + 1, schedule_steps(cfg))  # recipe.switch
    dims.build_mesh(device.type)
    compat.apply_all()
    recipe, model, optimizer, scheduler = build_training(cfg, rcfg, impl, dims, device)
    loader, eval_batches = build_data(
        cfg.data,
        tokenizer,
        global_batch_size=cfg.train.global_batch_size,
        dp_rank=dims.dp_rank,
        dp_size=dims.dp_size,
        eval_batches=cfg.eval.batches,
        log=say,
    )
    check = _EvalOnlyCheck(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    train_state = TrainState(on_load=check)
    state = checkpointed_state(model, optimizer, scheduler, loader, train_state, recipe, say)
    for key in ("loader", "rng"):  # where training would go on: not needed to evaluate
        state.pop(key)
    step = ckpt.resume(state)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None
    layout = batch_layout(loader, dims, impl)
    model.eval()
    val_loss = evaluate(
        model,
        eval_batches,
        micro_batches=grad_accum,
        autocast=autocast,
        dp_group=dims.loss_group,
        layout=layout,
    )
    ckpt.close()
    if check.changes:
        say(
            f"note: evaluated with changes against the checkpoint's config: "
            f"{'; '.join(map(str, check.changes))}"
        )
    saved = yaml.safe_load(check.saved or "") or {}
    if check.saved and not (saved.get("eval") or {}).get("every") and not cfg.data.eval_split:
        say(
            "note: the run trained with eval.every=0, so these held-out documents were also "
            "in its training data (train with eval.every>0 to hold them out)"
        )
    n = cfg.eval.batches * cfg.train.global_batch_size
    say(
        f"eval: step {step} val_loss {float(val_loss):.4f} on {cfg.eval.batches} held-out "
        f"batches ({n} sequences of {cfg.data.seq_len} tokens) from {ckpt.root}"
    )
    return 0


def batch_layout(loader, dims: ParallelDims, impl: str) -> BatchLayout:
    """The run's rows -> this rank's (inputs, labels, documents): the loader's document
    boundaries and this rank's context-parallel part (steps.BatchLayout)."""
    return BatchLayout(
        loader.boundaries,
        cp=dims.cp,
        cp_rank=dims.cp_rank,
        cp_group=dims.cp_group,
        align=token_align(impl, dims.tp),
    )


def dims_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def run(cfg: Config) -> int:
    """One training run (or dry run, or evaluation); returns the exit status."""
    # Installed first so a stop signal or Ctrl-C during setup is not fatal; without
    # checkpoints SIGTERM and SIGUSR1 keep their default meaning (terminate) and a Ctrl-C
    # stops at once in one line.
    # A worker of a launcher (torchrun) also stops when the launcher dies (runtime.StopSignal).
    stop = StopSignal(save=cfg.checkpoint.mode != "none", launcher=launcher_pid())
    register_stack_dump()  # kill -USR2 <pid>: where a run that seems stuck is
    try:
        return _run(cfg, stop)
    finally:
        stop.restore()


def _run(cfg: Config, stop: StopSignal) -> int:
    """Setup in its fixed order (the numbered steps), then `train_loop`."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = pick_device(cfg.train.device)
    say = functools.partial(print, flush=True) if rank == 0 else (lambda *a, **k: None)
    threads_line = _prepare_process(cfg, world_size, device, say)  # and step 1

    # 2. Model source: Hugging Face weights (model.init_from) unless the run resumes from a
    #    checkpoint; their config.json fills (model=hf) or checks the model config.
    run_dir = Path(cfg.run.root) / cfg.run.name
    cfg.model, hf_weights = model_source(cfg.model, cfg.checkpoint, run_dir)

    # 3. Config check: one clear line for any bad input, before GPU memory or data.
    dims, grad_accum, impl, tokenizer = _checked_config(cfg, world_size, device, say)
    # Dry run / evaluation only: from here on they take their own path (no run directory
    # written, no training).
    if cfg.train.dry_run or cfg.train.eval_only:
        path = dry_run if cfg.train.dry_run else eval_only
        return path(cfg, dims, grad_accum, impl, device, run_dir, tokenizer, say)
    # The run directory: writable, room for the checkpoints, and locked by rank 0 (one run at
    # a time; an absolute checkpoint.dir too); checkpoint/preflight.py.
    run_dir, run_lock = prepare_run_dir(*run_dir_args(cfg), rank, world_size)
    if run_lock is not None:
        stop.release = run_lock.release  # a second Ctrl-C frees the run directory
    segment, ckpt, resume_from = _plan_resume(cfg, run_dir, run_lock, rank, world_size, stop)
    if resume_from >= cfg.train.steps:
        # Nothing to train: nothing is built, loaded or written (a save here would commit the
        # resumed state under the smaller train.steps, a checkpoint mislabeled as that step).
        ckpt.close()
        say(nothing_to_do(run_dir, resume_from, cfg.train.steps))
        return 0
    _say_cpu_cost(cfg, world_size, device, say)
    loop = Loop(
        cfg, rank, world_size, device, dims, impl, grad_accum, run_dir, say, stop, ckpt, segment
    )
    _build(loop, tokenizer, resume_from, hf_weights, threads_line)  # steps 4-11
    return train_loop(loop)


def _prepare_process(cfg: Config, world_size: int, device, say) -> str | None:
    """What the process needs before anything else: deterministic kernels, CPU threads, NCCL
    priority, then (step 1) the process group. Returns the CPU threads line (or None)."""
    # Deterministic kernels before anything makes a cuBLAS handle or a TE module; a run whose
    # environment already asks for them is recorded as deterministic (config.TrainConfig).
    if not cfg.train.deterministic and deterministic_env():
        cfg.train.deterministic = True
        say(
            "deterministic: the environment sets NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 and "
            "CUBLAS_WORKSPACE_CONFIG: recorded as train.deterministic=true"
        )
    # CPU: the vector width first (before any kernel runs), then the threads; both go in the
    # model line
    arithmetic = pin_cpu_arithmetic(device)
    threads_line = apply_cpu_threads(device)
    if arithmetic:
        threads_line = f"{arithmetic} {threads_line}"
    for line in (
        apply_determinism(cfg.train.deterministic),
        apply_nccl_priority(cfg.parallel.nccl_high_priority, device),
    ):
        if line:
            say(line)

    # 1. Processes. The group comes before the config check because step 2 runs on rank 0
    #    first (a download) and decides the model shape the check needs.
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # A collective fails after this long (every group made later too) when a rank or node
        # died: the survivors end in one line instead of waiting torch's 10-30 min.
        timeout = collective_timeout(cfg.parallel.collective_timeout_s)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    return threads_line


def _say_cpu_cost(cfg: Config, world_size: int, device, say) -> None:
    """A model too big for this CPU: its cost here and the way out, once the run is known to
    go ahead (a refused run prints its error line alone) and before anything is built."""
    if device.type == "cpu" and dims_rank() == 0:
        threads = torch.get_num_threads()
        if note := cpu_note(cfg.model, cfg.train, cfg.data.seq_len, world_size, threads):
            say(note)


def _checked_config(cfg: Config, world_size: int, device, say):
    """Step 3: `check_config`, the start-up warnings and notes, and the tokenizer (checked
    against the model's vocabulary). Returns (dims, grad_accum, impl, tokenizer)."""
    dims, grad_accum, impl = check_config(cfg, world_size, device)
    for line in config_warnings(cfg):
        say(line)
    if environment := attention_environment(run_recipes(cfg)):  # set by check_config
        say(
            "attention: FP8 under the delayed scaling TE builds for it (recipe.fp8_attention): "
            + " ".join(f"{k}={v}" for k, v in environment.items())
        )
    if device.type == "cuda":
        say(memory_estimate_line(cfg, dims, grad_accum, device))
    # data=synthetic loads no tokenizer: its random ids need only the model's vocabulary size.
    tokenizer = build_tokenizer(cfg.data, vocab_size=cfg.model.vocab_size)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({tokenizer.vocab_size}); set model.vocab_size>={tokenizer.vocab_size}"
        )
    return dims, grad_accum, impl, tokenizer


def _plan_resume(cfg: Config, run_dir: Path, run_lock, rank: int, world_size: int, stop):
    """Every resume decision, before the model is built (at 8B-70B that takes minutes): which
    checkpoint, intact as far as its small files tell, this run's (run.name, model shape,
    corpus), and the config comparison. The manager starts here, so async_process's writer
    processes start while the model is built. Returns (segment, manager, step to resume)."""
    segment = SegmentConfig(OmegaConf.to_yaml(OmegaConf.structured(cfg)), cfg.resume.accept)
    ckpt = CheckpointManager(
        cfg.checkpoint,
        run_dir,
        rank=rank,
        world_size=world_size,
        lock=run_lock,
        corpus=corpus_fingerprint(cfg.data) if rank == 0 else None,
    )
    stop.release = ckpt.abandon  # a second Ctrl-C: no save waited for, the lock released
    resume_from = ckpt.plan_resume(
        segment.yaml, check=segment.check, accept_corpus=segment.accepts("data.corpus")
    )
    stop.stopped_line = lambda: ckpt.stopped_line(resume_from)
    return segment, ckpt, resume_from


@dataclasses.dataclass
class Loop:
    """What the training loop's per-step calls share: the run's fixed parts (from `_run`),
    the parts `_build` makes (steps 4-11), and the recipe, model, optimizer, schedule and
    checkpointed state, which a recipe switch replaces."""

    cfg: Config
    rank: int
    world_size: int
    device: torch.device
    dims: ParallelDims
    impl: str
    grad_accum: int
    run_dir: Path
    say: Callable
    stop: StopSignal
    ckpt: CheckpointManager
    segment: SegmentConfig
    # Set by `_build`:
    switches: dict = dataclasses.field(default_factory=dict)  # step -> the recipe after it
    recipe: Recipe | None = None
    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    loader: Any = None
    eval_batches: Any = None
    train_state: TrainState | None = None
    state: dict | None = None  # what a checkpoint holds (checkpointed_state)
    start_step: int = 0
    logger: MetricsLogger | None = None
    param_bytes: int = 0  # this rank's share of the parameters, as stored
    param_local_numel: int = 0
    autocast: Any = None
    clock: StepClock | None = None
    layout: BatchLayout | None = None
    profiler: StepProfiler | None = None

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.global_batch_size * self.cfg.data.seq_len

    @property
    def gathered_units(self) -> list:
        """The model's units that keep their gathered weights through a step's micro batches."""
        return gathered_units(self.model, self.cfg.parallel)


def _build(loop: Loop, tokenizer, resume_from: int, hf_weights, threads_line) -> None:
    """Steps 4-11 of `run`: mesh, model, optimizer, data, the resume, the logger and the
    loop's clock, each into `loop`."""
    cfg, dims, device = loop.cfg, loop.dims, loop.device
    # The recipe of the first step this run trains (recipe.switch: the resumed step decides).
    loop.switches = {s.step: s.recipe for s in resolve_switches(cfg.recipe, schedule_steps(cfg))}
    first_step = 1 + resume_from
    rcfg = recipe_for_step(cfg.recipe, first_step, schedule_steps(cfg))

    # 4. Mesh, and the fixes torch / TE need (compat/): the mesh object owns every process
    #    group; the fixes go in before anything builds a module.
    dims.build_mesh(device.type)
    dims.warm_up_groups(device)  # every NCCL communicator made while GPU memory is free
    compat.apply_all()
    torch.manual_seed(cfg.train.seed + loop.rank)  # per-rank stream; weights use their own seeds

    # 5-8. Model: meta build, parallelize, materialize, initialize (or load init_from),
    #      quantize; optimizer and schedule.
    loop.recipe, loop.model, loop.optimizer, loop.scheduler = build_training(
        cfg, rcfg, loop.impl, dims, device, init_from=hf_weights
    )

    # 9. Data: each data-parallel rank reads its rows of one global batch order (and of the
    #    held-out batches when evaluation is on).
    loop.loader, loop.eval_batches = build_data(
        cfg.data,
        tokenizer,
        global_batch_size=cfg.train.global_batch_size,
        dp_rank=dims.dp_rank,
        dp_size=dims.dp_size,
        eval_batches=cfg.eval.batches if cfg.eval.every > 0 else 0,
        log=loop.say,
    )
    if loop.eval_batches is not None:
        loop.say(f"eval: {cfg.eval.batches} held-out batches every {cfg.eval.every} steps")

    # 10. Checkpoint resume (what plan_resume chose; the config is compared again with the
    #     loaded train state's), then the logger (it trims metrics to the resumed step and
    #     reuses the wandb id stored in the checkpoint).
    _resume(loop, first_step)
    _start_logger(loop, hf_weights, threads_line)

    # 11. Train. The compute dtype is bf16 on GPU (TE's quantized GEMMs come from the recipe,
    #     inside the model), fp32 on CPU.
    loop.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None
    loop.clock = StepClock(
        start_step=loop.start_step,
        total_steps=cfg.train.steps,
        tokens_per_step=loop.tokens_per_step,
        step_flops=functools.partial(step_flops, cfg.model),
        peak_tflops=cfg.train.peak_tflops
        or (peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None),
        world_size=loop.world_size,
        eval_every=cfg.eval.every if loop.eval_batches is not None else 0,
    )
    loop.layout = batch_layout(loop.loader, dims, loop.impl)
    ratio = cfg.train.divergence_ratio  # the run stops when it diverges (0: never)
    loop.ckpt.watch_divergence(Divergence(ratio, cfg.optim.lr) if ratio > 0 else None)
    loop.profiler = StepProfiler(
        cfg.train.profile_steps, loop.run_dir, loop.rank, device, cfg.train.profile_memory
    )
    loop.model.train()


def _resume(loop: Loop, first_step: int) -> None:
    """Step 10's load: the checkpoint `_plan_resume` chose into the model, optimizer, schedule,
    loader and train state; then the segment's record (rank 0)."""
    cfg, ckpt, segment = loop.cfg, loop.ckpt, loop.segment
    loop.train_state = train_state = TrainState(config_yaml=segment.yaml, on_load=segment)
    loop.state = checkpointed_state(
        loop.model, loop.optimizer, loop.scheduler, loop.loader, train_state, loop.recipe, loop.say
    )
    start_step = loop.start_step = ckpt.resume(loop.state)
    loop.stop.stopped_line = lambda: ckpt.stopped_line(train_state.step)
    if start_step + 1 != first_step:
        raise RuntimeError(f"resumed step {start_step}, planned {first_step - 1}")
    if start_step:
        apply_config(loop.optimizer, loop.scheduler, cfg.optim)  # accepted optim changes
        # Older checkpoints stay until this segment's losses match the run's (health.py).
        logged = read_metrics(loop.run_dir / "metrics.jsonl") if loop.rank == 0 else None
        ckpt.watch_resumed_loss(logged, cfg.resume.loss_check)
    if loop.rank == 0:  # a segment that trains (one with nothing to train returned): record it
        recorded = segment.record(
            loop.run_dir, start_step, recipe=label(loop.recipe.cfg), device=loop.device.type
        )
        if segment.accepted:
            accepted = "; ".join(map(str, segment.accepted))
            loop.say(
                f"config: resuming step {start_step} with accepted changes: {accepted} "
                f"(recorded in {recorded})"
            )


def _start_logger(loop: Loop, hf_weights, threads_line: str | None) -> None:
    """Step 10's logger (metrics.jsonl trimmed to the resumed step, the wandb id the
    checkpoint stored) and the model line."""
    cfg, start_step = loop.cfg, loop.start_step
    loop.logger = MetricsLogger(
        cfg.logger,
        loop.run_dir,
        rank=loop.rank,
        run_name=cfg.run.name,
        config=OmegaConf.to_container(OmegaConf.structured(cfg)),
        tags=[cfg.model.name, cfg.recipe.name, cfg.parallel.name],
        total_steps=cfg.train.steps,
    )
    loop.train_state.wandb_run_id = loop.logger.start(start_step, loop.train_state.wandb_run_id)
    n_params = sum(p.numel() for p in loop.model.parameters())
    loop.param_bytes, loop.param_local_numel = parameter_storage(loop.model)
    loop.logger.info(
        f"model {cfg.model.name} impl={loop.impl} params={n_params / 1e6:.2f}M "
        f"param_mem={loop.param_bytes / 2**30:.3f}GiB/rank recipe={loop.recipe.name} "
        f"layout={cfg.parallel.name} {loop.dims} device={loop.device.type} "
        + (f"{threads_line} " if threads_line else "")
        + f"grad_accum={loop.grad_accum} "
        f"run_dir={loop.run_dir}"
        + (f" init_from={cfg.model.init_from}" if hf_weights is not None else "")
        + (f" resumed_from_step={start_step}" if start_step else "")
    )


def train_loop(loop: Loop) -> int:
    """The training loop: what happens at each step, in order, one named call each (a new
    per-step check goes here, between the step and the save). Returns the exit status."""
    steps = loop.cfg.train.steps
    loop.stop.ahead = lambda: _stop_ahead(loop)  # said as a stop signal arrives
    # Python's garbage collector at fixed steps on every rank (train.gc_every), or as usual.
    with GcSchedule(loop.cfg.train.gc_every, loop.say) as collector:
        for step in range(loop.start_step + 1, steps + 1):
            loss, grad_norm = _step(loop, step)
            last = step == steps
            val_loss = _maybe_evaluate(loop, step, last)
            switch_to = loop.switches.get(step)
            stopping = False
            if _is_log_step(loop, step, last, val_loss, switch_to):
                loss_value = _log_step(loop, step, loss, grad_norm, val_loss, switch_to)
                _check_loss(loop, step, loss_value)
                stopping = _stop_agreed(loop)
            loop.ckpt.maybe_save(step, loop.state, force=stopping or switch_to is not None)
            collector.after(step)  # while the GPU runs the step's queued kernels
            if switch_to is not None and not (last or stopping):
                _switch(loop, step, switch_to)
            if stopping:
                return _stop(loop, step)
    return _finish(loop)


def _step(loop: Loop, step: int):
    """One optimizer step (steps.train_step) on the loader's next batch; the train state
    counts it. Returns the (loss, grad norm) tensors, on the device (no host sync)."""
    loop.profiler.begin(step)
    # Document boundaries and this rank's context-parallel part, on the CPU.
    inputs, labels, documents = loop.layout(loop.loader.next_batch())
    loop.clock.count(loop.layout.attention_pairs)
    loss, grad_norm = train_step(
        loop.model,
        loop.optimizer,
        to_device(inputs, loop.device),
        to_device(labels, loop.device),
        grad_accum=loop.grad_accum,
        grad_clip=loop.cfg.optim.grad_clip,
        scheduler=loop.scheduler,
        autocast=loop.autocast,
        documents=documents,
        reduce_each_micro_batch=loop.cfg.parallel.grad_reduce == "micro_batch",
        hold_gathered=loop.gathered_units,
    )
    ts = loop.train_state
    ts.step, ts.tokens_seen = step, ts.tokens_seen + loop.tokens_per_step
    # On the device: checked before saves and at log steps (non-finite, divergence.py).
    loop.ckpt.observe_loss(step, loss, grad_norm)
    if (trace := loop.profiler.end(step)) is not None:
        loop.logger.info(f"profile of steps {loop.cfg.train.profile_steps} written to {trace}")
    return loss, grad_norm


def _maybe_evaluate(loop: Loop, step: int, last: bool) -> torch.Tensor | None:
    """The held-out loss every eval.every steps and at the last step (None otherwise)."""
    if loop.eval_batches is None or not (step % loop.cfg.eval.every == 0 or last):
        return None
    with loop.clock.evaluation():
        return evaluate(
            loop.model,
            loop.eval_batches,
            micro_batches=loop.grad_accum,
            autocast=loop.autocast,
            dp_group=loop.dims.loss_group,
            layout=loop.layout,
        )


def _is_log_step(loop: Loop, step: int, last: bool, val_loss, switch_to) -> bool:
    """Every train.log_every steps, the last step, an evaluation's and a recipe switch's."""
    return bool(step % loop.cfg.train.log_every == 0 or last or val_loss is not None or switch_to)


def _log_step(loop: Loop, step: int, loss, grad_norm, val_loss, switch_to) -> float:
    """The log step's one host sync (loss averaged over the ranks, grad norm, attention pairs)
    and its metrics record. Returns the loss."""
    device, dims, clock = loop.device, loop.dims, loop.clock
    # Attention work since the last log step, summed over the data-parallel ranks (cp and tp
    # ranks share their rows): MFU counts the documents' attention.
    pairs = torch.tensor(float(clock.take_pairs()), dtype=torch.float64, device=device)
    if dims.loss_group is not None:  # mean over dp x cp ranks (TP ranks agree)
        dist.all_reduce(loss, group=dims.loss_group)
        loss /= dims.loss_size
        dist.all_reduce(pairs, group=dims.dp_group)
    # The one host sync per log step (loss, grad norm and attention pairs together).
    loss_value, norm_value, pairs_value = torch.stack(
        [loss.double(), grad_norm.double(), pairs]
    ).tolist()
    switches, recipe = loop.switches, loop.recipe
    loop.logger.log(
        dict(
            step=step,
            loss=loss_value,
            val_loss=val_loss,
            grad_norm=norm_value,
            lr=loop.scheduler.get_last_lr()[0],
            tokens_seen=loop.train_state.tokens_seen,
            **clock.measure(step, attention_pairs=pairs_value),
            mem_gb=peak_memory_gb(device),
            alloc_retries=allocator_retries(device),
            param_bytes_per_param=loop.param_bytes / loop.param_local_numel,
            eval_s=clock.eval_last if val_loss is not None else None,
            **loop.ckpt.stats(),
            **({"recipe": label(recipe.cfg)} if switches else {}),
            **({"recipe_switch": f"-> {label(switch_to)}"} if switch_to else {}),
        )
    )
    return loss_value


def _check_loss(loop: Loop, step: int, loss_value: float) -> None:
    """The log step's loss checks: a non-finite loss or a diverged run (divergence.py) stops
    the run (nothing of it is saved); a resumed segment's first losses against the run's
    (checkpoint/health.py)."""
    loop.ckpt.check_finite(step, logged=loss_value)
    loop.ckpt.check_resumed_loss(step, loss_value)


def _stop_ahead(loop: Loop) -> str:
    """When a stop signal arriving now is saved: after the next log step (an evaluation or a
    recipe switch may come first), and in about how long at this run's pace so far."""
    cfg, clock = loop.cfg, loop.clock
    step = loop.train_state.step + 1  # the step being trained (or about to be)
    every = cfg.train.log_every
    at = min(-(-step // every) * every, cfg.train.steps)
    done = loop.train_state.step - clock.start_step
    pace = ""
    if done > 0:
        per_step = (clock.elapsed() - clock.eval_total) / done
        pace = f", in about {format_duration(per_step * (at - step + 1))} at this run's pace"
    return (
        f"during step {step}; the run saves a checkpoint of step {at} at the latest (the next "
        f"log step, train.log_every={every}){pace}, then exits"
    )


def _stop_agreed(loop: Loop) -> bool:
    """Whether every rank got a stop signal to save on. Checked where the loop syncs anyway
    (log steps): a stop lands within log_every steps."""
    return loop.stop.save and loop.stop.agreed(loop.device)


def _switch(loop: Loop, step: int, rcfg) -> None:
    """The recipe switch after `step` (switch_recipe), timed apart from the steps as
    evaluations are, recorded as a segment and said."""
    old = label(loop.recipe.cfg)
    # The old model, optimizer, schedule and state are freed before the new ones are built.
    loop.model = loop.optimizer = loop.scheduler = loop.state = None
    with loop.clock.evaluation():
        loop.recipe, loop.model, loop.optimizer, loop.scheduler, loop.state = switch_recipe(
            loop.cfg,
            rcfg,
            step,
            loop.impl,
            loop.dims,
            loop.device,
            loop.ckpt,
            loop.loader,
            loop.train_state,
            loop.say,
        )
    loop.param_bytes, loop.param_local_numel = parameter_storage(loop.model)
    new = label(loop.recipe.cfg)
    if loop.rank == 0:
        loop.segment.record(loop.run_dir, step, recipe=new, switch=old, device=loop.device.type)
    loop.logger.info(
        f"recipe switch after step {step}: {old} -> {new} in {loop.clock.eval_last:.1f}s"
    )


def _stop(loop: Loop, step: int) -> int:
    """A stop signal agreed at `step`: the checkpoint of `step` committed (maybe_save forced
    it), said, and the exit status. Ctrl-C: a person stopped the run; any other stop signal
    is the scheduler's."""
    if loop.stop.name == "SIGINT":
        status, why = (
            EXIT_INTERRUPTED,
            "(stopped by hand: not for requeue; run the same command to resume)",
        )
    else:
        status, why = EXIT_REQUEUE, "for requeue"
    loop.ckpt.finish(step, loop.state, save=False)  # said once committed, not before
    loop.logger.info(
        f"stop signal {loop.stop.describe(loop.world_size)}: checkpoint at step {step} saved; "
        f"every rank exits with status {status} {why}"
    )
    loop.logger.finish()
    return status


def _finish(loop: Loop) -> int:
    """The end of train.steps: the final save, the logger closed, the done line."""
    loop.ckpt.finish(loop.cfg.train.steps, loop.state)
    loop.logger.finish()
    loop.logger.info(
        f"done: step {loop.cfg.train.steps} in {format_duration(loop.clock.elapsed())}"
    )
    return 0


#: OSErrors that are the filesystem's state, not a bug: one line instead of a traceback.
_FILESYSTEM_ERRORS = (errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EIO)

#: Exit status of each Hydra job this process ran (a multirun runs several, in order).
STATUSES: list[int] = []


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(dcfg: DictConfig) -> int:
    """One Hydra job. Returns its status (and records it in STATUSES) instead of exiting, so a
    multirun goes on to its next job; `cli` turns the statuses into the exit status."""
    rank0 = int(os.environ.get("RANK", 0)) == 0
    # A stop signal or a Ctrl-C ended an earlier job of this sweep: the later ones do not run.
    stopped = [s for s in STATUSES if s in (EXIT_REQUEUE, EXIT_INTERRUPTED)]
    if stopped:
        STATUSES.append(stopped[0])
        return stopped[0]
    try:
        named = sweep.multirun_run_name(dcfg.run.name)
        if named is not None:
            dcfg.run.name, num = named
            if rank0:
                print(f"sweep job {num}: run.name={dcfg.run.name}", flush=True)
        cfg: Config = OmegaConf.to_object(dcfg)
        status = run(cfg)
    except ConfigError as e:
        report_error(str(e))
        close_open()
        remove_created()  # a refused run leaves no empty run directory behind
        status = 2
    except OSError as e:
        if e.errno not in _FILESYSTEM_ERRORS:
            raise
        # e.g. the filesystem turned read-only mid-run: the file and the reason, no traceback
        print(
            f"error: {e.strerror or e}: {e.filename or '?'} (rank "
            f"{os.environ.get('RANK', 0)}); the run stopped; committed checkpoints are intact",
            file=sys.stderr,
            flush=True,
        )
        status = 1
    except torch.OutOfMemoryError as e:
        # This rank's own error (other ranks may have room): its line, from this rank.
        report_error(out_of_memory_line(e), this_rank=True)
        status = 1
    except RuntimeError as e:  # torch.distributed's errors are RuntimeErrors
        # A collective whose peer died (or hangs past parallel.collective_timeout_s): one line
        # from each surviving node, not a traceback of the step it failed in.
        line = lost_peer_line(e, dcfg.parallel.collective_timeout_s)
        if line is None:
            raise
        report_error(line, every_node=True)
        status = 1
    finally:
        close_open()  # a run ended by an exception (Ctrl-C too): writers stopped, lock released
    STATUSES.append(status)
    return status


def check_sweep(argv: list[str]) -> None:
    """A multirun's every job through `check_config` before the first one trains: a job that
    breaks a rule stops the sweep at once, in one line naming the job, with nothing trained.
    Jobs whose model shape comes from Hugging Face (model.init_from, model=hf) are checked at
    their own start; a sweep that cannot be expanded or composed here is left to Hydra."""
    try:
        jobs = list(sweep.job_configs(sweep.override_args(argv)))
    except Exception:
        return
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    for num, swept, cfg in jobs:
        if cfg.model.init_from or cfg.model.shape_from_hf:
            continue
        try:
            device = pick_device(cfg.train.device)
            if device.type == "cuda":
                torch.cuda.set_device(device)  # as the run does: no context on another GPU
            check_config(cfg, world_size, device)
        except ConfigError as e:
            raise ConfigError(
                f"sweep job {num} ({' '.join(swept)}): {e} (no job of the sweep was started)"
            ) from None


def cli(argv: list[str]) -> int:
    """`python train.py [hydra flags] [overrides]`: checks `experiment=` against the presets
    before Hydra composes (the group is optional, so Hydra would run without a misspelled
    preset) and every override (overrides.py: one line where Hydra prints many), runs the job(s) and returns the exit status (a multirun fails if any job did)."""
    rank0 = int(os.environ.get("RANK", 0)) == 0
    try:
        check_flags(argv)  # e.g. --cfg jobs: one line, not argparse's usage block
        check_experiment_overrides(sweep.override_args(argv))
        check_overrides(argv)  # every other wrong override, one line each (overrides.py)
        if sweep.is_multirun(argv):
            check_sweep(argv)  # every job's config, before the first one trains
    except ConfigError as e:
        report_error(str(e))
        return 2
    sys.argv = [sys.argv[0], *sweep.cli_args(argv)]
    failed = True  # until main returns: an exception (Hydra's sys.exit on one too) is a failure
    try:
        main()
        failed = exit_status(STATUSES) not in (0, EXIT_REQUEUE)
    except KeyboardInterrupt:
        # A Ctrl-C before a run installed its handler (composing the config) or between the
        # jobs of a sweep: nothing of a run is in flight.
        if rank0:
            print("interrupted: stopped before a run started", file=sys.stderr, flush=True)
        STATUSES.append(EXIT_INTERRUPTED)
    finally:
        end_process_group(failed)  # a failed rank aborts: the launcher must see it exit
    if len(STATUSES) > 1 and rank0:
        print(f"sweep: {len(STATUSES)} jobs, exit statuses {STATUSES}", flush=True)
    return exit_status(STATUSES)


if __name__ == "__main__":
    if {"--help", "-h"} & set(sys.argv[1:]):  # the field reference, not Hydra's (confhelp.py)
        sys.exit(__import__("confhelp").main(sys.argv[1:]))
    sys.exit(cli(sys.argv[1:]))
