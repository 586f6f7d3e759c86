"""Precision that changes during a run (docs/RECIPE_SWITCH.md), on CPU.

- `recipe.switch` resolution and its one-line errors (recipes/switch.py, config.validate).
- Checkpoints portable across recipes (checkpoint/precision.py) on tests/fake_te.py's
  TE-shaped model and FusedAdam: saved under one recipe, loaded under another, the
  high-precision weights and moments equal the saved run's exactly, quantized weights are the
  new recipe's cast of them, and an in-job switch (CheckpointManager.reload into new objects)
  trains on exactly like a run resumed from the switch step; 1 process, and 2 gloo processes
  with sharded weights (saved on 2, loaded on 2 and on 1).
- train.py end to end with the reference model (bf16 with another bf16_layers: the same math,
  so the switched run must equal the run without a switch bitwise, through the rebuild and the
  reload), on 1 process and on 2 (fsdp, tp).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from checkpoint import CheckpointManager, TrainState, training_state
from checkpoint.config import CheckpointConfig
from config import ConfigError, check_resume, compose_config, validate
from recipes import RecipeConfig
from recipes.config import RecipeSwitchConfig
from recipes.switch import label, recipe_for_step, resolve_switches, saved_recipe
from runlog import load_run, read_metrics
from runtime import launch
from tests import fake_te as ft
from tests.distributed import run_distributed
from tests.helpers import CPU_ENV, TINY_RUN, FakeLoader

# ---------------------------------------------------------------- the schedule


def test_switch_steps_and_recipes():
    cfg = RecipeConfig(
        name="fp8_cs",
        quantized_init=True,
        switch=[
            RecipeSwitchConfig(at=10, bf16_layers=[0, -1]),
            RecipeSwitchConfig(at=0.8, name="bf16"),
        ],
    )
    switches = resolve_switches(cfg, schedule_steps=25)
    assert [s.step for s in switches] == [10, 20]
    assert (switches[0].recipe.name, switches[0].recipe.quantized_init) == ("fp8_cs", True)
    assert switches[0].recipe.bf16_layers == [0, -1]
    # bf16 has nothing to quantize: the switch to it turns quantized_init off.
    assert (switches[1].recipe.name, switches[1].recipe.quantized_init) == ("bf16", False)
    # The recipe that trains each step: a switch's own step is the last of the recipe before.
    assert [label(recipe_for_step(cfg, s, 25)) for s in (1, 10, 11, 20, 21)] == [
        "fp8_cs+quantized_init",
        "fp8_cs+quantized_init",
        "fp8_cs+quantized_init bf16_layers=[0, -1]",
        "fp8_cs+quantized_init bf16_layers=[0, -1]",
        "bf16 bf16_layers=[0, -1]",
    ]
    # A checkpoint at step k holds the recipe that trained step k (its saved config decides).
    saved = OmegaConf.to_container(OmegaConf.structured({"recipe": cfg, "train": {"steps": 25}}))
    assert saved_recipe(saved, 20).name == "fp8_cs" and saved_recipe(saved, 21).name == "bf16"
    assert saved_recipe(None, 5) is None


@pytest.mark.parametrize(
    "switch, message",
    [
        ("[{at: 0, name: bf16}]", "recipe.switch[0].at=0 must be a step >= 1 or a fraction"),
        ("[{at: 2.5, name: bf16}]", "recipe.switch[0].at=2.5 is neither a whole step"),
        ("[{at: 0.001, name: bf16}]", "before the first step"),
        ("[{at: 0.8, name: bf16}, {at: 0.5, bf16_layers: [0]}]", "recipe.switch[1] is at step 150"),
        ("[{at: 5}]", "recipe.switch[0] changes nothing"),
        ("[{at: 5, name: bf16, quantized_init: true}]", "quantized_init=true has no effect"),
        (
            "[{at: 5, name: bf16, fp8_attention: true}]",
            "recipe.switch[0]: fp8_attention=true has no effect with name=bf16 (nothing runs in "
            "FP8); drop fp8_attention from this entry",
        ),
        (
            "[{at: 5, name: fp8_block, fp8_attention: true}]",
            "recipe.switch[0]: fp8_attention=true is not available with name=fp8_block (TE 2.20 "
            "has no FP8 attention for FP8 block scaling); drop fp8_attention from this entry",
        ),
    ],
)
def test_bad_switches_are_one_line(switch, message):
    cfg = compose_config(["recipe=fp8_cs", f"recipe.switch={switch}"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert "\n" not in str(e.value) and message in str(e.value)


def test_switch_of_fp8_attention():
    """fp8_attention switches like quantized_init: null keeps it, a switch to bf16 or fp8_block
    turns it off; the label names it, and a saved config gives it back."""
    cfg = RecipeConfig(
        name="fp8_delayed",
        switch=[
            RecipeSwitchConfig(at=4, fp8_attention=True),
            RecipeSwitchConfig(at=6, name="fp8_cs"),
            RecipeSwitchConfig(at=8, name="fp8_block"),
            RecipeSwitchConfig(at=9, name="fp8_cs"),
        ],
    )
    switches = resolve_switches(cfg, schedule_steps=10)
    assert [(s.recipe.name, s.recipe.fp8_attention) for s in switches] == [
        ("fp8_delayed", True),
        ("fp8_cs", True),  # null: unchanged
        ("fp8_block", False),
        ("fp8_cs", False),  # turned off by the switch to fp8_block, not back on
    ]
    assert [label(recipe_for_step(cfg, s, 10)) for s in (4, 5, 7, 9, 10)] == [
        "fp8_delayed",
        "fp8_delayed+fp8_attention",
        "fp8_cs+fp8_attention",
        "fp8_block",
        "fp8_cs",
    ]
    saved = OmegaConf.to_container(OmegaConf.structured({"recipe": cfg, "train": {"steps": 10}}))
    assert saved_recipe(saved, 7) == switches[1].recipe
    assert saved_recipe(saved, 7).fp8_attention and not saved_recipe(saved, 4).fp8_attention
    off = resolve_switches(
        RecipeConfig(name="fp8_cs", fp8_attention=True, switch=[{"at": 2, "name": "bf16"}]), 5
    )
    assert (off[0].recipe.name, off[0].recipe.fp8_attention) == ("bf16", False)


def test_fp8_attention_changed_at_resume_is_a_recipe_change():
    """Like any recipe field: refused unless resume.accept names it (or recipe); a checkpoint
    from before the field ran attention in bf16; a switch that moves onto the checkpoint's
    step is named with it (check_recipe_at_resume)."""
    from config import check_recipe_at_resume

    def resolved(*overrides):
        return OmegaConf.to_yaml(OmegaConf.structured(compose_config(overrides)))

    saved = resolved("recipe=fp8_cs")
    current = resolved("recipe=fp8_cs", "recipe.fp8_attention=true")
    with pytest.raises(ConfigError) as e:
        check_resume(saved, current, [], step=5)
    msg = str(e.value)
    assert "\n" not in msg and "recipe.fp8_attention False -> True" in msg, msg
    assert "resume.accept=[recipe.fp8_attention]" in msg
    for accept in (["recipe.fp8_attention"], ["recipe"]):
        (change,) = check_resume(saved, current, accept, step=5)
        assert str(change) == "recipe.fp8_attention False -> True"
    old = yaml.safe_load(saved)
    del old["recipe"]["fp8_attention"]
    assert check_resume(yaml.safe_dump(old), saved, [], step=5) == []
    switch = "recipe.switch=[{at: 0.8, fp8_attention: true}]"
    before = resolved("recipe=fp8_cs", switch, "train.steps=25")
    stretched = resolved("recipe=fp8_cs", switch, "train.steps=50")
    with pytest.raises(ConfigError) as e:
        check_recipe_at_resume(before, stretched, ["train.steps"], step=25)
    assert (
        "saved with recipe fp8_cs+fp8_attention, but this config's recipe.switch puts fp8_cs at"
        in str(e.value)
    )


def test_precision_report_of_attention_scaling():
    """What a load under another recipe says about delayed-scaling state, attention's too;
    FP8 attention does not change how a quantized weight is stored."""
    from checkpoint.precision import _scaling_report, scaling_kept, weight_format

    q = frozenset({"layers.0.self_attention.proj.weight"})
    formats = {
        weight_format(RecipeConfig(name="fp8_cs", quantized_init=True, fp8_attention=a), w, q, 2)
        for a in (False, True)
        for w in q
    }
    assert len(formats) == 1 and None not in formats

    kinds = {
        n: scaling_kept(rc)
        for n, rc in {
            "bf16": RecipeConfig(),
            "fp8_cs": RecipeConfig(name="fp8_cs"),
            "fp8_delayed": RecipeConfig(name="fp8_delayed", fp8_attention=True),
            "fp8_cs+attention": RecipeConfig(name="fp8_cs", fp8_attention=True),
            "fp8_block": RecipeConfig(name="fp8_block"),
        }.items()
    }
    assert kinds == {
        "bf16": None,
        "fp8_cs": None,
        "fp8_delayed": "all",
        "fp8_cs+attention": "attention",
        "fp8_block": None,
    }
    assert _scaling_report("attention", "attention") == "carried over"
    assert _scaling_report("all", "attention").startswith("carried over for the attention")
    assert _scaling_report("attention", "all").startswith("carried over for the attention")
    assert _scaling_report("attention", None) == "not used by this recipe (left out)"
    assert _scaling_report(None, "attention").startswith("start fresh")


def test_switch_needs_checkpoints_and_a_runnable_recipe():
    with pytest.raises(ConfigError, match=r"recipe.switch needs checkpoints.*checkpoint=sync"):
        validate(compose_config(["checkpoint=none", "recipe.switch=[{at: 5, bf16_layers: [0]}]"]))
    # On CPU every recipe of the schedule must run there, checked before any work.
    r = launch(
        [
            *TINY_RUN,
            "train.steps=4",
            "recipe.switch=[{at: 2, name: fp8_cs}]",
            "run.root=/nonexistent",
        ],
        env=CPU_ENV,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "recipe.switch[0]" in lines[0] and "recipe=fp8_cs" in lines[0]


def test_a_changed_schedule_is_a_change_of_the_training():
    def resolved(*overrides):
        return OmegaConf.to_yaml(OmegaConf.structured(compose_config(overrides)))

    saved = resolved("recipe.switch=[{at: 0.8, name: bf16}]")
    assert check_resume(saved, saved, [], step=5) == []
    current = resolved("recipe.switch=[{at: 0.9, name: bf16}]")
    with pytest.raises(ConfigError, match=r"resume.accept=\[recipe.switch\]"):
        check_resume(saved, current, [], step=5)
    assert check_resume(saved, current, ["recipe"], step=5)
    # Another bf16_layers is a change of the recipe too: refused unless accepted.
    with pytest.raises(ConfigError, match=r"recipe.bf16_layers \[\] -> \[0\]"):
        check_resume(resolved(), resolved("recipe.bf16_layers=[0]"), [], step=5)


def test_a_fraction_that_moves_with_the_schedule_is_refused():
    """Stretching the schedule (accepted train.steps) moves a fractional switch: the recipe
    the checkpoint holds at its step would change without a recipe change being accepted."""
    from config import check_recipe_at_resume

    def resolved(*overrides):
        return OmegaConf.to_yaml(OmegaConf.structured(compose_config(overrides)))

    switch = "recipe.switch=[{at: 0.8, name: bf16}]"
    saved = resolved("recipe=fp8_cs", switch, "train.steps=25")
    stretched = resolved("recipe=fp8_cs", switch, "train.steps=50")
    assert check_resume(saved, stretched, ["train.steps"], step=25)
    with pytest.raises(ConfigError) as e:
        check_recipe_at_resume(saved, stretched, ["train.steps"], step=25)
    msg = str(e.value)
    assert "\n" not in msg and "saved with recipe bf16" in msg and "puts fp8_cs at that step" in msg
    check_recipe_at_resume(saved, stretched, ["train.steps", "recipe.switch"], step=25)
    kept = resolved("recipe=fp8_cs", switch, "train.steps=50", "optim.schedule_steps=25")
    check_recipe_at_resume(saved, kept, [], step=25)  # the schedule kept: no change
    check_recipe_at_resume(saved, stretched, ["train.steps"], step=10)  # before both switches


# ---------------------------------------------------------------- portable checkpoints (fakes)


def rc(spec: str) -> RecipeConfig:
    """'fp8_cs+q:1' -> fp8_cs, quantized_init, bf16_layers=[1]."""
    spec, _, layers = spec.partition(":")
    name, _, q = spec.partition("+")
    return RecipeConfig(
        name=name, quantized_init=q == "q", bf16_layers=[int(x) for x in layers.split(",") if x]
    )


PAIRS = [
    ("fp8_cs+q", "bf16"),
    ("bf16", "fp8_cs+q"),
    ("fp8_delayed", "fp8_cs"),
    ("fp8_block+q", "fp8_cs+q"),
    ("fp8_cs+q", "fp8_cs+q:1"),
    ("mxfp8+q", "nvfp4+q"),
    ("nvfp4+q", "bf16"),
    ("bf16", "mxfp8+q"),
    ("fp8_delayed+q", "fp8_block+q:0"),
    ("fp8_cs+q", "fp8_cs+q"),
]
SWITCH_STEP, END = 3, 5


def checkpointed(rcfg, recipe, model, optimizer, logs):
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    config = {"recipe": rcfg, "train": {"steps": END}}
    train_state = TrainState(config_yaml=OmegaConf.to_yaml(OmegaConf.structured(config)))
    state = training_state(
        model, optimizer, scheduler, FakeLoader(), train_state, recipe=recipe, log=logs.append
    )
    return train_state, state


def manager(root: Path, rank: int = 0, world: int = 1) -> CheckpointManager:
    cfg = CheckpointConfig(mode="sync", interval=0, resume="auto")
    return CheckpointManager(cfg, root, rank, world, log=lambda m: None)


def run_a(a: RecipeConfig, root: Path, shard=None, rank=0, world=1):
    """Recipe a trains steps 1..SWITCH_STEP and saves: the run before the switch."""
    recipe, model, optimizer = ft.build_fake(a, shard=shard)
    losses = ft.train(model, optimizer, range(1, SWITCH_STEP + 1))
    train_state, state = checkpointed(a, recipe, model, optimizer, [])
    train_state.step = SWITCH_STEP
    ckpt = manager(root, rank, world)
    ckpt.save(SWITCH_STEP, state)
    ckpt.finish(SWITCH_STEP, state, save=False)
    return losses, ft.high_precision(model, optimizer), ft.moments(model, optimizer), optimizer


def load_b(b: RecipeConfig, root: Path, *, reload: bool, shard=None, rank=0, world=1):
    """Recipe b's model and optimizer, loaded from the switch step's checkpoint: as a run
    resumed from it (resume) or by the in-job switch (reload)."""
    logs: list[str] = []
    recipe, model, optimizer = ft.build_fake(b, shard=shard)
    _, state = checkpointed(b, recipe, model, optimizer, logs)
    ckpt = manager(root, rank, world)
    if reload:
        ckpt.reload(SWITCH_STEP, state)
    else:
        assert ckpt.resume(state) == SWITCH_STEP
    return recipe, model, optimizer, logs


def check_loaded(recipe, model, optimizer, hp, moments, opt_a):
    """The state the load left against the saved run's: exactly its high-precision weights,
    moments and step counts; quantized weights are this recipe's cast of those weights."""
    got = ft.high_precision(model, optimizer)
    assert got.keys() == hp.keys()
    for name in hp:
        assert torch.equal(got[name], hp[name]), name
    got_moments = ft.moments(model, optimizer)
    for name in moments:
        assert torch.equal(got_moments[name], moments[name]), name
    assert [g["step"] for g in optimizer.param_groups] == [g["step"] for g in opt_a.param_groups]
    weights = ft.weights(model)
    for name, p in model.named_parameters():
        local = getattr(p, "_local_tensor", p)
        if isinstance(local, ft.FakeQuantizedTensor):
            assert type(local).__name__ == ft.QUANTIZERS[recipe.name]().tensor_class.__name__
            assert torch.equal(weights[name], local._quantizer.cast(hp[name])), name
        else:
            assert type(local) is not ft.FakeQuantizedTensor
            assert torch.equal(weights[name], hp[name]), name


@pytest.mark.parametrize("a, b", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_checkpoint_loads_under_another_recipe(tmp_path, a, b):
    a, b = rc(a), rc(b)
    losses_a, hp, moments, opt_a = run_a(a, tmp_path)
    recipe, model, optimizer, logs = load_b(b, tmp_path, reload=False)
    check_loaded(recipe, model, optimizer, hp, moments, opt_a)
    if a == b:
        assert logs == []  # the same recipe: the plain load, nothing to report
    else:
        text = "\n".join(logs)
        assert f"checkpoint saved with {label(a)}, this run uses {label(b)}" in text
        assert "high-precision weights carried over exactly" in text
        delayed = "carried over" if a.name == b.name == "fp8_delayed" else ""
        assert "delayed-scaling amax history and scales: " + delayed in text
    resumed = ft.train(model, optimizer, range(SWITCH_STEP + 1, END + 1))
    # The in-job switch: new objects reloaded in the same process go on exactly the same way.
    recipe2, model2, optimizer2, _ = load_b(b, tmp_path, reload=True)
    assert ft.train(model2, optimizer2, range(SWITCH_STEP + 1, END + 1)) == resumed
    after, after2 = ft.high_precision(model, optimizer), ft.high_precision(model2, optimizer2)
    assert all(torch.equal(after[n], after2[n]) for n in after)


def test_same_recipe_load_is_unchanged_by_the_plan(tmp_path):
    """With the run's recipe known (a plan) and unchanged, a resume loads what it loaded
    before plans existed, bitwise (the parameters' saved bytes, not a re-cast)."""
    a = rc("fp8_block+q")
    run_a(a, tmp_path)
    _, model, optimizer, _ = load_b(a, tmp_path, reload=False)
    recipe, model2, optimizer2 = ft.build_fake(a)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer2, lambda s: 1.0)
    plain = training_state(model2, optimizer2, scheduler, FakeLoader(), TrainState())
    manager(tmp_path).resume(plain)
    w, w2 = ft.weights(model), ft.weights(model2)
    assert all(torch.equal(w[n], w2[n]) for n in w)
    assert ft.train(model, optimizer, range(4, 6)) == ft.train(model2, optimizer2, range(4, 6))


def _two_ranks(rank, world, root, out):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    result = {}
    for i, (a, b) in enumerate((("fp8_cs+q", "bf16"), ("bf16", "nvfp4+q"))):
        a, b = rc(a), rc(b)
        sub = Path(root) / f"pair{i}"
        _, hp, moments, opt_a = run_a(a, sub, mesh, rank, world)
        recipe, model, optimizer, _ = load_b(
            b, sub, reload=True, shard=mesh, rank=rank, world=world
        )
        check_loaded(recipe, model, optimizer, hp, moments, opt_a)
        result[str(i)] = {"hp": hp, "moments": moments}
    if rank == 0:
        torch.save(result, out)


def test_two_ranks_sharded_and_resharded_to_one(tmp_path):
    """Saved on 2 gloo ranks (embedding and head sharded), loaded on 2 under the new recipe;
    then loaded on 1 process (resharded), the values are the same."""
    out = tmp_path / "saved.pt"
    run_distributed(_two_ranks, 2, str(tmp_path), str(out))
    saved = torch.load(out)
    for i, b in enumerate(("bf16", "nvfp4+q")):
        recipe, model, optimizer, _ = load_b(rc(b), tmp_path / f"pair{i}", reload=False)
        got = ft.high_precision(model, optimizer)
        assert all(torch.equal(got[n], saved[str(i)]["hp"][n]) for n in got)
        got_m = ft.moments(model, optimizer)
        assert all(torch.equal(got_m[n], saved[str(i)]["moments"][n]) for n in got_m)


# ---------------------------------------------------------------- train.py end to end

#: 2 blocks so bf16_layers has a layer to name; 6 steps with the schedule fixed at 6, so a
#: 3-step first segment resumes without changing it.
RUN = [*TINY_RUN, "model.n_layers=2", "optim.schedule_steps=6", "optim.warmup_steps=2"]
SWITCH = "recipe.switch=[{at: 0.5, bf16_layers: [0]}]"


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def train(root: Path, name: str, *args: str, nproc: int = 1) -> str:
    r = launch(
        [*RUN, f"run.root={root}", f"run.name={name}", *args], nproc=nproc, env=CPU_ENV, timeout=600
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_train_py_switches_in_job_and_on_resume(tmp_path):
    # a: one job that switches after step 3; b: no switch (the same math on the reference
    # model); c: stops at step 3 (the switch step: no switch in its job), resumed to 6;
    # d: stops at step 2, resumed: the resumed job switches after step 3 itself.
    out_a = train(tmp_path, "a", "train.steps=6", SWITCH, "train.log_every=2")
    train(tmp_path, "b", "train.steps=6")
    train(tmp_path, "c", "train.steps=3", SWITCH)
    out_c = train(tmp_path, "c", "train.steps=6", SWITCH)
    train(tmp_path, "d", "train.steps=2", SWITCH)
    out_d = train(tmp_path, "d", "train.steps=6", SWITCH)
    la, lb, lc, ld = (losses(tmp_path / n) for n in "abcd")
    assert sorted(la) == [2, 3, 4, 6]  # every log_every=2 step, and the switch step
    assert la == {s: lb[s] for s in la} and lc == ld and {s: lc[s] for s in la} == la
    assert "recipe switch after step 3: bf16 -> bf16 bf16_layers=[0]" in out_a
    assert "recipe switch after step 3" in out_d and "recipe switch" not in out_c
    assert "precision: checkpoint saved with bf16, this run uses bf16 bf16_layers=[0]" in out_c
    records = {r["step"]: r for r in read_metrics(tmp_path / "a" / "metrics.jsonl")}
    assert records[3]["recipe_switch"] == "-> bf16 bf16_layers=[0]"
    assert records[2]["recipe"] == records[3]["recipe"] == "bf16"
    assert records[4]["recipe"] == "bf16 bf16_layers=[0]" and "recipe_switch" not in records[4]
    # The segment history: the switch is a segment of its own, in the job and on resume.
    heads = {
        p.name: p.read_text().splitlines()[0] for p in (tmp_path / "a" / "configs").glob("*.yaml")
    }
    assert "recipe: bf16" in heads["segment-0000000.yaml"]
    assert "recipe switch: bf16 -> bf16 bf16_layers=[0]" in heads["segment-0000003.yaml"]
    head_c = (tmp_path / "c" / "configs" / "segment-0000003.yaml").read_text().splitlines()[0]
    assert "recipe: bf16 bf16_layers=[0]" in head_c
    saved = yaml.safe_load((tmp_path / "a" / "config.yaml").read_text())
    assert saved["recipe"]["switch"][0]["at"] == 0.5  # the schedule, as given


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_train_py_switch_on_two_ranks(tmp_path, layout):
    """2 gloo ranks: the job that switches after step 3 equals the one resumed from that
    step's checkpoint under the later recipe, bitwise."""
    args = [f"parallel={layout}", "model.n_kv_heads=2", "train.steps=6", SWITCH]
    out = train(tmp_path, "a", *args, nproc=2)
    assert "recipe switch after step 3" in out
    train(tmp_path, "c", *args[:-2], "train.steps=3", SWITCH, nproc=2)
    train(tmp_path, "c", *args, nproc=2)
    assert losses(tmp_path / "a") == losses(tmp_path / "c")
    assert sorted(losses(tmp_path / "a")) == [1, 2, 3, 4, 5, 6]


# ---------------------------------------------------------------- tools/compare_runs.py


def test_compare_runs_marks_the_switch(tmp_path):
    from tests.test_compare_runs import PNG_MAGIC, cli, losses, write_run
    from tools.compare_runs import switch_marks

    a = write_run(tmp_path / "a", losses(range(1, 11)))
    b = write_run(tmp_path / "b", losses(range(1, 11), k=9, delta=0.01))
    records = read_metrics(b / "metrics.jsonl")
    records[7]["recipe_switch"] = "-> bf16"  # step 8, as train.py writes it
    (b / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    runs = {"a": load_run(a), "b": load_run(b)}
    assert switch_marks(runs) == [("b", 8, "b: recipe -> bf16")]
    assert switch_marks(runs, x="tokens") == [("b", 8 * 1024, "b: recipe -> bf16")]
    png = tmp_path / "cmp.png"
    rc, out = cli(a, b, "--plot", png)
    assert rc == 0 and "b: recipe switch after step 8 (-> bf16)" in out, out
    assert png.read_bytes().startswith(PNG_MAGIC)
