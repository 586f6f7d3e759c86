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
from data.config import DataConfig
from errors import ConfigError
from model.config import ModelConfig
from parallel.config import ParallelConfig
from recipes.config import RecipeConfig


@dataclass
class RunConfig:
    #: Run directory is <root>/<name>; re-running with the same name resumes it.
    name: str = "${model.name}-${recipe.name}-${parallel.name}"
    root: str = "runs"


@dataclass
class TrainConfig:
    steps: int = 300
    #: Sequences per optimizer step over all data-parallel ranks.
    global_batch_size: int = 16
    #: Sequences per forward/backward on one rank; the rest is gradient accumulation.
    #: null: the whole per-rank share of the global batch (no accumulation).
    micro_batch_size: int | None = None
    log_every: int = 10
    seed: int = 1234
    #: auto | cpu | cuda
    device: str = "auto"
    #: Peak dense bf16 TFLOP/s of one device for MFU; null = look up by GPU name (none on CPU).
    peak_tflops: float | None = None
    #: Steps to record with torch.profiler (a contiguous range, e.g. [10,11,12]); the trace
    #: and a kernel table go to <run_dir>/profile/ (profiling.py). Empty: no profiling.
    profile_steps: list[int] = field(default_factory=list)


@dataclass
class OptimConfig:
    #: adamw: torch AdamW for the reference implementation, TE FusedAdam for TE.
    name: str = "adamw"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    #: Max global grad norm (0 disables clipping).
    grad_clip: float = 1.0


@dataclass
class WandbConfig:
    #: disabled | offline | online
    mode: str = "disabled"
    project: str = "te-llama"
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)


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


IMPLS = ("auto", "te", "torch")
DEVICES = ("auto", "cpu", "cuda")
WANDB_MODES = ("disabled", "offline", "online")


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _one_of(value: Any, allowed: tuple, field_name: str) -> None:
    _require(value in allowed, f"{field_name}={value!r} is not one of {', '.join(allowed)}")


def validate(cfg: Config) -> None:
    """Single-config rules (no environment needed). Raises ConfigError."""
    t, o, m, d = cfg.train, cfg.optim, cfg.model, cfg.data
    _require(
        "/" not in cfg.run.name and cfg.run.name.strip() != "",
        f"run.name={cfg.run.name!r} must be a non-empty name without '/'",
    )
    _one_of(t.device, DEVICES, "train.device")
    _require(t.steps > 0, f"train.steps={t.steps} must be > 0")
    _require(t.global_batch_size > 0, f"train.global_batch_size={t.global_batch_size} must be > 0")
    _require(
        t.micro_batch_size is None or t.micro_batch_size > 0,
        f"train.micro_batch_size={t.micro_batch_size} must be > 0 (or null)",
    )
    _require(t.log_every > 0, f"train.log_every={t.log_every} must be > 0")
    steps = sorted(t.profile_steps)
    _require(
        not steps or (steps[0] >= 1 and steps == list(range(steps[0], steps[-1] + 1))),
        f"train.profile_steps={list(t.profile_steps)} must be consecutive steps >= 1, "
        "e.g. [10,11,12]",
    )
    _require(o.name == "adamw", f"optim.name={o.name!r} is not supported; use adamw")
    _require(o.lr > 0, f"optim.lr={o.lr} must be > 0")
    _require(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
    _require(o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps} must be >= 0")
    _require(o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay} must be >= 0")
    _require(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optim.beta1/beta2 must be in [0, 1)")
    _require(o.eps > 0, f"optim.eps={o.eps} must be > 0")
    _require(o.grad_clip >= 0, f"optim.grad_clip={o.grad_clip} must be >= 0 (0 disables)")
    _one_of(m.impl, IMPLS, "model.impl")
    for name in (
        "dim",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "ffn_dim",
        "vocab_size",
        "pad_vocab_multiple",
        "max_seq_len",
    ):
        _require(getattr(m, name) > 0, f"model.{name}={getattr(m, name)} must be > 0")
    _require(
        m.dim % m.n_heads == 0, f"model.dim={m.dim} must be divisible by model.n_heads={m.n_heads}"
    )
    _require(
        m.n_heads % m.n_kv_heads == 0,
        f"model.n_heads={m.n_heads} must be divisible by model.n_kv_heads={m.n_kv_heads} (GQA)",
    )
    _require(
        m.head_dim % 2 == 0, f"model head_dim={m.head_dim} (dim/n_heads) must be even for RoPE"
    )
    _require(d.seq_len > 0, f"data.seq_len={d.seq_len} must be > 0")
    _require(
        d.seq_len <= m.max_seq_len,
        f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}; "
        "raise model.max_seq_len or lower data.seq_len",
    )
    _require(d.name in ("embedded", "hf"), f"data.name={d.name!r} is not one of embedded, hf")
    _require(
        d.name != "hf" or bool(d.path),
        "data.path is required with data=hf (a hub dataset name or local files)",
    )
    _one_of(cfg.checkpoint.mode, CHECKPOINT_MODES, "checkpoint.mode")
    _require(
        cfg.checkpoint.interval >= 0, f"checkpoint.interval={cfg.checkpoint.interval} must be >= 0"
    )
    _require(
        cfg.checkpoint.keep_last >= 1,
        f"checkpoint.keep_last={cfg.checkpoint.keep_last} must be >= 1",
    )
    _one_of(cfg.logger.wandb.mode, WANDB_MODES, "logger.wandb.mode")


def validate_batch(cfg: Config, dp_size: int) -> int:
    """Returns gradient-accumulation steps; the global batch must split evenly over DP ranks."""
    t = cfg.train
    _require(
        t.global_batch_size % dp_size == 0,
        f"train.global_batch_size={t.global_batch_size} must be divisible by the "
        f"data-parallel size {dp_size}; change it or the parallel degrees",
    )
    micro = t.micro_batch_size or t.global_batch_size // dp_size
    per_step = micro * dp_size
    _require(
        t.global_batch_size % per_step == 0,
        f"train.global_batch_size={t.global_batch_size} must be divisible by "
        f"train.micro_batch_size={micro} x data-parallel size {dp_size}; "
        "change one of them",
    )
    return t.global_batch_size // per_step
