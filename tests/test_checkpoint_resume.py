"""checkpoint/resume.py on its own: the decision (`decide`, rank 0, filesystem only) as a table
over fresh, renamed, damaged, inconsistent, foreign and mismatched checkpoints, and `Resumer`
(plan, load) against it, without a CheckpointManager around them.

One tiny run (tests/ckpt_harness.py) commits steps 2 and 4 once per module; each case copies
its checkpoint directory and changes it. The end-to-end refusals (train.py's lines, every
rank) are test_checkpoint_damage.py's and test_checkpoint_silent.py's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from checkpoint import CheckpointManager, store
from checkpoint.context import Context
from checkpoint.resume import Resumer, decide
from errors import ConfigError
from tests.ckpt_harness import Run, ckpt_cfg, committed
from tests.helpers import config_yaml

#: The saved run's config: the harness's model, run.name alpha.
NAMED = config_yaml() + "run:\n  name: alpha\n"
CORPUS = "corpus-a"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """Checkpoint directory with steps 2 and 4 of run alpha, trained on CORPUS."""
    run_dir = tmp_path_factory.mktemp("source")
    run = Run(run_dir)
    run.ckpt.close()
    run.ckpt = CheckpointManager(ckpt_cfg(), run_dir, log=run.messages.append, corpus=CORPUS)
    run.train_state.config_yaml = NAMED
    run.train(4)
    root = run_dir / "checkpoints"
    assert committed(root) == [2, 4]
    return root


def _context(run_dir: Path, messages: list[str], corpus: str | None = None, **cfg) -> Context:
    return Context.create(ckpt_cfg(**cfg), run_dir, 0, 1, messages.append, corpus)


def _tamper(root: Path, case: str) -> None:
    step4 = root / store.step_name(4)
    if case == "renamed":
        step4.rename(root / (store.step_name(4) + ".bak"))
    elif case == "damaged":
        data = sorted(step4.glob("*" + store.DATA_SUFFIX))[0]
        with data.open("r+b") as f:
            f.truncate(data.stat().st_size - 10)
    elif case == "name_mismatch":
        step4.rename(root / store.step_name(8))
    elif case == "empty":
        shutil.rmtree(root)
        root.mkdir()


#: (case, settings, corpus, config_yaml override, expected step or error fragment, log fragment)
CASES = [
    ("auto_newest", {}, None, None, 4, None),
    ("empty", {}, None, None, 0, None),
    ("renamed", {}, None, None, 2, "is not resumed from: its name is not a step directory's"),
    ("damaged", {}, None, None, "step_0000004 is damaged (", None),
    ("name_mismatch", {}, None, None, "but the directory is step_0000008: the manifest", None),
    ("shape", {}, None, "dim: 256", "model.dim: checkpoint has 128, config has 256", None),
    ("corpus", {}, "corpus-b", None, "was trained on another corpus (corpus-a", None),
    ("none", {"resume": "none"}, None, None, 0, "existing checkpoint moved aside"),
]


@pytest.mark.parametrize(
    "case,settings,corpus,change,expected,logged", CASES, ids=[c[0] for c in CASES]
)
def test_decision_table(source, tmp_path, case, settings, corpus, change, expected, logged):
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    shutil.copytree(source, root)
    _tamper(root, case)
    messages: list[str] = []
    ctx = _context(run_dir, messages, corpus, **settings)
    mine = NAMED.replace("dim: 128", change) if change else NAMED
    decision = decide(ctx, mine)
    if isinstance(expected, int):
        assert decision["error"] is None, decision
        assert decision["step"] == expected
        want = str(root / store.step_name(expected)) if expected else None
        assert decision["path"] == want
    else:
        assert decision["path"] is None and expected in decision["error"], decision
    if logged is not None:
        assert any(logged in m for m in messages), messages
    if case == "none":
        assert committed(root) == []  # moved aside, not deleted
        assert len(list(root.glob("step_*" + store.ABANDONED_SUFFIX + "-*"))) == 2


def test_damaged_names_the_previous_checkpoint_and_the_first_has_none(source, tmp_path):
    root = tmp_path / "run" / "checkpoints"
    shutil.copytree(source, root)
    _tamper(root, "damaged")
    decision = decide(_context(tmp_path / "run", []), NAMED)
    assert f"pass checkpoint.resume={root / store.step_name(2)}" in decision["error"]
    shutil.rmtree(root / store.step_name(2))
    decision = decide(_context(tmp_path / "run", []), NAMED)
    assert "there is no earlier complete checkpoint" in decision["error"]


def test_another_runs_directory_is_refused_in_auto_mode_only(source, tmp_path):
    shared = tmp_path / "shared"
    shutil.copytree(source, shared)
    run_dir = tmp_path / "run"
    other = NAMED.replace("name: alpha", "name: beta")
    decision = decide(_context(run_dir, [], dir=str(shared)), other)
    assert (
        f"holds the checkpoints of run alpha (newest: {shared / 'step_0000004'})"
        in (decision["error"])
    )
    assert decide(_context(run_dir, [], dir=str(shared)), NAMED)["step"] == 4  # its own name
    explicit = decide(_context(run_dir, [], dir=str(shared), resume=str(shared)), other)
    assert explicit["step"] == 4 and explicit["error"] is None  # on purpose


def test_explicit_paths_corpus_accept_and_the_callers_check(source, tmp_path):
    run_dir = tmp_path / "run"
    missing = decide(_context(run_dir, [], resume=str(tmp_path / "nothing")), NAMED)
    assert "no checkpoint there" in missing["error"]
    older = decide(_context(run_dir, [], resume=str(source / store.step_name(2))), NAMED)
    assert older["step"] == 2 and older["path"] == str(source / store.step_name(2))

    messages: list[str] = []
    ctx = _context(run_dir, messages, "corpus-b", resume=str(source))
    assert decide(ctx, NAMED, accept_corpus=True)["step"] == 4
    assert any("continuing on the new one (resume.accept)" in m for m in messages)

    seen = []

    def check(saved_yaml, step):
        seen.append((saved_yaml, step))
        raise ConfigError("the configs differ")

    refused = decide(_context(run_dir, [], resume=str(source)), NAMED, check)
    assert refused["error"] == "the configs differ" and seen == [(NAMED, 4)]


def test_resumer_plans_as_decided_and_loads_into_a_fresh_state(source, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir / "checkpoints")
    fresh = Run(tmp_path / "unused")
    fresh.ckpt.close()
    resumer = Resumer(_context(run_dir, []))
    assert resumer.plan_resume(NAMED) == 4
    assert resumer.planned_path == run_dir / "checkpoints" / store.step_name(4)
    assert resumer.resume(fresh.state) == 4
    assert fresh.train_state.step == 4
    assert resumer.loaded == 4 and resumer.resumed[1] == 4  # in its own directory

    _tamper(run_dir / "checkpoints", "name_mismatch")
    with pytest.raises(ConfigError, match="but the directory is step_0000008: the manifest"):
        Resumer(_context(run_dir, [])).plan_resume(NAMED)
