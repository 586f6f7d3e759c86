"""Seeded initialization that does not depend on the implementation or the layout.

Every parameter's *full* value is drawn from its own generator, seeded from (seed, name), on
the device the parameter lives on; each rank then keeps the part its (DTensor) parameter
holds. So the TE and reference models, and every parallel layout, start from the same global
weights (docs/ARCHITECTURE.md, decision 2). CPU and CUDA generators differ: a CPU run and a GPU run
start from different (equally valid) weights.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from model.config import ModelConfig


def param_seed(seed: int, name: str) -> int:
    return int(hashlib.sha256(f"{seed}/{name}".encode()).hexdigest()[:15], 16)


def init_std(cfg: ModelConfig, name: str) -> float | None:
    """Std of a parameter's normal init; None means ones (norm weights)."""
    if name.endswith("norm_weight") or name.endswith("norm.weight"):
        return None
    if name.endswith("proj.weight") or name.endswith("fc2_weight"):
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return cfg.init_std


def full_init_value(cfg: ModelConfig, name: str, shape, seed: int, device) -> torch.Tensor:
    std = init_std(cfg, name)
    if std is None:
        return torch.ones(shape, device=device)
    gen = torch.Generator(device=device).manual_seed(param_seed(seed, name))
    return torch.randn(shape, generator=gen, device=device) * std


def local_part(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The slice of `full` that `param` (plain tensor or DTensor) holds on this rank."""
    if isinstance(param, DTensor):
        return distribute_tensor(
            full, param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
    return full


def canonical_name(name: str) -> str:
    """Strip wrapper prefixes (activation checkpointing, torch.compile) from a parameter name."""
    for junk in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(junk, "")
    return name


@torch.no_grad()
def init_weights(model: torch.nn.Module, cfg: ModelConfig, seed: int) -> None:
    for name, p in model.named_parameters():
        name = canonical_name(name)
        device = p.device
        full = full_init_value(cfg, name, p.shape, seed, device)
        local = p.to_local() if isinstance(p, DTensor) else p
        local.copy_(local_part(p, full).to(local.dtype))
