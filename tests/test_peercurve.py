"""The peer curve's CPU side (docs/PEER_CURVE.md; tests/gpu/suite.sh peercurve runs it on GPUs):

- tools/tt_metrics.py reads torchtitan's step lines, written here in its exact format (the
  f-string of torchtitan v0.2.2's components/metrics.py, its colour codes, its logging
  prefix and torchrun's rank prefix), into records tools/compare_runs.py reads;
- its restatement of torchtitan's warmup-stable-decay schedule gives, with the mapping the
  stage uses, this recipe's schedule (optim.lr_lambda) at every step;
- compare_runs --peer-bounds on synthetic curves, against values computed here another way;
- tools/tt_peercurve.py (torchtitan's loader replaced) deals out the same rows as this
  recipe's loader (data/loader.py PackedLoader) at every rank and step, across passes;
- the stage's last steps on canned outputs: torchtitan's log converted, the bounds table,
  the lr check and the plot.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from data.loader import PackedLoader
from optim import OptimConfig, build_scheduler, lr_lambda
from runlog import load_run
from tools import compare_runs, tt_metrics, tt_peercurve
from tools.tt_peercurve import SameOrderDataset, pack_documents, rank_sample_ids

ROOT = Path(__file__).resolve().parents[1]

# torchtitan v0.2.2's Color class; its NoColor is all empty strings.
COLOR = dict(
    red="\033[31m",
    green="\033[32m",
    orange="\033[38;2;180;60;0m",
    turquoise="\033[38;2;54;234;195m",
    blue="\033[34m",
    cyan="\033[36m",
    magenta="\033[35m",
    yellow="\033[33m",
    reset="\033[39m",
)
NO_COLOR = dict.fromkeys(COLOR, "")


def tt_message(step, loss, grad_norm, mem_gib, mem_pct, tps, tflops, mfu, color=True):
    """MetricsProcessor.log's console message, as torchtitan v0.2.2 formats it."""
    c = COLOR if color else NO_COLOR
    return (
        f"{c['red']}step: {step:2}  "
        f"{c['green']}loss: {loss:8.5f}  "
        f"{c['orange']}grad_norm: {grad_norm:7.4f}  "
        f"{c['turquoise']}memory: {mem_gib:5.2f}GiB"
        f"({mem_pct:.2f}%)  "
        f"{c['blue']}tps: {round(tps):,}  "
        f"{c['cyan']}tflops: {tflops:,.2f}  "
        f"{c['magenta']}mfu: {mfu:.2f}%{c['reset']}"
    )


def tt_validation(step, loss, mem_gib, mem_pct, tps, color=True):
    c = COLOR if color else NO_COLOR
    return (
        f"{c['yellow']}validate step: {step:2}  "
        f"{c['green']}loss: {loss:7.4f}  "
        f"{c['turquoise']}memory: {mem_gib:5.2f}GiB"
        f"({mem_pct:.2f}%)  "
        f"{c['blue']}tps: {round(tps):,}{c['reset']}"
    )


def logged(message: str, rank: int | None = 0, second: int = 1) -> str:
    """torchtitan's logging format ('[titan] %(asctime)s - %(name)s - %(levelname)s -
    %(message)s'), behind torchrun's --tee --role rank prefix."""
    line = f"[titan] 2026-11-27 10:00:{second:02d},123 - root - INFO - {message}"
    return line if rank is None else f"[rank{rank}]:{line}"


# --------------------------------------------------------------------------------------
# tools/tt_metrics.py


def canned_log(color: bool = True) -> str:
    lines = [
        "W1127 10:00:00.000000 123 torch/distributed/run.py:792] Setting OMP_NUM_THREADS",
        logged("Starting job: Llama 3 throughput vs te-llama"),
        logged(
            f"{COLOR['blue']}Model llama3_same_order 1B {COLOR['red']}size: 1,498,482,688 "
            f"total parameters{COLOR['reset']}"
        ),
        logged("Training starts at step 1"),
        # rank 1 printed step 1 first (no --local-ranks-filter): the first line is kept
        logged(tt_message(1, 11.77561, 5.4321, 40.12, 50.81, 9870, 88.5, 8.95, color), rank=1),
        logged(tt_message(1, 11.77561, 5.4321, 41.5, 52.55, 10234, 91.73, 9.27, color)),
        logged(tt_message(2, 11.20937, 12.0456, 55.25, 69.95, 123456.4, 1234.567, 124.8, color)),
        logged("Dataset c4_test is being re-looped", second=2).replace("INFO", "WARNING"),
        logged(tt_validation(2, 10.5, 55.25, 69.95, 5000, color)),
        logged(tt_message(10, 6.5, 0.98766, 55.25, 69.95, 40000, 360.0, 36.4, color), second=5),
    ]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("color", [True, False], ids=["colour", "no-colour"])
def test_parse_reads_each_step_line_once(color):
    parsed = tt_metrics.parse_log(canned_log(color))
    assert [p["step"] for p in parsed] == [1, 2, 10]  # the validation line is not a step
    first, second, tenth = parsed
    assert first == {
        "step": 1,
        "loss": 11.77561,
        "grad_norm": 5.4321,
        "memory_gib": 40.12,
        "memory_pct": 50.81,
        "tps": 9870.0,
        "tflops": 88.5,
        "mfu_pct": 8.95,
    }
    assert second["tps"] == 123456.0 and second["tflops"] == 1234.57  # thousands separators
    assert second["grad_norm"] == 12.0456 and second["mfu_pct"] == 124.8
    assert tenth["loss"] == 6.5 and tenth["grad_norm"] == 0.9877
    # --rank 0: rank 1's line for step 1 is not read
    assert tt_metrics.parse_log(canned_log(color), rank=0)[0]["tps"] == 10234.0
    assert [p["step"] for p in tt_metrics.parse_log(canned_log(color), rank=1)] == [1]


def test_parse_without_prefixes_and_with_nan():
    text = tt_message(3, float("nan"), float("inf"), 1.0, 1.0, 10, 1.0, 1.0) + "\n"
    (rec,) = tt_metrics.parse_log(text)
    assert rec["step"] == 3 and math.isnan(rec["loss"]) and rec["grad_norm"] == math.inf


def test_cli_writes_records_compare_runs_reads(tmp_path, capsys):
    log, out = tmp_path / "tt.log", tmp_path / "tt" / "metrics.jsonl"
    log.write_text(canned_log())
    args = [log, out, "--tokens-per-step", 32768, "--world-size", 2]
    args += ["--lr", 3e-4, "--warmup-steps", 4, "--total-steps", 10]
    args += ["--decay-type", "cosine", "--min-lr-factor", 0.1]
    assert tt_metrics.main([str(a) for a in args]) == 0
    assert "3 steps (1..10)" in capsys.readouterr().out
    run = load_run(out)
    assert sorted(run) == [1, 2, 10]
    one = run[1]
    assert one["loss"] == 11.77561 and one["grad_norm"] == 5.4321
    assert one["tokens_seen"] == 32768 and run[10]["tokens_seen"] == 327680
    assert one["tokens_per_s_per_device"] == 9870 and one["tokens_per_s"] == 19740
    assert one["step_time_s"] == pytest.approx(32768 / 19740)
    assert one["mem_reserved_gb"] == 40.12 and "mem_gb" not in one
    assert one["mfu"] == pytest.approx(0.0895) and one["tflops"] == 88.5
    # the lr in force after the step, as train.py records it: step 1 of warmup 4 -> 2/4
    assert one["lr"] == pytest.approx(3e-4 * 2 / 4)
    assert run[10]["lr"] == pytest.approx(3e-5)  # the end of the cosine: lr x min_lr_factor
    # no lr or tokens without their flags
    assert tt_metrics.main([str(log), str(out)]) == 0
    assert set(load_run(out)[2]) == {
        "loss",
        "grad_norm",
        "tokens_per_s_per_device",
        "mem_reserved_gb",
        "tflops",
        "mfu",
    }


def test_cli_bad_input_exits_2(tmp_path, capsys):
    empty = tmp_path / "empty.log"
    empty.write_text(logged("Training starts at step 1") + "\n")
    out = str(tmp_path / "x.jsonl")
    assert tt_metrics.main([str(empty), out]) == 2
    assert "no torchtitan step line" in capsys.readouterr().err
    assert tt_metrics.main([str(tmp_path / "missing.log"), out]) == 2
    assert tt_metrics.main([str(empty), out, "--lr", "1e-3"]) == 2
    assert "--total-steps" in capsys.readouterr().err


# --------------------------------------------------------------------------------------
# The schedule mapping: optim.* -> lr_scheduler.*


def test_torchtitan_schedule_by_hand():
    """tt_lr_factor against values worked out from torchtitan's definition: total 10, warmup
    2 -> decay 8, one stable step."""
    f = [tt_metrics.tt_lr_factor(c, warmup_steps=2, total_steps=10) for c in range(11)]
    assert f[:3] == [0.5, 1.0, 1.0]
    assert f[3:] == pytest.approx([7 / 8, 6 / 8, 5 / 8, 4 / 8, 3 / 8, 2 / 8, 1 / 8, 0.0])
    sq = tt_metrics.tt_lr_factor(4, warmup_steps=2, total_steps=10, decay_type="sqrt")
    assert sq == pytest.approx(1 - math.sqrt(2 / 8))
    # WSD: decay_ratio 0.5 -> 5 decay steps, 4 stable (steps_done 2..5), then down to the floor
    wsd = [
        tt_metrics.tt_lr_factor(
            c, warmup_steps=2, total_steps=10, decay_ratio=0.5, min_lr_factor=0.2
        )
        for c in range(11)
    ]
    assert wsd[:6] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert wsd[6:] == pytest.approx([0.2 + 0.8 * (1 - k / 5) for k in range(1, 6)])


@pytest.mark.parametrize(
    "warmup,total,min_ratio", [(30, 300, 0.1), (0, 50, 0.0), (10, 37, 0.25), (300, 300, 0.1)]
)
def test_stage_mapping_gives_this_recipes_schedule(warmup, total, min_ratio):
    """optim.warmup_steps -> lr_scheduler.warmup_steps, optim.min_lr_ratio ->
    lr_scheduler.min_lr_factor, cosine, lr_scheduler.total_steps = train.steps: the same
    multiplier at every step."""
    ours = lr_lambda(OptimConfig(warmup_steps=warmup, min_lr_ratio=min_ratio), total)
    for c in range(total + 1):
        theirs = tt_metrics.tt_lr_factor(
            c,
            warmup_steps=warmup,
            total_steps=total,
            decay_type="cosine",
            min_lr_factor=min_ratio,
        )
        assert theirs == pytest.approx(ours(c), rel=1e-12, abs=1e-15), c


# --------------------------------------------------------------------------------------
# compare_runs --peer-bounds


def curve(steps):
    """A loss curve with step-to-step noise."""
    return {s: 3.0 + 8.0 / (1 + 0.05 * s) + 0.05 * math.sin(1.7 * s) for s in steps}


def write_metrics(path: Path, loss: dict[int, float]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in loss.items()))
    return path


def trailing_means(values: list[float], n: int) -> np.ndarray:
    """The mean of the last n values at each point (fewer at the start), via cumulative sums."""
    c = np.concatenate([[0.0], np.cumsum(values)])
    i = np.arange(1, len(values) + 1)
    lo = np.maximum(i - n, 0)
    return (c[i] - c[lo]) / (i - lo)


def perturbed(ref: dict[int, float]) -> dict[int, float]:
    """ref x (1 + 2e-4) at step 1, a 10-step bump of +4% at steps 100-109, +0.6% over the
    last 50 steps."""
    out = {}
    for s, v in ref.items():
        e = 2e-4 if s == 1 else 0.0
        e += 0.04 if 100 <= s < 110 else 0.0
        e += 0.006 if s > 250 else 0.0
        out[s] = v * (1 + e)
    return out


def test_peer_bounds_on_synthetic_curves():
    steps = range(1, 301)
    ref = curve(steps)
    other = perturbed(ref)
    a, b = [ref[s] for s in steps], [other[s] for s in steps]
    rows = compare_runs.peer_bounds(
        {s: {"loss": v} for s, v in ref.items()}, {s: {"loss": v} for s, v in other.items()}
    )
    step1, tail, window = rows
    assert step1.value == pytest.approx(2e-4, rel=1e-9) and step1.ok and step1.checked
    assert tail.value == pytest.approx(0.006, rel=1e-9) and tail.bound == 0.01 and tail.ok
    # the bump: the 20-step means differ most where the window holds all 10 bumped steps
    ma, mb = trailing_means(a, 20), trailing_means(b, 20)
    rel = np.abs(mb - ma) / np.abs(ma)
    assert window.value == pytest.approx(rel.max(), rel=1e-9)
    assert 109 <= 1 + int(rel.argmax()) <= 119
    assert 0.019 < window.value < 0.021 and window.ok  # about 10/20 of 4%
    assert f"at step {1 + int(rel.argmax())}:" in window.detail


def test_peer_bounds_exceeded_and_the_spread_of_further_references(tmp_path, capsys):
    steps = range(1, 121)
    ref = curve(steps)
    tt = write_metrics(tmp_path / "tt.jsonl", ref)
    # 1.5% above over the last 50 steps, and 5% above for 20 steps: two bounds exceeded
    worse = {
        s: v * (1 + (0.015 if s > 70 else 0) + (0.05 if 30 <= s < 50 else 0))
        for s, v in ref.items()
    }
    ours = write_metrics(tmp_path / "ours.jsonl", worse)
    assert compare_runs.main([str(tt), str(ours), "--peer-bounds"]) == 1
    out = capsys.readouterr().out
    assert (
        "| mean of the last 50 common steps: relative difference | 1.500e-02 | 1.0e-02 | EXCEEDED"
        in out
    )
    assert (
        "| 20-step trailing means: largest relative difference | 5.000e-02 | 3.0e-02 | EXCEEDED"
        in out
    )
    assert "FAIL: a peer bound is exceeded" in out
    # a second torchtitan run 2% away over its last 50 steps widens the tail bound to 2%
    tt2 = write_metrics(
        tmp_path / "tt2.jsonl", {s: v * (1.02 if s > 70 else 1.0) for s, v in ref.items()}
    )
    rows = compare_runs.peer_bounds(load_run(tt), load_run(ours), [load_run(tt2)])
    assert rows[1].bound == pytest.approx(0.02) and rows[1].ok
    assert "the references' spread 2.00%" in rows[1].detail
    assert not rows[2].ok


def test_peer_bounds_step_one_and_its_options(tmp_path, capsys):
    steps = range(1, 31)  # fewer than 50: the tail is every common step
    ref = curve(steps)
    tt = write_metrics(tmp_path / "tt.jsonl", ref)
    ours = write_metrics(
        tmp_path / "ours.jsonl", {s: v * (1.005 if s == 1 else 1) for s, v in ref.items()}
    )
    assert compare_runs.main([str(tt), str(ours), "--peer-bounds"]) == 1
    assert (
        "| step 1: relative difference | 5.000e-03 | 1.0e-03 | EXCEEDED" in capsys.readouterr().out
    )
    assert compare_runs.main([str(tt), str(ours), "--peer-bounds", "--different-batches"]) == 0
    out = capsys.readouterr().out
    assert "(different batches: not checked) | 5.000e-03 | 1.0e-03 | (not checked)" in out
    assert "mean of the last 30 common steps" in out and "OK: within the peer bounds" in out
    for bad in (["--rtol", "0.1"], ["--exact"]):
        assert compare_runs.main([str(tt), str(ours), "--peer-bounds", *bad]) == 2
    assert compare_runs.main([str(tt), str(ours), "--different-batches"]) == 2
    assert "--different-batches goes with --peer-bounds" in capsys.readouterr().err


# --------------------------------------------------------------------------------------
# tools/tt_peercurve.py: torchtitan's loader replaced by this recipe's order


@pytest.mark.parametrize("dp,global_batch,micro", [(1, 8, 4), (2, 8, 4), (2, 8, 2), (4, 4, 1)])
def test_same_order_rows_are_this_recipes(dp, global_batch, micro):
    seq = 15
    tokens = np.arange(23 * (seq + 1) + 7, dtype=np.int64) * 7 % 1009  # 23 samples + a tail
    samples = tokens[: 23 * (seq + 1)].reshape(23, seq + 1)
    steps = 13  # past four passes of 23 samples, with batches straddling them
    for rank in range(dp):
        ours = PackedLoader(
            tokens,
            shuffle=False,
            shuffle_seed=0,
            seq_len=seq,
            global_batch_size=global_batch,
            dp_rank=rank,
            dp_size=dp,
            more_data_hint="",
        )
        dataset = SameOrderDataset(samples, rank=rank, dp=dp, global_batch=global_batch)
        # torchtitan's loader is a StatefulDataLoader over the dataset with batch_size =
        # training.local_batch_size; a step takes global / (dp x micro) of its batches.
        theirs = iter(torch.utils.data.DataLoader(dataset, batch_size=micro))
        for step in range(steps):
            rows = ours.next_batch()
            got = [next(theirs) for _ in range(global_batch // (dp * micro))]
            inputs = torch.cat([x["input"] for x, _ in got])
            labels = torch.cat([y for _, y in got])
            assert torch.equal(inputs, rows[:, :-1]), (rank, step)
            assert torch.equal(labels, rows[:, 1:]), (rank, step)
        assert dataset.state_dict() == {"taken": steps * global_batch // dp}


def test_same_order_resumes_and_shifts():
    ids = rank_sample_ids(0, 12, rank=1, dp=2, global_batch=4, n_samples=5)
    assert ids.tolist() == [2, 3, 1, 2, 0, 1, 4, 0, 3, 4, 2, 3]
    shifted = rank_sample_ids(0, 12, rank=1, dp=2, global_batch=4, n_samples=5, shift=3)
    assert shifted.tolist() == ((ids + 3) % 5).tolist()
    samples = np.arange(5 * 4).reshape(5, 4)
    a = SameOrderDataset(samples, rank=1, dp=2, global_batch=4)
    it = iter(a)
    first = [next(it)[1] for _ in range(7)]
    b = SameOrderDataset(samples, rank=1, dp=2, global_batch=4)
    b.load_state_dict({"taken": 3})
    rest = iter(b)
    assert all(torch.equal(next(rest)[1], y) for y in first[3:])
    with pytest.raises(ValueError, match="fewer than one global batch"):
        SameOrderDataset(samples, rank=0, dp=1, global_batch=6)
    with pytest.raises(ValueError, match="not divisible"):
        rank_sample_ids(0, 1, rank=0, dp=3, global_batch=4, n_samples=5)


def test_packing_is_this_recipes():
    """[BOS] + tokens + [EOS] per document (what torchtitan's tokenizer.encode(add_bos=True,
    add_eos=True) gives), concatenated and cut as data/packing.py cuts its stream."""
    import datasets

    from data.packing import pack_dataset
    from data.tokenizer import ByteTokenizer

    texts = ["def f():\n    return 1\n", "", "x = [i * i for i in range(9)]\n" * 3, "é"]
    tok = ByteTokenizer()
    stream = pack_dataset(datasets.Dataset.from_dict({"text": texts}), tok, "text")
    docs = [[tok.bos_id, *tok.encode(t), tok.eos_id] for t in texts]
    for seq in (7, 16, 40):
        n = len(stream) // (seq + 1)
        expect = stream[: n * (seq + 1)].reshape(n, seq + 1)
        assert np.array_equal(pack_documents(docs, seq), expect)


# --------------------------------------------------------------------------------------
# tools/tt_peercurve.py: the flavors, the shared samples, the text


def tt_param_count(s) -> int:
    """Parameters of torchtitan's Transformer of a PeerShape, counted from its layers: the
    embedding, per block wq/wk/wv/wo, w1/w2/w3 and two norms, the final norm, the output."""
    head = s.dim // s.n_heads
    hidden = tt_peercurve.tt_ffn_dim(s.dim, s.multiple_of, s.ffn_multiplier)
    attention = s.dim * head * (2 * s.n_heads + 2 * s.n_kv_heads)
    block = attention + 3 * s.dim * hidden + 2 * s.dim
    return 2 * s.vocab_size * s.dim + s.n_layers * block + s.dim


@pytest.mark.parametrize("flavor", sorted(tt_peercurve.PEER_SHAPES))
def test_each_flavor_is_the_same_shape_on_both_sides(flavor):
    """torchtitan's FFN width from multiple_of and the multiplier is this recipe's ffn_dim, and
    the overrides build this recipe's model with torchtitan's parameter count. (80M, counted
    once on CPU by torchtitan v0.2.2 itself: 78,662,400, and its logits from the export equal
    this recipe's to 3e-6: docs/PEER_CURVE.md.)"""
    from config import compose_config
    from model import build_model

    s = tt_peercurve.PEER_SHAPES[flavor]
    assert tt_peercurve.tt_ffn_dim(s.dim, s.multiple_of, s.ffn_multiplier) == s.ffn_dim
    cfg = compose_config(tt_peercurve.ours_overrides(flavor, 4096))
    m = cfg.model
    shape = (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size)
    assert shape == (s.dim, s.n_layers, s.n_heads, s.n_kv_heads, s.ffn_dim, s.vocab_size)
    assert not m.tie_embeddings and m.rope_scaling.factor == 8.0 and m.rope_theta == 500000.0
    assert m.max_seq_len >= 4096
    with torch.device("meta"):
        model = build_model(m, "torch")
    assert sum(p.numel() for p in model.parameters()) == tt_param_count(s)
    if flavor == "80M":
        assert tt_param_count(s) == 78_662_400


def test_samples_cache_and_parallel_encoding(tmp_path):
    """The packed samples: the same from 1 or 2 worker processes; a cache entry keyed by the
    bytes of the data and tokenizer files and the sample length (not by how the folder is
    named), written once and then read."""
    from data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()

    def encode(text):  # torchtitan's encode(text, add_bos=True, add_eos=True)
        return [tok.bos_id, *tok.encode(text), tok.eos_id]

    texts = [f"def f{i}():\n    return {i} * {i}\n" * (i % 5 + 1) for i in range(40)]
    one = tt_peercurve.encode_documents(texts, encode, workers=1)
    assert tt_peercurve.encode_documents(texts, encode, workers=2) == one
    data, tokenizer = tmp_path / "text", tmp_path / "tok"
    data.mkdir()
    tokenizer.mkdir()
    (data / "data.json").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (tokenizer / "tokenizer.json").write_text("{}")
    key = tt_peercurve.samples_key(data, tokenizer, 16)
    made = []

    def make():
        made.append(1)
        return tt_peercurve.pack_documents(one, 16)

    samples, hit = tt_peercurve.cached_samples(tmp_path / "cache", key, make)
    assert not hit and samples.shape[1] == 17 and len(made) == 1
    again, hit = tt_peercurve.cached_samples(tmp_path / "cache", key, make)
    assert hit and len(made) == 1 and np.array_equal(again, samples)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [f"{key}.npy"]
    relative = Path(*[".."] * len(Path.cwd().parts)) / data.relative_to("/")
    assert tt_peercurve.samples_key(relative, tokenizer, 16) == key
    assert tt_peercurve.samples_key(data, tokenizer, 32) != key
    (tokenizer / "tokenizer.json").write_text("{ }")
    assert tt_peercurve.samples_key(data, tokenizer, 16) != key


def test_text_from_python_sources(tmp_path, monkeypatch):
    """`text`: the .py files of a source in sorted depth-first order, without byte code, text
    that is not UTF-8, empty files or files holding a special token's text, until the bytes
    asked for."""
    pkg = tmp_path / "src" / "pkgx"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__pycache__").mkdir()
    files = {
        "__init__.py": "x = 1\n",
        "b.py": "def b():\n    pass\n",
        "a.py": "A = 'é'\n",
        "sub/c.py": "c = 3\n" * 10,
        "sub/empty.py": "\n",
        "sub/special.py": "EOS = '<|end_of_text|>'\n",
        "__pycache__/d.py": "d = 4\n",
        "notes.txt": "not python\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text, encoding="utf-8")
    (pkg / "latin.py").write_bytes(b"s = '\xe9'\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    info = tt_peercurve.write_text(tmp_path / "out", 10_000, ["pkgx"])
    docs = [json.loads(line)["text"] for line in (tmp_path / "out" / "data.json").open()]
    assert docs == [files["__init__.py"], files["a.py"], files["b.py"], files["sub/c.py"]]
    assert info["files"] == 4 and not info["enough"]
    assert info["bytes"] == sum(len(d.encode()) for d in docs)
    small = tt_peercurve.write_text(tmp_path / "small", 10, ["pkgx"])
    assert small["files"] == 2 and small["enough"]  # __init__.py (6 bytes), a.py (9)


# --------------------------------------------------------------------------------------
# The stage's last steps on canned outputs (tests/gpu/suite.sh pc_case)


def test_stage_tail_on_canned_outputs(tmp_path, capsys):
    """pc_tt's and pc_verdict's steps on canned outputs of one case, 60 steps, 3 runs a side:
    torchtitan's logs through tt_metrics with the stage's flags, train.py's metrics.jsonl (the
    lr of optim.build_scheduler, read after each step), the noise verdict with the stage's
    flags (the runs spread by 0.2%, no difference: same, and within the 1% bound), the plot, and
    the lr check at rtol 1e-6."""
    steps, lr, warmup = 60, 3e-4, 6
    ref = curve(range(1, steps + 1))
    rng = np.random.default_rng(0)
    flags = ["--tokens-per-step", "32768", "--world-size", "1", "--lr", str(lr)]
    flags += ["--warmup-steps", str(warmup), "--total-steps", str(steps)]
    flags += ["--decay-type", "cosine", "--min-lr-factor", "0.1"]
    tt, ours = [], []
    for i in range(1, 4):
        own = 1 + 0.002 * rng.standard_normal()
        log = tmp_path / f"bf16-2048-cp1.ref{i}.log"
        log.write_text(
            "".join(
                logged(tt_message(s, ref[s] * (own if s > 1 else 1), 1.0 / s, 40, 50, 4e5, 9, 9))
                + "\n"
                for s in range(1, steps + 1)
            )
        )
        tt.append(tmp_path / f"bf16-2048-cp1.ref{i}.jsonl")
        assert tt_metrics.main([str(log), str(tt[-1]), *flags]) == 0
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        scheduler = build_scheduler(
            opt, OptimConfig(lr=lr, warmup_steps=warmup, min_lr_ratio=0.1), steps
        )
        own = 1 + 0.002 * rng.standard_normal()
        records = []
        for s in range(1, steps + 1):
            opt.step()
            scheduler.step()
            loss = ref[s] * (own if s > 1 else 1 + 1e-6)
            records.append({"step": s, "loss": loss, "lr": scheduler.get_last_lr()[0]})
        ours.append(tmp_path / f"bf16-2048-cp1.ours{i}.jsonl")
        ours[-1].write_text("".join(json.dumps(r) + "\n" for r in records))
    png, record = tmp_path / "peercurve_bf16-2048-cp1.png", tmp_path / "verdict.json"
    args = [*map(str, tt), "--vs", *map(str, ours), "--names", "torchtitan,ours"]
    args += ["--metrics", "loss", "--window", "31:60", "--bound", "1%", "--first-rtol", "1e-3"]
    args += ["--json", str(record), "--plot", str(png), "--smooth", "10"]
    assert compare_runs.main(args) == 0
    out = capsys.readouterr().out
    # step 1: torchtitan's loss as its log rounds it (5 decimals), ours 1e-6 above the exact one
    first = re.search(
        r"step 1: torchtitan 10.6686, ours 10.6686 \(group means\): relative "
        r"difference ([\d.e+-]+) <= 0.001",
        out,
    )
    assert first and float(first[1]) == pytest.approx((ref[1] * (1 + 1e-6)) / 10.66863 - 1, rel=0.1)
    assert "noise check on loss over steps 31-60 (30 steps" in out
    assert "same within noise: difference" in out and "bound ±1.00%: within" in out
    v = json.loads(record.read_text())
    assert v["verdict"] == "same" and v["groups"]["torchtitan"]["runs"] == [p.stem for p in tt]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert compare_runs.main([str(tt[0]), str(ours[0]), "--metrics", "lr", "--rtol", "1e-6"]) == 0
    assert "OK: runs agree" in capsys.readouterr().out


def test_the_stage_calls_these_tools():
    """suite.sh's peercurve runs tt_metrics, compare_runs --vs, convert_hf and tt_peercurve's
    command line, and names torchtitan's spec of this order and the bundle's flags for the HF
    start; both sides' deterministic switches."""
    text = (ROOT / "tests" / "gpu" / "suite.sh").read_text()
    body = text[text.index("pc_ours() {") : text.index("switch() {")]
    for needle in (
        "tools/tt_metrics.py",
        "tools/compare_runs.py",
        "--vs",
        "--bound",
        "--first-rtol",
        "tools/convert_hf.py export",
        "tools/tt_peercurve.py overrides",
        "tools/tt_peercurve.py text",
        "tools/tt_peercurve.py pack",
        "--check-ours",
        "TT_PEERCURVE_CACHE=",
        "custom_import tt_peercurve",
        "llama3_same_order",
        "--training.dataset_path",
        "--checkpoint.initial_load_in_hf",
        "model.init_from=",
        "data.shuffle=false",
        "data.document_mask=false",
        "train.deterministic=true",
        "--debug.deterministic",
    ):
        assert needle in body, needle
    assert "|peercurve|" in text and "bash tests/gpu/suite.sh peercurve" in text


def run_stage(root: Path, out: Path, **env) -> tuple[int, str]:
    import os
    import subprocess
    import sys

    stage_env = dict(
        os.environ,
        OUT=str(out),
        PYTHON=sys.executable,
        PEERCURVE_DEVICE="cpu",
        PEERCURVE_FLAVOR="tiny",
        PEERCURVE_CASES="bf16:64",
        PEERCURVE_TOKENS="128",
        PEERCURVE_STEPS="4",
        PEERCURVE_RUNS="2",
        PEERCURVE_WARMUP="2",
        PEERCURVE_TOKENIZER="byte",
        PEERCURVE_ROOT=str(root),
        PEERCURVE_TEXT_FROM="stdlib",
        PEERCURVE_NUM_PROC="1",
        **env,
    )
    r = subprocess.run(
        ["bash", str(ROOT / "tests" / "gpu" / "suite.sh"), "peercurve"],
        env=stage_env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return r.returncode, r.stdout + r.stderr


def test_the_stage_in_its_smallest_form_on_cpu(tmp_path):
    """`bash tests/gpu/suite.sh peercurve` itself, on CPU: the text from this Python's
    standard library, the export, the queue over two lanes, the verdict, the plot, the table
    and the bundle of logs. torchtitan needs CUDA, so the reference group is this recipe again
    (PEERCURVE_DEVICE=cpu sets PEERCURVE_REFERENCE=ours): the runs are identical on CPU, and
    the verdict says so. Then again on the kept export with no time left: no run starts, and
    the case is not compared (exit 1)."""
    import tarfile

    root, out = tmp_path / "root", tmp_path / "out"
    rc, log = run_stage(root, out)
    assert rc == 0, log
    assert "plan: 1 case(s) (bf16:64) x (2 ours-again + 2 ours) = 4 runs of 4 steps" in log
    assert "2 at a time: 2 wave(s)" in log and "initial weights in" in log
    row = "| bf16-64-cp1 | 2 | 0.0e+00 <= 0.001 | "
    assert row in log and "same: the runs are identical" in log and "within (±1.0%)" in log
    assert (out / "peercurve_verdict.md").read_text().count(row) == 1
    assert (out / "peercurve_bf16-64-cp1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with tarfile.open(out / "peercurve_logs.tgz") as tgz:
        names = set(tgz.getnames())
    runs = [f"out/bf16-64-cp1.{side}{i}" for side in ("ref", "ours") for i in (1, 2)]
    for name in [f"{r}.{ext}" for r in runs for ext in ("log", "jsonl")]:
        assert name in names, name
    for name in ("init.log", "jobs.txt", "text.json", "bf16-64-cp1.verdict.json"):
        assert f"out/{name}" in names, name
    jobs = (root / "out" / "jobs.txt").read_text()
    assert jobs.count(" exit 0 ") == 4, jobs
    ref, ours = (load_run(root / "out" / f"bf16-64-cp1.{side}1.jsonl") for side in ("ref", "ours"))
    assert sorted(ref) == sorted(ours) == [1, 2, 3, 4]
    assert [ref[s]["loss"] for s in ref] == [ours[s]["loss"] for s in ours]
    # No time left (PEERCURVE_BUDGET=1): nothing starts; the kept export is reused.
    rc, log = run_stage(root, out, PEERCURVE_BUDGET="1", PEERCURVE_REUSE="1")
    assert rc == 1 and "of an earlier call on this machine (PEERCURVE_REUSE=1)" in log, log
    assert log.count(" skipped - 0 ") == 4 and "no complete run on a side: not compared" in log
    assert "| bf16-64-cp1 | - | - | - | - | - | - | - | not compared | - |" in log
