"""Is a resumed segment healthy? Damage that passes every check of a load (a weight changed
and its hash rewritten, or any damage under checkpoint.checksum=false) shows first as a loss
that jumps at the resume. Until the resumed segment's first logged losses are in line with
what the run logged just before its checkpoint, the checkpoints from the resumed step on are
unconfirmed, on disk (checkpoint/store.py: unconfirmed.json), and pruning keeps the newest
confirmed one, so a bad resume costs the steps since that checkpoint, never the run. A
segment that ends before its verdict (train.steps reached, a stop signal) leaves its
checkpoints unconfirmed, and the next resume goes on judging the same resume: the losses
logged after it are judged, never taken as history (checkpoint/resume.py).

What a resumed loss is judged against (`Recent`): the losses logged up to the resumed step
(metrics.jsonl; at least `MIN_HISTORY`). A least-squares line through the last `RECENT` gives
the loss's level at the checkpoint and its trend; the step-to-step noise is measured on the
last `NOISE_RECENT`, robustly (`step_noise`: 1.4826 x the median absolute deviation of the
differences of consecutive losses, over sqrt 2: a difference holds two losses' noise, and the
median removes the trend; one spiky batch moves neither). The limit is the level, plus the
trend over the judged losses when it rises (a falling trend is not counted on), plus a margin
of `NOISE_UNITS` noises, at least `MIN_MARGIN` of the level. The verdict takes the first
`FIRST` logged losses of the segment and flags it when `ABOVE` of them are above the limit,
so one spiky batch does not stop a run; only the upper side is judged (a lower loss is
progress, not damage).

Why these numbers (`python tools/resume_guard_study.py DIR`, CPU, issue 55): 498 clean
resumes, one at every logged step of 12 uninterrupted CPU runs (model=tiny and model=small,
document masking on and off, batches of 128 to 1024 tokens, peak lr 1e-3 to 1e-2, warmup 2 to
30 steps, log_every 1 and 5, embedded and synthetic data, resumes from step 3 to the end of
the cosine schedule and 20 steps past it at the final lr), which a resume reproduces bit for
bit, as 4 real resumes there confirm, and a real resume of a finished run extended past its
schedule (the lr rising again): none stopped. The statistic is the second largest of a
resume's first 3 losses minus the level (+ rising trend), in noises: median -0.7, 99th
percentile 2.2, largest 3.1; the 5-noise margin is 1.6 times that. The largest loss alone
reached 10 noises: hence 2 of the 3, not one. Damage, with hashes rewritten, resumed from
steps 8, 12 and 16 of a 20-step run: every weight halved caught 3 of 3 (10.5-30 noises), the
weights of step 4 in their place 3 of 3 (8.5-14), the output head halved 3 of 3 (5.4-14); noise
of 10% of each tensor's spread and each tensor scaled by 0.9-1.1 were missed 6 of 6 (0.2-1.9
noises; in issue 55's run such a resume logged within 0.01 of the clean run's losses, or below
them: nothing to catch). A model reset
to chance (the run's untrained losses in place of the resumed ones) is caught in 429 of the
442 clean resumes of runs that had learned 15% of their loss; missed where one step's noise
is as large as the jump (model=small on 128-token batches). The rule this replaces (all 3
above a limit whose noise was the standard deviation of the last 8: one spike doubled it) also
stopped none of the clean resumes, but passed the halved output head and the step-4 weights
resumed from step 16 (and, in issue 55's run, both resumed from step 12). The floor is for a
noise estimate small by chance (3 losses give 2 differences) or a flat, nearly noiseless run.
Fewer than 3 losses logged before the resume: nothing to judge against.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

#: Logged losses before the resume that make the level and trend.
RECENT = 8
#: Logged losses before the resume that the step-to-step noise is measured on.
NOISE_RECENT = 16
#: Fewer logged losses than this before the resume: nothing to judge against.
MIN_HISTORY = 3
#: Logged losses of the resumed segment that decide.
FIRST = 3
#: How many of them above the limit make the segment unhealthy.
ABOVE = 2
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


def step_noise(values: list[float]) -> float:
    """The step-to-step noise of consecutive logged losses: the spread of their differences
    (a difference holds two losses' noise: over sqrt 2), measured robustly, as 1.4826 times
    the median absolute deviation of the differences from their median (the median removes
    the trend; one spiky batch, which makes two large differences, moves neither)."""
    diffs = [b - a for a, b in zip(values, values[1:])]
    mid = statistics.median(diffs)
    return 1.4826 * statistics.median(abs(d - mid) for d in diffs) / math.sqrt(2)


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
    #: How many logged losses the noise was measured on (the last ones up to last_step).
    noise_count: int = 0

    @classmethod
    def from_losses(cls, points: list[tuple[int, float]]) -> Recent | None:
        """From (step, loss) in step order: the last RECENT; None with fewer than
        MIN_HISTORY."""
        noisy = points[-NOISE_RECENT:]
        points = points[-RECENT:]
        n = len(points)
        if n < MIN_HISTORY:
            return None
        xs = [float(s) for s, _ in points]
        ys = [v for _, v in points]
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        return cls(
            first_step=points[0][0],
            last_step=points[-1][0],
            count=n,
            level=my + slope * (xs[-1] - mx),
            slope=slope,
            noise=step_noise([v for _, v in noisy]),
            spacing=(xs[-1] - xs[0]) / (n - 1),
            noise_count=len(noisy),
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
        noise = f"the step-to-step noise of the last {self.noise_count}"
        if NOISE_UNITS * self.noise >= MIN_MARGIN * abs(self.level):
            margin = f"{NOISE_UNITS:g} x {noise}, {self.noise:.3f}"
        else:
            margin = f"{MIN_MARGIN:.0%} of it ({noise}: {self.noise:.3f})"
        return (
            f"the level {self.level:.3f} that the last {self.count} losses logged before the "
            f"resume (steps {self.first_step}-{self.last_step}) lead to{rise}, + {margin}"
        )


@dataclass
class ResumeWatch:
    """The first FIRST logged losses of a resumed segment against `recent`'s limit. `seen`
    may start with losses logged after the resumed step by an earlier segment (one that
    stopped before its verdict: checkpoint/resume.py). `observe` returns None while
    undecided, then once "healthy" or "unhealthy"."""

    recent: Recent
    seen: list[tuple[int, float]] = field(default_factory=list)
    verdict: str | None = None
    #: Logged losses a verdict takes.
    needed: int = FIRST

    def observe(self, step: int, loss: float) -> str | None:
        if self.verdict is not None:
            return None
        self.seen.append((step, loss))
        return self.decide()

    def decide(self) -> str | None:
        """The verdict once `needed` losses are seen (None before, and after it was given)."""
        if self.verdict is not None or len(self.seen) < self.needed:
            return None
        del self.seen[self.needed :]
        # nan compares False: a non-finite loss is left to the loss guard's own line
        above = sum(value > self.recent.limit for _, value in self.seen)
        self.verdict = "unhealthy" if above >= ABOVE else "healthy"
        return self.verdict

    def describe(self) -> str:
        losses = ", ".join(f"{v:.3f}" for _, v in self.seen)
        steps = f"{self.seen[0][0]}-{self.seen[-1][0]}"
        above = sum(v > self.recent.limit for _, v in self.seen)
        return (
            f"losses {losses} at steps {steps} ({above} of {len(self.seen)} above), against at "
            f"most {self.recent.limit:.3f} ({self.recent.describe()})"
        )
