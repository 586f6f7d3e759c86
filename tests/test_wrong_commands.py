"""Wrong commands, run as a user runs them: each is answered by exactly one line naming the
field and the fix, and nothing else.

What is asserted, and why:

* `python train.py ...` (one process): exit status 2, and the whole output (stdout and stderr
  together, blank lines dropped) is exactly one line, `error: <field>...`, holding the fix.
  One line in all, not merely a last line: a traceback or Hydra's own text above it would
  be the "many lines" this test exists to catch. Each expected line is given in full or by
  its field and fix, so the test fails if the message loses either.
* `torchrun --nproc_per_node=2 train.py ...`: torchrun (its elastic agent) always follows a
  failed worker with a report of its own, a Python traceback of the launcher and a failure
  summary, whatever the worker does (an exit status without an exception included); train.py
  cannot stop that. So what is asserted is what train.py controls: rank 0 prints the line
  once, no worker prints a traceback (the only "Traceback" is the launcher's, raised in
  torch/distributed/run.py), and each failure the launcher's summary lists, the root cause
  included, reads `traceback : error: <the same line>` (the worker's error file), so the last
  words the user reads name the field and the fix.
"""

from __future__ import annotations

import re

import pytest

from runtime import launch
from tests.helpers import CPU_ENV

#: (command-line overrides, the start of the one line, a part of it that names the fix)
WRONG = [
    (
        ["modle=small"],
        "error: modle: no such config group or key; did you mean model?",
        "groups (GROUP=OPTION): checkpoint, data, experiment, logger, model",
    ),
    (
        ["+modle=small"],
        "error: modle: no such config group or key; did you mean model?",
        "('+' adds a key, and this config's keys are fixed)",
    ),
    (
        ["recipe=fp16"],
        "error: recipe: no option 'fp16'; choose one of bf16, fp8_block, fp8_cs, fp8_delayed, "
        "mxfp8, nvfp4",
        "choose one of",
    ),
    (
        ["train.foo=1"],
        "error: train.foo: no such key in train;",
        "its keys: steps, global_batch_size",
    ),
    (
        ["+train.foo=1"],
        "error: train.foo: no such key in train;",
        "('+' adds a key",
    ),
    (
        ["train.stpes=100"],
        "error: train.stpes: no such key in train; did you mean train.steps?",
        "its keys: steps",
    ),
    (
        ["optim.learning_rate=1e-3"],
        "error: optim.learning_rate: no such key in optim; did you mean optim.lr?",
        "its keys: name, lr,",
    ),
    (
        ["recipe=fp8_cs"],
        "error: recipe=fp8_cs needs TransformerEngine and a CUDA GPU; this run is on CPU",
        "use recipe=bf16 here",
    ),
    (
        ["train.steps=abc"],
        "error: train.steps: 'abc' is not an int; give a whole number, e.g. train.steps=300",
        "e.g. train.steps=300",
    ),
    (
        ["optim.lr=fast"],
        "error: optim.lr: 'fast' is not a number; give a number, e.g. optim.lr=0.003",
        "give a number",
    ),
    (
        ["train.profile_steps=3"],
        "error: train.profile_steps: 3 is not a list; write a list, e.g. train.profile_steps=[3]",
        "train.profile_steps=[3]",
    ),
    (["+model=small"], "error: model: a group of the defaults list;", "model=OPTION (no '+')"),
    (["+train.steps=5"], "error: train.steps: already in the config;", "train.steps=VALUE"),
    (["train.steps=[1"], "error: train.steps=[1: not a valid override", "write KEY=VALUE"),
    (["experiment=nope"], "error: experiment=nope is not a preset", "choose one of"),
    (["-m", "recipe=bf16,fp16"], "error: recipe: no option 'fp16';", "choose one of bf16"),
    (["parallel.tp=3"], "error: parallel.", "parallel.tp=3"),
    (["optim.lr=-1"], "error: optim.lr=-1.0 must be > 0", "must be > 0"),
    (
        ["train.dry_run=true", "train.eval_only=true"],
        "error: train.dry_run and train.eval_only are two different commands",
        "set one of them",
    ),
    (
        ["model.rope_theta=0"],
        "error: model.rope_theta=0.0 must be a finite number > 1 (RoPE's base",
        "Llama 3 uses 500000",
    ),
    (
        ["model.rope_scaling.high_freq_factor=1"],
        "error: model.rope_scaling: low_freq_factor=1.0 and high_freq_factor=1.0 must satisfy "
        "0 < low_freq_factor < high_freq_factor",
        "Llama 3 uses 1 and 4",
    ),
    (
        ["--cfg", "jobs"],
        "error: --cfg jobs: not one of job, hydra, all; did you mean --cfg job?",
        "e.g. python train.py --cfg job",
    ),
]


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("args, line, fix", WRONG, ids=[" ".join(a) for a, _, _ in WRONG])
def test_one_line_each(tmp_path, args, line, fix):
    r = launch([*args, f"run.root={tmp_path}"], env=CPU_ENV, timeout=300)
    out = _lines(r.stdout) + _lines(r.stderr)
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(out) == 1, "\n".join(out)
    assert out[0].startswith(line) and fix in out[0], out[0]
    assert not any(tmp_path.iterdir())  # nothing created for a refused command


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, line",
    [
        (["parallel.tp=3"], "error: parallel.dp_replicate=1 x parallel.cp=1 x parallel.tp=3"),
        (["recipe=fp16"], "error: recipe: no option 'fp16'; choose one of bf16"),
    ],
)
def test_under_torchrun(tmp_path, args, line):
    # torchrun itself (TEST_LAUNCH=subprocess), not the test suite's forked ranks: what it
    # prints after a failed worker is what this test reads.
    env = {**CPU_ENV, "TEST_LAUNCH": "subprocess"}
    r = launch([*args, f"run.root={tmp_path}", "train.steps=2"], nproc=2, env=env, timeout=300)
    text = r.stdout + r.stderr
    assert r.returncode != 0, text
    ours = [x for x in _lines(text) if x.startswith("error: ")]
    assert len(ours) == 1 and ours[0].startswith(line), text  # rank 0 only, once
    # No worker traceback: the one traceback is the launcher's own.
    assert text.count("Traceback (most recent call last)") == 1, text
    assert "ChildFailedError" in text
    # The launcher's summary: every failure (root cause last) names our line.
    fields = re.findall(r"^\s*traceback : (.*)$", text, flags=re.M)
    assert fields and all(f == ours[0] for f in fields), fields
    summary = _lines(text[text.index("Root Cause") :])
    assert summary[-2].strip() == f"traceback : {ours[0]}", summary
    assert set(summary[-1].strip()) == {"="}, summary  # then only the summary's border
