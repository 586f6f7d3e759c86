"""The Llama model, twice: TE (model/te_llama.py) and plain PyTorch (model/llama.py).

`build_model` is the one seam where the two implementations meet.
"""

from __future__ import annotations

import importlib.util

import torch

from model.config import ModelConfig
from model.init import init_weights

__all__ = ["ModelConfig", "build_model", "init_weights", "resolve_impl", "te_available"]


def te_available() -> bool:
    """TE is usable when CUDA is present and transformer_engine.pytorch imports."""
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def resolve_impl(impl: str) -> str:
    """'auto' -> 'te' when TE and CUDA are available, else 'torch'."""
    if impl == "auto":
        return "te" if te_available() else "torch"
    return impl


def build_model(cfg: ModelConfig, impl: str, **te_kwargs) -> torch.nn.Module:
    """Construct on the current default device (use `torch.device("meta")` for large models).

    impl must be resolved ('te' or 'torch'). te_kwargs go to the TE implementation only
    (the precision recipe, tensor-parallel group, sequence parallel); the reference runs bf16
    only (recipes.check_recipe refuses anything else for it).
    """
    if impl == "torch":
        from model.llama import Llama

        return Llama(cfg)
    if impl == "te":
        from model.te_llama import TELlama

        return TELlama(cfg, **te_kwargs)
    raise ValueError(f"unknown model implementation {impl!r}")
