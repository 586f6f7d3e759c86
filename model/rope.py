"""Rotary position embedding with Llama-3 frequency scaling, shared by both implementations.

Convention: the "rotate half" (GPT-NeoX / Hugging Face) layout, where the first and second
halves of each head dimension form the rotated pairs. This is TE's non-interleaved RoPE, so
`rope_freqs` feeds TE's fused kernel unchanged, and HF Llama weights load without permuting.
"""

from __future__ import annotations

import math

import torch

from model.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) in fp32, with Llama-3 scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = cfg.rope_scaling
    if s is None:
        return inv.float()
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * inv / s.factor + smooth * inv
    out = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, blended, out).float()


def rope_freqs(
    cfg: ModelConfig, seq_len: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Angles (seq_len, 1, 1, head_dim) in fp32: [theta, theta] per position (TE's format)."""
    inv = inv_frequencies(cfg).to(device)
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(pos, inv)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]


def apply_rope(
    x: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """x: (batch, seq, heads, head_dim); freqs from `rope_freqs`. Computed in fp32.
    positions: (batch, seq) position of each token (restarting at each document); None means
    0..seq-1 in every row."""
    if positions is None:
        f = freqs[: x.shape[1]].transpose(0, 1)  # (1, seq, 1, head_dim)
    else:
        f = freqs[positions][:, :, 0]  # (batch, seq, 1, head_dim)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * f.cos() + rotated * f.sin()).type_as(x)
