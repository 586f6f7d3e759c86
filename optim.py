"""Optimizer, LR schedule and gradient clipping for both model implementations."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor

from config import OptimConfig


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
