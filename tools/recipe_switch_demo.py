"""A precision switch inside one job: FP8 training that finishes in bf16 (docs/RECIPE_SWITCH.md).

    python tools/recipe_switch_demo.py                       # llama3_1b, seq 8192, one GPU, 25 steps
    python tools/recipe_switch_demo.py --steps 30 --at 0.8 --out runs/switch-demo
    python tools/recipe_switch_demo.py --model tiny --seq-len 256 --batch 16 --micro-batch 16  # quick look

Runs train.py twice with the same seed, data and schedule: `switch` (fp8_cs with
quantized_init, `recipe.switch=[{at: <at>, name: bf16}]`) and `fp8` (fp8_cs with quantized_init
all the way, the reference the run equals up to the switch). Prints the loss of both at every
step around the switch, the median tokens/s per GPU before and after it (the step after the
switch, which includes the switch's save and reload, is left out: train.py times the switch
apart), and the switch's own line; writes `compare.png` (tools/compare_runs.py, the switch
marked) when matplotlib is installed. Everything after `--` goes to both train.py runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools import benchlib  # noqa: E402

#: One checkpoint in all: the switch step's (llama3_1b with FP8 weights: about 16 GB).
BASE = [
    "optim.warmup_steps=5",
    "train.log_every=1",
    "checkpoint=sync",
    "checkpoint.interval=0",
    "checkpoint.save_at_end=false",
]


def run(name: str, args: list[str], out: Path) -> tuple[list[dict], str]:
    args = [*args, f"run.root={out}", f"run.name={name}", "checkpoint.resume=none"]
    case = benchlib.run_case(args, run_dir=out / name)
    (out / f"{name}.log").write_text(case.stdout + case.stderr)
    if not case.ok:
        sys.exit(f"error: the {name} run failed (exit {case.returncode}); see {out / name}.log")
    return case.records, case.stdout


def main(argv: list[str] | None = None) -> int:
    argv, extra = benchlib.split_overrides(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--at", default="0.8", help="recipe.switch's at: a fraction or a step")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "recipe-switch-demo")
    parser.add_argument("--model", default="llama3_1b")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8, help="train.global_batch_size")
    parser.add_argument("--micro-batch", type=int, default=4, help="train.micro_batch_size")
    parser.add_argument("--recipe", default="fp8_cs", help="the recipe before the switch")
    parser.add_argument("--quantized-init", default="true", choices=("true", "false"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    common = [
        f"model={args.model}",
        f"data.seq_len={args.seq_len}",
        f"train.global_batch_size={args.batch}",
        f"train.micro_batch_size={args.micro_batch}",
        f"recipe={args.recipe}",
        f"recipe.quantized_init={args.quantized_init}",
        *BASE,
        f"train.steps={args.steps}",
        *extra,
    ]
    switched, log = run(
        "switch", [*common, f"recipe.switch=[{{at: {args.at}, name: bf16}}]"], args.out
    )
    # The reference saves nothing (interval 0 without the switch's save: the config check
    # refuses checkpoint=sync that never saves).
    reference, _ = run("fp8", [*common, "checkpoint=none"], args.out)
    step_of = next((r["step"] for r in switched if r.get("recipe_switch")), None)
    if step_of is None:
        sys.exit("error: the switch run logged no recipe switch (is --at past --steps?)")
    ref = {r["step"]: r for r in reference}
    first = args.recipe + (" + quantized_init" if args.quantized_init == "true" else "")
    print(f"| step | recipe | loss (switch run) | loss ({first} throughout) | tokens/s/GPU |")
    print("|---|---|---|---|---|")
    for r in switched:
        other = ref.get(r["step"], {}).get("loss")
        mark = " (switch after this step)" if r["step"] == step_of else ""
        print(
            f"| {r['step']}{mark} | {r.get('recipe', '')} | {r['loss']:.4f} | "
            f"{other:.4f} | {r.get('tokens_per_s', 0):,.0f} |"
            if other is not None
            else f"| {r['step']} | {r.get('recipe', '')} | {r['loss']:.4f} | - | - |"
        )

    def median_tps(records):
        values = [r["tokens_per_s"] for r in records if r.get("tokens_per_s")]
        return statistics.median(values) if values else float("nan")

    # Steps 1-2 warm up (allocation, TE kernel selection); the first step after the switch
    # builds and warms up the bf16 model.
    before = [r for r in switched if 3 <= r["step"] <= step_of]
    after = [r for r in switched if r["step"] > step_of + 1]
    ref_after = [r for r in reference if r["step"] > step_of + 1]
    print(
        f"\ntokens/s/GPU (median): {first} before the switch "
        f"{median_tps(before):,.0f}; bf16 after it {median_tps(after):,.0f}; the reference "
        f"over the same steps {median_tps(ref_after):,.0f}"
    )
    same = all(ref[r["step"]]["loss"] == r["loss"] for r in switched if r["step"] <= step_of)
    print(f"losses up to the switch step equal the reference bitwise: {same}")
    for line in log.splitlines():
        if "recipe switch after" in line or line.startswith("precision:"):
            print(line)
    try:
        from runlog import load_run
        from tools.compare_runs import plot

        path = plot(
            {"switch": load_run(args.out / "switch"), "fp8": load_run(args.out / "fp8")},
            ["loss"],
            args.out / "compare.png",
        )
        print(f"plot: {path}")
    except Exception as e:  # matplotlib missing: the table above is the result
        print(f"no plot ({e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
