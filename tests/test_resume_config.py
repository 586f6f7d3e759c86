"""Config changes on resume: which fields may change (config.RESUME_FREE) and which refuse
unless `resume.accept` names them; an accepted optimizer change takes effect from the
resumed step on (optim.apply_config on the loaded LambdaLR); train.py end to end: the
refusal is one line and leaves the run directory as it was, an accepted change is recorded
in the segment history, a harmless change resumes bitwise."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from config import (
    ConfigError,
    OptimConfig,
    check_accept,
    check_resume,
    compose_config,
    config_changes,
    validate,
)
from optim import apply_config, build_optimizer, build_scheduler, lr_lambda
from runlog import read_metrics
from runtime import launch
from tests.harness.resume import keep_only_checkpoint
from tests.helpers import CPU_ENV
from tests.test_eval import TINY


def resolved(*overrides: str) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(compose_config(overrides)))


def paths(changes):
    """Each change by the name messages give it (the field the user edited)."""
    return {c.name: (c.old, c.new) for c in changes}


def test_harmless_fields_resume_without_a_word():
    saved = resolved()
    current = resolved(
        "train.log_every=5",
        "train.micro_batch_size=4",
        "checkpoint.interval=7",
        "checkpoint=async",
        "logger=wandb",
        "run.root=/elsewhere",
        "parallel=fsdp_tp",
        "parallel.activation_checkpointing=full",
        "train.profile_steps=[3,4]",
        "train.deterministic=true",
        "eval.batches=9",
        "data.num_proc=4",
        "optim.schedule_steps=300",  # = train.steps: the schedule is unchanged
    )
    changes = config_changes(saved, current)
    assert changes and all(c.free for c in changes), [str(c) for c in changes]
    assert check_resume(saved, current, [], step=10) == []


@pytest.mark.parametrize(
    "override, field, old, new",
    [
        ("optim.lr=0.01", "optim.lr", 0.003, 0.01),
        ("optim.warmup_steps=5", "optim.warmup_steps", 30, 5),
        ("optim.min_lr_ratio=0.2", "optim.min_lr_ratio", 0.1, 0.2),
        ("train.global_batch_size=32", "train.global_batch_size", 16, 32),
        ("train.seed=1", "train.seed", 1234, 1),
        ("data.seq_len=128", "data.seq_len", 256, 128),
        ("data.shuffle_seed=3", "data.shuffle_seed", 0, 3),
        ("model.rope_theta=10000.0", "model.rope_theta", 500000.0, 10000.0),
        ("recipe=fp8_cs", "recipe.name", "bf16", "fp8_cs"),
        ("recipe.fp8_attention=true", "recipe.fp8_attention", False, True),
        ("parallel.param_dtype=fp32", "parallel.param_dtype", "bf16", "fp32"),
        ("train.steps=600", "train.steps", 300, 600),  # compared as the schedule's length
        ("optim.schedule_steps=600", "optim.schedule_steps", 300, 600),
        ("eval.every=50", "data.eval_fraction", 0.0, 0.01),
    ],
)
def test_fields_that_change_the_training_refuse(override, field, old, new):
    saved, current = resolved(), resolved(override)
    with pytest.raises(ConfigError) as e:
        check_resume(saved, current, [], step=10)
    msg = str(e.value)
    assert "\n" not in msg and f"{field} {old} -> {new}" in msg, msg
    assert f"resume.accept=[{field}]" in msg and "(step 10)" in msg
    # The first way out is a separate run; the checkpoint's run is named.
    assert msg.index("run.name=NAME") < msg.index("resume.accept="), msg
    name = yaml.safe_load(current)["run"]["name"]  # tiny-bf16-fsdp, or with recipe=...
    assert msg.startswith(f"resume: runs/{name} has a checkpoint (step 10)"), msg
    accepted = check_resume(saved, current, [field], step=10)
    assert paths(accepted)[field] == (old, new)


def test_extending_train_steps():
    saved = resolved("train.steps=300")
    # Extend the run: the refusal names train.steps (the field edited), never the derived
    # optim.schedule_steps, and the one way to extend: resume.accept=[train.steps].
    with pytest.raises(ConfigError) as e:
        check_resume(saved, resolved("train.steps=600"), [], step=300)
    msg = str(e.value)
    assert "train.steps 300 -> 600 (the LR schedule's length" in msg, msg
    assert "resume.accept=[train.steps];" in msg and "accept=[optim" not in msg, msg
    assert "unless optim.schedule_steps=300" in msg
    assert check_resume(saved, resolved("train.steps=600"), ["train.steps"], step=300)
    # Accepting the derived name works too (older commands), and the change is still named
    # after train.steps.
    (c,) = check_resume(saved, resolved("train.steps=600"), ["optim.schedule_steps"], step=300)
    assert str(c).startswith("train.steps 300 -> 600")
    # The stretched cosine puts the lr back up, and the change says so (the README's
    # extension to 400 steps: 3.00e-04 at the end of 300, 7.58e-04 for step 301).
    (c,) = check_resume(saved, resolved("train.steps=400"), ["train.steps"], step=300)
    assert str(c).endswith("; the lr of step 301: 3.00e-04 -> 7.58e-04 (the lr rises again))")
    # ... or keep it: past schedule_steps the lr stays at its final value.
    current = resolved("train.steps=600", "optim.schedule_steps=300")
    assert check_resume(saved, current, [], step=300) == []
    cfg = compose_config(["optim.schedule_steps=300"]).optim
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=cfg.lr)
    f = build_scheduler(opt, cfg, 600).lr_lambdas[0]
    assert f(299) > f(300) == f(450) == f(599) == cfg.min_lr_ratio


def test_accepting_a_group_and_older_checkpoints():
    saved, current = resolved(), resolved("optim.lr=0.01", "optim.beta2=0.99")
    assert len(check_resume(saved, current, ["optim"], step=1)) == 2
    with pytest.raises(ConfigError, match=r"optim.beta2 0.95 -> 0.99"):
        check_resume(saved, current, ["optim.lr"], step=1)
    # A checkpoint written before a field existed compares as that field's default.
    old = yaml.safe_load(saved)
    del old["optim"]["schedule_steps"], old["eval"], old["data"]["eval_fraction"]
    assert check_resume(yaml.safe_dump(old), saved, [], step=1) == []
    assert check_resume(None, current, [], step=1) == []  # saved without a config


def test_accept_names_are_checked():
    check_accept(["optim.lr", "optim", "data.seq_len", "experiment.anything"])
    with pytest.raises(ConfigError, match=r"resume.accept: 'optim.lrr' is not a config field"):
        check_accept(["optim.lrr"])
    with pytest.raises(ConfigError, match=r"resume.accept"):
        validate(compose_config(["resume.accept=[optim.lrr]"]))


def test_apply_config_puts_the_new_settings_in_force():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    old = OptimConfig(lr=3e-3, warmup_steps=2)
    opt = build_optimizer(model, old, "torch")
    sched = build_scheduler(opt, old, 20)
    for _ in range(5):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()

    def resumed(cfg):
        opt2 = build_optimizer(model, cfg, "torch")
        sched2 = build_scheduler(opt2, cfg, 20)
        opt2.load_state_dict(saved_opt)
        sched2.load_state_dict(saved_sched)
        return opt2, sched2

    # Loaded as saved: the old base lr is back, whatever the config says.
    new = replace(old, lr=1e-2, weight_decay=0.2, beta2=0.99)
    opt2, sched2 = resumed(new)
    assert sched2.base_lrs == [3e-3, 3e-3] and opt2.param_groups[0]["weight_decay"] == 0.1
    apply_config(opt2, sched2, new)
    factor = lr_lambda(new, 20)
    assert [g["lr"] for g in opt2.param_groups] == [1e-2 * factor(5)] * 2
    assert sched2.get_last_lr() == [1e-2 * factor(5)] * 2
    assert [g["weight_decay"] for g in opt2.param_groups] == [0.2, 0.0]
    assert all(g["betas"] == (0.9, 0.99) for g in opt2.param_groups)
    sched2.step()
    assert opt2.param_groups[0]["lr"] == 1e-2 * factor(6)
    # Unchanged config: every value is what the checkpoint had (bitwise).
    opt3, sched3 = resumed(old)
    before = [dict(g, params=None) for g in opt3.param_groups]
    apply_config(opt3, sched3, old)
    assert [dict(g, params=None) for g in opt3.param_groups] == before


def snapshot(run_dir: Path) -> dict[str, str]:
    """Every file of a run directory with a digest of its content."""
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


def test_resume_refuses_accepts_and_records(tmp_path):
    args = [*TINY, "train.steps=6", "checkpoint=sync", "checkpoint.interval=3"]
    args += [f"run.root={tmp_path}"]
    a = launch([*args, "run.name=a"], env=CPU_ENV, timeout=600)
    assert a.returncode == 0, a.stderr[-3000:]
    assert "step      4/6 | loss " in a.stdout and "| step_time " in a.stdout
    assert "| eta " in a.stdout
    ref = read_metrics(tmp_path / "a" / "metrics.jsonl")
    assert all(r["step_time_s"] > 0 and r["eta_s"] >= 0 and r["time"] > 0 for r in ref)

    # A changed lr: one line, exit 2, nothing in the run directory touched.
    keep_only_checkpoint(tmp_path / "a", tmp_path / "b", 3)
    before = snapshot(tmp_path / "b")
    r = launch([*args, "run.name=b", "optim.lr=1e-2"], env=CPU_ENV, timeout=600)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("error: resume: ") and "optim.lr 0.003 -> 0.01" in lines[0]
    assert "resume.accept=[optim.lr]" in lines[0]
    assert snapshot(tmp_path / "b") == before

    # Accepted: it takes effect from step 4 on and is recorded.
    r = launch([*args, "run.name=b", "optim.lr=1e-2", "resume.accept=[optim.lr]"], env=CPU_ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "accepted changes: optim.lr 0.003 -> 0.01" in r.stdout
    got = read_metrics(tmp_path / "b" / "metrics.jsonl")
    factor = lr_lambda(compose_config(["optim.warmup_steps=2"]).optim, 6)
    assert [x["loss"] for x in got[:4]] == [x["loss"] for x in ref[:4]]  # step 4: same weights
    assert got[3]["lr"] == 1e-2 * factor(4) != ref[3]["lr"]  # the lr after step 4's update
    assert got[4]["loss"] != ref[4]["loss"]
    run_b = tmp_path / "b"
    segments = sorted(p.name for p in (run_b / "configs").iterdir())
    assert segments == ["segment-0000000.yaml", "segment-0000003.yaml"]
    first = yaml.safe_load((run_b / "configs" / "segment-0000000.yaml").read_text())
    second_text = (run_b / "configs" / "segment-0000003.yaml").read_text()
    assert first["optim"]["lr"] == 0.003 and yaml.safe_load(second_text)["optim"]["lr"] == 0.01
    assert (
        second_text.startswith("# segment from step 3")
        and "optim.lr 0.003 -> 0.01" in (second_text.splitlines()[0])
    )
    current = yaml.safe_load((run_b / "config.yaml").read_text())
    assert current["optim"]["lr"] == 0.01 and current["resume"]["accept"] == ["optim.lr"]

    # Harmless changes (intervals, profiling): resumed silently, bitwise the same curve.
    keep_only_checkpoint(tmp_path / "a", tmp_path / "c", 3)
    harmless = ["checkpoint.interval=2", "train.log_every=1", "checkpoint.keep_last=3"]
    r = launch([*args, "run.name=c", *harmless], env=CPU_ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "accepted changes" not in r.stdout and "resumed_from_step=3" in r.stdout
    same = read_metrics(tmp_path / "c" / "metrics.jsonl")
    assert [(x["step"], x["loss"], x["lr"]) for x in same] == [
        (x["step"], x["loss"], x["lr"]) for x in ref
    ]
