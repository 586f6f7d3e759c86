"""What train.deterministic buys and costs, per precision recipe, on one GPU (docs/RUNS.md, Determinism).

    python tools/bench_determinism.py                 # llama3_1b, seq 8192, micro batch 4, sm_90 recipes
    python tools/bench_determinism.py --recipes bf16 fp8_cs --steps 8 --resume-at 5 --out runs/det
    python tools/bench_determinism.py --model tiny --seq-len 256 --micro-batch 8 --recipes bf16  # CPU look

Per recipe, train.py runs (each in its own process, `--steps` steps logged every step, one
micro batch per step):

- `det-a`: train.deterministic=true, saving step `--resume-at` (checkpoint=sync; default 5 of
  8 steps: one save);
- `det-b`: the same without checkpoints;
- `det-resumed`: resumed from det-a's checkpoint to `--steps`;
- `plain-a`: as shipped (NVTE_ALLOW_NONDETERMINISTIC_ALGO=1); `plain-b` its repeat, for the
  recipes in `--plain-repeat` (default bf16: as shipped, two runs differ within a few steps).

Prints one table: per recipe and mode, the loss of run a and b at step 2 and at the last step,
the resumed run's last loss, whether a and b agree bitwise at every step and the resumed run
agrees with a from the resumed step on, the median tokens/s over the steps after the second,
the peak allocated GiB, and the attention backend TE ran (TE's own log line, NVTE_DEBUG=1
NVTE_DEBUG_LEVEL=2; the reasons TE gave for disabling backends in deterministic mode are
printed under the table). Then the cost of deterministic mode per recipe.

Time: each llama3_1b run takes about 30-45 s (start-up, TE, 8 steps; the save and the resume
about 15 s each), so the default (4 recipes, 4 runs each, plain-b for bf16) is planned for one
600-second call; `--budget` seconds (default 570) stops starting runs that would not finish in
time (from the longest run so far) and says which were dropped. Everything after `--` goes to
every train.py run. Logs and runs go to `--out`.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools import benchlib  # noqa: E402

RECIPES = ["bf16", "fp8_delayed", "fp8_cs", "fp8_block"]
#: TE's attention logging: the backend it runs with (INFO) and why it disabled others (DEBUG).
TE_LOG = {"NVTE_DEBUG": "1", "NVTE_DEBUG_LEVEL": "2"}
_TE_LINE = re.compile(r"(Running with \w+ backend.*|Disabling \w+.*)")


def _median_tps(records: list[dict]) -> float | None:
    values = [r["tokens_per_s"] for r in records if r.get("tokens_per_s") and r["step"] > 2]
    return statistics.median(values) if values else None


def _peak(records: list[dict]) -> float | None:
    values = [r["mem_gb"] for r in records if r.get("mem_gb") is not None]
    return max(values) if values else None


def _loss(records: list[dict], step: int) -> float | None:
    return next((r["loss"] for r in records if r["step"] == step), None)


def _f(x, fmt="{:.4f}") -> str:
    return benchlib.cell(x, fmt)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(the tool's arguments, the train.py overrides after `--`)."""
    argv, extra = benchlib.split_overrides(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", nargs="+", default=RECIPES)
    p.add_argument(
        "--plain-repeat", nargs="*", default=["bf16"], help="recipes run twice as shipped"
    )
    p.add_argument("--steps", type=int, default=8)
    p.add_argument(
        "--resume-at", type=int, default=5, help="det-a saves here (and at its multiples)"
    )
    p.add_argument("--model", default="llama3_1b")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--budget", type=float, default=570.0, help="seconds for all runs")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-determinism")
    p.add_argument("--json", help="append the results (one JSON line) to this file")
    return p.parse_args(argv), extra


def plan(args, extra: list[str]) -> tuple[list[str], list[tuple[str, str, list[str]]]]:
    """(the overrides of every run, [(recipe, kind, the kind's overrides)] in run order)."""
    common = [
        f"model={args.model}",
        f"data.seq_len={args.seq_len}",
        # Causal attention: TE on sm_90 has no deterministic fused backward for documents
        # (runtime.check_determinism refuses the combination); the as-shipped runs match.
        "data.document_mask=false",
        f"train.global_batch_size={args.micro_batch}",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.steps={args.steps}",
        "train.log_every=1",
        f"optim.schedule_steps={args.steps}",
        f"run.root={args.out}",
        *extra,
    ]
    det_a = [
        "train.deterministic=true",
        "checkpoint=sync",
        f"checkpoint.interval={args.resume_at}",
        "checkpoint.save_at_end=false",
        f"checkpoint.keep_last={args.steps // args.resume_at}",  # the resume_at one stays
    ]
    plans = []
    for r in args.recipes:
        ckpt = args.out / f"{r}-det-a" / "checkpoints" / f"step_{args.resume_at:07d}"
        plans += [
            (r, "det-a", det_a),
            (r, "det-b", ["train.deterministic=true", "checkpoint=none"]),
            (
                r,
                "det-resumed",
                ["train.deterministic=true", "checkpoint=none", f"checkpoint.resume={ckpt}"],
            ),
            (r, "plain-a", ["checkpoint=none"]),
        ]
        if r in args.plain_repeat:
            plans.append((r, "plain-b", ["checkpoint=none"]))
    return common, plans


def run_plans(args, common, plans, t_start: float):
    """Each planned run that fits the time budget (a resumed run only after its det-a ran).
    Returns ({(recipe, kind): run}, the dropped runs)."""
    longest = 0.0
    runs: dict[tuple[str, str], dict] = {}
    dropped = []
    for recipe, kind, overrides in plans:
        elapsed = time.perf_counter() - t_start
        if elapsed + longest > args.budget or (
            kind == "det-resumed" and runs.get((recipe, "det-a"), {}).get("status") != 0
        ):
            dropped.append(f"{recipe} {kind}")
            continue
        name = f"{recipe}-{kind}"
        env = dict(TE_LOG)
        if kind.startswith("plain"):
            env["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "1"
        case = benchlib.run_case(
            [*common, f"recipe={recipe}", f"run.name={name}", *overrides],
            run_dir=args.out / name,
            env=env,
        )
        longest = max(longest, case.seconds)
        log = case.stdout + case.stderr
        (args.out / f"{name}.log").write_text(log)
        if kind == "det-resumed":  # 13.8 GiB a recipe at llama3_1b: the disk holds few
            shutil.rmtree(args.out / f"{recipe}-det-a" / "checkpoints", ignore_errors=True)
        te_lines = list(dict.fromkeys(m.group(1).strip() for m in _TE_LINE.finditer(log)))
        runs[(recipe, kind)] = {
            "status": case.returncode,
            "seconds": case.seconds,
            "records": case.records,
            "backend": next((x for x in te_lines if x.startswith("Running")), None),
            "disabled": [x for x in te_lines if x.startswith("Disabling")],
        }
        print(
            f"{name}: exit {case.returncode} in {case.seconds:.0f}s"
            + ("" if case.ok else f": {case.error} (log: {args.out / name}.log)"),
            flush=True,
        )
    return runs, dropped


def _steps_losses(records: list[dict], after: int = 0) -> list[tuple[int, float]]:
    return [(x["step"], x["loss"]) for x in records if x["step"] > after]


def compare(args, runs) -> list[dict]:
    """One row per recipe and mode (deterministic or as shipped) whose run a succeeded."""
    rows = []
    for recipe in args.recipes:
        for mode in ("det", "plain"):
            a = runs.get((recipe, f"{mode}-a"))
            b = runs.get((recipe, f"{mode}-b"))
            res = runs.get((recipe, f"{mode}-resumed"))
            if a is None or a["status"] != 0:
                continue
            ra, rb = a["records"], (b or {}).get("records") or []
            rr = (res or {}).get("records") or []
            same = None if not rb else _steps_losses(ra) == _steps_losses(rb)
            resumed_same = (
                None if not rr else _steps_losses(rr) == _steps_losses(ra, args.resume_at)
            )
            rows.append(
                {
                    "recipe": recipe,
                    "deterministic": mode == "det",
                    "loss_a": {x["step"]: x["loss"] for x in ra},
                    "loss_b": {x["step"]: x["loss"] for x in rb},
                    "loss_resumed": {x["step"]: x["loss"] for x in rr},
                    "a_equals_b": same,
                    "resumed_equals_a": resumed_same,
                    "tokens_per_s": _median_tps(ra),
                    "peak_gib": _peak(ra),
                    "attention": a["backend"],
                    "disabled": a["disabled"],
                }
            )
    return rows


def table(args, runs, rows: list[dict]) -> str:
    last = args.steps
    head = ["recipe", "deterministic", "step-2 loss a / b", f"step-{last} loss a / b"]
    head += [f"resumed step {last}", "a = b bitwise", "resumed = a bitwise", "tokens/s"]
    head += ["peak GiB", "attention"]
    yes = {True: "yes", False: "NO", None: "-"}
    out = []
    for row in rows:
        mode = "det" if row["deterministic"] else "plain"
        ra = runs[(row["recipe"], f"{mode}-a")]["records"]
        rb = (runs.get((row["recipe"], f"{mode}-b")) or {}).get("records") or []
        rr = (runs.get((row["recipe"], f"{mode}-resumed")) or {}).get("records") or []
        out.append(
            [
                row["recipe"],
                "on" if row["deterministic"] else "off",
                f"{_f(_loss(ra, 2))} / {_f(_loss(rb, 2))}",
                f"{_f(_loss(ra, last))} / {_f(_loss(rb, last))}",
                _f(_loss(rr, last)),
                yes[row["a_equals_b"]],
                yes[row["resumed_equals_a"]],
                _f(row["tokens_per_s"], "{:,.0f}"),
                _f(row["peak_gib"], "{:.1f}"),
                row["attention"] or "-",
            ]
        )
    return benchlib.table(head, out)


def report(args, runs, rows, dropped) -> None:
    """What follows the table: the cost of deterministic mode per recipe, TE's reasons, the
    failed and dropped runs."""
    for recipe in args.recipes:
        det = next((r for r in rows if r["recipe"] == recipe and r["deterministic"]), None)
        plain = next((r for r in rows if r["recipe"] == recipe and not r["deterministic"]), None)
        if det and plain and det["tokens_per_s"] and plain["tokens_per_s"]:
            print(
                f"cost of train.deterministic, {recipe}: tokens/s "
                f"{det['tokens_per_s'] / plain['tokens_per_s'] - 1:+.1%}, peak "
                f"{_f(plain['peak_gib'], '{:.1f}')} -> {_f(det['peak_gib'], '{:.1f}')} GiB"
            )
        if det and det["disabled"]:
            print(f"TE in deterministic mode, {recipe}: " + "; ".join(det["disabled"]))
    failed = [f"{r} {k}" for (r, k), v in runs.items() if v["status"] != 0]
    if failed:
        print(f"failed runs: {', '.join(failed)} (logs in {args.out})")
    if dropped:
        print(
            f"dropped (time budget of {args.budget:.0f}s, or no checkpoint to resume): "
            + ", ".join(dropped)
        )


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(list(sys.argv[1:] if argv is None else argv))
    if not 0 < args.resume_at < args.steps:
        print("error: --resume-at must be between 0 and --steps (exclusive)", file=sys.stderr)
        return 2
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    common, plans = plan(args, extra)
    t_start = time.perf_counter()
    runs, dropped = run_plans(args, common, plans, t_start)
    rows = compare(args, runs)
    print(
        f"\n{args.model}, seq {args.seq_len}, micro batch {args.micro_batch}, {args.steps} steps "
        f"on one device; resumed from step {args.resume_at}\n"
    )
    print(table(args, runs, rows))
    print()
    report(args, runs, rows, dropped)
    print(f"total {time.perf_counter() - t_start:.0f}s")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}) + "\n")
    bad = [
        r for r in rows if r["deterministic"] and False in (r["a_equals_b"], r["resumed_equals_a"])
    ]
    failed = [k for k, v in runs.items() if v["status"] != 0]
    return 1 if failed or bad else 0


if __name__ == "__main__":
    sys.exit(main())
