"""Simulated loss curves for the noise comparison of tools/compare_runs.py (`--vs`).

    python tools/noise_sim.py thresholds               # the k thresholds, as runlog.py holds them
    python tools/noise_sim.py rates                    # false alarms and detections, a table
    python tools/noise_sim.py rates --draws 2000 --runs 3

`compare_groups` (runlog.py) reduces each run to its mean over a window of steps and calls two
groups different when k = |d| / s is above a threshold, d the difference of the group means and
s the pooled spread of the runs around their own group's mean. This file is where the
thresholds come from and where the rule is tried on curves whose answer is known.

**thresholds.** For each pair of group sizes, k is simulated for groups with no difference
whose runs' window means scatter normally, group A with standard deviation 1 and group B with
r, for r in SD_RATIOS (0 to infinity: one group may be much noisier than the other, as
torchtitan's bf16 runs were against this recipe's in issue 54). The threshold is the largest
over r of the 1 - NOISE_ALARM_RATE quantile of k, so that no ratio of spreads raises false
alarms more often than that. With one run on a side that side's spread cannot be seen, and
it is taken to be the other side's (r = 1). The printed dict is runlog.NOISE_THRESHOLDS.

**rates.** Whole curves, 300 steps of a falling loss, with the noise of GPU runs that read
the same batches (NoiseModel): each run drifts away from the others over the first steps and
then keeps a slow offset of its own, wanders about it (an AR(1) process, correlated over
steps), shares the batch-to-batch ups and downs of every run, and may have a loss spike.
The models are set to the spreads measured in issue 54 (llama3_1b, torchtitan against this
recipe): torchtitan's bf16 runs 2.2% apart over their last 50 steps, this recipe's 0.13%. For
each pair of models it counts how often compare_groups' rule (the same function, vectorized
over draws) says "differs" when the groups are the same (false alarms) and when every step of
group B is 1% higher (detections), and, for contrast, how often a test that takes each step
of the window as an independent sample does.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runlog import (  # noqa: E402
    NOISE_ALARM_RATE,
    NOISE_MAX_RUNS,
    noise_threshold,
    spread_statistic,
)

#: Ratios of group B's spread to group A's that the thresholds hold at (math.inf: A has none).
SD_RATIOS = (0.0, 0.1, 0.3, 1.0, 3.0, 10.0, math.inf)
#: Group sizes of the table: every pair up to this many runs a side, then equal sizes.
TABLE_PAIRS = 8


def null_k(n_a: int, n_b: int, ratio: float, draws: int, rng: np.random.Generator) -> np.ndarray:
    """k of `draws` pairs of groups with no difference: window means ~ N(0, 1) in A and
    N(0, ratio^2) in B (ratio inf: A's are all 0 and B's N(0, 1))."""
    sd_a, sd_b = (0.0, 1.0) if math.isinf(ratio) else (1.0, ratio)
    a = rng.standard_normal((draws, n_a)) * sd_a
    b = rng.standard_normal((draws, n_b)) * sd_b
    return spread_statistic(a, b)[2]


def threshold(n_a: int, n_b: int, draws: int = 1_000_000, seed: int = 0) -> float:
    """The largest over SD_RATIOS (over r = 1 alone with one run on a side) of the
    1 - NOISE_ALARM_RATE quantile of k under no difference."""
    if n_a + n_b < 3:
        raise ValueError("one run a side has no spread to compare with")
    rng = np.random.default_rng(seed)
    ratios = SD_RATIOS if min(n_a, n_b) >= 2 else (1.0,)
    worst = 0.0
    for r in ratios:
        ks = np.concatenate(
            [null_k(n_a, n_b, r, c, rng) for c in _chunks(draws, 2_000_000 // (n_a + n_b))]
        )
        worst = max(worst, float(np.quantile(ks, 1 - NOISE_ALARM_RATE)))
    return worst


def _chunks(total: int, size: int) -> list[int]:
    size = max(1, size)
    return [min(size, total - i) for i in range(0, total, size)]


def table_pairs() -> list[tuple[int, int]]:
    pairs = [(a, b) for a in range(1, TABLE_PAIRS + 1) for b in range(a, TABLE_PAIRS + 1)]
    pairs = [p for p in pairs if p != (1, 1)]
    return pairs + [(n, n) for n in range(TABLE_PAIRS + 1, NOISE_MAX_RUNS + 1)]


# --------------------------------------------------------------------------------------
# Whole curves


@dataclass(frozen=True)
class NoiseModel:
    """Relative noise of one group's runs around the common level curve (fractions of it)."""

    name: str
    #: SD of a run's own slow offset, reached linearly over the first `diverge` steps.
    offset: float
    #: SD of the run's wander about its offset (AR(1) with step-to-step correlation phi).
    wander: float
    phi: float
    #: SD of the step-to-step noise every run shares (the same batch at the same step).
    batch: float = 0.02
    #: Chance that a run has a loss spike in the window, its height and decay (steps).
    spike_rate: float = 0.0
    spike: float = 0.03
    spike_steps: float = 10.0
    diverge: int = 50


#: torchtitan bf16 in issue 54: two runs' last-50 means 2.2% apart, 20-step means up to 2.6%.
TORCHTITAN_BF16 = NoiseModel("torchtitan bf16 (measured)", offset=0.018, wander=0.004, phi=0.9)
#: This recipe bf16 in issue 54: last-50 means 0.13% apart, 20-step means up to 1.3%.
OURS_BF16 = NoiseModel("this recipe bf16 (measured)", offset=0.0004, wander=0.005, phi=0.7)
#: Runs that spread by 0.3% over the window: what the peer curve's levers aim at.
LEVERS = NoiseModel("0.3% between runs (the levers' aim)", offset=0.0025, wander=0.003, phi=0.8)
#: This recipe's noise plus a loss spike (3%, decaying over 10 steps) in 30% of the runs.
SPIKY = NoiseModel(
    "this recipe bf16 + spikes in 30% of runs", offset=0.0004, wander=0.005, phi=0.7, spike_rate=0.3
)

#: (label, group A's model, group B's model) of the rates table.
SCENARIOS = (
    ("torchtitan against torchtitan", TORCHTITAN_BF16, TORCHTITAN_BF16),
    ("this recipe against this recipe", OURS_BF16, OURS_BF16),
    ("torchtitan against this recipe", TORCHTITAN_BF16, OURS_BF16),
    ("0.3% spread on both sides", LEVERS, LEVERS),
    ("this recipe with loss spikes", SPIKY, SPIKY),
)

STEPS = 300


def level(steps: int = STEPS) -> np.ndarray:
    """A falling loss curve, 11.8 at step 1, 3.4 at 60, 2.9 at 300 (the issue's runs)."""
    t = np.arange(1, steps + 1, dtype=np.float64)
    return 2.6 + 9.2 * t**-0.6


class CurveDraws:
    """`draws` independent repeats of a group of `n` runs under `model`, generated step by
    step (only running sums are kept, so memory does not grow with the steps)."""

    def __init__(self, model: NoiseModel, n: int, draws: int, rng: np.random.Generator):
        self.model, self.rng = model, rng
        self.shape = (draws, n)
        self.offset = rng.standard_normal(self.shape) * model.offset
        self.wander = rng.standard_normal(self.shape) * model.wander
        spiking = rng.random(self.shape) < model.spike_rate
        self.spike_at = np.where(spiking, rng.integers(STEPS // 2, STEPS, self.shape), STEPS + 1)

    def step(self, t: int, shared: np.ndarray) -> np.ndarray:
        """Relative deviation of every run at step t (1-based); `shared` (draws,) is the batch
        noise every run of every group has at this step."""
        m = self.model
        if t > 1:
            innovation = self.rng.standard_normal(self.shape) * m.wander
            self.wander = m.phi * self.wander + math.sqrt(1 - m.phi**2) * innovation
        ramp = min(1.0, t / m.diverge)
        since = t - self.spike_at
        spike = np.where(since >= 0, m.spike * np.exp(-np.maximum(since, 0) / m.spike_steps), 0.0)
        return self.offset * ramp + self.wander + spike + shared[:, None]


def simulate(
    model_a: NoiseModel,
    model_b: NoiseModel,
    n_a: int,
    n_b: int,
    *,
    draws: int,
    offset: float = 0.0,
    seed: int = 0,
    steps: int = STEPS,
) -> dict[str, np.ndarray]:
    """Window means of both groups (draws, n) over the second half of `steps` (compare_groups'
    default window), group B's curves x (1 + offset); and, for the per-step test, the mean and
    variance over the window of the difference of the group means at each step."""
    rng = np.random.default_rng(seed)
    curve = level(steps)
    first = steps // 2 + 1  # steps[len // 2:] of 1..steps
    a, b = CurveDraws(model_a, n_a, draws, rng), CurveDraws(model_b, n_b, draws, rng)
    sum_a, sum_b = np.zeros((draws, n_a)), np.zeros((draws, n_b))
    diff_sum, diff_squares = np.zeros(draws), np.zeros(draws)
    for t in range(1, steps + 1):
        shared = rng.standard_normal(draws) * max(model_a.batch, model_b.batch)
        loss_a = curve[t - 1] * (1 + a.step(t, shared))
        loss_b = curve[t - 1] * (1 + b.step(t, shared)) * (1 + offset)
        if t >= first:
            sum_a += loss_a
            sum_b += loss_b
            diff = loss_b.mean(1) - loss_a.mean(1)
            diff_sum += diff
            diff_squares += diff**2
    width = steps - first + 1
    diff_mean = diff_sum / width
    diff_var = (diff_squares - width * diff_mean**2) / (width - 1)
    return {
        "a": sum_a / width,
        "b": sum_b / width,
        "diff_mean": diff_mean,
        "diff_var": diff_var,
        "width": np.full(draws, width),
    }


def differs(sim: dict[str, np.ndarray]) -> np.ndarray:
    """compare_groups' rule on each draw: k above the threshold for the groups' sizes."""
    k = spread_statistic(sim["a"], sim["b"])[2]
    return k > noise_threshold(sim["a"].shape[1], sim["b"].shape[1])


def differs_per_step(sim: dict[str, np.ndarray]) -> np.ndarray:
    """The rule this file argues against: a t statistic over the window's steps, each step's
    difference of group means taken as an independent sample (two-sided, 5%)."""
    t = sim["diff_mean"] / np.sqrt(sim["diff_var"] / sim["width"])
    return np.abs(t) > 1.97  # Student t, 149 degrees of freedom, 97.5%


def two_run_figures(model: NoiseModel, draws: int, seed: int = 0) -> tuple[float, float]:
    """Medians over draws of what issue 54 measured between two runs: the relative difference
    of their means over the last 50 steps, and the largest of their 20-step trailing means'."""
    rng = np.random.default_rng(seed)
    curve = level()
    runs = CurveDraws(model, 2, draws, rng)
    values = np.empty((STEPS, draws, 2))
    for t in range(1, STEPS + 1):
        values[t - 1] = curve[t - 1] * (1 + runs.step(t, rng.standard_normal(draws) * model.batch))
    tail = values[-50:].mean(0)
    last50 = np.abs(tail[:, 1] - tail[:, 0]) / tail[:, 0]
    c = np.cumsum(values, axis=0)
    trailing = np.concatenate([c[19:20], c[20:] - c[:-20]]) / 20  # steps 20..300
    worst = (np.abs(trailing[..., 1] - trailing[..., 0]) / trailing[..., 0]).max(0)
    return float(np.median(last50)), float(np.median(worst))


def rates_table(draws: int, runs: Sequence[int], seed: int = 0) -> list[str]:
    lines = [
        f"{draws:,} draws per cell; window steps {STEPS // 2 + 1}-{STEPS}; thresholds for "
        f"{NOISE_ALARM_RATE:.0%} false alarms at the worst ratio of spreads",
        "",
        "| model | two runs: last-50 means apart, largest 20-step difference (medians) |",
        "| --- | --- |",
    ]
    for model in (TORCHTITAN_BF16, OURS_BF16, LEVERS, SPIKY):
        last50, worst20 = two_run_figures(model, min(draws, 4000), seed)
        lines.append(f"| {model.name} | {last50:.2%}, {worst20:.2%} |")
    lines += [
        "",
        "| groups (A against B) | runs a side | false alarms | detections of +1% | "
        "per-step test: false alarms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, model_a, model_b in SCENARIOS:
        for n in runs:
            null = simulate(model_a, model_b, n, n, draws=draws, seed=seed)
            planted = simulate(model_a, model_b, n, n, draws=draws, offset=0.01, seed=seed + 1)
            lines.append(
                f"| {label} | {n} | {differs(null).mean():.2%} | {differs(planted).mean():.1%} "
                f"| {differs_per_step(null).mean():.1%} |"
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("thresholds", help="print NOISE_THRESHOLDS (runlog.py)")
    t.add_argument("--draws", type=int, default=1_000_000, help="draws per ratio of spreads")
    r = sub.add_parser("rates", help="false alarms and detections on simulated curves")
    r.add_argument("--draws", type=int, default=20_000, help="draws per cell")
    r.add_argument("--runs", type=int, nargs="+", default=[2, 3, 4], help="runs a side")
    args = parser.parse_args(argv)
    if args.command == "thresholds":
        print("NOISE_THRESHOLDS: dict[tuple[int, int], float] = {")
        for i, (n_a, n_b) in enumerate(table_pairs()):
            value = threshold(n_a, n_b, args.draws, seed=i)
            print(f"    ({n_a}, {n_b}): {value:.4g},", flush=True)
        print("}")
    else:
        print("\n".join(rates_table(args.draws, args.runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
