"""Activation checkpointing on the TE model: the same losses and gradients as without it, for
every recipe this GPU runs, with and without quantized weights, in every mode.

    python -m pytest -m gpu tests/gpu/test_ac_gpu.py -q -s

Two optimizer steps per case (so delayed scaling's amax history, updated after step 1, takes
part in step 2): the losses of both steps must be equal, and the gradients of step 2 equal to
rounding (the recompute runs the same kernels in the same quantization state; a recompute
outside the FP8 context changes gradients at the FP8 error level, ~1e-2, or fails outright
with TE's "different number of tensors" error, as it did before parallel/ac.py).
"""

from __future__ import annotations

import pytest
import torch

from model import te_available
from tests.harness.matrix import VARIANTS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not te_available(), reason="needs CUDA and TransformerEngine"),
]

#: Relative norm difference allowed per gradient (bf16 reductions may be ordered differently).
GRAD_RTOL = 1e-3


def _run(recipe_name: str, quantized_init: bool, mode: str, every: int = 1):
    import compat
    from model.config import ModelConfig
    from optim import OptimConfig, build_optimizer
    from parallel import ParallelConfig, ParallelDims
    from recipes import build_recipe
    from recipes.config import RecipeConfig
    from steps import train_step
    from train import build_parallel_model

    compat.apply_all()  # what train.py does before building a model
    cfg = ModelConfig(
        name="ac", dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=512, max_seq_len=256
    )
    rcfg = RecipeConfig(name=recipe_name, quantized_init=quantized_init, bf16_layers=[-1])
    recipe = build_recipe(rcfg, cfg.n_layers)
    pcfg = ParallelConfig(activation_checkpointing=mode, activation_checkpointing_every=every)
    dims = ParallelDims(pcfg, 1)
    device = torch.device("cuda")
    model, group = build_parallel_model(cfg, "te", recipe, dims, device, seed=5)
    opt = build_optimizer(model, OptimConfig(lr=1e-3), "te", recipe.fused_adam_kwargs())
    recipe.attach_optimizer(model, opt, group)
    g = torch.Generator(device="cuda").manual_seed(11)
    tokens = torch.randint(0, cfg.vocab_size, (2, 2, 129), device=device, generator=g)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    loss1, _ = train_step(model, opt, tokens[0, :, :-1], tokens[0, :, 1:], autocast=autocast)
    with autocast:
        loss2 = model(tokens[1, :, :-1], labels=tokens[1, :, 1:])
    loss2.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss1.item(), loss2.item(), grads


@pytest.mark.parametrize("recipe_name,quantized_init", VARIANTS)
def test_activation_checkpointing_matches(recipe_name, quantized_init):
    from recipes import runnable_recipes
    from recipes.recipe import device_capability

    _, capability = device_capability(torch.device("cuda"))
    if recipe_name not in runnable_recipes(capability):
        pytest.skip(f"{recipe_name} does not run on sm_{capability[0]}{capability[1]}")
    ref = _run(recipe_name, quantized_init, "none")
    for mode, every in (("full", 1), ("mlp", 1), ("full", 2), ("selective", 1)):
        got = _run(recipe_name, quantized_init, mode, every)
        assert got[0] == ref[0] and got[1] == ref[1], (mode, every, got[:2], ref[:2])
        assert got[2].keys() == ref[2].keys()
        worst = max(
            ((got[2][n] - ref[2][n]).norm() / ref[2][n].norm().clamp_min(1e-30)).item()
            for n in ref[2]
        )
        print(
            f"\n{recipe_name} q={quantized_init} ac={mode}/{every}: losses {got[:2]}, "
            f"max grad rel diff {worst:.2e}"
        )
        assert worst <= GRAD_RTOL, (mode, every, worst)
