"""Resume parity: an uninterrupted run vs the same run resumed from its middle checkpoint.

    python tools/resume_check.py --steps 20 -- model=tiny data.seq_len=64          # CPU
    python tools/resume_check.py --modes sync async --recipes bf16 fp8_cs --quantized-init both \
        -- model=small                                                          # one GPU
    python tools/resume_check.py --nproc 4 --resume-nproc 2 --resume-overrides parallel=fsdp \
        -- model=small parallel=fsdp                                            # reshard 4 -> 2

For each (recipe, quantized_init, checkpoint mode) it trains `--steps` steps saving every
steps/2 (run A), copies A's run directory without its later checkpoints, resumes it from the
middle checkpoint (run B, optionally on another process count or layout) and compares the
losses of the second half with tools/compare_runs.py. Prints one table row per case: max
absolute loss difference and whether the curves are bitwise equal.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.compare_runs import compare, load_run  # noqa: E402


def launch(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        cmd + ["train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )


def replace_overrides(base: list[str], new: list[str]) -> list[str]:
    """`base` with `new` applied: an override in `new` replaces every base override of the
    same key or below it (`parallel=tp` drops `parallel=fsdp` and `parallel.dp_shard=2`)."""
    keys = [o.split("=", 1)[0] for o in new]
    kept = [
        o for o in base if not any(o.split("=", 1)[0] == k or o.startswith(k + ".") for k in keys)
    ]
    return kept + list(new)


def keep_only_checkpoint(src: Path, dst: Path, step: int) -> None:
    """Copy run directory `src` to `dst` with only the checkpoint of `step` (what a run killed
    right after that save would have left)."""
    shutil.copytree(src, dst)
    for d in (dst / "checkpoints").iterdir():
        if d.is_dir() and d.name != f"step_{step:07d}":
            shutil.rmtree(d)


def second_half(run_a: Path, run_b: Path, half: int) -> dict:
    """Loss of run B (resumed at `half`) against run A after `half`: steps compared, max
    absolute difference, bitwise equality, first differing step."""
    runs = {"A": load_run(run_a), "B": load_run(run_b)}
    second = {k: {s: r for s, r in v.items() if s > half} for k, v in runs.items()}
    report = compare(second, metrics=("loss",), rtol=0, atol=0)
    d = report.diffs[0]
    return dict(
        steps=d.common_steps, max_abs=d.max_abs, bitwise=report.ok, first_diff=d.first_diff_step
    )


def case_overrides(
    recipe: str, qinit: bool, mode: str, steps: int, root: Path, extra: list[str]
) -> tuple[str, list[str]]:
    """Name and train.py overrides of one resume case: save every steps/2, log every step."""
    name = f"{recipe}{'-q' if qinit else ''}-{mode}"
    return name, [
        f"recipe={recipe}",
        f"recipe.quantized_init={str(qinit).lower()}",
        f"checkpoint={mode}",
        f"checkpoint.interval={steps // 2}",
        "checkpoint.keep_last=4",
        f"train.steps={steps}",
        "train.log_every=1",
        f"run.root={root}",
        *extra,
    ]


def format_table(rows: list[dict], keys: tuple[str, ...] = ("case",), timing: bool = False) -> str:
    """Markdown table of resume rows: the `keys` columns, then the comparison (and the seconds
    runs A + B took with `timing`). Rows with `error` or `refused` say so instead."""
    head = [*keys, "resumed", "steps compared", "max abs loss diff", "bitwise"]
    head += ["s (A+B)"] if timing else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    blanks = " |" * (len(head) - len(keys) - 1)
    for r in rows:
        first = "| " + " | ".join(str(r.get(k, "")) for k in keys) + " |"
        if "refused" in r:
            lines.append(f"{first} refused by the config check: {r['refused']} |{blanks}")
        elif "error" in r:
            lines.append(f"{first} failed: {r['error']} |{blanks}")
        else:
            cells = [r["resumed"], r["steps"], f"{r['max_abs']:.3g}", r["bitwise"]]
            cells += [f"{r['seconds_a'] + r['seconds_b']:.0f}"] if timing else []
            lines.append(f"{first} " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def one_case(tmp: Path, recipe: str, qinit: bool, mode: str, a: argparse.Namespace) -> dict:
    half = a.steps // 2
    name, common = case_overrides(recipe, qinit, mode, a.steps, tmp, a.overrides)
    ra = launch(a.nproc, common + [f"run.name={name}-A"])
    if ra.returncode != 0:
        return dict(case=name, error=(ra.stderr.strip().splitlines() or ["A failed"])[-1])
    run_a, run_b = tmp / f"{name}-A", tmp / f"{name}-B"
    keep_only_checkpoint(run_a, run_b, half)
    rb = launch(
        a.resume_nproc or a.nproc,
        replace_overrides(common, a.resume_overrides) + [f"run.name={name}-B"],
    )
    if rb.returncode != 0:
        return dict(case=name, error=(rb.stderr.strip().splitlines() or ["B failed"])[-1])
    resumed = f"resumed_from_step={half}" in rb.stdout
    return dict(case=name, resumed=resumed, **second_half(run_a, run_b, half))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--recipes", nargs="+", default=["bf16"])
    ap.add_argument("--quantized-init", choices=["false", "true", "both"], default="false")
    ap.add_argument("--modes", nargs="+", default=["sync"])
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--resume-nproc", type=int, default=None)
    ap.add_argument("--resume-overrides", nargs="*", default=[])
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    qinits = {"false": [False], "true": [True], "both": [False, True]}[a.quantized_init]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in a.recipes:
            for q in [False] if recipe == "bf16" else qinits:
                for mode in a.modes:
                    rows.append(one_case(Path(tmp), recipe, q, mode, a))
                    print(rows[-1], flush=True)
    print("\n" + format_table(rows))
    sys.exit(0 if all(r.get("bitwise") for r in rows) else 1)


if __name__ == "__main__":
    main()
