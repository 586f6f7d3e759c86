"""Precision recipe config (the `recipe` group). Field meanings follow TE's recipe classes."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING


@dataclass
class RecipeSwitchConfig:
    """One entry of `recipe.switch`: from step `at` on, these recipe fields change (the fields
    left null keep the value in force before). recipes/switch.py resolves and checks them."""

    #: The last step trained with the recipe before: a step (an integer >= 1), or a fraction
    #: of the LR schedule in (0, 1) (0.8: after 80% of optim.schedule_steps, train.steps by
    #: default). The steps after it train with the new recipe.
    at: float = MISSING
    #: The recipe's name from that step on (null: unchanged).
    name: str | None = None
    #: quantized_init from that step on (null: unchanged; false when switching to bf16).
    quantized_init: bool | None = None
    #: bf16_layers from that step on (null: unchanged).
    bf16_layers: list[int] | None = None
    #: fp8_attention from that step on (null: unchanged; false when switching to bf16 or
    #: fp8_block).
    fp8_attention: bool | None = None


@dataclass
class RecipeConfig:
    #: bf16 | fp8_delayed | fp8_cs | fp8_block | mxfp8 | nvfp4
    name: str = "bf16"
    #: Build weights inside TE quantized_model_init (low-precision parameters, fp32
    #: master weights in FusedAdam). False: bf16 parameters, low-precision compute only.
    quantized_init: bool = False
    #: FP8 format: HYBRID (E4M3 forward, E5M2 backward) or E4M3.
    fp8_format: str = "HYBRID"
    #: fp8_delayed: steps of amax history a scale is computed from (>= 1).
    amax_history_len: int = 1024
    #: fp8_delayed: reduction over the amax history: max | most_recent.
    amax_compute_algo: str = "max"
    #: fp8_delayed: scales are divided by 2^margin, headroom against growing amax (>= 0).
    margin: int = 0
    #: fp8_block: scales rounded to powers of 2.
    power_2_scale: bool = True
    #: fp8_block: activation scaling blocks: 1 (1x128 tiles) | 2 (128x128 blocks).
    x_block_scaling_dim: int = 1
    #: fp8_block: weight scaling blocks: 1 (1x128 tiles) | 2 (128x128 blocks; needed with
    #: quantized_init on several ranks).
    w_block_scaling_dim: int = 2
    #: fp8_block: gradient scaling blocks: 1 (1x128 tiles) | 2 (128x128 blocks).
    grad_block_scaling_dim: int = 1
    #: nvfp4: turn off the random Hadamard transform applied before quantizing.
    disable_rht: bool = False
    #: nvfp4: turn off stochastic rounding of gradients.
    disable_stochastic_rounding: bool = False
    #: nvfp4: quantize weights in 1x16 blocks instead of 16x16 (2-D); must stay false with
    #: quantized_init on several ranks.
    disable_2d_quantization: bool = False
    #: Dot-product attention in FP8 too (TE's fp8_dpa: cuDNN fused FP8 attention), always with
    #: delayed scaling, so a position's output never depends on later positions: fp8_delayed
    #: uses its own recipe; fp8_cs, mxfp8 and nvfp4 keep theirs for the Linear layers and run
    #: attention under TE's delayed-scaling attention recipe (train.py sets its NVTE_DPA_*
    #: variables). Needs sm_90+ (head_dim 128 on sm_90) and data.document_mask=false; not
    #: with bf16 or fp8_block (docs/PRECISION.md, FP8 attention).
    fp8_attention: bool = False
    #: Transformer block indices kept in bf16 (negative counts from the end, e.g. [0, -1]).
    #: The output head is always kept in high precision.
    bf16_layers: list[int] = field(default_factory=list)
    #: Recipe changes during the run, applied in the running job at their step and again on
    #: resume, e.g. [{at: 0.8, name: bf16}] (docs/RECIPE_SWITCH.md).
    switch: list[RecipeSwitchConfig] = field(default_factory=list)
