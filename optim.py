"""Optimizer, LR schedule and gradient clipping for both model implementations."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from errors import require

#: optim.moment_dtype: the dtypes TE FusedAdam keeps Adam's moments in (here).
MOMENT_DTYPES = ("fp32", "bf16")


@dataclass
class OptimConfig:
    #: adamw: torch AdamW for the reference implementation, TE FusedAdam for TE.
    name: str = "adamw"
    #: Peak learning rate, reached at the end of warmup.
    lr: float = 3e-3
    #: The cosine decays to lr * min_lr_ratio at the end of the schedule (in [0, 1]).
    min_lr_ratio: float = 0.1
    #: Linear warmup from 0 to lr, in optimizer steps (longer than the schedule: a warning).
    warmup_steps: int = 30
    #: AdamW decoupled weight decay of the matrix weights (1-D parameters such as norms: none).
    weight_decay: float = 0.1
    #: Adam's first-moment decay, in [0, 1).
    beta1: float = 0.9
    #: Adam's second-moment decay, in [0, 1).
    beta2: float = 0.95
    #: Adam's denominator epsilon (> 0).
    eps: float = 1e-8
    #: Max global grad norm (0 disables clipping).
    grad_clip: float = 1.0
    #: Length of the warmup + cosine schedule in optimizer steps; past it the lr stays at
    #: lr * min_lr_ratio. null: train.steps. Set it to the old train.steps to extend a run
    #: without changing its schedule (docs/RUNS.md).
    schedule_steps: int | None = None
    #: dtype of Adam's two moments: fp32 | bf16 (TE FusedAdam only: half their memory, 4
    #: bytes a parameter less; the update is still computed in fp32, but the moments are
    #: rounded to bf16 after every step, a numerics change). Checkpoints hold them in fp32.
    moment_dtype: str = "fp32"

    def validate(self) -> None:
        require(self.name == "adamw", f"optim.name={self.name!r} is not supported; use adamw")
        require(
            self.moment_dtype in MOMENT_DTYPES,
            f"optim.moment_dtype={self.moment_dtype!r} is not one of {', '.join(MOMENT_DTYPES)}",
        )
        require(self.lr > 0, f"optim.lr={self.lr} must be > 0")
        require(
            0 <= self.min_lr_ratio <= 1,
            f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]",
        )
        require(self.warmup_steps >= 0, f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        require(self.weight_decay >= 0, f"optim.weight_decay={self.weight_decay} must be >= 0")
        require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "optim.beta1/beta2 must be in [0, 1)")
        require(self.eps > 0, f"optim.eps={self.eps} must be > 0")
        require(self.grad_clip >= 0, f"optim.grad_clip={self.grad_clip} must be >= 0 (0 disables)")
        require(
            self.schedule_steps is None or self.schedule_steps >= 2,
            f"optim.schedule_steps={self.schedule_steps} must be >= 2 (a warmup + cosine "
            "schedule of one step is no schedule), or null: train.steps",
        )


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (linear and embedding weights) decay; norm weights (1-D) do not."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    model: torch.nn.Module, cfg: OptimConfig, impl: str, fused_adam_kwargs: dict | None = None
) -> torch.optim.Optimizer:
    """torch AdamW for the reference (fp32 moments: train.check_config refuses others); TE
    FusedAdam (DTensor-aware, optional fp32 master weights for quantized parameters, moments
    in optim.moment_dtype) for the TE implementation."""
    groups = param_groups(model, cfg.weight_decay)
    common = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if impl == "te":
        from transformer_engine.pytorch.optimizers import FusedAdam

        kwargs = {**moment_kwargs(cfg), **(fused_adam_kwargs or {})}
        return FusedAdam(groups, adam_w_mode=True, **common, **kwargs)
    return torch.optim.AdamW(groups, **common)


def moment_kwargs(cfg: OptimConfig) -> dict:
    """FusedAdam's dtypes for Adam's moments (names as in TE 2.20.2's fused_adam.py). With both
    in bf16 its kernel reads and writes them directly (no fp32 copies, no per-tensor scale)."""
    if cfg.moment_dtype == "fp32":
        return {}
    return {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16}


def lr_lambda(cfg: OptimConfig, total_steps: int):
    """Linear warmup from lr/warmup to lr, then cosine decay to lr * min_lr_ratio at the end.

    Indexed by the number of optimizer steps already taken (LambdaLR's convention)."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        span = max(1, total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine

    return factor


def build_scheduler(optimizer, cfg: OptimConfig, total_steps: int):
    """Warmup + cosine over optim.schedule_steps (null: `total_steps`, i.e. train.steps)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg, cfg.schedule_steps or total_steps)
    )


def apply_config(optimizer: torch.optim.Optimizer, scheduler, cfg: OptimConfig) -> None:
    """After a resume: make this run's optimizer settings the ones in force.

    A checkpoint restores the param groups as they were saved (lr, initial_lr, betas, eps,
    weight_decay) and LambdaLR's base_lrs; the schedule's shape (warmup, min_lr_ratio,
    length) is the new lambda already, since a plain function is not saved. Here the saved
    hyperparameters are replaced by the config's and the current lr is recomputed as
    LambdaLR does (base_lr * factor(last_epoch)), so an accepted change of optim.lr, ...
    takes effect from the first resumed step on. With an unchanged config every value is
    set to what it already was (bitwise). Groups follow `param_groups`: [decay, no_decay].
    """
    decay = [cfg.weight_decay, 0.0]
    for i, group in enumerate(optimizer.param_groups):
        group["betas"] = (cfg.beta1, cfg.beta2)
        group["eps"] = cfg.eps
        if i < len(decay):
            group["weight_decay"] = decay[i]
        group["initial_lr"] = cfg.lr
    scheduler.base_lrs = [cfg.lr for _ in optimizer.param_groups]
    for group, base, factor in zip(
        optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas
    ):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


@torch.no_grad()
def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """Global gradient norm over plain and DTensor gradients on any mix of meshes; clips
    when max_norm > 0. Returns the norm as a 0-d tensor (no host sync).

    Gradients are grouped by (mesh, placements): each group's norm is one foreach kernel and,
    for DTensors, one reduction across the ranks that hold its shards."""
    params = [p for p in params if p.grad is not None]
    groups: dict = defaultdict(list)
    for p in params:
        g = p.grad
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups[key].append(g)
    norms = []
    for grads in groups.values():
        n = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
