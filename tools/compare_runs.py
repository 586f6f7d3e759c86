"""Compare training runs step by step: loss parity across resumes, layouts and recipes.

    python tools/compare_runs.py runs/a runs/a-resumed --assert-equal
    python tools/compare_runs.py runs/a runs/b runs/a-resumed --exact
    python tools/compare_runs.py runs/bf16 runs/fp8_cs --metrics loss,val_loss --rtol 2e-2
    python tools/compare_runs.py runs/a me/te-llama/3xk2p9aa --plot a.png --smooth 20 --logy
    python tools/compare_runs.py runs/lr1 runs/lr2 --metrics val_loss --plot v.png --x tokens
    python tools/compare_runs.py runs/a1 runs/a2 runs/a3 --vs runs/b1 runs/b2 runs/b3 \
        --names bf16,fp8 --window 501:1000 --plot ab.png --smooth 20

The first run is the reference; every other run is compared with it on the steps both
logged. Per metric it prints the number of common steps, the max absolute and relative
difference (relative to the reference value), and the first step where the two differ by
more than `atol + rtol * |reference|` (the defaults, 0 and 0, mean "not bitwise equal").

`--exact` fails on any difference: bitwise equal values on the same set of steps, and it lists
each run's first differing step with both values. A run directory whose recorded config
(configs/segment-*.yaml: train.deterministic, and the device train.py ran on) says it ran on a
GPU without `train.deterministic` gets one line saying its differences from another run are
expected noise, with the tolerance used.

`--peer-bounds` checks a run against a peer trainer's (the first run; docs/PEER_CURVE.md) on
the loss, with the bounds of issue 49: the step-1 losses within 1e-3 relative (the same
weights and first batch; `--different-batches`: reported, not checked), the means of the last
50 common steps within 1% (or within the spread of further reference runs given after the
second: the largest relative difference of their last-50 means from the first's, when that is
larger), and the 20-step trailing means (`moving_average`, as the plot draws them) within 3%
at every common step. It prints a table and exits 1 when a bound is exceeded.

`--vs` compares two groups of runs against their noise: the runs before it are group A, the
runs after it group B (one or more each). Each run is reduced to its mean over a window of
steps (`--window FIRST:LAST`; default the second half of the steps every run logged); d is
the difference of the group means, s the pooled spread of the runs around their own group's
mean, and the groups "differ" when k = |d| / s is above a threshold for their sizes
(runlog.NOISE_THRESHOLDS, simulated by tools/noise_sim.py: at most 5% false alarms whatever
the ratio of the two groups' spreads). The verdict is one line, "same within noise:
difference d, spread s between runs of a group" or "differs: d = k x the spread"; with one
run a side it cannot decide, and says how many runs a side would (at the spread `--spread`
assumes). `--bound B` also says whether the interval d ± threshold x s lies within ±B of A's
mean (then the exit status follows that: the difference is shown to be smaller than B);
`--first-rtol R` checks the group means at the first common step (the same start and first
batch); `--json FILE` appends the verdict as a JSON line; `--names A,B` names the groups.
With `--plot`, each group's mean curve and the band its runs span, and every run against
A's mean, with the window and the verdict. docs/RUNS.md says how to use it.

`--plot FILE` also writes a PNG: per metric, the curves and each run minus the reference.
`--smooth N` draws each curve as the trailing moving average of its last N logged points
(the mean of points i-N+1..i; fewer at the start); the report always uses the raw values.
`--logy` puts the curves on a log y axis, `--x tokens` plots against tokens_seen instead of
the step. The plot needs matplotlib (pip install matplotlib); without it everything else
works, and `--plot` fails at once with one line saying so.

A run is any of:
  - a run directory (`runs/<name>/`) holding `metrics.jsonl`, or that file itself;
  - a wandb offline run inside a run directory (`runs/<name>/wandb/` or one of its
    `offline-run-*` directories): read as that run directory's metrics.jsonl;
  - `entity/project/run_id` of an online wandb run (full history through wandb.Api);
  - a CSV exported from a wandb chart: one run per "<run> - <metric>" column.
Legends name runs shortly (the run directory's or file's name; `--labels` to choose).

Exit status: 0 when the runs agree (or when no check was asked for), 1 when `--assert-equal`,
`--exact` or `--rtol/--atol` was given and a metric differs beyond tolerance on a common step,
when `--peer-bounds` was given and a bound is exceeded, when `--vs` finds the groups
different or cannot decide (with `--bound`: unless the difference is shown within it), or the
runs share no step for it (a comparison that compares nothing does not pass), or
`--same-steps` was given and the step sets differ; 2 for bad input (a path that is not a
run, a metric no run logged, `--x tokens` on a run without tokens_seen, `--plot` without
matplotlib). Steps only one run logged are listed but do not fail a check unless
`--same-steps` is given.

The reading and the comparison are the library module runlog.py (`load_run`, `compare`,
`Report`, `compare_groups`); this file is its command line and the plots.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# Runs as a script (`python tools/compare_runs.py`): the repository root holds runlog.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runlog import (  # noqa: E402
    CompareError,
    NoiseVerdict,
    Run,
    compare,
    compare_groups,
    load_runs,
    metric_value,
    nondeterministic_gpu_segments,
    recipe_switches,
    steps_with,
)

# --------------------------------------------------------------------------------------
# Plot

PLOT_INSTALL = "--plot needs matplotlib: pip install matplotlib (or pip install -e '.[dev]')"


def _pyplot():
    """matplotlib's pyplot (Agg: files only), or CompareError saying what to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; no display on clusters
        import matplotlib.pyplot as plt
    except ImportError:
        raise CompareError(PLOT_INSTALL) from None
    return plt


def moving_average(values: Sequence[float], n: int) -> list[float]:
    """Trailing mean of the last n values at each point (fewer at the start); n <= 1: as is."""
    if n <= 1:
        return list(values)
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= n:
            total -= values[i - n]
        out.append(total / min(i + 1, n))
    return out


def _x_values(run: Run, steps: Sequence[int], x: str, label: str) -> list[float]:
    if x == "step":
        return list(steps)
    xs = [metric_value(run[s], "tokens_seen") for s in steps]
    if any(v is None for v in xs):
        raise CompareError(f"{label}: --x tokens needs tokens_seen in every record; use --x step")
    return xs


def switch_marks(runs: Mapping[str, Run], x: str = "step") -> list[tuple[str, float, str]]:
    """(run label, x position, text) of every recipe switch, for the plot's vertical lines."""
    marks = []
    for label, run in runs.items():
        for step, to in recipe_switches(run).items():
            marks.append((label, _x_values(run, [step], x, label)[0], f"{label}: recipe {to}"))
    return marks


def plot(
    runs: Mapping[str, Run],
    metrics: Sequence[str],
    path: str | Path,
    *,
    smooth: int = 1,
    logy: bool = False,
    x: str = "step",
    names: Mapping[str, str] | None = None,
) -> Path:
    """PNG with one row per metric: the curves, and each run minus the reference. names: the
    legends' short name of each run (default: its label)."""
    plt = _pyplot()
    labels = list(runs)
    names = {label: (names or {}).get(label, label) for label in labels}
    ref = runs[labels[0]]
    xlabel = "tokens seen" if x == "tokens" else "step"
    note = f" (moving average of {smooth})" if smooth > 1 else ""
    fig, axes = plt.subplots(len(metrics), 2, figsize=(12, 3.6 * len(metrics)), squeeze=False)
    for row, metric in enumerate(metrics):
        curves, diffs = axes[row]
        for label in labels:
            steps = sorted(steps_with(runs[label], metric))
            values = [metric_value(runs[label][s], metric) for s in steps]
            curves.plot(
                _x_values(runs[label], steps, x, label),
                moving_average(values, smooth),
                label=names[label],
                linewidth=1,
            )
        if logy:
            curves.set_yscale("log")
        curves.set(xlabel=xlabel, ylabel=metric, title=metric + note)
        curves.legend(fontsize="small")
        for label in labels[1:]:
            steps = sorted(steps_with(ref, metric) & steps_with(runs[label], metric))
            delta = [
                metric_value(runs[label][s], metric) - metric_value(ref[s], metric) for s in steps
            ]
            diffs.plot(
                _x_values(runs[label], steps, x, label),
                moving_average(delta, smooth),
                label=f"{names[label]} - {names[labels[0]]}",
                linewidth=1,
            )
        # the step after which the recipe changed
        for _, where, text in switch_marks({names[k]: runs[k] for k in labels}, x):
            for ax in (curves, diffs):
                ax.axvline(where, color="gray", linestyle="--", linewidth=0.8)
            curves.annotate(
                text,
                (where, 1.0),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                ha="right",
                fontsize="x-small",
            )
        diffs.axhline(0.0, color="gray", linewidth=0.5)
        diffs.set(xlabel=xlabel, ylabel=f"{metric} difference", title=f"{metric} - reference")
        diffs.legend(fontsize="small")
    return _save(plt, fig, path)


def _save(plt, fig, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------
# Peer bounds (--peer-bounds)

#: Issue 49's bounds: step 1, the mean of the last PEER_TAIL steps, the PEER_WINDOW-step
#: trailing means.
PEER_STEP1_RTOL, PEER_TAIL_RTOL, PEER_WINDOW_RTOL = 1e-3, 0.01, 0.03
PEER_TAIL, PEER_WINDOW = 50, 20


@dataclass
class PeerRow:
    target: str
    value: float
    bound: float
    detail: str
    checked: bool = True

    @property
    def ok(self) -> bool:
        return self.value <= self.bound


def _rel(a: float, b: float) -> float:
    """|b - a| / |a|: the relative difference of b from the reference a (inf where either is
    not finite, or a is 0 and b is not)."""
    if a == b and math.isfinite(a):
        return 0.0
    rel = abs(b - a) / abs(a) if a != 0 else math.inf
    return rel if math.isfinite(rel) else math.inf


def _curve(run: Run, steps: Sequence[int], metric: str) -> list[float]:
    return [metric_value(run[s], metric) for s in steps]


def peer_bounds(
    reference: Run,
    other: Run,
    extra_references: Sequence[Run] = (),
    *,
    metric: str = "loss",
    tail: int = PEER_TAIL,
    window: int = PEER_WINDOW,
    same_first_batch: bool = True,
) -> list[PeerRow]:
    """The three rows of `--peer-bounds` for `other` against `reference`, on their common
    steps (module docstring). extra_references: further runs of the reference trainer (other
    data seeds); the spread of their last-`tail` means around the reference's widens the
    tail bound when it is larger than PEER_TAIL_RTOL. Raises CompareError when the runs share
    no step."""
    steps = sorted(steps_with(reference, metric) & steps_with(other, metric))
    if not steps:
        raise CompareError(f"--peer-bounds: the runs share no step with {metric}")
    ref, oth = _curve(reference, steps, metric), _curve(other, steps, metric)
    rows = []
    first = steps[0]
    rows.append(
        PeerRow(
            f"step {first}: relative difference"
            + ("" if same_first_batch else " (different batches: not checked)"),
            _rel(ref[0], oth[0]),
            PEER_STEP1_RTOL,
            f"{ref[0]:.5f} vs {oth[0]:.5f}",
            checked=same_first_batch,
        )
    )
    n = min(tail, len(steps))
    mean_ref, mean_oth = statistics.fmean(ref[-n:]), statistics.fmean(oth[-n:])
    spread, bound = 0.0, PEER_TAIL_RTOL
    for extra in extra_references:
        extra_steps = sorted(steps_with(reference, metric) & steps_with(extra, metric))[-tail:]
        if not extra_steps:
            raise CompareError("--peer-bounds: a further reference run shares no step")
        a = statistics.fmean(_curve(reference, extra_steps, metric))
        spread = max(spread, _rel(a, statistics.fmean(_curve(extra, extra_steps, metric))))
    bound = max(bound, spread)
    spread_note = f"; the references' spread {spread:.2%}" if extra_references else ""
    rows.append(
        PeerRow(
            f"mean of the last {n} common steps: relative difference",
            _rel(mean_ref, mean_oth),
            bound,
            f"{mean_ref:.5f} vs {mean_oth:.5f} (steps {steps[-n]}-{steps[-1]}){spread_note}",
        )
    )
    smooth_ref, smooth_oth = moving_average(ref, window), moving_average(oth, window)
    worst, at = max((_rel(a, b), s) for a, b, s in zip(smooth_ref, smooth_oth, steps))
    i = steps.index(at)
    rows.append(
        PeerRow(
            f"{window}-step trailing means: largest relative difference",
            worst,
            PEER_WINDOW_RTOL,
            f"at step {at}: {smooth_ref[i]:.5f} vs {smooth_oth[i]:.5f} ({len(steps)} common steps)",
        )
    )
    return rows


def format_peer_rows(rows: Sequence[PeerRow], reference: str, other: str, metric: str) -> str:
    lines = [
        f"peer bounds on {metric}: {other} against {reference}",
        "| target | value | bound | result | detail |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        result = ("ok" if r.ok else "EXCEEDED") if r.checked else "(not checked)"
        lines.append(f"| {r.target} | {r.value:.3e} | {r.bound:.1e} | {result} | {r.detail} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Two groups against their noise (--vs)

GROUP_COLORS = ("tab:blue", "tab:orange")


def _common_steps(runs: Sequence[Run], metric: str) -> list[int]:
    steps = sorted(set.intersection(*(steps_with(r, metric) for r in runs)))
    if not steps:
        raise CompareError(f"--plot: the runs share no step with {metric}")
    return steps


def plot_groups(
    groups: Mapping[str, Mapping[str, Run]],
    metrics: Sequence[str],
    path: str | Path,
    *,
    smooth: int = 1,
    logy: bool = False,
    x: str = "step",
    verdicts: Mapping[str, NoiseVerdict] | None = None,
) -> Path:
    """PNG with one row per metric: each group's mean curve and the band its runs span (min to
    max, after smoothing), and every run's relative difference from the first group's mean,
    coloured by group, with the window and the verdict where one was made for the metric."""
    import textwrap

    import numpy as np

    plt = _pyplot()
    names = list(groups)
    xlabel = "tokens seen" if x == "tokens" else "step"
    note = f" (moving average of {smooth})" if smooth > 1 else ""
    fig, axes = plt.subplots(len(metrics), 2, figsize=(12, 3.9 * len(metrics)), squeeze=False)
    for row, metric in enumerate(metrics):
        curves, diffs = axes[row]
        steps = _common_steps([r for g in groups.values() for r in g.values()], metric)
        first_label, first_run = next(iter(groups[names[0]].items()))
        xs = _x_values(first_run, steps, x, first_label)
        reference = np.mean([_curve(r, steps, metric) for r in groups[names[0]].values()], axis=0)
        for name, color in zip(names, GROUP_COLORS):
            runs = groups[name]
            raw = np.array([_curve(r, steps, metric) for r in runs.values()])
            smoothed = np.array([moving_average(list(v), smooth) for v in raw])
            n = len(runs)
            curves.plot(
                xs, smoothed.mean(0), color=color, linewidth=1, label=f"{name}: mean of {n}"
            )
            if n > 1:
                curves.fill_between(
                    xs, smoothed.min(0), smoothed.max(0), color=color, alpha=0.25, linewidth=0
                )
            for i, values in enumerate(raw):
                relative = list(100 * (values - reference) / np.abs(reference))
                diffs.plot(
                    xs,
                    moving_average(relative, smooth),
                    color=color,
                    linewidth=0.8,
                    label=f"{name} ({n} runs)" if i == 0 else None,
                )
        if logy:
            curves.set_yscale("log")
        curves.set(xlabel=xlabel, ylabel=metric, title=f"{metric}{note}: group means, runs' range")
        curves.legend(fontsize="small")
        diffs.axhline(0.0, color="gray", linewidth=0.5)
        title = f"{metric}: each run against {names[0]}'s mean (%)"
        verdict = (verdicts or {}).get(metric)
        if verdict is not None:
            where = _x_values(first_run, [verdict.steps[0], verdict.steps[-1]], x, first_label)
            diffs.axvspan(*where, color="gray", alpha=0.12, linewidth=0, label="window")
            title += "\n" + textwrap.fill(verdict.summary(), 80)
        diffs.set(xlabel=xlabel, ylabel=f"{metric} difference (%)")
        diffs.set_title(title, fontsize="small")
        diffs.legend(fontsize="small")
    return _save(plt, fig, path)


def _fraction(text: str) -> float:
    """A fraction given as 0.01 or 1%."""
    text = text.strip()
    value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    if not value >= 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: a fraction >= 0 (0.01 or 1%)")
    return value


def _steps_window(text: str) -> tuple[int, int]:
    first, sep, last = text.partition(":")
    try:
        window = (int(first), int(last)) if sep else None
    except ValueError:
        window = None
    if window is None or window[0] > window[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: FIRST:LAST, two steps, FIRST <= LAST")
    return window


def first_step_line(
    groups: Mapping[str, Mapping[str, Run]], metric: str, rtol: float
) -> tuple[str, bool]:
    """The groups' means at the first step every run logged, and whether they agree within
    rtol (the same start and first batch: the noise has not begun)."""
    runs = [r for g in groups.values() for r in g.values()]
    step = _common_steps(runs, metric)[0]
    (name_a, a), (name_b, b) = (
        (name, statistics.fmean(metric_value(r[step], metric) for r in g.values()))
        for name, g in groups.items()
    )
    rel = _rel(a, b)
    ok = rel <= rtol
    return (
        f"step {step}: {name_a} {a:.6g}, {name_b} {b:.6g} (group means): relative difference "
        f"{rel:.1e} {'<=' if ok else 'EXCEEDS'} {rtol:g}",
        ok,
    )


def verdict_record(verdict: NoiseVerdict, first: tuple[str, bool] | None) -> dict:
    """One JSON line of `--json`: the verdict in numbers (relative ones as fractions)."""
    interval = verdict.interval
    record = {
        "metric": verdict.metric,
        "window": [verdict.steps[0], verdict.steps[-1]],
        "groups": {
            g.name: {
                "runs": g.labels,
                "means": g.means,
                "mean": g.mean,
                "spread": g.relative_spread,
            }
            for g in (verdict.a, verdict.b)
        },
        "difference": verdict.rel(verdict.difference),
        "spread": None if verdict.spread is None else verdict.rel(verdict.spread),
        "k": verdict.k if verdict.k is None or math.isfinite(verdict.k) else "inf",
        "threshold": verdict.threshold,
        "interval": None if interval is None else [verdict.rel(v) for v in interval],
        "verdict": verdict.verdict,
        "summary": verdict.summary(),
        "needed": verdict.needed,
        "bound": verdict.bound,
        "bound_verdict": verdict.bound_verdict,
    }
    if first is not None:
        record["first_step"] = {"line": first[0], "ok": first[1]}
    return record


# --------------------------------------------------------------------------------------
# Command line


def _labels(paths: Sequence[str]) -> list[str]:
    return _unique([p.rstrip("/") or p for p in paths])


def _unique(names: Sequence[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        while name in out:
            name += "'"
        out.append(name)
    return out


def load_inputs(paths: Sequence[str]) -> list[tuple[str, str, str, Run]]:
    """(label, short name, path, run) of every run the arguments hold, in order: a path is one
    run (labelled by the path as given), or a wandb chart CSV several (`<path>:<run name>`)."""
    out = []
    for label, path in zip(_labels(paths), paths):
        loaded = load_runs(path)
        if len(loaded) == 1 and not str(path).endswith(".csv"):
            ((name, run),) = loaded.items()
            out.append((label, name, path, run))
        else:
            out += [(f"{label}:{name}", name, path, run) for name, run in loaded.items()]
    for label, _, _, run in out:
        if not run:
            raise CompareError(f"{label}: the run has no logged steps")
    return out


def first_differences(runs: Mapping[str, Run], report) -> list[str]:
    """`--exact`: for each run and metric that differs, the first differing step with both
    values (or the steps only one run logged)."""
    lines = []
    for d in report.diffs:
        if d.first_diff_step is not None:
            step = d.first_diff_step
            a = metric_value(runs[d.reference].get(step), d.metric)
            b = metric_value(runs[d.other].get(step), d.metric)
            lines.append(
                f"first difference: {d.metric} at step {step}: {d.reference} {a!r}, {d.other} {b!r}"
            )
        elif d.only_reference or d.only_other:
            missing = min(d.only_reference + d.only_other)
            lines.append(f"first difference: {d.metric} at step {missing}: logged by one run only")
    return lines


def noise_notes(label: str, path: str, report) -> list[str]:
    """One line per run that ran on a GPU without train.deterministic (read from its run
    directory's configs/): its differences from a repeat are expected noise."""
    segments = nondeterministic_gpu_segments(path)
    if not segments:
        return []
    steps = ", ".join(str(s.start_step) for s in segments)
    where = "ran on a GPU" if all(s.device == "cuda" for s in segments) else "may have run on a GPU"
    tol = ""
    if report is not None:
        tol = (
            " (compared bitwise)"
            if report.rtol == 0 and report.atol == 0
            else f" (compared with rtol={report.rtol:g} atol={report.atol:g})"
        )
    return [
        f"note: {label} {where} without train.deterministic (segment(s) from step {steps}): "
        f"its differences from another run are expected noise{tol}; rerun both with "
        "train.deterministic=true to compare bit for bit"
    ]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Compare runs step by step (the first run is the reference).",
        epilog="exit status: 0 agree / no check asked, 1 differ beyond tolerance, 2 bad input",
    )
    parser.add_argument(
        "runs",
        nargs="+",
        help="run dir, metrics.jsonl, wandb offline dir or file, or entity/project/run_id",
    )
    parser.add_argument("--metrics", default="loss", help="comma-separated (default: loss)")
    parser.add_argument(
        "--assert-equal", action="store_true", help="fail unless bitwise equal on every common step"
    )
    parser.add_argument(
        "--exact",
        action="store_true",
        help="fail on any difference: bitwise equal values on the same steps (lists the first "
        "differing step)",
    )
    parser.add_argument(
        "--rtol",
        type=float,
        default=None,
        help="fail beyond this relative tolerance (|b-a| > atol + rtol*|a|)",
    )
    parser.add_argument(
        "--atol", type=float, default=None, help="fail beyond this absolute tolerance"
    )
    parser.add_argument(
        "--same-steps",
        action="store_true",
        help="with a check: also fail when the runs logged different steps",
    )
    parser.add_argument("--plot", metavar="FILE", help="also write a PNG of the curves")
    parser.add_argument(
        "--smooth",
        type=int,
        default=1,
        metavar="N",
        help="plot: trailing moving average over the last N logged points",
    )
    parser.add_argument("--logy", action="store_true", help="plot: log y axis")
    parser.add_argument(
        "--x", choices=("step", "tokens"), default="step", help="plot: x axis (tokens_seen)"
    )
    parser.add_argument(
        "--peer-bounds",
        action="store_true",
        help="check the second run's loss against the first's (a peer trainer): step 1 within "
        "1e-3, the last-50-step means within 1%% (or the spread of further reference runs "
        "given after the second), the 20-step trailing means within 3%%",
    )
    group = parser.add_argument_group(
        "two groups against their noise",
        "RUNS is group A, --vs group B; each run's mean over a window of steps, the groups' "
        "difference against the spread between runs of a group (docs/RUNS.md)",
    )
    group.add_argument("--vs", nargs="+", metavar="RUN", help="group B's runs (after A's)")
    group.add_argument(
        "--names", metavar="A,B", help="the two groups' names (default: A,B)", default="A,B"
    )
    group.add_argument(
        "--labels", metavar="L,...", help="short names of the runs for the plot, in order"
    )
    group.add_argument(
        "--window",
        type=_steps_window,
        metavar="FIRST:LAST",
        help="steps to average each run over (default: the second half of the steps every run "
        "logged)",
    )
    group.add_argument(
        "--spread",
        type=_fraction,
        metavar="S",
        help="with one run a side: the spread between runs to assume (0.003 or 0.3%%) for the "
        "number of runs that would decide",
    )
    group.add_argument(
        "--bound",
        type=_fraction,
        metavar="B",
        help="also decide whether the difference is within ±B of A's mean (0.01 or 1%%); "
        "the exit status then follows this",
    )
    group.add_argument(
        "--first-rtol",
        type=float,
        metavar="R",
        help="also check the groups' means at the first common step within R (same start)",
    )
    group.add_argument("--json", metavar="FILE", help="append the verdict to FILE as a JSON line")
    parser.add_argument(
        "--different-batches",
        action="store_true",
        help="with --peer-bounds: the runs' first batches differ, so step 1 is not checked",
    )
    # Earlier versions wrote a PNG unless told not to; the flag is still accepted.
    parser.add_argument("--no-plot", action="store_true", help=argparse.SUPPRESS)
    return parser


def _args_problem(args) -> str | None:
    """The first contradiction among the options, as one line (None: they agree). --exact
    turns on --assert-equal and --same-steps."""
    tolerances = args.rtol is not None or args.atol is not None
    if (args.assert_equal or args.exact) and tolerances:
        return "use either --assert-equal/--exact or --rtol/--atol"
    if args.peer_bounds and (args.assert_equal or args.exact or tolerances or args.same_steps):
        return "--peer-bounds is a check of its own: drop --assert-equal/--exact/--rtol/--atol"
    if args.different_batches and not args.peer_bounds:
        return "--different-batches goes with --peer-bounds"
    grouped = (args.window, args.spread, args.bound, args.first_rtol, args.json)
    if args.vs is None and (any(v is not None for v in grouped) or args.names != "A,B"):
        return "--names, --window, --spread, --bound, --first-rtol and --json go with --vs"
    if args.vs is not None and (
        args.assert_equal or args.exact or tolerances or args.same_steps or args.peer_bounds
    ):
        return "--vs is a check of its own: drop --assert-equal/--exact/--rtol/--atol/--peer-bounds"
    if args.vs is not None and len(args.names.split(",")) != 2:
        return "--names takes two names, A,B"
    if args.exact:
        args.assert_equal = args.same_steps = True
    if len(args.runs) < 2 and args.vs is None and not args.runs[0].endswith(".csv"):
        return "give two or more runs (or groups: RUNS --vs RUNS)"
    if args.same_steps and not (args.assert_equal or tolerances):
        return "--same-steps goes with --assert-equal or --rtol/--atol"
    if min(args.rtol or 0.0, args.atol or 0.0) < 0:
        return "--rtol and --atol must be >= 0"
    if args.smooth < 1:
        return "--smooth must be >= 1"
    if not args.plot and (args.smooth > 1 or args.logy or args.x != "step"):
        return "--smooth, --logy and --x shape the plot: add --plot FILE"
    return None


def _short_names(args, inputs: Sequence[tuple[str, str, str, Run]]) -> list[str]:
    if args.labels is None:
        return _unique([name for _, name, _, _ in inputs])
    given = [x.strip() for x in args.labels.split(",")]
    if len(given) != len(inputs):
        raise CompareError(f"--labels names {len(given)} runs, but there are {len(inputs)}")
    return _unique(given)


def groups_main(args, metrics: Sequence[str]) -> int:
    """--vs: the two groups' noise comparison on each metric, its plot, its exit status."""
    a_inputs, b_inputs = load_inputs(args.runs), load_inputs(args.vs)
    short = _short_names(args, [*a_inputs, *b_inputs])
    name_a, name_b = (x.strip() for x in args.names.split(","))
    if name_a == name_b:
        raise CompareError("--names: the two groups need different names")
    groups = {
        name_a: dict(zip(short[: len(a_inputs)], (r for *_, r in a_inputs))),
        name_b: dict(zip(short[len(a_inputs) :], (r for *_, r in b_inputs))),
    }
    verdicts, ok = {}, True
    for metric in metrics:
        verdict = compare_groups(
            groups[name_a],
            groups[name_b],
            metric,
            names=(name_a, name_b),
            window=args.window,
            spread=args.spread,
            bound=args.bound,
        )
        first = None
        if args.first_rtol is not None:
            first = first_step_line(groups, metric, args.first_rtol)
            print(first[0])
            ok &= first[1]
        print("\n".join(verdict.lines()))
        verdicts[metric] = verdict
        ok &= verdict.ok
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(verdict_record(verdict, first)) + "\n")
    if args.plot:
        path = plot_groups(
            groups,
            metrics,
            args.plot,
            smooth=args.smooth,
            logy=args.logy,
            x=args.x,
            verdicts=verdicts,
        )
        print(f"plot: {path}")
    what = "within the bound" if args.bound is not None else "the same within their noise"
    print(f"OK: the groups are {what}" if ok else "FAIL: see above")
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    problem = _args_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    tolerances = args.rtol is not None or args.atol is not None
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
    try:
        if args.plot:
            _pyplot()  # before any work: say what to install, in one line
        if args.vs is not None:
            return groups_main(args, metrics)
        inputs = load_inputs(args.runs)
        runs = {label: run for label, _, _, run in inputs}
        if len(runs) < 2:
            raise CompareError("give two or more runs")
        names = dict(zip(runs, _short_names(args, inputs)))
        report = compare(
            runs, metrics, rtol=args.rtol or 0.0, atol=args.atol or 0.0, same_steps=args.same_steps
        )
        print(report.format())
        if args.exact:
            for line in first_differences(runs, report):
                print(line)
        checking = args.assert_equal or tolerances
        for label, _, path, _ in inputs:
            for line in noise_notes(label, path, report if checking else None):
                print(line)
        for label, run in runs.items():
            for step, to in recipe_switches(run).items():
                print(f"{label}: recipe switch after step {step} ({to})")
        peer_ok = True
        if args.peer_bounds:
            labels = list(runs)
            rows = peer_bounds(
                runs[labels[0]],
                runs[labels[1]],
                [runs[label] for label in labels[2:]],
                same_first_batch=not args.different_batches,
            )
            print(format_peer_rows(rows, labels[0], labels[1], "loss"))
            peer_ok = all(r.ok for r in rows if r.checked)
        if args.plot:
            path = plot(
                runs, metrics, args.plot, smooth=args.smooth, logy=args.logy, x=args.x, names=names
            )
            print(f"plot: {path}")
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not peer_ok:
        print("FAIL: a peer bound is exceeded (see above)")
        return 1
    if args.peer_bounds:
        print("OK: within the peer bounds")
    checking = args.assert_equal or tolerances
    if checking and not report.ok:
        print("FAIL: runs differ (see above)")
        return 1
    if checking:
        print("OK: runs agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
