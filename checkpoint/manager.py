"""CheckpointManager: when, how and where to save; what to resume from.

    ckpt = CheckpointManager(cfg.checkpoint, run_dir, rank=rank, world_size=world_size)
    start_step = ckpt.resume(state)       # 0 when starting fresh
    for step in ...:
        ...
        ckpt.observe_loss(step, loss, grad_norm)   # on device, no sync
        ckpt.maybe_save(step, state)      # every checkpoint.interval steps
    ckpt.finish(step, state)              # final save, wait for async writes, close

Modes (checkpoint/writer.py writes the files in every mode: `write_threads` files per rank in
parallel, each hashed while written):
- `sync`: the loop waits for the whole save, written the async way: the state is copied into
  one CPU staging buffer (below) and written from it by the writer threads, then committed;
  the save is complete and durable when the call returns. (Without room in host memory for
  the copy, the writer threads copy each device tensor themselves: slower.)
- `async`: the loop waits only while the state is copied into a CPU staging buffer
  (checkpoint/staging.py: allocated once, pinned with CUDA, in /dev/shm when it has room;
  planned and allocated in the background at the first step, so the first save finds it
  ready); a thread of this process runs the DCP save from the copy, with the GIL switch
  interval shortened meanwhile.
- `async_process`: the same copy, into shared memory, written by a writer process of this
  rank (checkpoint/writer_process.py) started with the manager; works in a world of one.
DCP's collectives run on a gloo group of the manager's own (`_pg`), so a background write
never interleaves with the training loop's collectives; the loop's own agreements (is a
staging buffer free, was every loss finite, where the staging buffers go) use a second gloo
group (`_ctl`).

A busy writer (checkpoint.when_busy): with `staging_buffers=2` a save that comes due while the
previous one is written is staged into the other buffer and written next. When no buffer is
free (all ranks agree on that over `_ctl`), `defer` (default) takes the save at the first
step a buffer is free, `skip` drops it, `wait` blocks the loop. Saves forced by a stop signal
and the final save always wait. Each case is logged.

Losses: `observe_loss` keeps, on the device, the first step whose loss was not finite; the
flag is synced (a scalar all-reduce) before every save and at `check_finite` (log steps).
A non-finite loss stops the run with a NonFiniteLossError after the saves in flight (all of
earlier, finite steps) are committed: no checkpoint of that step or later is ever written, so
nothing good is pruned by it.

Commit (checkpoint/store.py): every save goes to `step_XXXXXXX.tmp/`; rank 0 writes the
manifest (each file's size and hash, from the writers) and renames the directory once the
save is complete on every rank. DCP's save ends with a gather of every rank's write results
to rank 0 before rank 0 writes `.metadata`, so rank 0's save returning means every rank
finished writing: rank 0 commits alone, on its writer thread for async modes. `finish` waits
for the last save and then holds every rank at a barrier, so a finished run always has its
last checkpoint committed. A failed save commits nothing and prunes nothing; a full disk is
reported as such, with the space the checkpoint needs.

Resume (`checkpoint.resume`): `auto` takes the newest step directory of this run's checkpoint
directory (none: start at step 0; a step directory renamed by hand, `step_0000040.bak`, is
announced in one line and not read); `none` starts fresh; anything else is a path.
`plan_resume` makes every decision before the model is built (train.py); `resume` then loads.
Rank 0 checks that the step entry is a readable directory (not a file or a symlink loop), the
manifest (present, every file there with its size, each data file's trailer naming this save),
`.metadata` (readable, same save id), config.yaml (a config whose model shape matches this
run; in auto mode with a checkpoint directory outside the run directory, this run's run.name),
the corpus the checkpoint was trained on (`corpus`) and the config comparison (`check`); then
every rank checks that each tensor it will load exists with the same global shape, the load
reads each byte once and verifies the data files' hashes as it reads them
(checkpoint/reader.py, checkpoint.checksum: one rank hashes each file front to back), and
after the load every rank checks that its weights are finite. Each failure is a one-line
ConfigError on every rank naming the checkpoint and the problem, raised before any
Stateful's load_state_dict and before the run trains or saves (a damaged file may have put
some of its values into the model by then; the run stops). A damaged checkpoint is never
used and never skipped, in auto mode too: the error names the previous complete checkpoint
to pass as
`checkpoint.resume=<path>` (or the damaged directory can be moved away). Resuming from an
older step, or with resume=none, renames the newer step directories of this directory to
`*.abandoned-<time>` (kept, ignored) so the new timeline's saves and pruning never mix with
them.

Layout: this module is the facade train.py, tools/ and the tests call; the work is done by
checkpoint/resume.py (`Resumer`: find, plan, decide, load, verify, the resumed-loss watch) and
checkpoint/save.py (`Saver`: when, stage, write, close; `InFlight`: the async saves in flight,
settled in order; `Committer`: commit, prune, a failed save's error; `SaveRecords`: the
numbers of every save), which share one checkpoint/context.py `Context` (settings, log, the
two gloo groups and their collectives). The facade wires what crosses the two sides: the step
a resume leaves as saved, the pruning that follows the loss watch's verdict, and the loss
guard (checked before every save).
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from checkpoint import store
from checkpoint.config import CheckpointConfig, validate
from checkpoint.context import SAVES_LOG, Context, checkpoint_root, default_log, first_line
from checkpoint.resume import (
    COMPLETE_PARTS,
    SHAPE_FIELDS,
    Resumer,
    model_shape_mismatches,
    request_problems,
    resumes,
)
from checkpoint.save import Saver
from divergence import FLAT, Divergence, StepStats
from errors import ConfigError, DivergenceError, NonFiniteLossError

# Single-process runs save and load without a process group on purpose.
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable")

__all__ = [
    "COMPLETE_PARTS",
    "SAVES_LOG",
    "SHAPE_FIELDS",
    "CheckpointManager",
    "checkpoint_root",
    "close_open",
    "model_shape_mismatches",
    "request_problems",
    "resumes",
]

_NO_BAD_STEP = 2**62

#: Managers not closed yet: `close_open` closes them when a run ends by an exception.
_OPEN: weakref.WeakSet = weakref.WeakSet()


def close_open() -> None:
    """Close every manager of this process that is still open (waiting for its saves in
    flight, stopping its writers, releasing its run lock): for a run that ended by an
    exception, Ctrl-C included, so nothing is left for interpreter exit to wait on."""
    for manager in list(_OPEN):
        try:
            manager.close()
        except Exception as e:  # the run already fails with its own error
            manager._log(f"while closing after the failure: {first_line(e)}")


class _LossGuard:
    """What each step's loss and gradient norm show, kept on the loss's device (no host
    sync): the first step whose loss was not finite, the largest loss since the last read and
    its step, the first step's loss, and the run of steps with a gradient norm of exactly 0
    and a flat loss (divergence.py). `read` takes them to the host: one sync and, with a
    group, one small all-gather."""

    #: The order of the numbers kept (one float64 each).
    FIELDS = ("first_bad", "peak", "peak_step", "first", "dead_steps", "dead_from", "dead_loss")

    def __init__(self):
        self.first_bad: torch.Tensor | None = None

    def observe(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        loss = loss.detach().double()
        if self.first_bad is None:
            full = lambda v: torch.full((), v, dtype=torch.float64, device=loss.device)  # noqa: E731
            self.first_bad, self.peak, self.peak_step = full(_NO_BAD_STEP), full(-math.inf), full(0)
            self.first = loss.clone()
            self.dead_steps, self.dead_from, self.dead_loss = full(0), full(0), full(0)
        bad = ~torch.isfinite(loss)
        self.first_bad = torch.where(bad, self.first_bad.clamp(max=step), self.first_bad)
        higher = loss > self.peak  # False for nan
        self.peak = torch.where(higher, loss, self.peak)
        self.peak_step = torch.where(higher, step, self.peak_step)
        if grad_norm is not None:
            zero = grad_norm.detach() == 0
            flat = (loss - self.dead_loss).abs() <= FLAT * self.dead_loss.abs()
            going_on = zero & (self.dead_steps > 0) & flat
            begins = zero & ~going_on
            self.dead_steps = torch.where(going_on, self.dead_steps + 1, begins.double())
            self.dead_from = torch.where(begins, step, self.dead_from)
            self.dead_loss = torch.where(begins, loss, self.dead_loss)

    def read(self, group) -> tuple[int | None, StepStats]:
        """The numbers over every rank (a host sync, and with a group an all-gather of 7
        numbers a rank): the first non-finite step (None: none) and the StepStats; the
        largest loss is then forgotten (the next read covers the steps after this one)."""
        mine = torch.stack([getattr(self, f) for f in self.FIELDS]).cpu()
        self.peak = torch.full_like(self.peak, -math.inf)
        ranks = [mine]
        if group is not None:
            ranks = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
            dist.all_gather(ranks, mine, group=group)
        rows = [dict(zip(self.FIELDS, r.tolist())) for r in ranks]
        top = max(rows, key=lambda r: r["peak"])
        dead = min(rows, key=lambda r: r["dead_steps"])  # dead on every rank
        bad = min(r["first_bad"] for r in rows)
        return int(bad) if bad < _NO_BAD_STEP else None, StepStats(
            peak=top["peak"] if top["peak"] > -math.inf else None,
            peak_step=int(top["peak_step"]) if top["peak"] > -math.inf else None,
            first=sum(r["first"] for r in rows) / len(rows),
            dead_steps=int(dead["dead_steps"]),
            dead_from=int(dead["dead_from"]),
            dead_loss=dead["dead_loss"],
        )


class CheckpointManager:
    """One run's checkpoints (see the module docstring). `resumer` and `saver` are the two
    sides; the methods here are what train.py calls."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        run_dir: str | Path,
        rank: int = 0,
        world_size: int = 1,
        *,
        log: Callable[[str], None] | None = None,
        lock: Any = None,
        corpus: str | None = None,
    ):
        validate(cfg)
        on = dist.is_available() and dist.is_initialized()
        if on and (rank, world_size) != (dist.get_rank(), dist.get_world_size()):
            raise ValueError(
                f"CheckpointManager(rank={rank}, world_size={world_size}) does not "
                f"match torch.distributed ({dist.get_rank()}, "
                f"{dist.get_world_size()}): pass the global rank and world size"
            )
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.run_dir = Path(run_dir)
        self.root = checkpoint_root(cfg, self.run_dir)
        self.saving = cfg.mode != "none"
        self._lock = lock  # the run directory's lock (checkpoint/runlock.py): released at close
        #: The fingerprint of the training corpus (data=embedded: it changes with the Python
        #: version), recorded in every manifest and compared on resume (None: not recorded).
        self.corpus = corpus
        self._closed = False
        self.saver: Saver | None = None
        self._log = log if log is not None else default_log(rank)
        _OPEN.add(self)  # from here on, a failure below leaves close_open to release the lock
        self._ctx = Context.create(cfg, self.run_dir, rank, world_size, self._log, corpus)
        self._guard = _LossGuard()
        self._divergence: Divergence | None = None
        self._checked = 0  # the last step check_finite passed
        self.resumer = Resumer(self._ctx)
        self.saver = Saver(self._ctx, check_finite=self.check_finite)
        self.saver.start()

    # -- resume (checkpoint/resume.py) --------------------------------------------------------

    def plan_resume(
        self,
        config_yaml: str | None = None,
        check: Callable[[str, int], Any] | None = None,
        accept_corpus: bool = False,
    ) -> int:
        """Every resume decision, made before the model is built (train.py): which checkpoint
        (`checkpoint.resume`), whether it is there and intact as far as rank 0 can tell
        without reading the data (manifest, sizes, trailers, `.metadata`, the small files'
        hashes), whether it belongs to this run, whether its model shape and its corpus are
        this run's (`corpus`, unless `accept_corpus`), and `check(saved_config_yaml, step)`
        (the config comparison; raises ConfigError). Returns the step `resume` will load (0:
        fresh start); a refusal is a one-line ConfigError on every rank. Call once, on every
        rank."""
        return self.resumer.plan_resume(config_yaml, check, accept_corpus)

    @property
    def planned_path(self) -> Path | None:
        """The checkpoint `plan_resume` chose (None: a fresh start, or not planned yet)."""
        return self.resumer.planned_path

    def resume(self, state: Mapping[str, Any]) -> int:
        """Load the checkpoint `checkpoint.resume` points to into `state`; returns its step (0
        when starting fresh). Call once, on every rank, before the first save; after
        `plan_resume` it loads what that decided."""
        step = self.resumer.resume(state)
        self._checked = step
        if self.resumer.loaded is not None:  # saves go on from a checkpoint of this directory
            self.saver.last_saved_step = step if self.resumer.resumed is not None else None
        return step

    def reload(self, step: int, state: Mapping[str, Any]) -> Path:
        """Load this run's checkpoint of `step` into `state` (new objects: a rebuilt model and
        optimizer), as a resume from it would: the in-job recipe switch (train.py) saves the
        switch step, rebuilds, and loads it here, so the run goes on exactly as one resumed from
        that checkpoint. Saves `step` first if it is not saved yet; waits for every save."""
        if not self.saving:
            raise ConfigError("a recipe switch goes through a checkpoint; use checkpoint=sync")
        self.saver.wait_all()
        path = self.root / store.step_name(step)
        self.resumer.reload(path, step, state)
        return path

    # -- a resumed segment's health (checkpoint/health.py) ------------------------------------

    def watch_resumed_loss(self, records: list[dict] | None, policy: str = "stop") -> None:
        """After `resume`: judge the resumed segment's first logged losses against `records`
        (rank 0's metrics.jsonl; other ranks pass None), by `check_resumed_loss`. Until the
        healthy verdict, the checkpoints from the resumed step on are unconfirmed, on disk
        (checkpoint/store.py), and pruning keeps the newest confirmed one. A resume of a
        checkpoint saved after an earlier resume that was never judged goes on judging that
        one, and may stop here already. Nothing to watch without a resume in this directory,
        without enough logged history, or with policy off. Call on every rank."""
        self._act_on(*self.resumer.watch_loss(records, policy))

    def check_resumed_loss(self, step: int, loss: float) -> None:
        """Every rank at each log step, with the logged (rank-reduced) loss: confirms the
        checkpoints and prunes as usual once the resumed segment is healthy; when its first
        losses are above what the run logged before, stops the run in one line naming the
        checkpoint it resumed from and the confirmed one kept (resume.loss_check=stop), or
        says so and goes on keeping it (continue)."""
        self._act_on(*self.resumer.judge_loss(step, loss))

    def _act_on(self, verdict: str | None, line: str) -> None:
        if verdict == "healthy":
            self.saver.committer.prune_again()
        elif verdict == "stop":
            try:
                self.saver.wait_all()
            finally:
                self.close()
            raise ConfigError(line)

    # -- losses -------------------------------------------------------------------------------

    def observe_loss(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None = None
    ) -> None:
        """Remember (on the device, no sync) whether this step's loss was finite, and what
        the divergence check reads (the largest loss, a zero gradient norm)."""
        self._guard.observe(step, loss, grad_norm)

    def watch_divergence(self, rule: Divergence | None) -> None:
        """Judge the losses and gradient norms observed by `rule` (divergence.py) at every
        `check_finite`: a diverged run stops there, before anything of it is saved."""
        self._divergence = rule

    def check_finite(self, step: int, logged: float | None = None) -> None:
        """Every rank at the same step (log steps, with the step's `logged` loss; and before
        every save): stop with a NonFiniteLossError when a loss observed so far was not
        finite, or with a DivergenceError when the divergence rule says the run diverged
        (`watch_divergence`). In-flight saves (of earlier, checked steps) are committed
        first; nothing later is saved."""
        if self._guard.first_bad is None:
            return
        bad, stats = self._guard.read(self._ctx.ctl)
        rule = self._divergence
        line = rule.judge(step, stats) if bad is None and rule is not None else None
        if rule is not None and logged is not None:
            rule.logged(logged)
        if bad is None and line is None:
            self._checked = step
            return
        try:
            self.saver.wait_all()
        finally:
            self.close()
        found = store.newest_complete(self.root) if self.saving else None
        newest = found.path if found else "none"
        if bad is not None:
            raise NonFiniteLossError(
                f"the loss is not finite (nan or inf) at step {bad}; training stopped at step "
                f"{step} and nothing from step {bad} on was saved (newest checkpoint: "
                f"{newest}); lower optim.lr, check the data or the precision recipe, then resume"
            )
        after = f" after step {self._checked}" if self._checked else ""
        raise DivergenceError(
            f"{line}; training stopped at step {step} and nothing{after} was saved (newest "
            f"checkpoint: {newest}); {rule.hint(found is not None)}"
        )

    # -- save (checkpoint/save.py) ------------------------------------------------------------

    def maybe_save(
        self, step: int, state: Mapping[str, Any], force: bool = False
    ) -> dict[str, float] | None:
        """Save when `step` is a multiple of checkpoint.interval, or `force` (those wait for a
        busy writer), or a deferred save is due. Returns the timings of this save (what the loop
        waited), or None when not saving. Call on every rank at every step."""
        return self.saver.maybe_save(step, state, force)

    def save(self, step: int, state: Mapping[str, Any]) -> dict[str, float]:
        """Save `step` now (on every rank), waiting for a staging buffer if all are busy."""
        return self.saver.save(step, state)

    def stats(self) -> dict[str, float]:
        """The newest save completed since the last call, for the metrics log: save_step,
        save_blocking_s (what the loop waited), save_total_s (start to commit), and where
        measured save_stage_s (the copy into the staging buffer; save_state_dict_s and
        save_alloc_s: the Statefuls' state_dict() calls and buffer allocation before it),
        save_drain_s (waiting for the device to finish the step already queued: part of the
        blocking time, though the device was busy anyway),
        save_wait_prev_s (waiting for a free buffer), save_queue_s (staged to write start),
        save_write_s (the DCP save), save_commit_s
        (rank 0: manifest, rename; old checkpoints are pruned on another thread), save_bytes
        (this rank's bytes), save_file_s / save_write_calls_s / save_hash_s / save_fsync_s
        (this rank's file writing, summed over its files: checkpoint/writer.py),
        save_checkpoint_bytes (rank 0: the whole checkpoint). Empty when none completed."""
        return self.saver.stats()

    # -- end ----------------------------------------------------------------------------------

    def finish(self, step: int, state: Mapping[str, Any], save: bool = True) -> None:
        """End of training: save `step` (checkpoint.save_at_end, unless `save=False` or it was
        just saved), wait for in-flight async saves, close."""
        if self._closed:
            return
        self.saver.finish(step, state, save)
        self._ctx.barrier()
        if self.saving and self.rank == 0 and (pending := self.resumer.pending_line()):
            self._log(pending)
        self.close()

    def stopped_line(self, step: int) -> str:
        """What a run stopped at once after `step` leaves behind (rank 0 reads the checkpoint
        directory): the newest committed checkpoint, the steps not saved, the saves in flight
        that are abandoned."""
        return self.saver.stopped_line(step)

    def abandon(self) -> None:
        """For a process about to end at once (a second Ctrl-C): release the run lock and stop
        the writer process without waiting for any save; a save in flight stays an
        uncommitted `.tmp` directory, which the next start removes."""
        self._closed = True
        _OPEN.discard(self)
        if self.saver is not None:
            self.saver.abandon()
        if self._lock is not None:
            self._lock.release()

    def close(self) -> None:
        """Wait for saves in flight, stop the writers, free the buffers, release the lock."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        try:
            if self.saver is not None:
                self.saver.close()
        finally:
            if self._lock is not None:
                self._lock.release()
