"""Bytes that parameters occupy on this rank, seeing through DTensor and quantized tensors."""

from __future__ import annotations

import torch


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
