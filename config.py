"""Root config schema, its registration with Hydra, and the one early validation step.

Each group's dataclass lives next to the code it configures (model/config.py, ...); this
file assembles them. Hydra merges the YAML files of conf/ into these typed nodes, so an
unknown key or a wrong type fails in Hydra with its own message. Rules that involve more
than one field are checked once, in `validate`, before any expensive work
(docs/ARCHITECTURE.md, decision 9): each failure is a `ConfigError` whose text is one line naming the field and fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from checkpoint.config import MODES as CHECKPOINT_MODES
from checkpoint.config import CheckpointConfig
from checkpoint.health import POLICIES as LOSS_CHECKS
from data.config import DataConfig
from errors import ConfigError, one_of, require
from logger import LoggerConfig
from model.config import ModelConfig
from optim import OptimConfig, lr_lambda
from parallel.config import ParallelConfig
from recipes.config import RecipeConfig


@dataclass
class RunConfig:
    #: Run directory is <root>/<name>; re-running with the same name resumes it.
    name: str = "${model.name}-${recipe.name}-${parallel.name}"
    #: Folder that holds the run directories (relative to the current directory).
    root: str = "runs"

    def validate(self) -> None:
        require(
            "/" not in self.name and self.name.strip() != "",
            f"run.name={self.name!r} must be a non-empty name without '/'",
        )


#: train.device values.
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class TrainConfig:
    #: Optimizer step to stop at (the run's end; raising it on resume extends the run).
    steps: int = 300
    #: Sequences per optimizer step over all data-parallel ranks.
    global_batch_size: int = 16
    #: Sequences per forward/backward on one rank; the rest is gradient accumulation.
    #: null: the whole per-rank share of the global batch (no accumulation).
    micro_batch_size: int | None = None
    #: Print and record metrics every this many steps (and at the last step).
    log_every: int = 10
    #: Seed of the weight init (per parameter, from seed and name) and of each rank's RNG.
    seed: int = 1234
    #: auto | cpu | cuda
    device: str = "auto"
    #: Peak dense bf16 TFLOP/s of one device for MFU; null = look up by GPU name (none on CPU).
    peak_tflops: float | None = None
    #: Steps to record with torch.profiler (a contiguous range, e.g. [10,11,12]); the trace
    #: and a kernel table go to <run_dir>/profile/ (profiling.py). Empty: no profiling.
    profile_steps: list[int] = field(default_factory=list)
    #: While profiling on a GPU, rank 0 also records the CUDA allocator's history with Python
    #: stacks (profile/*_memory.md: what is alive at the peak, by the line that allocated it).
    #: false leaves it out (a profiled step of llama3_8b at 71 of 80 GiB, its allocator
    #: retrying every step, failed inside TE's recompute with this recording on: torch 2.11,
    #: docs/CONTEXT_PARALLEL.md).
    profile_memory: bool = True
    #: Deterministic GPU kernels (runtime.apply_determinism: TE attention, cuBLAS, cuDNN,
    #: torch's deterministic algorithms), so two runs, or a run and its resume, give the same
    #: losses bit for bit on the same GPUs and world size; costs some speed and memory
    #: (docs/RUNS.md, Determinism). Also true when NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 and
    #: CUBLAS_WORKSPACE_CONFIG=:4096:8 are set by hand (the record says what was in effect).
    #: It changes no math, so a resume may turn it on or off.
    deterministic: bool = False
    #: Check everything and train nothing: every check the run makes before training (the
    #: config, the run directory's permissions and free space, the run lock, the resume
    #: decision against the run's checkpoint), the model built on the meta device, the mesh,
    #: parameter count, memory and checkpoint-size estimates and what was not checked, then
    #: exit 0. The run directory is neither created nor changed; no data is read.
    dry_run: bool = False
    #: Evaluate only: load the run's newest checkpoint (or checkpoint.resume=PATH), print the
    #: loss on eval.batches held-out batches (even with eval.every=0), save nothing, exit.
    eval_only: bool = False
    #: N > 0: Python's automatic garbage collection off in the training loop, a full
    #: collection after every N-th step on every rank (runtime.GcSchedule; a collection on one
    #: rank at its own moment delays all ranks at the next collective). 0: Python's default.
    gc_every: int = 0
    #: Stop the run, in one line and before a checkpoint of it is saved, when a loss comes
    #: more than this many times above the run's recent level (the lowest median of 8
    #: consecutive logged losses; and 1 nat above it), or the gradient norm stays exactly 0
    #: with a flat loss for 3 steps (divergence.py, which gives the measurements: clean runs
    #: came at most 1.53 times their level). Raise it to loosen the check; 0 turns it off.
    divergence_ratio: float = 3.0

    def validate(self) -> None:
        """The train fields on their own (train.dry_run against train.eval_only: with the
        command's checks, `_check_command`)."""
        one_of(self.device, DEVICES, "train.device")
        require(self.steps > 0, f"train.steps={self.steps} must be > 0")
        require(
            self.global_batch_size > 0,
            f"train.global_batch_size={self.global_batch_size} must be > 0",
        )
        require(
            self.micro_batch_size is None or self.micro_batch_size > 0,
            f"train.micro_batch_size={self.micro_batch_size} must be > 0 (or null)",
        )
        require(self.log_every > 0, f"train.log_every={self.log_every} must be > 0")
        require(
            self.divergence_ratio == 0 or self.divergence_ratio > 1,
            f"train.divergence_ratio={self.divergence_ratio} must be above 1 (a loss that "
            "many times the run's recent level stops it) or 0 (no divergence check)",
        )
        require(
            self.gc_every >= 0,
            f"train.gc_every={self.gc_every} must be >= 0 (N: collect garbage after every N-th "
            "step; 0: Python's automatic collection)",
        )
        require(
            self.peak_tflops is None or self.peak_tflops > 0,
            f"train.peak_tflops={self.peak_tflops} must be > 0 (one device's peak dense bf16 "
            "TFLOP/s, for MFU), or null to look it up by GPU name",
        )
        steps = sorted(self.profile_steps)
        require(
            not steps or (steps[0] >= 1 and steps == list(range(steps[0], steps[-1] + 1))),
            f"train.profile_steps={list(self.profile_steps)} must be consecutive steps >= 1, "
            "e.g. [10,11,12]",
        )


@dataclass
class EvalConfig:
    #: Loss on held-out data every `every` steps and at the last step (0: no evaluation, and
    #: no documents held out of training).
    every: int = 0
    #: Held-out global batches (train.global_batch_size sequences each) per evaluation: the
    #: same batches every time, whatever the training position.
    batches: int = 4

    def validate(self) -> None:
        require(self.every >= 0, f"eval.every={self.every} must be >= 0 (0: no evaluation)")
        require(self.batches >= 1, f"eval.batches={self.batches} must be >= 1")


@dataclass
class ResumeConfig:
    #: Fields (dotted, e.g. optim.lr) or whole groups (optim) whose change against the
    #: checkpoint's config a resume accepts on purpose; the fields that change the training
    #: otherwise refuse to resume. The fields that may change freely are listed in
    #: docs/RUNS.md (Resume and extending a run).
    accept: list[str] = field(default_factory=list)
    #: After a resume, the checkpoints from before it are not pruned until the segment's first
    #: 3 logged losses are in line with the run's last 8 before it: their fitted level, plus 5
    #: step-to-step noises, at least 5% (checkpoint/health.py).
    #: When all 3 are above it: stop (one line naming the checkpoint resumed from and the older
    #: one kept), continue (say so and go on, keeping them), or off (no check).
    loss_check: str = "stop"

    def validate(self) -> None:
        """resume.loss_check (resume.accept is checked against the whole schema:
        `check_accept`)."""
        one_of(self.loss_check, LOSS_CHECKS, "resume.loss_check")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    model: ModelConfig = MISSING
    recipe: RecipeConfig = MISSING
    parallel: ParallelConfig = MISSING
    checkpoint: CheckpointConfig = MISSING
    data: DataConfig = MISSING
    optim: OptimConfig = MISSING
    logger: LoggerConfig = MISSING
    eval: EvalConfig = field(default_factory=EvalConfig)
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    #: Free-form experiment metadata (conf/experiment presets may set it).
    experiment: dict[str, Any] = field(default_factory=dict)


def register_configs() -> None:
    """Register the root schema. Every group's YAML merges into its typed node of `Config`, so
    an unknown key or a wrong type fails in Hydra; the groups' own schemas need no separate
    registration (so `--help` lists only the options users can select)."""
    ConfigStore.instance().store(name="base_config", node=Config)


CONF_DIR = Path(__file__).resolve().parent / "conf"


def compose_config(overrides: Sequence[str] = ()) -> Config:
    """The Config `python train.py <overrides>` runs with (Hydra's compose API over conf/), for
    tools and tests that run or inspect configs in-process. Not validated."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose("config", overrides=list(overrides)))


def validate(cfg: Config) -> None:
    """Single-config rules (no environment needed). Raises ConfigError.

    Each section checks its own fields in its `validate`, beside its dataclass; the rules
    across sections follow. The order is fixed: the first failure is the one reported."""
    cfg.run.validate()
    cfg.train.validate()
    cfg.optim.validate()
    cfg.model.validate()
    m = cfg.model
    cfg.data.validate(max_seq_len=m.max_seq_len, vocab_size=m.vocab_size, eval_every=cfg.eval.every)
    _validate_checkpoint(cfg.checkpoint, switching=bool(cfg.recipe.switch))
    cfg.resume.validate()
    cfg.logger.validate()
    cfg.eval.validate()
    _check_held_out(cfg.eval, cfg.data)
    _check_command(cfg)
    check_accept(cfg.resume.accept)
    _check_recipe_switch(cfg)


def _validate_checkpoint(c: CheckpointConfig, switching: bool) -> None:
    """The checkpoint section. Kept here, not beside CheckpointConfig: checkpoint/config.py's
    own `validate` (run when the checkpoint manager starts) words its checks for that use.
    `switching`: recipe.switch is set (its switch step saves, so that run does save)."""
    one_of(c.mode, CHECKPOINT_MODES, "checkpoint.mode")
    require(c.interval >= 0, f"checkpoint.interval={c.interval} must be >= 0")
    require(c.keep_last >= 1, f"checkpoint.keep_last={c.keep_last} must be >= 1")
    require(
        c.mode == "none" or c.interval > 0 or c.save_at_end or switching,
        f"checkpoint.interval=0 with checkpoint.save_at_end=false never saves a checkpoint "
        f"(checkpoint={c.mode}); set checkpoint.interval>0 or checkpoint.save_at_end=true, or "
        "use checkpoint=none",
    )
    require(
        c.mode != "none" or str(c.resume) != "auto",
        "checkpoint.resume=auto with checkpoint=none: a run that saves no checkpoints has none "
        "of its own to resume; use checkpoint=sync (or async, async_process) to save and "
        "resume, or checkpoint.resume=<path> to start from a checkpoint without saving",
    )


def _check_held_out(e: EvalConfig, d: DataConfig) -> None:
    """With evaluation on, the data must hold documents out (a split, or a fraction)."""
    if e.every > 0:
        require(
            d.eval_split is None or d.name == "hf",
            f"data.eval_split={d.eval_split!r} needs data=hf (data=embedded has one split and "
            "holds out data.eval_fraction of its documents); set data.eval_split=null",
        )
        require(
            d.eval_split is not None or 0 < d.eval_fraction <= 0.5,
            f"data.eval_fraction={d.eval_fraction} must be in (0, 0.5] with eval.every > 0 "
            "(the share of documents held out of training for evaluation)",
        )


def _check_command(cfg: Config) -> None:
    """train.dry_run and train.eval_only: one of them, and what evaluating a checkpoint needs."""
    t, d = cfg.train, cfg.data
    require(
        not (t.dry_run and t.eval_only),
        "train.dry_run and train.eval_only are two different commands; set one of them",
    )
    if t.eval_only:
        require(
            str(cfg.checkpoint.resume) != "none",
            "train.eval_only evaluates a checkpoint and checkpoint.resume=none loads none; use "
            "checkpoint.resume=auto (the run's newest) or checkpoint.resume=PATH",
        )
        require(
            d.name != "synthetic",
            "train.eval_only needs held-out documents, which data=synthetic has none of; use "
            "data=embedded or data=hf",
        )


def _check_recipe_switch(cfg: Config) -> None:
    """recipe.switch: its steps on the schedule's length, and checkpoints to switch through."""
    if cfg.recipe.switch:
        from recipes.switch import resolve_switches

        resolve_switches(cfg.recipe, cfg.optim.schedule_steps or cfg.train.steps)
        require(
            cfg.checkpoint.mode != "none",
            "recipe.switch needs checkpoints (the switch loads the checkpoint of its step, as a "
            "resume would); use checkpoint=sync (or async, async_process)",
        )


def validate_batch(cfg: Config, dp_size: int) -> int:
    """Returns gradient-accumulation steps; the global batch must split evenly over DP ranks."""
    t = cfg.train
    require(
        t.global_batch_size % dp_size == 0,
        f"train.global_batch_size={t.global_batch_size} must be divisible by the "
        f"data-parallel size {dp_size}; change it or the parallel degrees",
    )
    micro = t.micro_batch_size or t.global_batch_size // dp_size
    per_step = micro * dp_size
    require(
        t.global_batch_size % per_step == 0,
        f"train.global_batch_size={t.global_batch_size} must be divisible by "
        f"train.micro_batch_size={micro} x data-parallel size {dp_size}; "
        "change one of them",
    )
    return t.global_batch_size // per_step


def validate_tp_split(mcfg: ModelConfig, tp: int) -> None:
    """Tensor parallelism (`tp`: parallel.tp as ParallelDims resolved it) splits heads, KV
    heads, FFN columns and the (padded) vocabulary."""
    if tp == 1:
        return
    for name, value in (
        ("n_heads", mcfg.n_heads),
        ("n_kv_heads", mcfg.n_kv_heads),
        ("ffn_dim", mcfg.ffn_dim),
    ):
        if value % tp:
            raise ConfigError(
                f"model.{name}={value} is not divisible by parallel.tp={tp}; "
                f"pick a tp that divides it"
            )
    if mcfg.padded_vocab_size % tp:
        raise ConfigError(
            f"model padded vocabulary {mcfg.padded_vocab_size} (vocab_size="
            f"{mcfg.vocab_size}, pad_vocab_multiple={mcfg.pad_vocab_multiple}) is not "
            f"divisible by parallel.tp={tp}; raise model.pad_vocab_multiple to a multiple "
            f"of {tp}"
        )


# --------------------------------------------------------------------------------------
# Presets: `experiment=<name>` must name a file of conf/experiment/


def experiment_presets() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


def check_experiment_overrides(args: Sequence[str]) -> None:
    """Command-line `experiment=` overrides (also `+experiment=`, and sweeps `a,b`) against
    conf/experiment/. The group is optional in the defaults list, so Hydra itself would
    compose a misspelled preset as no preset at all; this runs before Hydra composes."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    presets = experiment_presets()
    for arg in args:
        if arg.lstrip("+").split("=", 1)[0] != "experiment" or "=" not in arg:
            continue
        try:
            override = OverridesParser.create().parse_override(arg)
            if override.is_sweep_override():
                values = list(override.sweep_string_iterator())
            else:
                values = [override.get_value_element_as_str()]
        except Exception:
            continue  # not parseable: Hydra reports it with its own message
        for value in values:
            if value not in presets and value != "null":
                raise ConfigError(
                    f"experiment={value} is not a preset of conf/experiment/; choose one of: "
                    f"{', '.join(presets)}"
                )


# --------------------------------------------------------------------------------------
# Config changes on resume (docs/RUNS.md)

#: Fields a resume may change freely: where the run executes, how it is split over devices,
#: what it records and when it stops. A name ending in "." covers a whole group. Every other
#: field changes what is computed ("math") and refuses to resume unless `resume.accept`
#: names it. train.steps only says where to stop: the schedule's length is compared as
#: optim.schedule_steps (null means train.steps), and the held-out documents as the
#: effective data.eval_fraction (0 while nothing is held out).
RESUME_FREE = (
    "run.",
    "train.steps",
    "train.micro_batch_size",
    "train.log_every",
    "train.peak_tflops",
    "train.profile_steps",
    "train.profile_memory",
    "train.deterministic",
    "train.dry_run",
    "train.eval_only",
    "train.gc_every",
    "train.divergence_ratio",
    "parallel.name",
    "parallel.dp_replicate",
    "parallel.dp_shard",
    "parallel.tp",
    "parallel.cp",
    "parallel.cp_comm_type",
    "parallel.cp_a2a_size",
    "parallel.reshard_after_forward",
    "parallel.keep_gathered_blocks",
    "parallel.sequence_parallel",
    "parallel.activation_checkpointing",
    "parallel.activation_checkpointing_every",
    "parallel.nccl_high_priority",
    "parallel.collective_timeout_s",
    "parallel.grad_reduce",
    "checkpoint.",
    "logger.",
    "eval.",
    "resume.",
    "experiment.",
    "data.num_proc",
    "data.cache_dir",
    "data.eval_split",
)

_ABSENT = "<absent>"


def _covers(name: str, path: str) -> bool:
    name = name.rstrip(".")
    return path == name or path.startswith(name + ".")


def is_free_on_resume(path: str) -> bool:
    return any(_covers(name, path) for name in RESUME_FREE)


def schema_defaults() -> dict:
    """The whole config with every group's dataclass defaults, as plain containers."""
    from omegaconf import OmegaConf

    cfg = Config(
        model=ModelConfig(),
        recipe=RecipeConfig(),
        parallel=ParallelConfig(),
        checkpoint=CheckpointConfig(),
        data=DataConfig(),
        optim=OptimConfig(),
        logger=LoggerConfig(),
    )
    return OmegaConf.to_container(OmegaConf.structured(cfg))


def _paths(tree: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in tree.items():
        path = f"{prefix}{k}"
        out.add(path)
        if isinstance(v, dict):
            out |= _paths(v, path + ".")
    return out


def check_accept(names: Sequence[str]) -> None:
    """Every `resume.accept` entry names a config field or group."""
    known = _paths(schema_defaults())
    for name in names:
        if name not in known and not _covers("experiment", name):
            raise ConfigError(
                f"resume.accept: {name!r} is not a config field; name fields as in the "
                "config (resume.accept=[optim.lr]) or whole groups (resume.accept=[optim])"
            )


@dataclass
class Change:
    """One field whose value differs between the checkpoint's config and this run's."""

    path: str
    old: Any
    new: Any
    #: Other names that accept it (the field the user edited, when `path` is derived).
    via: tuple[str, ...] = ()
    note: str = ""
    #: The field the user edited when `path` is derived from it (optim.schedule_steps left
    #: null follows train.steps): messages name it, and it is what resume.accept should name.
    edited: str | None = None

    @property
    def free(self) -> bool:
        return is_free_on_resume(self.path)

    @property
    def name(self) -> str:
        """The field to name to the user (and in resume.accept)."""
        return self.edited or self.path

    def accepted_by(self, names: Sequence[str]) -> bool:
        return any(_covers(n, p) for n in names for p in (self.path, *self.via))

    def __str__(self) -> str:
        return f"{self.name} {self.old} -> {self.new}" + (f" ({self.note})" if self.note else "")


def _merge_defaults(defaults: Any, saved: Any) -> Any:
    if isinstance(defaults, dict) and isinstance(saved, dict):
        out = dict(saved)
        for k, v in defaults.items():
            out[k] = _merge_defaults(v, saved[k]) if k in saved else v
        return out
    return saved


def _effective(tree: dict) -> dict:
    """Replace fields whose meaning depends on others by what they amount to."""
    tree = {k: (dict(v) if isinstance(v, dict) else v) for k, v in tree.items()}
    optim, train, data = tree.get("optim", {}), tree.get("train", {}), tree.get("data", {})
    if optim.get("schedule_steps") is None:
        optim["schedule_steps"] = train.get("steps")
    holding = (tree.get("eval") or {}).get("every", 0) > 0 and not data.get("eval_split")
    data["eval_fraction"] = data.get("eval_fraction") if holding else 0.0
    return tree


def _diff(old: Any, new: Any, path: str, out: list[Change]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for k in [*new, *(k for k in old if k not in new)]:
            _diff(old.get(k, _ABSENT), new.get(k, _ABSENT), f"{path}.{k}" if path else k, out)
    elif new is _ABSENT or new == _ABSENT:
        return  # a field this code no longer has: nothing to compare it with
    elif old != new:
        out.append(Change(path, old, new))


#: Fields whose default is not what the code did before they existed: a saved config that
#: predates one of them is read with this value (what its run did), not with the default.
PREDATING_VALUES = {"data.document_mask": False}


def _with_predating_values(tree: dict) -> dict:
    for path, value in PREDATING_VALUES.items():
        *groups, leaf = path.split(".")
        node = tree
        for g in groups:
            node = node.setdefault(g, {}) if isinstance(node.get(g, {}), dict) else {}
        node.setdefault(leaf, value)
    return tree


def config_changes(saved_yaml: str, current_yaml: str) -> list[Change]:
    """Every field that differs between two resolved configs (train.py's config.yaml text),
    on their effective values; fields the saved config predates count as their default
    (or as `PREDATING_VALUES` says)."""
    import yaml

    defaults = schema_defaults()
    saved_tree = _with_predating_values(yaml.safe_load(saved_yaml) or {})
    raw = [_merge_defaults(defaults, t) for t in (saved_tree, yaml.safe_load(current_yaml) or {})]
    saved, current = map(_effective, raw)
    changes: list[Change] = []
    _diff(saved, current, "", changes)
    # optim.schedule_steps left null on both sides: the user changed train.steps.
    follows_steps = all((t.get("optim") or {}).get("schedule_steps") is None for t in raw)
    for c in changes:
        if c.path == "optim.schedule_steps":
            c.via = ("train.steps",)
            if follows_steps:
                c.edited = "train.steps"
                c.note = (
                    f"the LR schedule's length: {c.new} steps unless optim.schedule_steps={c.old}"
                )
            else:
                c.note = "the LR schedule's length"
        elif c.path == "data.eval_fraction":
            c.via = ("eval.every", "data.eval_split")
            c.note = "documents held out of training for evaluation"
    return changes


def _lr_at_resume(saved_yaml: str, current_yaml: str, step: int) -> str:
    """What a new schedule length does to the lr of the first resumed step: "; the lr of step
    N: A -> B" (rising again when the cosine is stretched), or "" when it stays."""
    import yaml

    def lr(text: str) -> float:
        tree = _merge_defaults(schema_defaults(), yaml.safe_load(text) or {})
        o = {k: v for k, v in tree["optim"].items() if k in OptimConfig.__dataclass_fields__}
        cfg = OptimConfig(**o)
        return cfg.lr * lr_lambda(cfg, cfg.schedule_steps or tree["train"]["steps"])(step)

    old, new = lr(saved_yaml), lr(current_yaml)
    if f"{old:.2e}" == f"{new:.2e}":
        return ""
    rises = " (the lr rises again)" if new > old else ""
    return f"; the lr of step {step + 1}: {old:.2e} -> {new:.2e}{rises}"


def check_resume(
    saved_yaml: str | None, current_yaml: str, accept: Sequence[str], step: int
) -> list[Change]:
    """Compare this run's config with the checkpoint's. Returns the accepted changes of
    fields that change the training; raises ConfigError (one line) for any other."""
    if not saved_yaml:
        return []  # a checkpoint saved without its config: nothing to compare
    math = [c for c in config_changes(saved_yaml, current_yaml) if not c.free]
    for c in math:
        if c.path == "optim.schedule_steps":
            c.note += _lr_at_resume(saved_yaml, current_yaml, step)
    refused = [c for c in math if not c.accepted_by(accept)]
    if refused:
        import yaml

        run = (yaml.safe_load(current_yaml) or {}).get("run") or {}
        where = f"{run.get('root', 'runs')}/{run.get('name', '')}"
        names = ",".join(dict.fromkeys(c.name for c in refused))
        raise ConfigError(
            f"resume: {where} has a checkpoint (step {step}) of another config: "
            f"{'; '.join(map(str, refused))}; to start a separate run, add run.name=NAME; to "
            f"continue this run with the change on purpose, add resume.accept=[{names}]; or "
            "resume with the checkpoint's values"
        )
    return math


def config_warnings(cfg: Config) -> list[str]:
    """Valid settings that are likely not what the user meant: one line each, printed at
    start-up (nothing is refused)."""
    out = []
    o, length = cfg.optim, cfg.optim.schedule_steps or cfg.train.steps
    if o.warmup_steps > length:
        source = "optim.schedule_steps" if o.schedule_steps else "train.steps"
        out.append(
            f"warning: optim.warmup_steps={o.warmup_steps} exceeds the LR schedule's {length} "
            f"steps ({source}): the lr never reaches optim.lr={o.lr}; lower "
            "optim.warmup_steps to train at the full lr"
        )
    return out


def check_recipe_at_resume(
    saved_yaml: str | None, current_yaml: str, accept: Sequence[str], step: int
) -> None:
    """The recipe in force at the checkpoint's step must be the one it was saved with, unless
    a recipe change is accepted: with an unchanged `recipe.switch`, a fraction `at` still moves
    when the schedule's length does (an accepted train.steps), which would switch the recipe
    back or forth without anyone asking for it."""
    import yaml

    from recipes.switch import label, saved_recipe

    if not saved_yaml or any(_covers(n, "recipe.switch") for n in accept):
        return
    old = saved_recipe(yaml.safe_load(saved_yaml), step)
    new = saved_recipe(yaml.safe_load(current_yaml), step)
    if old is None or new is None or old == new:
        return
    if any(_covers(n, "recipe") or n.startswith("recipe.") for n in accept):
        return
    raise ConfigError(
        f"resume: the checkpoint (step {step}) was saved with recipe {label(old)}, but this "
        f"config's recipe.switch puts {label(new)} at that step (its fractions follow the "
        "schedule's length); give recipe.switch's `at` as steps, or accept the change on purpose "
        "with resume.accept=[recipe.switch]"
    )


class SegmentConfig:
    """This run's config against a resumed checkpoint's, and the record of each segment.

    Called with the checkpoint's TrainState as soon as it loads (checkpoint/state.py
    `on_load`), before any other part loads and before anything in the run directory
    changes: `check_resume` refuses, in one line, a change of the training that
    `resume.accept` does not name. `record` then writes <run_dir>/config.yaml (this segment's
    config) and configs/segment-<start step>.yaml (every segment's; a fresh start moves an
    earlier timeline's configs/ aside, a second segment from the same step keeps the first
    one's file under another name: nothing is overwritten)."""

    def __init__(self, config_yaml: str, accept: Sequence[str]):
        self.yaml, self.accept = config_yaml, list(accept)
        self.accepted: list[Change] = []

    def __call__(self, loaded) -> None:
        self.accepted = self.check(loaded.saved_config_yaml, loaded.step)

    def check(self, saved_yaml: str | None, step: int) -> list[Change]:
        """The comparison alone (train.py runs it before the model is built, from the
        checkpoint's config.yaml): the accepted changes, or a one-line ConfigError."""
        accepted = check_resume(saved_yaml, self.yaml, self.accept, step)
        check_recipe_at_resume(saved_yaml, self.yaml, self.accept, step)
        return accepted

    def accepts(self, path: str) -> bool:
        """Whether `resume.accept` names `path` (or a group holding it)."""
        return any(_covers(n, path) for n in self.accept)

    def record(
        self,
        run_dir: Path,
        start_step: int,
        recipe: str | None = None,
        switch: str | None = None,
        device: str | None = None,
    ) -> Path:
        """recipe: the recipe this segment trains with (recipe.switch runs); switch: the recipe
        before, when the segment starts at a switch inside the running job; device: where it
        ran (cpu, cuda), for tools/compare_runs.py (a GPU run without train.deterministic
        differs from its repeat by noise)."""
        import time

        configs = run_dir / "configs"
        stamp = int(time.time())
        if start_step == 0 and configs.is_dir() and any(configs.iterdir()):
            configs.rename(run_dir / f"configs.{stamp}")
        configs.mkdir(exist_ok=True)
        header = f"# segment from step {start_step}, started {time.strftime('%Y-%m-%d %H:%M:%S')}"
        if self.accepted and switch is None:
            header += "; accepted changes: " + "; ".join(map(str, self.accepted))
        if switch is not None:
            header += f"; recipe switch: {switch} -> {recipe}"
        elif recipe is not None:
            header += f"; recipe: {recipe}"
        if device is not None:
            header += f"; device: {device}"
        segment = configs / f"segment-{start_step:07d}.yaml"
        if segment.exists():
            segment.rename(configs / f"segment-{start_step:07d}.{stamp}.yaml")
        segment.write_text(header + "\n" + self.yaml)
        (run_dir / "config.yaml").write_text(self.yaml)
        return segment
