"""Precision recipes: bf16, fp8_delayed, fp8_cs, fp8_block, mxfp8, nvfp4 (+ FP8 attention).

One `Recipe` object, built from the `recipe` config group, is the seam the model and trainer
use: the TE recipe object, autocast and quantized-init contexts, per-layer high precision,
quantized weights with FusedAdam master weights, and the weight amax-reduction policy.
TransformerEngine is imported only inside the functions that need it.
"""

from recipes.amax import set_weight_amax_groups, weight_amax_group, weight_quantizers
from recipes.attention import (
    apply_attention_environment,
    attention_environment,
    check_fp8_attention,
    cudnn_version,
)
from recipes.config import RecipeConfig
from recipes.quantized import master_weight_kwargs, quantize_weights, seed_master_weights
from recipes.recipe import (
    RECIPES,
    SUPPORTED,
    WEIGHT_TYPES,
    Recipe,
    TERecipeSpec,
    attention_recipe_spec,
    build_recipe,
    build_te_recipe,
    check_bf16_layers,
    check_recipe,
    check_recipe_layout,
    device_capability,
    resolve_bf16_layers,
    runnable_recipes,
    te_recipe_spec,
    te_support,
)

__all__ = [
    "RECIPES",
    "SUPPORTED",
    "WEIGHT_TYPES",
    "Recipe",
    "RecipeConfig",
    "TERecipeSpec",
    "apply_attention_environment",
    "attention_environment",
    "attention_recipe_spec",
    "build_recipe",
    "build_te_recipe",
    "check_bf16_layers",
    "check_fp8_attention",
    "check_recipe",
    "check_recipe_layout",
    "cudnn_version",
    "device_capability",
    "master_weight_kwargs",
    "quantize_weights",
    "resolve_bf16_layers",
    "runnable_recipes",
    "seed_master_weights",
    "set_weight_amax_groups",
    "te_recipe_spec",
    "te_support",
    "weight_amax_group",
    "weight_quantizers",
]
