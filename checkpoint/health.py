"""Is a resumed segment healthy? Damage that passes every check of a load (a weight changed
and its hash rewritten, or any damage under checkpoint.checksum=false) shows first as a loss
that jumps at the resume. Until the resumed segment's first logged losses are in line with
what the run logged just before its checkpoint, the checkpoints from before it are not pruned
(CheckpointManager holds them), so a bad resume costs the steps since the previous
checkpoint, never the run.

What a resumed loss is judged against (`Recent`): the last `RECENT` finite losses logged up
to the resumed step (metrics.jsonl; at least `MIN_HISTORY`). A least-squares line through
them gives the loss's level at the checkpoint and its trend; the step-to-step noise is
measured from the differences of consecutive logged losses (their standard deviation over
sqrt 2: a difference holds two losses' noise, and its mean is the trend, which is removed).
The limit is the level, plus the trend over the judged losses when it rises (a falling trend
is not counted on), plus a margin of `NOISE_UNITS` noises, at least `MIN_MARGIN` of the
level. The verdict takes the first `FIRST` logged losses of the segment and flags it only
when all of them are above the limit, so one spiky batch does not stop a run; only the upper
side is judged (a lower loss is progress, not damage).

Why these numbers (tools/resume_guard_study.py: 443 clean resumes, one at every logged step
of 11 uninterrupted CPU runs, which a resume reproduces bit for bit, as 4 real resumes there
confirm; model=tiny and model=small, document masking on and off, batches of 128 to 1024
tokens, peak lr 1e-3 to 1e-2, warmup 2 to 30 steps, log_every 1 and 5, embedded and synthetic
data, resumes from step 3 to the end of the cosine schedule; the reference CPU model runs
recipe=bf16 only). The statistic is the smallest of a resume's first 3 losses minus the level
(+ rising trend), in noises: median -1.4, 99th percentile 1.6, largest 2.6 (at the end of the
schedule, where the loss levels off below the line's extrapolation); the 5-noise margin is
about twice that. The first loss alone reached 5.3 noises: hence all 3 must exceed, not one.
The noise itself ranged from 0.14% of the level (synthetic data: nothing to learn) to 61%
(model=small on 128-token batches). The floor is for a noise estimate small by chance
(3 losses give 2 differences) or a flat, nearly noiseless run: no clean resume with fewer
than 8 losses before it came above its level by more than 1.8% of it. Damage that matters moves the loss by much more: a model
reset to chance (the run's own untrained losses put in place of the resumed ones) is caught
in 351 of the 390 clean resumes of runs that had learned 15% of their loss (median 11
noises above the level; issue 46's case: 5.53 against a level of 3.99 at step 12, 16 noises);
it is missed only where the run is as noisy as the jump (model=small or a 128-token batch:
a noise of 0.5 or more) or has learned little (the tiny run's step 4). Fewer than 3 losses
logged before the resume: nothing to judge against.

The range of all losses logged since the start (the rule this replaces) held step 1's
untrained loss for the first 20 logged steps, so it passed a model reset to chance there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: Logged losses before the resume that make the level, trend and noise.
RECENT = 8
#: Fewer logged losses than this before the resume: nothing to judge against.
MIN_HISTORY = 3
#: Logged losses of the resumed segment that decide.
FIRST = 3
#: The margin above the level, in step-to-step noises.
NOISE_UNITS = 5.0
#: The margin is at least this fraction of the level.
MIN_MARGIN = 0.05

#: resume.loss_check values.
POLICIES = ("stop", "continue", "off")


def logged_losses(records: list[dict], last_step: int) -> list[tuple[int, float]]:
    """(step, loss) of metrics.jsonl's records (runlog.read_metrics) up to `last_step`, in
    step order, finite losses only; a later record of a step replaces an earlier one (the
    records of a segment that was resumed from an older checkpoint are superseded)."""
    by_step: dict[int, float] = {}
    for r in records:
        step, loss = r.get("step"), r.get("loss")
        if isinstance(step, int) and step <= last_step and isinstance(loss, (int, float)):
            if math.isfinite(loss):
                by_step[step] = float(loss)
            else:
                by_step.pop(step, None)
    return sorted(by_step.items())


@dataclass(frozen=True)
class Recent:
    """What the run logged just before the resume: the last `count` losses (steps
    `first_step`-`last_step`), their fitted level at `last_step`, trend per step, and
    step-to-step noise; and the limit a resumed loss must keep."""

    first_step: int
    last_step: int
    count: int
    level: float
    slope: float
    noise: float
    spacing: float

    @classmethod
    def from_losses(cls, points: list[tuple[int, float]]) -> Recent | None:
        """From (step, loss) in step order: the last RECENT; None with fewer than
        MIN_HISTORY."""
        points = points[-RECENT:]
        n = len(points)
        if n < MIN_HISTORY:
            return None
        xs = [float(s) for s, _ in points]
        ys = [v for _, v in points]
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        diffs = [b - a for a, b in zip(ys, ys[1:])]
        md = sum(diffs) / len(diffs)
        noise = math.sqrt(sum((d - md) ** 2 for d in diffs) / (len(diffs) - 1) / 2)
        return cls(
            first_step=points[0][0],
            last_step=points[-1][0],
            count=n,
            level=my + slope * (xs[-1] - mx),
            slope=slope,
            noise=noise,
            spacing=(xs[-1] - xs[0]) / (n - 1),
        )

    @classmethod
    def from_records(cls, records: list[dict], resumed_step: int) -> Recent | None:
        """From metrics.jsonl's records: the losses logged at or before `resumed_step`."""
        return cls.from_losses(logged_losses(records, resumed_step))

    @property
    def rise(self) -> float:
        """A rising trend carried over the judged losses (a falling one is not counted on)."""
        return max(self.slope, 0.0) * self.spacing * FIRST

    @property
    def margin(self) -> float:
        return max(NOISE_UNITS * self.noise, MIN_MARGIN * abs(self.level))

    @property
    def limit(self) -> float:
        return self.level + self.rise + self.margin

    def describe(self) -> str:
        rise = f" + a rising trend {self.rise:.3f}" if self.rise > 0 else ""
        if NOISE_UNITS * self.noise >= MIN_MARGIN * abs(self.level):
            margin = f"{NOISE_UNITS:g} x their step-to-step noise {self.noise:.3f}"
        else:
            margin = f"{MIN_MARGIN:.0%} of it (their step-to-step noise: {self.noise:.3f})"
        return (
            f"the level {self.level:.3f} that the last {self.count} losses logged before the "
            f"resume (steps {self.first_step}-{self.last_step}) lead to{rise}, + {margin}"
        )


@dataclass
class ResumeWatch:
    """The first FIRST logged losses of a resumed segment against `recent`'s limit.
    `observe` returns None while undecided, then once "healthy" or "unhealthy"."""

    recent: Recent
    seen: list[tuple[int, float]] = field(default_factory=list)
    verdict: str | None = None

    def observe(self, step: int, loss: float) -> str | None:
        if self.verdict is not None:
            return None
        self.seen.append((step, loss))
        if len(self.seen) < FIRST:
            return None
        # nan compares False: a non-finite loss is left to the loss guard's own line
        above = all(value > self.recent.limit for _, value in self.seen)
        self.verdict = "unhealthy" if above else "healthy"
        return self.verdict

    def describe(self) -> str:
        losses = ", ".join(f"{v:.3f}" for _, v in self.seen)
        steps = f"{self.seen[0][0]}-{self.seen[-1][0]}"
        return (
            f"losses {losses} at steps {steps}, against at most {self.recent.limit:.3f} "
            f"({self.recent.describe()})"
        )
