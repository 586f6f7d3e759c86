"""Recipe switches and checkpoints portable across recipes on one Hopper GPU (real TE 2.20.2).

    python -m pytest -m gpu tests/gpu/test_recipe_switch_gpu.py -q

1. State (in-process, the tiny TE model built by train.build_training, FusedAdam): a
   checkpoint saved under recipe A after 3 steps is loaded under recipe B; the high-precision
   weights (A's fp32 masters of quantized weights, else the parameters) and the moments come
   back bit for bit, quantized weights of B are B's cast of them, and B trains on exactly alike
   whether it resumed (a new run) or reloaded in the same process (the in-job switch).
   A -> B: fp8_delayed, fp8_cs, fp8_cs + quantized_init, fp8_block (+ quantized_init) -> bf16;
   bf16 -> fp8_cs (+ quantized_init); fp8_cs + quantized_init -> fp8_block + quantized_init;
   fp8_delayed -> fp8_delayed with bf16_layers (its amax history carries over).
2. train.py end to end: fp8_cs + quantized_init switching to bf16 after step 3 of 6 in one job
   equals the run stopped at step 3 and resumed (the later recipe from step 4), loss for loss.
3. MXFP8 / NVFP4 in a switch on sm_90: refused in one line before any work.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model import te_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not te_available(), reason="needs a CUDA GPU and TransformerEngine"),
]

#: Loss difference allowed between the in-job switch and the run resumed from the switch step.
#: Both run the same code on the same GPU (tests/harness/resume.py finds GPU resumes bitwise),
#: so none; a run-to-run nondeterminism of TE kernels would show here first.
LOSS_ATOL = 0.0
SWITCH_STEP, END = 3, 5

CASES = [
    ("fp8_delayed", "bf16"),
    ("fp8_cs", "bf16"),
    ("fp8_cs+q", "bf16"),
    ("fp8_block", "bf16"),
    ("fp8_block+q", "bf16"),
    ("bf16", "fp8_cs"),
    ("bf16", "fp8_cs+q"),
    ("fp8_cs+q", "fp8_block+q"),
    ("fp8_delayed", "fp8_delayed:0"),
]


def overrides(spec: str) -> list[str]:
    """'fp8_cs+q:0' -> Hydra overrides for recipe fp8_cs, quantized_init, bf16_layers=[0]."""
    spec, _, layers = spec.partition(":")
    name, _, q = spec.partition("+")
    out = [f"recipe={name}"]
    if q == "q":
        out.append("recipe.quantized_init=true")
    if layers:
        out.append(f"recipe.bf16_layers=[{layers}]")
    return out


BASE = ["model=tiny", "train.device=cuda", "model.impl=te", "optim.warmup_steps=2"]


def build(spec: str):
    """cfg, recipe, model, optimizer, scheduler as train.py builds them (one GPU, no mesh)."""
    import compat
    from config import compose_config
    from train import build_training, check_config

    cfg = compose_config([*BASE, *overrides(spec)])
    device = torch.device("cuda", 0)
    dims, _, impl = check_config(cfg, 1, device)
    dims.build_mesh(device.type)  # one process: no mesh, as train.py on one GPU
    compat.apply_all()
    torch.manual_seed(0)
    recipe, model, optimizer, scheduler = build_training(cfg, cfg.recipe, impl, dims, device)
    return cfg, recipe, model, optimizer, scheduler


def state_of(cfg, recipe, model, optimizer, scheduler, logs):
    from omegaconf import OmegaConf

    from checkpoint import TrainState, training_state
    from tests.helpers import FakeLoader

    train_state = TrainState(config_yaml=OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    state = training_state(
        model,
        optimizer,
        scheduler,
        FakeLoader(),
        train_state,
        te_recipe=recipe.te_recipe(),
        recipe=recipe,
        log=logs.append,
    )
    return train_state, state


def manager(root: Path):
    from checkpoint import CheckpointManager
    from checkpoint.config import CheckpointConfig

    cfg = CheckpointConfig(mode="sync", interval=0, resume="auto")
    return CheckpointManager(cfg, root, 0, 1, log=lambda m: None)


def train(model, optimizer, scheduler, steps) -> list[float]:
    from steps import train_step
    from tests.helpers import FakeLoader

    losses = []
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    for step in steps:  # the same 8 sequences for a step in every run
        batch = torch.stack([FakeLoader.sample(i + 8 * step) for i in range(8)]).cuda()
        loss, _ = train_step(
            model,
            optimizer,
            batch[:, :-1],
            batch[:, 1:],
            grad_clip=1.0,
            scheduler=scheduler,
            autocast=autocast,
        )
        losses.append(loss.item())
    return losses


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _quantized(t) -> bool:
    return hasattr(t, "_quantizer") and hasattr(t, "dequantize")


def high_precision(model, optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if _quantized(_local(p)):
            value = optimizer.get_unscaled_state(p, "master_param")
        else:
            value = p
        out[name] = _local(value).detach().float().cpu().clone()
    return out


def moments(model, optimizer) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{k}": _local(optimizer.get_unscaled_state(p, k)).detach().cpu().clone()
        for name, p in model.named_parameters()
        for k in ("exp_avg", "exp_avg_sq")
    }


@pytest.mark.parametrize("a, b", CASES, ids=[f"{a}->{b}" for a, b in CASES])
def test_checkpoint_loads_under_another_recipe(tmp_path, a, b):
    cfg, recipe, model, optimizer, scheduler = build(a)
    train(model, optimizer, scheduler, range(1, SWITCH_STEP + 1))
    train_state, state = state_of(cfg, recipe, model, optimizer, scheduler, [])
    train_state.step = SWITCH_STEP
    ckpt = manager(tmp_path)
    ckpt.save(SWITCH_STEP, state)
    ckpt.finish(SWITCH_STEP, state, save=False)
    hp, mom = high_precision(model, optimizer), moments(model, optimizer)
    steps_a = [g.get("step") for g in optimizer.param_groups]
    del model, optimizer, scheduler, state

    def load(reload: bool):
        cfg_b, recipe_b, model_b, opt_b, sched_b = build(b)
        logs: list[str] = []
        _, state_b = state_of(cfg_b, recipe_b, model_b, opt_b, sched_b, logs)
        m = manager(tmp_path)
        if reload:
            m.reload(SWITCH_STEP, state_b)
        else:
            assert m.resume(state_b) == SWITCH_STEP
        return recipe_b, model_b, opt_b, sched_b, logs

    recipe_b, model_b, opt_b, sched_b, logs = load(reload=False)
    got, got_m = high_precision(model_b, opt_b), moments(model_b, opt_b)
    for name in hp:
        assert torch.equal(got[name], hp[name]), name
    for name in mom:
        assert torch.equal(got_m[name], mom[name]), name
    assert [g.get("step") for g in opt_b.param_groups] == steps_a
    n_quantized = 0
    for name, p in model_b.named_parameters():
        local = _local(p)
        if _quantized(local):  # b's cast of the high-precision weight
            n_quantized += 1
            assert type(local).__name__ == recipe_b.weight_tensor_class, name
            deq = local.dequantize().float().cpu()
            err = ((deq - hp[name]).norm() / hp[name].norm()).item()
            assert err < 0.1, (name, err)
    assert (n_quantized > 0) == recipe_b.quantized_init
    text = "\n".join(logs)
    assert "high-precision weights carried over exactly" in text, text
    if a.startswith("fp8_delayed") and b.startswith("fp8_delayed"):
        assert "amax history and scales: carried over" in text
    resumed = train(model_b, opt_b, sched_b, range(SWITCH_STEP + 1, END + 1))
    del model_b, opt_b, sched_b
    _, model_c, opt_c, sched_c, _ = load(reload=True)
    switched = train(model_c, opt_c, sched_c, range(SWITCH_STEP + 1, END + 1))
    assert max(abs(x - y) for x, y in zip(switched, resumed)) <= LOSS_ATOL, (switched, resumed)


def test_train_py_switch_equals_resumed_run(tmp_path):
    from runlog import read_metrics
    from runtime import launch

    args = [
        "model=tiny",
        "recipe=fp8_cs",
        "recipe.quantized_init=true",
        "recipe.switch=[{at: 3, name: bf16}]",
        "train.log_every=1",
        "optim.schedule_steps=6",
        f"run.root={tmp_path}",
    ]

    def run(name, steps):
        r = launch([*args, f"run.name={name}", f"train.steps={steps}"], timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return r.stdout

    out = run("switched", 6)
    assert "recipe switch after step 3: fp8_cs+quantized_init -> bf16" in out
    run("resumed", 3)
    out_r = run("resumed", 6)
    assert "precision: checkpoint saved with fp8_cs+quantized_init, this run uses bf16" in out_r

    def losses(name):
        return {r["step"]: r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl")}

    a, b = losses("switched"), losses("resumed")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    assert all(abs(a[s] - b[s]) <= LOSS_ATOL for s in a), (a, b)


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_blackwell_recipe_in_a_switch_is_refused_on_hopper(tmp_path, name):
    from recipes import device_capability
    from runtime import launch

    if device_capability(torch.device("cuda", 0))[1] >= (10, 0):
        pytest.skip("this GPU runs MXFP8/NVFP4: the refusal is for sm_90")
    r = launch(
        [
            "model=tiny",
            "recipe=fp8_cs",
            f"recipe.switch=[{{at: 3, name: {name}}}]",
            f"run.root={tmp_path}",
        ],
        timeout=300,
    )
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr[-2000:]
    assert f"recipe.switch[0] (to {name})" in errors[0] and "compute capability" in errors[0]
    assert not (tmp_path / "tiny-fp8_cs-fsdp" / "checkpoints").exists()
