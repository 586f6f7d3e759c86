"""The smallest real form of the GPU harnesses (tests/harness/) and tools (tools/) that no other
CPU test runs, so that a renamed attribute or function anywhere they reach fails CI here
instead of a GPU call later (issue #46: kill_save.py patched a method that had moved).

| module | here | how |
|---|---|---|
| harness/kill_save.py | test_kill_save_... | the whole scenario: 3 torchrun jobs of 2 gloo ranks, 8 steps |
| harness/parity.py, ac_layouts.py | test_parity_and_ac_layouts_... | main() --cpu in 2 gloo ranks: cp=2 + documents, fsdp_tp |
| harness/multitier.py `rows` | the two above | their outputs -> rows -> table, as suite.sh |
| harness/reshard.py | test_reshard_... | main() with a stand-in for train.py (cost) |
| harness/scale.py | test_scale_table | main() on run directories |
| tools/bench_step, bench_recipes, bench_determinism, recipe_switch_demo | test_train_py_tools_... | main(), 1-2 tiny train.py runs each |
| tools/bench_threads.py | test_bench_threads_synthetic | main() --synthetic vs synthetic_steps() |
| tools/bench_loss.py | test_bench_loss | main(), small shapes |
| tests/gpu/suite.sh | test_suite_sh_... | every harness / tool it runs exists and takes its flags |

Elsewhere: matrix.py, resume.py (test_harness.py), multitier.py (test_multitier.py),
slow_commit.py (test_ctrl_c.py), bench_checkpoint.py (test_checkpoint_async.py), benchlib.py,
compare_runs.py, convert_hf.py (test_hf_io.py), deps_met.py, index_reachable.py, cpu_torch.py
(test_makefile.py), lint_imports.py (test_import_layers.py),
prepare_data.py (test_data_cache.py), two_node.py (test_slurm.py), paced.py
(test_slurm_real.py), sample.py, trace_summary.py, resume_guard_study.py (their test files).
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from runlog import read_metrics
from tests.distributed import run_distributed
from tests.harness import multitier as mt

ROOT = Path(__file__).resolve().parents[1]
#: The tiny model of tests.helpers.TINY_RUN, causal attention (bench_determinism's choice), so
#: every tool below trains the same model on the same data: their step-1 losses must agree.
TINY = [
    "model=tiny",
    "model.dim=64",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.ffn_dim=128",
    "data.max_bytes=200000",
    "data.document_mask=false",
]
SEQ, BATCH = 32, 4


@pytest.fixture
def cpu_env(monkeypatch):
    """train.py subprocesses of the tools: no GPU, one thread (tests.helpers.CPU_ENV)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def table_of(tmp_path: Path, parts: list[str], *rows_files: Path, capsys) -> tuple[int, str]:
    """suite.sh's last multitier step: the table of `rows_files`, and its exit status."""
    capsys.readouterr()
    status = mt.main(["table", *map(str, rows_files), "--parts", *parts])
    return status, capsys.readouterr().out


# -- tests/harness/kill_save.py ------------------------------------------------------------------


def test_kill_save_kill9_mid_async_save_then_exact_resume(tmp_path, cpu_env, capsys):
    """suite.sh multitier's kill9 part on CPU: rank 0 SIGKILLed while its async save of step 4
    hangs before the commit, only step 2 committed, the same command resumes from 2 and its
    8 losses equal the uninterrupted run's bit for bit."""
    from tests.harness import kill_save

    out = tmp_path / "kill9.jsonl"
    args = ["--root", str(tmp_path / "k"), "--interval", "2"]
    run = [*TINY, f"data.seq_len={SEQ}", f"train.global_batch_size={BATCH}"]
    status = kill_save.main([*args, "--jsonl", str(out), "--", *run])
    rows = read_metrics(out)
    assert status == 0, rows
    assert [r["result"] for r in rows] == ["passed"] * 4, rows
    killed, _, resumed, losses = (r["detail"] for r in rows)
    assert "committed [2], step_0000004.tmp left" in killed
    assert "resumed from step 2" in resumed and "step_0000004.tmp removed" in resumed
    assert losses.startswith("8 steps compared, max abs diff 0")
    # The uninterrupted run saved every 2 steps: the schedule the rows speak of.
    ref = read_metrics(tmp_path / "k" / "reference" / "metrics.jsonl")
    assert [r["step"] for r in ref] == list(range(1, 9))
    # suite.sh's mt_kill9: the rows file through `multitier rows rows`, then the table.
    rows_file = tmp_path / "rows_kill9.jsonl"
    mt.main(
        ["rows", "rows", str(out), "--part", "kill9", "--job", "kill9", "--out", str(rows_file)]
    )
    status, text = table_of(tmp_path, ["kill9"], rows_file, capsys=capsys)
    assert status == 0 and text.strip().endswith(
        "multitier: 4 passed, 0 failed, 0 not run, 0 refused"
    )


# -- tests/harness/parity.py and ac_layouts.py: main() in gloo ranks -------------------------------


def _parity_and_ac(rank, world_size, out: str):
    from tests.harness import ac_layouts, parity

    out = Path(out)
    # Context parallelism with documents (parity's longest path); fsdp_tp (TP plans, FSDP2).
    argv = ["--cpu", "--layouts", "fsdp+cp2+docs", "--steps", "2", "--global-batch", "4"]
    assert parity.main([*argv, "--seq-len", "32", "--json", str(out / "parity.json")]) == 0
    argv = ["--cpu", "--layouts", "fsdp_tp", "--jsonl", str(out / "ac.jsonl")]
    assert ac_layouts.main(argv) == 0


def test_parity_and_ac_layouts_on_cpu(tmp_path, capsys):
    run_distributed(_parity_and_ac, 2, str(tmp_path))
    parity = json.loads((tmp_path / "parity.json").read_text())
    (curve,) = parity["curves"]
    assert parity["world_size"] == 2 and curve["degrees"] == "1x1x1xcp2"
    # Two steps against the 1-process reference, which attends per document as well.
    assert curve["ok"] and curve["reference"] == parity["reference"]["bf16+docs"], curve
    assert len(curve["losses"]) == 2 and curve["max_rel"] < 1e-5, curve

    ac = read_metrics(tmp_path / "ac.jsonl")
    modes = ["none", "full", "mlp", "selective", "full /2"]
    assert [(r["layout"], r["mode"]) for r in ac] == [("fsdp_tp", m) for m in modes]
    for r in ac:  # recomputation changes what is kept, not what is computed
        assert r["ok"] and r["recipe"] == "bf16", r
        if r["mode"] != "none":
            assert r["rel1"] <= 1e-6 and r["rel2"] <= 1e-5, r

    # suite.sh's mt_parity / mt_ac: the outputs through `multitier rows`, then the table.
    rows = tmp_path / "rows.jsonl"
    for kind, out in (("parity", "parity.json"), ("ac", "ac.jsonl")):
        mt.main(["rows", kind, str(tmp_path / out), "--part", kind, "--out", str(rows)])
    status, text = table_of(tmp_path, ["parity", "ac"], rows, capsys=capsys)
    assert status == 0, text
    assert text.strip().endswith("multitier: 6 passed, 0 failed, 0 not run, 0 refused"), text


# -- tests/harness/reshard.py -------------------------------------------------------------------


def test_reshard_chain_rows(tmp_path, monkeypatch):
    """reshard.main()'s chain and rows, with train.py replaced by a stand-in: the real chain is
    12 train.py processes (~60 s of CPU); saving on N and resuming on M processes is
    test_checkpoint_dist.py's. The stand-in writes what train.py leaves (metrics.jsonl and
    step_* directories), continuing from the checkpoint a copied directory holds; one run
    (D4) drifts from its reference by 10%."""
    from tests.harness import reshard

    calls = []

    def stand_in(nproc, overrides, log, gpus):
        opts = dict(o.split("=", 1) for o in overrides)
        run = Path(opts["run.root"]) / opts["run.name"]
        calls.append((opts["run.name"], nproc, opts["parallel"], opts["recipe"]))
        ckpts = sorted((run / "checkpoints").glob("step_*")) if run.is_dir() else []
        start = int(ckpts[-1].name[5:]) if ckpts else 0
        (run / "checkpoints").mkdir(parents=True, exist_ok=True)
        drift = 1.1 if opts["run.name"] == "D4" else 1.0
        kept = (
            [r for r in read_metrics(run / "metrics.jsonl") if r["step"] <= start] if ckpts else []
        )
        records = kept + [
            {"step": s, "loss": (5.0 - 0.1 * s) * (drift if s > start else 1.0)}
            for s in range(start + 1, reshard.STEPS + 1)
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        for s in range(start + reshard.INTERVAL, reshard.STEPS + 1, reshard.INTERVAL):
            (run / "checkpoints" / f"step_{s:07d}").mkdir()
        log.write_text("stand-in\n")
        return subprocess.Popen([sys.executable, "-c", ""])

    monkeypatch.setattr(reshard, "start", stand_in)
    out = tmp_path / "rows.jsonl"
    argv = ["--root", str(tmp_path / "r"), "--jsonl", str(out), "--", "recipe=fp8_cs"]
    assert reshard.main(argv) == 1  # D4's row fails
    assert calls == [
        ("A4", 4, "fsdp", "fp8_cs"),
        ("R1", 1, "fsdp", "fp8_cs"),
        ("B2", 2, "fsdp", "fp8_cs"),
        ("D4", 4, "fsdp", "fp8_cs"),
        ("C1", 1, "fsdp", "fp8_cs"),
    ]
    rows = {r["case"].removeprefix("fp8_cs: "): r for r in read_metrics(out)}
    assert {case: r["result"] for case, r in rows.items()} == {
        "4 procs vs 1, uninterrupted (no checkpoint; scale of the tolerance)": "passed",
        "saved on 4, resumed on 2 at step 10": "passed",
        "saved on 1, resumed on 4 at step 10": "failed",
        "4 -> 2 -> 1: resumed on 1 at step 20": "passed",
    }
    assert rows["4 -> 2 -> 1: resumed on 1 at step 20"]["detail"].startswith(
        "step 21 loss 2.9000 vs 2.9000 (rel 0.00e+00 <= 0.01); max rel 0.00e+00 <= 0.03 over 10"
    )
    assert "(rel 1.00e-01 <= 0.01)" in rows["saved on 1, resumed on 4 at step 10"]["detail"]
    # What the copies kept: B2 came from A4 with only step 10, C1 from B2 with only step 20.
    c1 = sorted(p.name for p in (tmp_path / "r" / "C1" / "checkpoints").iterdir())
    assert c1 == ["step_0000020", "step_0000030"]


# -- tests/harness/scale.py ---------------------------------------------------------------------


def test_scale_table(tmp_path, capsys):
    from tests.harness import scale

    def write(name, losses):
        (tmp_path / name).mkdir()
        lines = [json.dumps({"step": s, "loss": v}) for s, v in losses.items()]
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(lines) + "\n")

    curve = {s: 5.0 - 0.1 * s for s in range(1, 5)}
    for run in ("1gpu", "hsdp", "fsdp_tp", "hsdp-to-fsdp_tp"):
        write(f"bf16-{run}", curve)
    write("bf16-hsdp-to-fsdp2", {3: curve[3] + 0.01, 4: curve[4]})
    assert scale.main([str(tmp_path), "--resume-step", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
        lines[2]
        == "| bf16 | parity | 1gpu | hsdp | 4 | 4.9000/4.8000/4.6000 | 4.9000/4.8000/4.6000 | 0 | 0 |"
    )
    want = "| bf16 | resume | hsdp | hsdp-to-fsdp2 | 2 | 4.7000/4.6000 | 4.7100/4.6000 | 0.01 |"
    assert lines[-1].startswith(want), lines
    # A run that failed: no metrics; a resumed run that stopped at once: nothing after step 2.
    (tmp_path / "bf16-fsdp_tp" / "metrics.jsonl").unlink()
    (tmp_path / "bf16-hsdp-to-fsdp_tp" / "metrics.jsonl").write_text('{"step": 2, "loss": 4.8}\n')
    assert scale.main([str(tmp_path), "--resume-step", "2"]) == 1
    out = capsys.readouterr().out
    assert "| bf16 | parity | 1gpu | fsdp_tp | missing:" in out
    assert (
        "| bf16 | resume | hsdp | hsdp-to-fsdp_tp | hsdp-to-fsdp_tp: no steps after step 2 |" in out
    )


# -- tools that run train.py --------------------------------------------------------------------


def test_train_py_tools_on_the_tiny_model(tmp_path, cpu_env, capsys, request):
    """bench_step, bench_recipes, bench_determinism and recipe_switch_demo, each in its smallest
    form (1-2 train.py runs of 2 steps), all on the same tiny model and data: their step-1
    losses agree (one forward of the same weights on the same batch)."""
    from tools import bench_determinism, bench_recipes, bench_step

    # recipe_switch_demo, as a command beside the others (two runs): a bf16 -> bf16 switch after
    # step 1 (the same math: the losses up to the switch equal the reference's).
    argv = ["--model", "tiny", "--seq-len", str(SEQ), "--batch", str(BATCH), "--micro-batch"]
    argv += [str(BATCH), "--recipe", "bf16", "--quantized-init", "false", "--steps", "2"]
    demo = tmp_path / "switch"
    demo_proc = subprocess.Popen(
        [sys.executable, "tools/recipe_switch_demo.py", *argv, "--at", "1", "--out", str(demo)]
        + ["--", *TINY],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    request.addfinalizer(lambda: (demo_proc.kill(), demo_proc.wait()))  # once it failed here
    step1 = {}
    # bench_step: one case, with full recomputation (its override path), a JSON record.
    out = tmp_path / "step.json"
    argv = ["--case", f"tiny:fsdp:bf16:full:{BATCH}", "--seq", str(SEQ), "--steps", "2"]
    assert bench_step.main([*argv, "--warmup", "1", "--json", str(out), *TINY]) == 0
    (rec,) = read_metrics(out)
    assert rec["ac"] == "full" and rec["steps_measured"] == 1 and rec["tokens_per_s_per_gpu"] > 0
    text = capsys.readouterr().out
    assert f"| tiny | fsdp | 1 | bf16 | full | {BATCH} |" in text
    bench_step_loss2 = rec["loss_last"]

    # bench_recipes: bf16 only, the rows as JSON.
    out = tmp_path / "recipes.json"
    argv = ["--recipes", "bf16", "--steps", "2", "--at", "1", "2", "--log-every", "1"]
    run = [*TINY, f"data.seq_len={SEQ}", f"train.global_batch_size={BATCH}"]
    bench_recipes.main([*argv, "--out", str(out), *run])
    (row,) = json.loads(out.read_text())
    assert row["recipe"] == "bf16" and not row["error"] and set(row["loss"]) == {"1", "2"}
    assert "| bf16 | False | " in capsys.readouterr().out
    step1["bench_recipes"] = row["loss"]["1"]
    assert row["loss"]["2"] == pytest.approx(bench_step_loss2, rel=1e-6)

    # bench_determinism: --budget 1 (s) runs the first planned run (det-a, saving step 1) only.
    out = tmp_path / "det.jsonl"
    argv = ["--model", "tiny", "--seq-len", str(SEQ), "--micro-batch", str(BATCH)]
    argv += ["--recipes", "bf16", "--steps", "2", "--resume-at", "1", "--budget", "1"]
    status = bench_determinism.main(
        [*argv, "--out", str(tmp_path / "det"), "--json", str(out), "--", *TINY]
    )
    assert status == 0
    (result,) = read_metrics(out)
    (det,) = result["rows"]
    assert det["deterministic"] and det["a_equals_b"] is None and set(det["loss_a"]) == {"1", "2"}
    assert (tmp_path / "det" / "bf16-det-a" / "checkpoints" / "step_0000001").is_dir()
    text = capsys.readouterr().out
    assert "dropped (time budget of 1s, or no checkpoint to resume): bf16 det-b, " in text
    step1["bench_determinism"] = det["loss_a"]["1"]

    # recipe_switch_demo (started above) after its two runs.
    text, _ = demo_proc.communicate(timeout=600)
    assert demo_proc.returncode == 0, text[-3000:]
    assert "| 1 (switch after this step) | bf16 |" in text
    assert "losses up to the switch step equal the reference bitwise: True" in text
    assert f"plot: {demo / 'compare.png'}" in text
    for name in ("switch", "fp8"):
        step1[f"recipe_switch_demo {name}"] = read_metrics(demo / name / "metrics.jsonl")[0]["loss"]

    first = next(iter(step1.values()))
    assert 5.0 < first < 6.0  # ln(258) = 5.55: a fresh model on bytes
    assert all(v == pytest.approx(first, rel=1e-6) for v in step1.values()), step1


# -- tools that run no train.py ------------------------------------------------------------------


def test_bench_threads_synthetic(capsys, cpu_env):
    """main() --synthetic, one step: its `--inner` subprocess trains conf/model/tiny.yaml's
    model on random tokens; the loss it prints (step 1: before any update) is that model's
    loss on the first batch, computed here."""
    import torch

    from config import compose_config
    from model import build_model, init_weights
    from tools import bench_threads

    bench_threads.main(["--synthetic", "--threads", "1", "--busy", "0", "--steps", "1"])
    line = capsys.readouterr().out.splitlines()[-1]
    pattern = r"nproc 1 threads  1 busy cores  0 \(load .*\): (\S+) s/step, step 1 loss (\S+)"
    m = re.fullmatch(pattern, line)
    assert m and float(m.group(1)) > 0, line
    cfg = compose_config(["model=tiny"]).model
    model = build_model(cfg, "torch")
    init_weights(model, cfg, 1234)
    batch = torch.randint(0, 258, (16, 257), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = model(batch[:, :-1], labels=batch[:, 1:]).item()
    assert float(m.group(2)) == pytest.approx(loss, abs=6e-5)  # printed to 4 places


def test_bench_loss(capsys):
    from tools import bench_loss

    bench_loss.main(["--tokens", "64", "--dim", "16", "--vocab", "100", "--chunk-tokens", "16"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("device=cpu tokens=64 dim=16 vocab=100 padded=128 matmul=fp32")
    losses = [float(line.rsplit("loss ", 1)[1]) for line in lines[2:4]]
    assert [line.split(":")[0].strip() for line in lines[2:4]] == ["reference", "fused"]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5) and losses[0] > 0
    diffs = re.findall(r"([\d.e+-]+) (?:abs|rel)", lines[4])
    assert len(diffs) == 3 and all(float(d) < 1e-4 for d in diffs), lines[4]


# -- tests/gpu/suite.sh ---------------------------------------------------------------------------


def suite_invocations() -> list[tuple[str, list[str]]]:
    """(module, the --flags after it) of every `-m tests.harness.X`, `tools/X.py` and `mt_py`
    call in tests/gpu/suite.sh: the flags up to `--`, a pipe or a redirection."""
    text = (ROOT / "tests" / "gpu" / "suite.sh").read_text().replace("\\\n", " ")
    text = re.sub(r"\$\(\([^)]*\)\)", "N", text)  # $((arithmetic)): its ")" ends nothing
    calls = []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for m in re.finditer(
            r"(?:-m tests\.harness\.(\w+)|tools/(\w+)\.py|\bmt_py\b(?!\(\)))", line
        ):
            module = f"tests.harness.{m.group(1)}" if m.group(1) else None
            module = module or (f"tools.{m.group(2)}" if m.group(2) else "tests.harness.multitier")
            rest = re.split(r" -- |\||>|\)|;|&&", line[m.end() :] + " ")[0]
            calls.append((module, re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest)))
    return calls


def help_text(module: str, capsys) -> str:
    """The module's --help, and each of its subcommands' (`{rows,notrun,table}`)."""
    main = importlib.import_module(module).main

    def help_of(argv: list[str]) -> str:
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main([*argv, "--help"])
        assert e.value.code == 0, (module, argv)
        return capsys.readouterr().out

    text = help_of([])
    subcommands = re.search(r"\{([\w,-]+)\}", text.split("\n\n")[0])
    for sub in subcommands.group(1).split(",") if subcommands else ():
        text += help_of([sub])
    return text


def test_suite_sh_runs_modules_that_take_its_flags(capsys):
    calls = suite_invocations()
    modules = sorted({m for m, _ in calls})
    # Every harness suite.sh runs, and the benchmark tools (a module renamed fails here).
    harnesses = ["ac_layouts", "kill_save", "matrix", "multitier", "parity", "reshard"]
    harnesses += ["resume", "scale"]
    tools = ["bench_checkpoint", "bench_determinism", "bench_recipes", "bench_step"]
    tools += ["recipe_switch_demo", "compare_runs", "convert_hf", "tt_metrics"]
    wanted = {f"tests.harness.{h}" for h in harnesses} | {f"tools.{t}" for t in tools}
    assert wanted <= set(modules), sorted(wanted - set(modules))
    missing = []
    for module in modules:
        text = help_text(module, capsys)
        used = sorted({f for m, flags in calls if m == module for f in flags})
        missing += [f"{module} {f}" for f in used if not re.search(rf"{f}(?![\w-])", text)]
    assert not missing, missing
