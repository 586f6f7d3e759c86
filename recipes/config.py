"""Precision recipe config (the `recipe` group). Field meanings follow TE's recipe classes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RecipeConfig:
    #: bf16 | fp8_delayed | fp8_cs | fp8_block | mxfp8 | nvfp4
    name: str = "bf16"
    #: Build weights inside TE quantized_model_init (low-precision parameters, fp32
    #: master weights in FusedAdam). False: bf16 parameters, low-precision compute only.
    quantized_init: bool = False
    #: FP8 format: HYBRID (E4M3 forward, E5M2 backward) or E4M3.
    fp8_format: str = "HYBRID"
    #: DelayedScaling: amax history length, reduction over history ("max" | "most_recent"), margin.
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0
    #: Float8BlockScaling: power-of-2 scales and block dims (1 = 1x128 tiles, 2 = 128x128 blocks).
    power_2_scale: bool = True
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    #: NVFP4BlockScaling switches.
    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    #: Transformer block indices kept in bf16 (negative counts from the end, e.g. [0, -1]).
    #: The output head is always kept in high precision.
    bf16_layers: list[int] = field(default_factory=list)
