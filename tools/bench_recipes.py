"""Train the same model with each precision recipe and print a comparison table.

    python tools/bench_recipes.py                                  # small model, 200 steps, sm_90 recipes
    python tools/bench_recipes.py --recipes bf16 fp8_cs --steps 50 -- model=tiny data.seq_len=128

Each configuration runs `train.py` in a subprocess (so one failure does not stop the others)
with the same seed, data and schedule; the table has the loss at steps 50/100/200 (or the
chosen --at steps), the final loss's difference from bf16, tokens/s per GPU (mean over the
logged steps after the first), peak GPU memory and parameter memory (bytes per parameter).
Everything after `--` is passed to train.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools import benchlib  # noqa: E402

SM90_RECIPES = ["bf16", "fp8_delayed", "fp8_cs", "fp8_block"]


def run_one(
    recipe: str, quantized: bool, steps: int, log_every: int, extra: list[str], root: Path
) -> tuple[list[dict], str]:
    name = f"{recipe}{'-qinit' if quantized else ''}"
    args = [
        "model=small",
        f"recipe={recipe}",
        f"recipe.quantized_init={str(quantized).lower()}",
        f"train.steps={steps}",
        f"train.log_every={log_every}",
        "train.global_batch_size=32",
        "data.seq_len=1024",
        "checkpoint=none",
        f"run.root={root}",
        f"run.name={name}",
        *extra,
    ]
    case = benchlib.run_case(args, run_dir=root / name)
    if not case.ok:
        return [], case.error
    return case.records, ""


def table(rows: list[dict], at: list[int]) -> str:
    """The comparison: the losses at the `at` steps, the last one's difference from bf16,
    speed and memory; a failed run's row says why."""
    base = next((r for r in rows if r["recipe"] == "bf16" and not r["error"]), None)
    last = at[-1]
    head = (
        ["recipe", "qinit"]
        + [f"loss@{s}" for s in at]
        + [f"d(loss@{last}) vs bf16", "tok/s/GPU", "MFU", "peak GiB", "param B/param"]
    )
    out = []
    for r in rows:
        if r["error"]:
            out.append([r["recipe"], r["quantized_init"], f"failed: {r['error']}"])
            continue
        losses = [f"{r['loss'].get(s, float('nan')):.4f}" for s in at]
        delta = (
            (r["loss"].get(last, float("nan")) - base["loss"].get(last, float("nan")))
            if base
            else float("nan")
        )
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        pbp = f"{r['param_bytes_per_param']:.2f}" if r["param_bytes_per_param"] else "-"
        out.append(
            [r["recipe"], r["quantized_init"], *losses, f"{delta:+.4f}"]
            + [f"{r['tokens_per_s_per_gpu']:,.0f}", mfu, f"{r['peak_mem_gb']:.2f}", pbp]
        )
    return benchlib.table(head, out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--recipes", nargs="+", default=SM90_RECIPES)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--at", type=int, nargs="+", default=[50, 100, 200])
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--no-quantized-init", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    ap.add_argument("train_overrides", nargs="*")
    args = ap.parse_args(argv)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in args.recipes:
            for quantized in (
                [False] if recipe == "bf16" or args.no_quantized_init else [False, True]
            ):
                records, error = run_one(
                    recipe, quantized, args.steps, args.log_every, args.train_overrides, Path(tmp)
                )
                by_step = {r["step"]: r for r in records}
                timed = [r["tokens_per_s_per_device"] for r in records[1:]] or [0.0]
                rows.append(
                    dict(
                        recipe=recipe,
                        quantized_init=quantized,
                        error=error,
                        loss={s: by_step[s]["loss"] for s in args.at if s in by_step},
                        tokens_per_s_per_gpu=sum(timed) / len(timed),
                        peak_mem_gb=records[-1]["mem_gb"] if records else None,
                        param_bytes_per_param=records[-1].get("param_bytes_per_param")
                        if records
                        else None,
                        mfu=records[-1].get("mfu") if records else None,
                    )
                )
                print(json.dumps(rows[-1]), flush=True)

    print("\n" + table(rows, args.at))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
