"""Is a resumed segment healthy? Damage that passes every check of a load (a weight changed
and its hash rewritten, or any damage under checkpoint.checksum=false) shows first as a loss
that jumps at the resume. Until the resumed segment's first logged losses are within the
range the run logged before the resume, the checkpoints from before it are not pruned
(CheckpointManager holds them), so a bad resume costs the steps since the previous
checkpoint, never the run.

The range: the last `WINDOW` losses the run logged up to the resumed step (metrics.jsonl).
The limit is their maximum plus their spread (max - min), at least `MIN_MARGIN` of the
maximum. Why: the spread of 20 logged losses is the run's own step-to-step noise plus its
recent downward trend; a healthy continuation stays below the window's maximum except for
noise, and exceeding the maximum by one more whole spread is far outside that noise (for
Gaussian noise, the range of 20 samples is about 3.7 standard deviations, so the limit sits
about 5.6 of them above the mean). Damage that matters moves the loss by much more: the
issue's case went from ~3.6 to ~5.6 against a late-run spread of a few tenths. The floor
keeps a flat, nearly noiseless window from flagging ordinary noise. The verdict takes the
first `FIRST` logged losses of the segment and flags it only when all of them are above the
limit, so one spiky batch does not stop a run; only the upper side is judged (a lower loss
is progress, not damage).
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Losses logged before the resume that make the range.
WINDOW = 20
#: Fewer logged losses than this before the resume: no range to judge against.
MIN_HISTORY = 3
#: Logged losses of the resumed segment that decide.
FIRST = 3
#: The margin above the window's maximum is at least this fraction of it.
MIN_MARGIN = 0.02

#: resume.loss_check values.
POLICIES = ("stop", "continue", "off")


@dataclass
class LossRange:
    """The range the run logged before the resume, and the limit a resumed loss must keep."""

    low: float
    high: float
    count: int

    @property
    def limit(self) -> float:
        return self.high + max(self.high - self.low, MIN_MARGIN * abs(self.high))

    @classmethod
    def from_records(cls, records: list[dict], resumed_step: int) -> LossRange | None:
        """From metrics.jsonl's records (runlog.read_metrics): the last WINDOW finite losses
        logged at or before `resumed_step`; None with fewer than MIN_HISTORY."""
        losses = [
            float(r["loss"])
            for r in records
            if isinstance(r.get("step"), int)
            and r["step"] <= resumed_step
            and isinstance(r.get("loss"), (int, float))
            and abs(float(r["loss"])) != float("inf")
            and r["loss"] == r["loss"]
        ][-WINDOW:]
        if len(losses) < MIN_HISTORY:
            return None
        return cls(min(losses), max(losses), len(losses))


@dataclass
class ResumeWatch:
    """The first FIRST logged losses of a resumed segment against `range`. `observe`
    returns None while undecided, then once "healthy" or "unhealthy"."""

    range: LossRange
    seen: list[tuple[int, float]] = field(default_factory=list)
    verdict: str | None = None

    def observe(self, step: int, loss: float) -> str | None:
        if self.verdict is not None:
            return None
        self.seen.append((step, loss))
        if len(self.seen) < FIRST:
            return None
        # nan compares False: a non-finite loss is left to the loss guard's own line
        above = all(value > self.range.limit for _, value in self.seen)
        self.verdict = "unhealthy" if above else "healthy"
        return self.verdict

    def describe(self) -> str:
        losses = ", ".join(f"{v:.3f}" for _, v in self.seen)
        steps = f"{self.seen[0][0]}-{self.seen[-1][0]}"
        r = self.range
        return (
            f"losses {losses} at steps {steps}, against at most {r.limit:.3f} (the last "
            f"{r.count} losses logged before the resume: {r.low:.3f}-{r.high:.3f})"
        )
