"""Held-out data and the validation loss: which documents are held out (only with eval on),
the fixed eval batches, `train.evaluate` averaged over data-parallel ranks, and train.py
end to end: val_loss in stdout and metrics.jsonl, bitwise equal after a resume."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from config import ConfigError
from data import ByteTokenizer, DataConfig, build_eval_batches, build_loader
from data.packing import pack_dataset
from data.sources import embedded_dataset, held_out_mask, is_held_out
from runlog import read_metrics
from runtime import launch
from steps import evaluate
from tests.distributed import run_distributed
from tests.harness.resume import keep_only_checkpoint
from tests.helpers import CPU_ENV, TINY_RUN
from tests.test_data import DOCS, expected_stream, hf_cfg, write_files

TOK = ByteTokenizer()


@pytest.mark.parametrize("n, f", [(437, 0.01), (60, 0.1), (11, 0.1), (100, 0.3), (7, 0.5)])
def test_held_out_mask_is_an_even_deterministic_fraction(n, f):
    mask = held_out_mask(n, f)
    assert mask.sum() == math.floor(n * f)
    assert [is_held_out(i, f) for i in range(n)] == mask.tolist()
    if f == 0.01:
        assert np.flatnonzero(mask).tolist() == [99, 199, 299, 399]


def test_embedded_training_data_changes_only_with_eval_on():
    cfg = DataConfig(name="embedded", seq_len=32, max_bytes=200_000, eval_fraction=0.1)
    docs = embedded_dataset(cfg)
    everything = pack_dataset(docs, TOK, "text")
    kept = docs.select([i for i in range(len(docs)) if not is_held_out(i, 0.1)])
    off = build_loader(cfg, TOK, global_batch_size=4, dp_rank=0, dp_size=1)
    on = build_loader(cfg, TOK, global_batch_size=4, dp_rank=0, dp_size=1, hold_out=True)
    # Eval off: every document, the same loader as before evaluation existed.
    assert off.samples_per_epoch == len(everything) // 33
    assert on.samples_per_epoch == len(pack_dataset(kept, TOK, "text")) // 33
    assert on.samples_per_epoch < off.samples_per_epoch
    # The held-out document's text is nowhere in the training samples, and is the eval data.
    held = docs[int(np.flatnonzero(held_out_mask(len(docs), 0.1))[0])]["text"]
    train_text = TOK.decode(on._samples.reshape(-1).tolist())
    assert held[:200] not in train_text
    ev = build_eval_batches(cfg, TOK, batches=2, global_batch_size=4, dp_rank=0, dp_size=1)
    assert ev.shape == (2, 4, 33)
    assert TOK.decode(ev[0, 0].tolist()).startswith(held[:32])


def test_eval_batches_are_fixed_and_split_over_ranks_like_training():
    cfg = DataConfig(name="embedded", seq_len=32, max_bytes=200_000, eval_fraction=0.1)
    full = build_eval_batches(cfg, TOK, batches=3, global_batch_size=8, dp_rank=0, dp_size=1)
    again = build_eval_batches(cfg, TOK, batches=3, global_batch_size=8, dp_rank=0, dp_size=1)
    assert torch.equal(full, again)
    parts = [
        build_eval_batches(cfg, TOK, batches=3, global_batch_size=8, dp_rank=r, dp_size=4)
        for r in range(4)
    ]
    assert torch.equal(torch.cat(parts, dim=1), full)
    with pytest.raises(ConfigError, match=r"fewer than eval.batches x train.global_batch_size"):
        build_eval_batches(cfg, TOK, batches=10_000, global_batch_size=8, dp_rank=0, dp_size=1)


@pytest.mark.parametrize("streaming", [False, True])
def test_hf_fraction_holds_out_documents(tmp_path, streaming):
    root = write_files(tmp_path / "j", "jsonl")
    cfg = hf_cfg(tmp_path, root, eval_fraction=0.1, streaming=streaming)
    held = [d for i, d in enumerate(DOCS) if is_held_out(i, 0.1)]
    kept = [d for i, d in enumerate(DOCS) if not is_held_out(i, 0.1)]
    assert len(held) == 6
    loader = build_loader(cfg, TOK, global_batch_size=4, dp_rank=0, dp_size=1, hold_out=True)
    stream = expected_stream(TOK, kept)
    got = torch.cat([loader.next_batch() for _ in range(5)]).flatten().numpy()
    np.testing.assert_array_equal(got, stream[: len(got)])
    ev = build_eval_batches(cfg, TOK, batches=2, global_batch_size=4, dp_rank=0, dp_size=1)
    np.testing.assert_array_equal(ev.flatten().numpy(), expected_stream(TOK, held)[: 8 * 33])


def test_hf_eval_split_is_for_hub_datasets(tmp_path):
    root = write_files(tmp_path / "j", "jsonl")
    cfg = hf_cfg(tmp_path, root, eval_split="validation")
    with pytest.raises(ConfigError, match=r"data.eval_split='validation' names a split of a hub"):
        build_eval_batches(cfg, TOK, batches=1, global_batch_size=4, dp_rank=0, dp_size=1)


def _tiny_model():
    from model import build_model, init_weights
    from model.config import ModelConfig

    mcfg = ModelConfig(dim=64, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=128, rope_scaling=None)
    model = build_model(mcfg, "torch")
    init_weights(model, mcfg, seed=3)
    return model


def _eval_batches(dp_rank: int, dp_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    full = torch.randint(0, 258, (2, 8, 17), generator=g)
    local = 8 // dp_size
    return full[:, dp_rank * local : (dp_rank + 1) * local]


def _evaluate_on_ranks(rank: int, world_size: int, expected: float):
    import torch.distributed as dist

    got = evaluate(
        _tiny_model(),
        _eval_batches(rank, world_size),
        micro_batches=2,
        dp_group=dist.group.WORLD,
    )
    assert got == pytest.approx(expected, rel=1e-6), (got, expected)


def test_evaluate_is_the_mean_over_micro_batches_and_ranks():
    model = _tiny_model()
    batches = _eval_batches(0, 1)
    model.train()
    one = evaluate(model, batches)
    assert model.training  # left as it was
    # The mean of the per-row losses (every row has the same number of labels).
    with torch.no_grad():
        rows = [model(b[None, :-1], labels=b[None, 1:]).item() for batch in batches for b in batch]
    assert one == pytest.approx(sum(rows) / len(rows), rel=1e-6)
    assert evaluate(model, batches, micro_batches=4) == pytest.approx(one, rel=1e-6)
    run_distributed(_evaluate_on_ranks, 2, one)


TINY = [
    *TINY_RUN,
    "optim.warmup_steps=2",
    "train.device=cpu",
]


def test_val_loss_is_logged_and_exact_on_resume(tmp_path):
    args = [
        *TINY,
        "train.steps=6",
        "eval.every=2",
        "eval.batches=2",
        "data.eval_fraction=0.1",
        "checkpoint=sync",
        "checkpoint.interval=3",
        f"run.root={tmp_path}",
    ]
    a = launch([*args, "run.name=a"], env=CPU_ENV, timeout=600)
    assert a.returncode == 0, a.stdout[-2000:] + a.stderr[-3000:]
    records = read_metrics(tmp_path / "a" / "metrics.jsonl")
    val = {r["step"]: r.get("val_loss") for r in records}
    assert [s for s, v in val.items() if v is not None] == [2, 4, 6]
    assert "| val_loss " in a.stdout and "eval: 2 held-out batches every 2 steps" in a.stdout
    # Resume from step 3: the evaluations at 4 and 6 see the same batches and weights.
    keep_only_checkpoint(tmp_path / "a", tmp_path / "b", 3)
    b = launch([*args, "run.name=b"], env=CPU_ENV, timeout=600)
    assert b.returncode == 0, b.stdout[-2000:] + b.stderr[-3000:]
    assert "resumed_from_step=3" in b.stdout
    resumed = {r["step"]: r for r in read_metrics(tmp_path / "b" / "metrics.jsonl")}
    for step in (4, 6):
        assert resumed[step]["val_loss"] == val[step]  # bitwise
    for r in records[3:]:
        assert resumed[r["step"]]["loss"] == r["loss"]


def test_val_loss_on_two_ranks_matches_one(tmp_path):
    """FSDP2 over 2 gloo ranks: each evaluates its rows, the mean is the one-process value
    (fp32 on CPU; only the reduction order differs)."""
    args = [*TINY, "train.steps=4", "eval.every=2", "eval.batches=2", "data.eval_fraction=0.1"]
    args += ["train.micro_batch_size=2", "checkpoint=none", f"run.root={tmp_path}"]
    runs = {}
    for nproc in (1, 2):
        r = launch([*args, f"run.name=n{nproc}"], nproc=nproc, env=CPU_ENV, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        runs[nproc] = {x["step"]: x for x in read_metrics(tmp_path / f"n{nproc}" / "metrics.jsonl")}
    for step in (2, 4):
        one, two = runs[1][step]["val_loss"], runs[2][step]["val_loss"]
        assert two == pytest.approx(one, rel=1e-5, abs=1e-6), (step, one, two)
