"""Reading what runs logged, and comparing runs step by step.

    from runlog import compare, load_run, read_metrics
    records = read_metrics(Path("runs/a/metrics.jsonl"))         # [{"step": 1, "loss": ...}, ...]
    run = load_run("runs/a")                                     # {step: {metric: value}}
    report = compare({"a": run, "b": load_run("runs/b")}, ["loss"], rtol=0, atol=0)
    report.ok, report.format()

A run (`load_run`) is any of:
  - a run directory (`runs/<name>/`) holding `metrics.jsonl`, or that file itself;
  - a wandb offline run inside a run directory (`runs/<name>/wandb/`, one of its
    `offline-run-*` directories or a file in one): read as the enclosing run directory's
    metrics.jsonl, which holds every step those segments were sent (wandb's own offline
    files are never parsed: their format is private);
  - `entity/project/run_id` of an online wandb run (its full, unsampled history through
    wandb's public API, `wandb.Api().run(path).scan_history()`).

`compare` checks every run against the first on the steps both logged: per metric the number
of common steps, the max absolute and relative difference (relative to the reference value),
and the first step where the two differ by more than `atol + rtol * |reference|` (the
defaults, 0 and 0, mean "not bitwise equal"). Anything that cannot be read or compared raises
`CompareError` with a one-line message.

Used by logger.py (metrics.jsonl), tools/compare_runs.py (the command line and plot) and the
test harnesses (tests/harness/). Library code: it imports nothing from tools/ or tests/.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

Run = dict[int, dict]

#: entity/project/run_id (wandb names: letters, digits, '-', '_', '.').
WANDB_RUN_PATH = re.compile(r"^[\w.-]+/[\w.-]+/[\w-]+$")


class CompareError(ValueError):
    """A run that cannot be read or compared; the message says which and why."""


# --------------------------------------------------------------------------------------
# metrics.jsonl


def read_metrics(path: Path) -> list[dict]:
    """Records of metrics.jsonl in file order; a line cut by a killed run is skipped, and a
    missing file has none."""
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def read_metrics_jsonl(path: Path) -> Run:
    """One record per line with a `step`; a later record for a step replaces an earlier one,
    and a line cut short by a killed run is skipped (read_metrics)."""
    return {
        int(r["step"]): {k: v for k, v in r.items() if k != "step"}
        for r in read_metrics(path)
        if isinstance(r, dict) and "step" in r
    }


# --------------------------------------------------------------------------------------
# Loading runs


def load_run(path: str | Path) -> Run:
    """Read one run as {step: {metric: value}} (see the module docstring for what a run is)."""
    p = Path(path)
    if p.exists():
        run_dir = _enclosing_run_dir(p)
        if run_dir is not None:
            return read_metrics_jsonl(run_dir / "metrics.jsonl")
        if p.is_file() and p.suffix != ".wandb":
            return read_metrics_jsonl(p)
        if _inside_wandb_dir(p):
            raise CompareError(
                f"{path}: a wandb offline run is read through the metrics.jsonl of the run "
                "directory that logged it, and no run directory encloses this one; upload it "
                "(wandb sync) and pass entity/project/run_id"
            )
        raise CompareError(f"{path}: no metrics.jsonl in it (not a run directory)")
    if WANDB_RUN_PATH.match(str(path)):
        return read_wandb_online(str(path))
    raise CompareError(
        f"{path}: not a run directory, metrics.jsonl, wandb offline run or entity/project/run_id"
    )


def _inside_wandb_dir(p: Path) -> bool:
    return any(part == "wandb" for part in p.resolve().parts)


def _enclosing_run_dir(p: Path) -> Path | None:
    """The run directory whose metrics.jsonl stands for `p`: p itself, or for a path in a
    run's wandb/ directory, the directory holding that wandb/."""
    p = p.resolve()
    if p.is_dir() and (p / "metrics.jsonl").is_file():
        return p
    for parent in [p, *p.parents]:
        if parent.name == "wandb" and (parent.parent / "metrics.jsonl").is_file():
            return parent.parent
    return None


def read_wandb_online(run_path: str) -> Run:
    try:
        import wandb

        api_run = wandb.Api().run(run_path)
        rows = list(api_run.scan_history())  # unsampled, unlike api_run.history()
    except Exception as e:  # network, login or a wrong path: one line, no traceback
        raise CompareError(
            f"{run_path}: could not read the wandb run ({type(e).__name__}: "
            f"{e}); check the path and `wandb login`"
        ) from None
    return {int(row["_step"]): _public(row) for row in rows if row.get("_step") is not None}


def _public(row: Mapping) -> dict:
    """Drop wandb's own columns (_step, _runtime, _timestamp, ...)."""
    return {k: v for k, v in row.items() if not k.startswith("_")}


@dataclass
class Segment:
    """One segment of a run directory (configs/segment-<step>.yaml: a job, or a recipe
    switch inside one): where it started, whether train.deterministic was in effect, and the
    device it ran on (None: not recorded, e.g. a run older than the record)."""

    start_step: int
    deterministic: bool
    device: str | None
    train_device: str


_DEVICE_RE = re.compile(r"; device: (\w+)")


def run_segments(path: str | Path) -> list[Segment]:
    """The segments a local run directory recorded (empty for a wandb online run, a bare
    metrics.jsonl, or a run directory without configs/)."""
    import yaml

    p = Path(path)
    run_dir = _enclosing_run_dir(p) if p.exists() else None
    configs = run_dir / "configs" if run_dir is not None else None
    if configs is None or not configs.is_dir():
        return []
    out = []
    for f in sorted(configs.glob("segment-*.yaml")):
        m = re.match(r"segment-(\d+)\.yaml$", f.name)
        if not m:
            continue  # a replaced segment (segment-<step>.<time>.yaml)
        try:
            text = f.read_text()
            config = yaml.safe_load(text) or {}
        except (OSError, yaml.YAMLError, UnicodeDecodeError):
            continue
        train = config.get("train") or {} if isinstance(config, dict) else {}
        found = _DEVICE_RE.search(text.splitlines()[0]) if text else None
        out.append(
            Segment(
                start_step=int(m.group(1)),
                deterministic=bool(train.get("deterministic", False)),
                device=found.group(1) if found else None,
                train_device=str(train.get("device", "auto")),
            )
        )
    return out


def nondeterministic_gpu_segments(path: str | Path) -> list[Segment]:
    """Segments that ran (or, unrecorded, may have run) on a GPU without train.deterministic:
    their losses differ from a repeat's by noise."""
    return [
        s
        for s in run_segments(path)
        if not s.deterministic
        and (s.device == "cuda" or (s.device is None and s.train_device != "cpu"))
    ]


# --------------------------------------------------------------------------------------
# Comparing


@dataclass
class MetricDiff:
    metric: str
    reference: str
    other: str
    common_steps: int
    only_reference: list[int]
    only_other: list[int]
    max_abs: float
    max_rel: float
    #: Step of the largest absolute difference (None without common steps).
    max_abs_step: int | None
    #: First common step where |other - ref| > atol + rtol * |ref| (None: none).
    first_diff_step: int | None

    def within(self, same_steps: bool) -> bool:
        if self.common_steps == 0 or self.first_diff_step is not None:
            return False
        return not (same_steps and (self.only_reference or self.only_other))


@dataclass
class Report:
    diffs: list[MetricDiff]
    rtol: float
    atol: float
    same_steps: bool = False

    @property
    def ok(self) -> bool:
        return all(d.within(self.same_steps) for d in self.diffs)

    def format(self) -> str:
        tol = (
            "bitwise"
            if self.rtol == 0 and self.atol == 0
            else f"rtol={self.rtol:g} atol={self.atol:g}"
        )
        lines = []
        for d in self.diffs:
            head = f"{d.metric}: {d.other} vs {d.reference}"
            if d.common_steps == 0:
                lines.append(f"{head}: no common steps")
            else:
                first = "none" if d.first_diff_step is None else f"step {d.first_diff_step}"
                lines.append(
                    f"{head}: {d.common_steps} common steps, max abs diff "
                    f"{d.max_abs:.3e} (step {d.max_abs_step}), max rel diff "
                    f"{d.max_rel:.3e}, first step beyond {tol}: {first}"
                )
            for label, steps in ((d.reference, d.only_reference), (d.other, d.only_other)):
                if steps:
                    lines.append(f"  only in {label}: {len(steps)} steps ({_span(steps)})")
        return "\n".join(lines)


def _span(steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[:5]))
    return shown + (f", ... {steps[-1]}" if len(steps) > 5 else "")


def metric_value(record: dict | None, metric: str) -> float | None:
    """The metric as a float, or None where the record lacks it or it is not a number."""
    value = None if record is None else record.get(metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def steps_with(run: Run, metric: str) -> set[int]:
    """The steps of `run` that logged a number for `metric`."""
    return {s for s, rec in run.items() if metric_value(rec, metric) is not None}


def recipe_switches(run: Run) -> dict[int, str]:
    """The steps after which the run switched precision recipe (`recipe.switch`: train.py logs
    `recipe_switch` on the switch step's record), with what it switched to."""
    return {
        s: str(rec["recipe_switch"]) for s, rec in sorted(run.items()) if rec.get("recipe_switch")
    }


def metric_names(runs: Mapping[str, Run]) -> set[str]:
    return {
        k
        for r in runs.values()
        for rec in r.values()
        for k in rec
        if metric_value(rec, k) is not None
    }


def compare(
    runs: Mapping[str, Run] | Sequence[Run],
    metrics: Sequence[str] = ("loss",),
    rtol: float = 0.0,
    atol: float = 0.0,
    same_steps: bool = False,
) -> Report:
    """Compare every run with the first one. `runs`: {label: {step: record}} or a list."""
    if not isinstance(runs, Mapping):
        runs = {f"run{i}": r for i, r in enumerate(runs)}
    if len(runs) < 2:
        raise CompareError("compare needs two or more runs")
    labels = list(runs)
    ref_label = labels[0]
    diffs = []
    for metric in metrics:
        if not any(steps_with(r, metric) for r in runs.values()):
            raise CompareError(
                f"metric {metric!r} is in none of the runs; pick --metrics "
                f"from: {', '.join(sorted(metric_names(runs)))}"
            )
        ref = runs[ref_label]
        ref_steps = steps_with(ref, metric)
        for label in labels[1:]:
            other = runs[label]
            other_steps = steps_with(other, metric)
            common = sorted(ref_steps & other_steps)
            max_abs, max_rel, max_abs_step, first = 0.0, 0.0, None, None
            for step in common:
                a, b = metric_value(ref[step], metric), metric_value(other[step], metric)
                if a == b or (math.isnan(a) and math.isnan(b)):
                    continue  # equal, or both diverged at the same step: agreement
                diff = abs(b - a)
                if not math.isfinite(diff):
                    diff = math.inf  # a NaN or inf on one side only
                rel = diff / abs(a) if a != 0 and math.isfinite(a) else math.inf
                if max_abs_step is None or diff > max_abs:
                    max_abs, max_abs_step = diff, step
                max_rel = max(max_rel, rel)
                tolerance = atol + rtol * abs(a) if math.isfinite(a) else atol
                if first is None and diff > tolerance:
                    first = step
            if common and max_abs_step is None:
                max_abs_step = common[0]
            diffs.append(
                MetricDiff(
                    metric=metric,
                    reference=ref_label,
                    other=label,
                    common_steps=len(common),
                    only_reference=sorted(ref_steps - other_steps),
                    only_other=sorted(other_steps - ref_steps),
                    max_abs=max_abs,
                    max_rel=max_rel,
                    max_abs_step=max_abs_step,
                    first_diff_step=first,
                )
            )
    return Report(diffs=diffs, rtol=rtol, atol=atol, same_steps=same_steps)
