"""Is the run diverging? Two signs stop it in one line, before a checkpoint of a diverged
step is written (train.divergence_ratio; 0: off):

- a loss far above the run's recent level: more than `ratio` times the level and more than
  MIN_RISE nats above it. The level is the lowest median of RECENT consecutive logged losses
  this segment has logged so far (before its first logged loss: its first step's loss). A
  median ignores a spiky batch, and the lowest one does not rise with a run that climbs
  slowly away from where it was.
- a dead model: the gradient norm exactly 0 on DEAD_STEPS consecutive steps while the loss
  stays flat (within FLAT of itself): nothing trains any more (the weights saturated after a
  blow-up; issue 55's lr=1e3 run logged 5.5530 with a gradient norm of 0.000 from step 4 on).

What is read, and when (no host sync of its own): every step's loss and gradient norm stay on
the device, where CheckpointManager keeps the largest loss since the last check, its step,
the first step's loss and the run of zero-gradient steps (a few scalar operations a step,
checkpoint/manager.py). They are read with the non-finite flag it already reads at each log
step and before every save, one host sync and one small all-reduce over the ranks for all of
them (the largest loss of any rank: each rank's own micro-batch mean). So the stop comes at
the first log step or save after the divergence, and every save was checked first.

Why these numbers (CPU, 2 shared cores of an Intel Xeon, `python tools/divergence_study.py`,
which judges each run as if checked every step and every 10th): over the resume guard study's
12 clean runs (model=tiny and model=small), lr 1e-2, 3e-2 and 0.1, and the default run's 300
steps, the largest loss came at most 1.53 times the level (model=small's warmup spike at step
6; the default run 1.28); lr 0.3 spiked to 1.52 times (6.31 at step 6) and trained back to the
others' loss. The GPU scale test's spike (model=small, lr 3e-3: 5.9 -> 8.1 at step 3) is 1.37.
The default ratio 3 is twice the largest of those. lr 1 (10.1 at step 4 from 3.7, then 8-13
for 45 steps, back to 3.5 only as the cosine ended) came 2.6 times above: not stopped by the
default, stopped by train.divergence_ratio=2. The runs that diverged were stopped at their
first check after the blow-up: lr 3 at step 4 (4.5 times; 9.7 times at step 10 checked every
10th); lr 10, 100 and 1e3 (8 steps of 8 x 64 tokens) at steps 3, 2 and 2 (13, 79 and 7,520
times), or at step 8 checked every 10th (35, 3,180 and 37,200 times). A gradient norm of
exactly 0 never occurred in a clean run (the smallest: 0.126).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

#: Logged losses of which a median is a level.
RECENT = 8
#: A loss this many nats above the level at least (a ratio says little near a loss of 0).
MIN_RISE = 1.0
#: Consecutive steps of a zero gradient norm (and a flat loss) that make a dead model.
DEAD_STEPS = 3
#: A loss within this fraction of the one where its zero-gradient steps began is flat.
FLAT = 1e-3


@dataclass(frozen=True)
class StepStats:
    """What the device kept since the last check (CheckpointManager), over every rank."""

    #: The largest loss since the last check, and its step (None: no step since).
    peak: float | None
    peak_step: int | None
    #: The loss of the segment's first step.
    first: float
    #: Consecutive steps up to now whose gradient norm was exactly 0 with a flat loss, the
    #: step where they began and the loss there.
    dead_steps: int
    dead_from: int
    dead_loss: float


@dataclass
class Divergence:
    """The rule over a segment's logged losses. `logged` after each log step's check,
    `judge` at each check: None, or the line the run stops with."""

    ratio: float
    #: The lr the run trains at (optim.lr), for the line's hint.
    lr: float
    #: The last RECENT logged losses.
    history: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    level: float | None = None

    def logged(self, loss: float) -> None:
        """A logged (rank-averaged) loss: the level is the lowest median so far."""
        if not math.isfinite(loss):
            return
        self.history.append(loss)
        median = statistics.median(self.history)
        self.level = median if self.level is None else min(self.level, median)

    def reference(self, stats: StepStats) -> float:
        return self.level if self.level is not None else stats.first

    def judge(self, step: int, stats: StepStats) -> str | None:
        """The stop line when `stats` show a divergence (None: they do not, or off)."""
        if self.ratio <= 0:
            return None
        ref = self.reference(stats)
        if stats.peak is not None and stats.peak > self.ratio * ref and stats.peak > ref + MIN_RISE:
            what = "the level of its first step" if self.level is None else "its recent level"
            return (
                f"the run diverged: the loss reached {stats.peak:.4g} at step {stats.peak_step}, "
                f"{stats.peak / ref:.3g} times {what} {ref:.4g} (a stop above "
                f"train.divergence_ratio={self.ratio:g} times it)"
            )
        if stats.dead_steps >= DEAD_STEPS:
            end = stats.dead_from + stats.dead_steps - 1
            return (
                f"the model stopped learning: its gradient norm was exactly 0 at steps "
                f"{stats.dead_from}-{end} with the loss flat at {stats.dead_loss:.4f} (a dead "
                "model: its weights saturated, usually after a blow-up)"
            )
        return None

    def hint(self, saved: bool) -> str:
        """The way out, for the stop line (`saved`: a checkpoint to resume from is there)."""
        again = "resume from that checkpoint with resume.accept=[optim]" if saved else "start again"
        return (
            f"the learning rate is the likely cause: lower optim.lr (now {self.lr:g}) or "
            f"lengthen optim.warmup_steps, and {again}; train.divergence_ratio=0 turns this "
            "check off"
        )
