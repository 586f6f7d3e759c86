"""checkpoint/: layout and commit protocol, clear errors, single-process save/resume.

The training setup (tiny reference Llama, FakeLoader, AdamW + the trainer's schedule, steps
through train.train_step) is tests/helpers.py's, shared with test_checkpoint_dist.py.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from checkpoint import CheckpointManager, store
from checkpoint.manager import model_shape_mismatches
from checkpoint.state import RNGState
from config import ConfigError
from model.config import ModelConfig
from model.init import init_weights
from model.llama import Llama
from tests.ckpt_harness import ckpt_cfg
from tests.helpers import BATCH, MODEL, SEQ, FakeLoader, build_training, config_yaml, run_steps

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# -- single-process runs ---------------------------------------------------------------------


def plain_model(cfg: ModelConfig = MODEL, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    model = Llama(cfg)
    init_weights(model, cfg, seed)
    return model


def single_run(run_dir: Path, steps: int, *, cfg: ModelConfig = MODEL, seed_rng: int = 0, **kw):
    """One process, no process group: build, resume, train to `steps`, finish."""
    torch.manual_seed(seed_rng)
    random.seed(seed_rng)
    model = plain_model(cfg)
    loader = FakeLoader()
    optimizer, scheduler, train_state, state = build_training(model, loader, cfg)
    ckpt = CheckpointManager(ckpt_cfg(**kw), run_dir, rank=0, world_size=1, log=lambda m: None)
    start = ckpt.resume(state)
    losses, _ = run_steps(
        model,
        optimizer,
        scheduler,
        loader,
        train_state,
        start,
        steps,
        ckpt=ckpt,
        state=state,
    )
    ckpt.finish(steps, state)
    return start, losses, model, train_state


# -- layout --------------------------------------------------------------------------------


def _fake_checkpoint(root: Path, step: int, payload: bytes = b"x" * 100) -> Path:
    tmp = root / (store.step_name(step) + store.TMP_SUFFIX)
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(payload)
    (tmp / ".metadata").write_bytes(b"m")
    store.write_manifest(tmp, step=step, world_size=1, checksum=True)
    final = root / store.step_name(step)
    store.commit(tmp, final)
    return final


def test_layout_commit_list_verify_prune(tmp_path):
    for s in (10, 20, 30):
        _fake_checkpoint(tmp_path, s)
    partial = tmp_path / (store.step_name(40) + store.TMP_SUFFIX)
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    stray = tmp_path / store.step_name(50)  # a step dir without manifest is not complete
    stray.mkdir()
    assert [c.step for c in store.list_complete(tmp_path)] == [10, 20, 30]
    assert store.newest_complete(tmp_path).step == 30

    manifest = json.loads((tmp_path / "step_0000030" / store.MANIFEST).read_text())
    assert manifest["step"] == 30 and manifest["files"]["__0_0.distcp"]["size"] == 100
    assert "crc32" in manifest["files"]["__0_0.distcp"]
    assert store.verify(tmp_path / "step_0000030") is None

    with (tmp_path / "step_0000030" / "__0_0.distcp").open("r+b") as f:
        f.truncate(60)
    assert "has 60 bytes, the manifest says 100" in store.verify(tmp_path / "step_0000030")
    (tmp_path / "step_0000020" / "__0_0.distcp").write_bytes(b"y" * 100)  # same size
    assert store.verify(tmp_path / "step_0000020", checksum=False) is None
    assert "CRC32" in store.verify(tmp_path / "step_0000020")
    (tmp_path / "step_0000010" / ".metadata").unlink()
    assert "missing" in store.verify(tmp_path / "step_0000010")

    assert store.clean_partial(tmp_path) == [partial] and not partial.exists()
    assert [p.name for p in store.prune(tmp_path, 2)] == ["step_0000010"]
    assert [c.step for c in store.list_complete(tmp_path)] == [20, 30]
    assert store.prune(tmp_path, 1) and [c.step for c in store.list_complete(tmp_path)] == [30]
    assert store.prune(tmp_path, 1) == []  # the newest complete one always stays
    assert stray.exists()


def test_prune_keeps_the_newest_confirmed_checkpoint_and_the_record_on_disk(tmp_path):
    """store.UNCONFIRMED: written atomically, read back, refused when unreadable; pruning
    keeps the newest checkpoint older than the unconfirmed ones, whatever keep_last says."""
    for step in (10, 20, 30, 40, 50):
        _fake_checkpoint(tmp_path, step)
    assert store.read_unconfirmed(tmp_path) is None
    store.write_unconfirmed(tmp_path, {"resumed_from": 30, "time": 1.0})
    assert store.read_unconfirmed(tmp_path) == {"resumed_from": 30, "time": 1.0}
    assert not list(tmp_path.glob("*.tmp"))  # written to a new file, renamed over
    record = store.read_unconfirmed(tmp_path)["resumed_from"]
    assert [p.name for p in store.prune(tmp_path, 1, unconfirmed_from=record)] == [
        "step_0000010",
        "step_0000030",
        "step_0000040",
    ]
    assert [c.step for c in store.list_complete(tmp_path)] == [20, 50]  # 20: newest before 30
    # Nothing older than the unconfirmed ones: keep_last alone decides.
    assert [p.name for p in store.prune(tmp_path, 1, unconfirmed_from=20)] == ["step_0000020"]
    assert store.clear_unconfirmed(tmp_path) and store.read_unconfirmed(tmp_path) is None
    for text in ("{not json", '{"resumed_from": "30"}', "[]"):
        (tmp_path / store.UNCONFIRMED).write_text(text)
        with pytest.raises(store.UnreadableRecord, match=str(tmp_path / store.UNCONFIRMED)):
            store.read_unconfirmed(tmp_path)


def test_layout_find_commit_over_existing_and_abandon(tmp_path):
    root = tmp_path / "checkpoints"
    _fake_checkpoint(root, 10)
    _fake_checkpoint(root, 20, payload=b"old")
    assert store.find_checkpoint(tmp_path).step == 20  # a run dir
    assert store.find_checkpoint(root).step == 20  # a checkpoints dir
    assert store.find_checkpoint(root / "step_0000010").step == 10
    assert store.find_checkpoint(tmp_path / "nope") is None
    assert store.find_checkpoint(root / "step_0000010" / ".metadata") is None
    # Re-saving a step that exists (a new timeline) replaces it.
    _fake_checkpoint(root, 20, payload=b"new!")
    assert (root / "step_0000020" / "__0_0.distcp").read_bytes() == b"new!"
    moved = store.abandon_newer(root, 10)
    assert len(moved) == 1 and moved[0].name.startswith("step_0000020.abandoned")
    assert [c.step for c in store.list_complete(root)] == [10]


def test_model_shape_mismatches_names_fields():
    a = config_yaml(ModelConfig(dim=256, n_heads=4))
    b = config_yaml(ModelConfig(dim=128, n_heads=4, name="other", init_std=0.01))
    assert model_shape_mismatches(a, b) == ["model.dim: checkpoint has 256, config has 128"]
    assert model_shape_mismatches(a, a) == []
    assert model_shape_mismatches(None, a) == []


# -- single-process manager --------------------------------------------------------------


def test_sync_resume_is_bitwise_and_prunes(tmp_path):
    _, straight, model_a, _ = single_run(tmp_path / "a", 8, mode="none", resume="none")
    start, first, _, _ = single_run(tmp_path / "b", 4, keep_last=2, interval=1)
    assert start == 0 and first == straight[:4]
    ckpts = tmp_path / "b" / "checkpoints"
    assert [c.step for c in store.list_complete(ckpts)] == [3, 4]
    assert not list(ckpts.glob("*.tmp"))
    assert (ckpts / "step_0000004" / "config.yaml").read_text() == config_yaml()
    start, second, model_b, train_state = single_run(tmp_path / "b", 8, keep_last=2, interval=1)
    assert start == 4 and second == straight[4:]
    assert train_state.tokens_seen == 8 * BATCH * SEQ and train_state.saved_config_yaml
    for (n, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(p, q), n


def test_async_thread_single_process(tmp_path):
    _, straight, _, _ = single_run(tmp_path / "a", 6, mode="none", resume="none")
    single_run(tmp_path / "b", 3, mode="async", interval=3)
    start, rest, _, _ = single_run(tmp_path / "b", 6, mode="async", interval=3)
    assert start == 3 and rest == straight[3:]


def test_stats_report_completed_saves(tmp_path):
    model = plain_model()
    loader = FakeLoader()
    optimizer, scheduler, train_state, state = build_training(model, loader)
    ckpt = CheckpointManager(ckpt_cfg(mode="async", interval=1), tmp_path, log=lambda m: None)
    assert ckpt.resume(state) == 0 and ckpt.stats() == {}
    train_state.step = 1
    timing = ckpt.maybe_save(1, state)
    assert set(timing) == {"save_blocking_s", "save_wait_prev_s"}
    assert ckpt.maybe_save(1, state) is None  # already saved
    ckpt.finish(1, state)  # nothing new to save; waits for the write
    stats = ckpt.stats()
    assert stats["save_total_s"] >= stats["save_blocking_s"] > 0
    assert ckpt.stats() == {}
    assert store.newest_complete(tmp_path / "checkpoints").step == 1


def test_resume_none_moves_old_checkpoints_aside(tmp_path):
    single_run(tmp_path, 4, interval=2)
    start, _, _, _ = single_run(tmp_path, 2, interval=2, resume="none")
    assert start == 0
    assert [c.step for c in store.list_complete(tmp_path / "checkpoints")] == [2]
    assert len(list((tmp_path / "checkpoints").glob("step_0000004.abandoned*"))) == 1


def test_partial_directory_is_ignored_and_cleaned(tmp_path):
    single_run(tmp_path, 2, interval=2)
    partial = tmp_path / "checkpoints" / "step_0000004.tmp"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"partial")
    start, _, _, _ = single_run(tmp_path, 3, interval=0)
    assert start == 2 and not partial.exists()


def test_error_explicit_path_without_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    for spec in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(ConfigError, match=r"checkpoint.resume=.*: no checkpoint there"):
            single_run(tmp_path / "run", 1, resume=str(spec))


def test_error_model_shape_mismatch_names_field(tmp_path):
    single_run(tmp_path, 2, interval=2)
    smaller = ModelConfig(max_seq_len=64, rope_scaling=None, dim=64, n_heads=4)
    with pytest.raises(ConfigError) as e:
        single_run(tmp_path, 3, cfg=smaller)
    msg = str(e.value)
    assert msg.startswith("model.dim: checkpoint has 128, config has 64") and "\n" not in msg


def test_error_shape_mismatch_without_config_names_tensor(tmp_path):
    """No current config to compare with: the tensor check names the tensor."""
    single_run(tmp_path, 2, interval=2)
    smaller = ModelConfig(max_seq_len=64, rope_scaling=None, ffn_dim=256)
    model = plain_model(smaller)
    optimizer, scheduler, train_state, state = build_training(model, FakeLoader(), smaller)
    train_state.config_yaml = None
    ckpt = CheckpointManager(ckpt_cfg(), tmp_path, log=lambda m: None)
    with pytest.raises(
        ConfigError,
        match=r"does not fit this run: 'model\.layers\.0\.layernorm_mlp"
        r"\.fc1_weight': checkpoint has shape \(768, 128\), this "
        r"run has \(512, 128\)",
    ):
        ckpt.resume(state)


def test_error_truncated_file_detected_and_previous_resumable(tmp_path):
    single_run(tmp_path, 4, interval=2)
    newest = tmp_path / "checkpoints" / "step_0000004"
    data = sorted(newest.glob("*.distcp"))[0]
    size = data.stat().st_size
    with data.open("r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(ConfigError) as e:
        single_run(tmp_path, 6, interval=2)
    msg = str(e.value)
    assert "step_0000004 is damaged" in msg and "truncated" in msg and "\n" not in msg
    assert f"checkpoint.resume={tmp_path / 'checkpoints' / 'step_0000002'}" in msg
    assert data.stat().st_size == size // 2  # not loaded, not deleted
    start, _, _, _ = single_run(
        tmp_path, 3, interval=0, resume=str(tmp_path / "checkpoints" / "step_0000002")
    )
    assert start == 2
    # The damaged newer checkpoint was moved out of auto-resume's way.
    assert [c.step for c in store.list_complete(tmp_path / "checkpoints")] == [2, 3]


def test_error_missing_entry_names_key(tmp_path):
    single_run(tmp_path, 2, interval=2)

    class NewLoader(FakeLoader):
        def state_dict(self):
            return {**super().state_dict(), "epoch": 0}

    model = plain_model()
    optimizer, scheduler, train_state, state = build_training(model, NewLoader())
    ckpt = CheckpointManager(ckpt_cfg(), tmp_path, log=lambda m: None)
    with pytest.raises(ConfigError, match=r"has no entry 'loader\.epoch'"):
        ckpt.resume(state)


def test_bad_mode_and_async_process_without_dist(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.mode='often' is not one of"):
        CheckpointManager(ckpt_cfg(mode="often"), tmp_path)
    # async_process needs no torch.distributed (issue #14): a writer process of its own.
    CheckpointManager(ckpt_cfg(mode="async_process"), tmp_path).close()


def test_rng_fallback_for_rank_missing_in_checkpoint(monkeypatch):
    import checkpoint.state as st

    torch.manual_seed(5)
    saved0 = torch.get_rng_state()
    monkeypatch.setattr(st, "_rank", lambda: 3)
    rng = RNGState()
    request = rng.load_request({"cpu_rank0": None, "cpu_rank1": None})
    assert set(request) == {"cpu_rank0"}  # own rank absent: only rank 0's, for the seed
    draws = []
    for _ in range(2):
        rng.load_state_dict({"cpu_rank0": saved0})
        draws.append(torch.rand(3))
    assert torch.equal(draws[0], draws[1])
    monkeypatch.setattr(st, "_rank", lambda: 2)
    rng.load_state_dict({"cpu_rank0": saved0})
    assert not torch.equal(torch.rand(3), draws[0])  # another rank, another stream


def test_rng_state_roundtrip():
    rng = RNGState()
    torch.manual_seed(1)
    random.seed(1)
    sd = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in rng.state_dict().items()}
    a, b = torch.rand(4), random.random()
    rng.load_state_dict(sd)
    assert torch.equal(torch.rand(4), a) and random.random() == b


#: One interpreter imports the third-party libraries once, then forks a child per order, in
#: which every project module is still unimported (7 fresh interpreters took ~35 s of imports).
IMPORT_ORDERS = """
import os, sys, traceback
import torch, torch.distributed.checkpoint, torch.distributed.tensor, hydra, omegaconf, yaml
failed = []
for first in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        assert "config" not in sys.modules and "train" not in sys.modules
        try:
            exec(f"import {first}, config, checkpoint, parallel, recipes, data, model")
        except BaseException:
            print(f"import {first} first:", file=sys.stderr)
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    if os.waitpid(pid, 0)[1] != 0:
        failed.append(first)
print("failed:", " ".join(failed))
"""


def test_packages_import_in_any_order():
    """Plain imports, no cycle: config (which imports every group's schema) and the packages
    whose schemas it imports load first in an interpreter that has imported none of them,
    whichever comes first."""
    import subprocess
    import sys

    firsts = ("config", "checkpoint", "parallel", "recipes", "data", "model", "train")
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_ORDERS, *firsts],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=300,
    )
    assert out.returncode == 0 and out.stdout.strip() == "failed:", out.stdout + out.stderr[-3000:]


def test_async_save_works_when_dcp_closes_the_stager(tmp_path, monkeypatch):
    """torch 2.11's dcp.async_save closes the stager it is given after staging; the manager
    must not hand the closed one to the next save (it fails with KeyError: <class 'type'>)."""
    import torch.distributed.checkpoint as dcp

    original = dcp.async_save

    def closing_async_save(*args, **kwargs):
        future = original(*args, **kwargs)
        stager = kwargs.get("async_stager")
        if stager is not None:
            stager.close()
        return future

    monkeypatch.setattr(dcp, "async_save", closing_async_save)
    _, straight, _, _ = single_run(tmp_path / "a", 6, mode="none", resume="none")
    single_run(tmp_path / "b", 4, mode="async", interval=2)  # saves at 2 and 4 (4 at finish)
    start, rest, _, _ = single_run(tmp_path / "b", 6, mode="async", interval=2)
    assert start == 4 and rest == straight[4:]


def test_resume_refuses_to_drop_optimizer_state(tmp_path):
    """An optimizer whose state exists for only some parameters (as after seeding FusedAdam
    masters for quantized weights alone) would load only those; the resume must refuse."""
    single_run(tmp_path, 2, interval=2)
    model = plain_model()
    optimizer, scheduler, train_state, state = build_training(model, FakeLoader())
    first = next(model.parameters())
    optimizer.state[first] = {
        "step": torch.tensor(0.0),
        "exp_avg": torch.zeros_like(first),
        "exp_avg_sq": torch.zeros_like(first),
    }
    ckpt = CheckpointManager(ckpt_cfg(), tmp_path, log=lambda m: None)
    with pytest.raises(ConfigError, match=r"'optimizer\.state\..*' would not be loaded"):
        ckpt.resume(state)
