"""CheckpointManager: when, how and where to save; what to resume from.

    ckpt = CheckpointManager(cfg.checkpoint, run_dir, rank=rank, world_size=world_size)
    start_step = ckpt.resume(state)       # 0 when starting fresh
    for step in ...:
        ...
        ckpt.observe_loss(step, loss)     # on device, no sync
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
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import secrets
import shutil
import sys
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpoint import hashing, staging, store
from checkpoint.config import CheckpointConfig, validate
from checkpoint.health import LossRange, ResumeWatch
from checkpoint.planners import BlockLoadPlanner
from checkpoint.preflight import format_bytes
from checkpoint.reader import CheckpointReader, first_problem
from checkpoint.state import ModelState, TrainState
from checkpoint.writer import os_error_in, write_checkpoint
from errors import ConfigError, NonFiniteLossError

# Single-process runs save and load without a process group on purpose.
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable")

#: Model fields that change parameter shapes: a checkpoint only loads when they agree.
SHAPE_FIELDS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "vocab_size",
    "pad_vocab_multiple",
    "tie_embeddings",
)
#: Log file of every save (rank 0): one JSON record per save, skip and deferral.
SAVES_LOG = "checkpoint_saves.jsonl"
_NO_BAD_STEP = 2**62
#: CPython's GIL switch interval while an `async` save is written by threads of the training
#: process. A writer thread takes the GIL back after each hash or write call; while the
#: training thread runs Python it gets it only when the interval (5 ms by default) runs out.
_WRITE_SWITCH_INTERVAL_S = 5e-4
#: What a failed DCP call raises (CheckpointException derives from BaseException).
_ERRORS = (Exception, CheckpointException)


@dataclass
class _Pending:
    step: int
    future: Future  # the write (and on rank 0 the commit); its result: the writer's numbers
    start: float
    blocking_s: float
    wait_s: float  # of blocking_s: waiting for a free staging buffer
    staging: dict[str, float]  # of blocking_s: drain_s, state_dict_s, alloc_s, stage_s
    bytes: int
    buffer: int
    end: list[float] = field(default_factory=list)


def model_shape_mismatches(saved_yaml: str | None, current_yaml: str | None) -> list[str]:
    """`model.<field>: checkpoint has X, config has Y` for every shape field that differs."""
    if not saved_yaml or not current_yaml:
        return []
    saved = (yaml.safe_load(saved_yaml) or {}).get("model") or {}
    current = (yaml.safe_load(current_yaml) or {}).get("model") or {}
    return [
        f"model.{f}: checkpoint has {saved[f]}, config has {current[f]}"
        for f in SHAPE_FIELDS
        if f in saved and f in current and saved[f] != current[f]
    ]


def checkpoint_root(cfg: CheckpointConfig, run_dir: str | Path) -> Path:
    """Where this run's step directories go: checkpoint.dir, relative to the run directory."""
    root = Path(cfg.dir).expanduser()
    return root if root.is_absolute() else Path(run_dir) / root


def resumes(cfg: CheckpointConfig, run_dir: str | Path) -> bool:
    """Whether `CheckpointManager.resume` will load a checkpoint (it may still refuse a damaged
    or mismatched one): checkpoint.resume is a path, or auto and this run's checkpoint
    directory holds a complete checkpoint. Filesystem only; for rank 0 to decide."""
    spec = str(cfg.resume)
    if spec == "none":
        return False
    if spec == "auto":
        return store.newest_complete(checkpoint_root(cfg, run_dir)) is not None
    return True


def _flatten(request: dict) -> dict[str, Any]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(request)[0]


#: Parts whose every saved entry must be loaded: an entry the run does not ask for would be
#: dropped without a word (e.g. moments of an optimizer whose state is only partly built).
COMPLETE_PARTS = ("model.", "optimizer.")


def request_problems(
    request: dict, saved: Mapping[str, Any], skipped: set[str] | frozenset[str] = frozenset()
) -> list[str]:
    """Keys missing from the checkpoint, tensors whose global shape differs, and model or
    optimizer entries of the checkpoint that this run would not load (except `skipped`: those
    a part leaves out on purpose, e.g. the FP8 bytes of a weight whose fp32 master loads)."""
    problems = []
    flat = _flatten(request)
    for fqn in saved:
        if fqn.startswith(COMPLETE_PARTS) and fqn not in flat and fqn not in skipped:
            problems.append(f"the checkpoint entry {fqn!r} would not be loaded by this run")
    for fqn, value in flat.items():
        md = saved.get(fqn)
        if md is None:
            problems.append(f"the checkpoint has no entry {fqn!r}")
        elif isinstance(value, torch.Tensor):
            if not isinstance(md, TensorStorageMetadata):
                problems.append(f"{fqn!r} is not a tensor in the checkpoint")
            elif tuple(md.size) != tuple(value.shape):
                problems.append(
                    f"{fqn!r}: checkpoint has shape {tuple(md.size)}, "
                    f"this run has {tuple(value.shape)}"
                )
    return problems


def _saved_config(path: Path) -> dict | None:
    """The resolved config saved with a checkpoint (verified with the other files), or None."""
    file = path / store.CONFIG_FILE
    try:
        config = yaml.safe_load(file.read_text()) if file.is_file() else None
    except (yaml.YAMLError, UnicodeDecodeError):
        return None
    return config if isinstance(config, dict) else None


def _run_name(config_yaml: str | None) -> str | None:
    """run.name of a resolved config's text (None: no config, or no name in it)."""
    if not config_yaml:
        return None
    tree = yaml.safe_load(config_yaml) or {}
    name = (tree.get("run") or {}).get("name") if isinstance(tree, dict) else None
    return str(name) if name is not None else None


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
            manager._log(f"while closing after the failure: {_first_line(e)}")


def _find(state: Mapping[str, Any], cls: type):
    return next((v for v in state.values() if isinstance(v, cls)), None)


def _all_finite(t: torch.Tensor) -> torch.Tensor | None:
    """A 0-d bool tensor on t's device: whether every value of `t` is finite (a quantized
    weight: its dequantized values); None when that cannot be computed."""
    try:
        if type(t) is not torch.Tensor and hasattr(t, "dequantize"):
            t = t.dequantize()
        if not t.is_floating_point():
            return None
        return torch.isfinite(t).all()
    except (RuntimeError, TypeError, NotImplementedError):
        return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


class _LossGuard:
    """The first step whose loss was not finite, kept on the loss's device (no host sync)."""

    def __init__(self):
        self.first_bad: torch.Tensor | None = None

    def observe(self, step: int, loss: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss.detach()).all()
        if self.first_bad is None:
            self.first_bad = torch.full((), _NO_BAD_STEP, dtype=torch.int64, device=loss.device)
        self.first_bad = torch.where(bad, self.first_bad.clamp(max=step), self.first_bad)

    def first(self, group) -> int | None:
        """The first non-finite step over all ranks (a host sync and, with a group, a scalar
        all-reduce), or None."""
        value = torch.tensor([int(self.first_bad.item())])
        if group is not None:
            dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
        v = int(value.item())
        return v if v < _NO_BAD_STEP else None


class CheckpointManager:
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
        self._dist = dist.is_available() and dist.is_initialized()
        if self._dist and (rank, world_size) != (dist.get_rank(), dist.get_world_size()):
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
        self._planned: dict[str, Any] | None = None
        self._writers_up = False  # async_process: every rank's writer process has started
        _OPEN.add(self)
        self._log = (
            log
            if log is not None
            else (
                (lambda msg: print(f"checkpoint: {msg}", flush=True))
                if rank == 0
                else (lambda msg: None)
            )
        )
        # DCP's collectives (a writer thread in async mode) and the loop's agreements.
        self._pg = dist.new_group(backend="gloo") if self._dist else None
        self._ctl = dist.new_group(backend="gloo") if self._dist else None
        # The save id prefix and hash algorithm: rank 0's, so every rank writes the same.
        self._token, self._algorithm = self._broadcast(
            (secrets.token_hex(6), hashing.default_algorithm() if cfg.checksum else None)
        )
        self._pending: deque[_Pending] = deque()
        self._deferred: int | None = None
        self._last_saved_step: int | None = None
        self._completed: list[dict[str, float]] = []
        self._guard = _LossGuard()
        self._saves = 0
        self._closed = False
        self._executor: ThreadPoolExecutor | None = None
        # Rank 0 deletes old checkpoints on a thread of its own: the next save need not wait
        # for it (deleting a 14 GiB checkpoint took ~4.5 s on an H200 host's disk).
        self._pruner: ThreadPoolExecutor | None = None
        self._stager = None
        self._writer = None
        self._buffer_version = 0
        if cfg.mode in ("async", "async_process"):
            process = cfg.mode == "async_process"
            if process:
                from checkpoint.writer_process import WriterProcess

                self._writer = WriterProcess(rank, world_size, self._pg)
            self._stager = staging.Stager(
                buffers=cfg.staging_buffers,
                shared=process,
                log=self._log,
                # a placement this rank decides alone (a reallocation) is said by every rank
                warn=self._log
                if rank == 0
                else (lambda msg: print(f"checkpoint: rank {rank}: {msg}", flush=True)),
                on_allocate=self._buffers_allocated,
                before_reallocate=self._wait_all,
                agree=self._minimum if self._ctl is not None else None,
            )
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="ckpt-write")
            # Its thread starts now, not inside the first save's `submit`: a Ctrl-C landing
            # in a thread start there left a worker the executor never recorded, which the
            # interpreter then waited for at exit (a hang with the run lock held).
            self._executor.submit(lambda: None).result()
        elif cfg.mode == "sync":
            # The async writer's path, waited for: one staging buffer (copied at the save, by
            # large pinned copies) written by the writer threads from host memory. Writing
            # straight from device tensors copied each tensor to pageable memory inside the
            # writer (0.98 GB/s against async's 1.8 on an H200 host). Without room in host
            # memory for the copy, sync writes from the device tensors as before (_sync_staging).
            self._stager = staging.Stager(
                buffers=1,
                log=self._log,
                warn=self._log
                if rank == 0
                else (lambda msg: print(f"checkpoint: rank {rank}: {msg}", flush=True)),
                agree=self._minimum if self._ctl is not None else None,
            )
        self._sync_staged: bool | None = None  # sync: staging decided (on the first use)
        self._saving_here: int | None = None  # the step of a save in the main thread
        #: (path, step) of the checkpoint resumed from, in this manager's directory.
        self._resumed: tuple[Path, int] | None = None
        #: Checkpoints up to this step are not pruned (a resumed segment not yet healthy).
        self._hold: int | None = None
        self._watch: ResumeWatch | None = None
        self._watch_policy = "off"

    # -- resume -------------------------------------------------------------------------------

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
        decision = None
        if self.rank == 0:
            try:
                decision = self._decide(config_yaml, check, accept_corpus)
            except OSError as e:  # e.g. a file of the checkpoint this run may not read
                decision = {
                    "path": None,
                    "step": 0,
                    "error": (
                        f"checkpoint.resume={self.cfg.resume}: cannot read "
                        f"{e.filename or self.root} ({e.strerror or e}); give this run access "
                        "to it (chmod/chown), or pass checkpoint.resume=<another checkpoint>"
                    ),
                }
            except Exception as e:  # every rank must hear of it, or the others wait forever
                decision = {"path": None, "step": 0, "error": None, "crash": _first_line(e)}
        decision = self._broadcast(decision)
        if decision.get("crash"):
            raise RuntimeError(f"checkpoint resume failed on rank 0: {decision['crash']}")
        if decision["error"]:
            raise ConfigError(decision["error"])
        self._planned = decision
        return decision["step"]

    @property
    def planned_path(self) -> Path | None:
        """The checkpoint `plan_resume` chose (None: a fresh start, or not planned yet)."""
        path = (self._planned or {}).get("path")
        return Path(path) if path else None

    def resume(self, state: Mapping[str, Any]) -> int:
        """Load the checkpoint `checkpoint.resume` points to into `state`; returns its step (0
        when starting fresh). Call once, on every rank, before the first save; after
        `plan_resume` it loads what that decided."""
        if self._planned is None:
            train = _find(state, TrainState)
            self.plan_resume(train.config_yaml if train is not None else None)
        decision, self._planned = self._planned, None
        if decision["path"] is None:
            return 0
        path, step = Path(decision["path"]), decision["step"]
        t0 = time.perf_counter()
        self._load(path, state, step, decision["hint"])
        self._check_loaded_finite(path, state, decision["hint"])
        train = _find(state, TrainState)
        if train is not None and train.step != step:
            # _decide made the directory name and the manifest agree (where the name is a
            # step directory's): both are named as the source of `step`.
            source = "directory name and manifest say" if store.dir_step(path) else "manifest says"
            raise ConfigError(
                f"checkpoint {path}: its {source} step {step} but its train state (the step "
                f"the saved training had reached) says {train.step}; the checkpoint is "
                f"inconsistent and was not resumed from; {decision['hint']}"
            )
        if self.rank == 0 and self.saving and self.cfg.resume != "auto":
            for p in store.abandon_newer(self.root, step):
                self._log(f"newer checkpoint of the old timeline moved aside: {p}")
        if self._dist:
            dist.barrier(group=self._pg)
        same_dir = path.resolve().parent == self.root.resolve()
        self._last_saved_step = step if same_dir else None
        self._resumed = (path, step) if same_dir else None
        seconds = time.perf_counter() - t0
        self._log(f"resumed from {path} (step {step}) in {seconds:.2f}s")
        if self.saving:  # a reading manager (train.eval_only, checkpoint=none) writes nothing
            manifest = store.read_manifest(path) or {"files": {}}
            self._append_log(
                {
                    "event": "resumed",
                    "step": step,
                    "path": str(path),
                    "seconds": seconds,
                    "bytes": sum(e.get("size", 0) for e in manifest["files"].values()),
                    "verified": bool(self.cfg.checksum),
                }
            )
        return step

    def reload(self, step: int, state: Mapping[str, Any]) -> Path:
        """Load this run's checkpoint of `step` into `state` (new objects: a rebuilt model and
        optimizer), as a resume from it would: the in-job recipe switch (train.py) saves the
        switch step, rebuilds, and loads it here, so the run goes on exactly as one resumed from
        that checkpoint. Saves `step` first if it is not saved yet; waits for every save."""
        if not self.saving:
            raise ConfigError("a recipe switch goes through a checkpoint; use checkpoint=sync")
        self._wait_all()
        path = self.root / store.step_name(step)
        if self._dist:
            dist.barrier(group=self._pg)
        if store.read_manifest(path) is None:
            raise RuntimeError(f"checkpoint {path} of the recipe switch is not committed")
        t0 = time.perf_counter()
        self._load(path, state, step, "the recipe switch cannot go on")
        if self._dist:
            dist.barrier(group=self._pg)
        self._log(f"reloaded {path} (step {step}) in {time.perf_counter() - t0:.2f}s")
        return path

    def _damaged(self, path: Path, problem: str, hint: str) -> str:
        return (
            f"checkpoint {path} is damaged ({problem}) and was not loaded; {hint}, "
            "or move the damaged directory away"
        )

    def _check_loaded_finite(self, path: Path, state: Mapping[str, Any], hint: str) -> None:
        """Every rank, right after a load: the model's weights (this rank's shards) are finite.
        A checkpoint whose hashes match but which holds nan or inf was saved that way; it
        would stop the run at its first step with a non-finite loss instead."""
        verified = self.cfg.checksum
        model = _find(state, ModelState)
        bad = self._non_finite_everywhere(model.model.named_parameters() if model else ())
        if bad:
            more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
            raise ConfigError(
                f"checkpoint {path} holds non-finite weights (nan or inf in model.{bad[0]}"
                f"{more}{'; its files match their hashes: saved so' if verified else ''}); "
                f"{hint}"
            )

    def _decide(
        self,
        config_yaml: str | None,
        check: Callable[[str, int], Any] | None = None,
        accept_corpus: bool = False,
    ) -> dict[str, Any]:
        """Rank 0: which checkpoint to load, or the one-line error every rank will raise."""
        spec = str(self.cfg.resume)
        if self.saving:
            for p in store.clean_partial(self.root):
                self._log(f"removed partial checkpoint {p}")
        if spec == "none":
            if self.saving:
                for p in store.abandon_newer(self.root, -1):
                    self._log(f"checkpoint.resume=none: existing checkpoint moved aside: {p}")
            return {"path": None, "step": 0, "error": None}
        if spec == "auto":
            found = store.newest_step(self.root)
            for c in store.renamed_steps(self.root):
                if found is None or c.step > found.step:
                    self._log(
                        f"{c.path} is not resumed from: its name is not a step directory's "
                        f"(renamed?); "
                        + (f"resuming from {found.path}" if found else "starting fresh")
                        + f" (rename it back to {store.step_name(c.step)} to resume from it)"
                    )
            if found is None:
                return {"path": None, "step": 0, "error": None}
        else:
            found = store.find_checkpoint(Path(spec).expanduser())
            if found is None:
                return {
                    "path": None,
                    "step": 0,
                    "error": (
                        f"checkpoint.resume={spec}: no checkpoint there (expected a step_XXXXXXX "
                        f"directory with {store.MANIFEST}, or a directory holding them); fix the "
                        "path, or use checkpoint.resume=auto|none"
                    ),
                }
        older = [c for c in store.list_complete(found.path.parent) if c.step < found.step]
        hint = (
            f"pass checkpoint.resume={older[-1].path} to resume from the previous "
            "complete checkpoint"
            if older
            else "there is no earlier complete checkpoint; use checkpoint.resume=none to "
            "start fresh"
        )
        problem = store.entry_problem(found.path)
        if problem and "cannot read" in problem:
            return {
                "path": None,
                "step": 0,
                "error": (
                    f"checkpoint {found.path}: {problem}; give this run read access to it "
                    f"(chmod/chown), or {hint}"
                ),
            }
        if problem:
            return {"path": None, "step": 0, "error": self._damaged(found.path, problem, hint)}
        problem = store.verify_layout(found.path)
        if not problem and self.cfg.checksum:  # the small files rank 0 reads next, first
            manifest = store.read_manifest(found.path)
            small = [n for n in (".metadata", store.CONFIG_FILE) if n in manifest["files"]]
            try:
                problem = store.verify_hashes(found.path, small, manifest)
            except ConfigError as e:  # e.g. xxh3-64 recorded, xxhash missing: not damage
                return {"path": None, "step": 0, "error": f"checkpoint {found.path}: {e}"}
        problem = problem or self._metadata_problem(found.path)
        if problem:
            return {"path": None, "step": 0, "error": self._damaged(found.path, problem, hint)}
        named = store.dir_step(found.path)
        recorded = (store.read_manifest(found.path) or {}).get("step")
        if named is not None and recorded != named:
            return {
                "path": None,
                "step": 0,
                "error": (
                    f"checkpoint {found.path}: its directory name says step {named} but its "
                    f"{store.MANIFEST} says step {recorded}; the checkpoint is inconsistent "
                    f"(renamed by hand? then rename it back to {store.step_name(recorded)} if "
                    f"that step is not taken); {hint}, or move it away"
                    if isinstance(recorded, int)
                    else f"checkpoint {found.path}: its {store.MANIFEST} records no step; "
                    f"{hint}, or move it away"
                ),
            }
        saved_file = found.path / store.CONFIG_FILE
        saved_yaml = saved_file.read_text() if saved_file.is_file() else None
        try:
            mismatches = model_shape_mismatches(saved_yaml, config_yaml)
            # Checkpoints in this run's directory are its own (a copied run directory
            # included); an absolute checkpoint.dir outside it may be another run's.
            shared = not self.root.resolve().is_relative_to(self.run_dir.resolve())
            owner = _run_name(saved_yaml) if spec == "auto" and shared else None
        except (yaml.YAMLError, AttributeError, TypeError, UnicodeDecodeError) as e:
            problem = f"{store.CONFIG_FILE} is not a readable config ({_first_line(e)})"
            return {"path": None, "step": 0, "error": self._damaged(found.path, problem, hint)}
        mine = _run_name(config_yaml)
        if owner is not None and mine is not None and owner != mine:
            return {
                "path": None,
                "step": 0,
                "error": (
                    f"checkpoint.dir={self.cfg.dir}: {self.root} holds the checkpoints of run "
                    f"{owner} (newest: {found.path}), not of run.name={mine}; give this run a "
                    f"checkpoint.dir of its own, or resume from it on purpose with "
                    f"checkpoint.resume={found.path}"
                ),
            }
        if mismatches:
            return {
                "path": None,
                "step": 0,
                "error": (
                    f"{'; '.join(mismatches)} (checkpoint {found.path}); resume with the "
                    "checkpoint's model settings, or train this model as a separate run with "
                    "another run.name (checkpoint.resume=none would move this run's "
                    "checkpoints aside)"
                ),
            }
        saved_corpus = (store.read_manifest(found.path) or {}).get("corpus")
        if saved_corpus and self.corpus and saved_corpus != self.corpus:
            if not accept_corpus:
                return {
                    "path": None,
                    "step": 0,
                    "error": (
                        f"checkpoint {found.path} was trained on another corpus ({saved_corpus}; "
                        f"this run's is {self.corpus}), so the run would continue on different "
                        "data; resume with the data it was trained on (data=embedded: under "
                        "the Python version it names), or accept the change on purpose with "
                        "resume.accept=[data]"
                    ),
                }
            self._log(
                f"corpus: {saved_corpus} in checkpoint {found.path}, {self.corpus} now; "
                "continuing on the new one (resume.accept)"
            )
        if check is not None and saved_yaml:
            try:
                check(saved_yaml, found.step)
            except ConfigError as e:
                return {"path": None, "step": 0, "error": str(e)}
        return {"path": str(found.path), "step": found.step, "error": None, "hint": hint}

    def _metadata_problem(self, path: Path) -> str | None:
        """`.metadata` unreadable, or written by another save than the manifest's."""
        try:
            metadata = FileSystemReader(str(path)).read_metadata()
        except _ERRORS as e:
            return f".metadata is unreadable ({_first_line(e)})"
        want = (store.read_manifest(path) or {}).get("save_id")
        got = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
        if want and got != want:
            return ".metadata belongs to another save than the manifest (swapped in?)"
        return None

    def _reader(self, path: Path) -> CheckpointReader:
        """The DCP reader of a resume: with checkpoint.checksum it verifies every data file's
        hash with the bytes it loads (checkpoint/reader.py: each byte is read once; `.metadata`
        and config.yaml were verified by rank 0 before, in `_decide`)."""
        manifest = store.read_manifest(path) or {"files": {}}
        hashed = any(hashing.recorded(e) for e in manifest["files"].values())
        if hashed and not self.cfg.checksum:
            self._log(f"not verifying the hashes of {path} (checkpoint.checksum=false)")
        return CheckpointReader(
            str(path),
            manifest=manifest,
            verify=self.cfg.checksum and hashed,
            threads=self.cfg.write_threads,
        )

    def _load(self, path: Path, state: Mapping[str, Any], step: int, hint: str) -> None:
        """Load `path` into `state`, verifying the hashes as it reads (`_reader`); every rank
        fails together, with one line naming the checkpoint, when a file of any rank is
        damaged."""
        try:
            saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        except _ERRORS as e:
            raise ConfigError(
                f"checkpoint {path} is damaged (.metadata is unreadable: {_first_line(e)})"
            ) from None
        config = _saved_config(path)
        for part in state.values():
            if hasattr(part, "plan_load"):  # e.g. a checkpoint of another precision recipe
                part.plan_load(config, step, set(saved))
        request: dict[str, Any] = {}
        for key, part in state.items():
            if hasattr(part, "load_request"):
                prefix = key + "."
                request[key] = part.load_request(
                    {k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix)}
                )
            else:
                request[key] = part.state_dict()
        skipped = set().union(
            *(p.skipped_entries() for p in state.values() if hasattr(p, "skipped_entries"))
        )
        problems = request_problems(request, saved, skipped)
        if self._pg is not None:  # every rank must fail together, or none
            everyone: list[Any] = [None] * dist.get_world_size(self._pg)
            dist.all_gather_object(everyone, problems, group=self._pg)
            problems = next((p for p in everyone if p), [])
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise ConfigError(
                f"checkpoint {path} does not fit this run: {problems[0]}{more}; "
                "resume with the settings it was saved with"
            )
        reader = self._reader(path)
        t0 = time.perf_counter()
        failed = None
        try:
            dcp.load(
                request,
                checkpoint_id=str(path),
                storage_reader=reader,
                planner=BlockLoadPlanner(),
                process_group=self._pg,
                no_dist=not self._dist,
            )
        except _ERRORS as e:
            failed = e
        found = list(reader.problems)
        if self._pg is not None:  # every rank reports every rank's damage alike
            everyone: list[Any] = [None] * dist.get_world_size(self._pg)
            dist.all_gather_object(everyone, found, group=self._pg)
            found = [p for ps in everyone for p in ps]
        first = first_problem(found)
        if first is not None:
            kind, problem = first
            if kind == "error":  # e.g. xxh3-64 recorded, xxhash missing: not damage
                raise ConfigError(f"checkpoint {path}: {problem}")
            raise ConfigError(self._damaged(path, problem, hint))
        if failed is not None:
            raise ConfigError(
                f"checkpoint {path} could not be loaded ({_first_line(failed)}); it may be "
                "damaged: resume with checkpoint.checksum=true to check its files"
            ) from failed
        if reader.verify:
            files = reader.manifest["files"]
            size = sum(e["size"] for e in files.values())
            self._log(
                f"verified the hashes of {len(files)} files ({size / 2**30:.2f} GiB) of {path} "
                f"as they were loaded ({time.perf_counter() - t0:.2f}s, this rank read "
                f"{reader.bytes_read / 2**30:.2f} GiB; {reader.phases()})"
            )
        self._check_request_finite(path, request, hint)
        for key, part in state.items():
            part.load_state_dict(request[key])

    def _non_finite_everywhere(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """The names of `named` tensors (this rank's shards) that hold nan or inf on any rank:
        one flag per tensor on its device (`_all_finite`), one host sync for this rank's
        flags, then the ranks' lists gathered. Every rank calls it."""
        names, flags = [], []
        for name, t in named:
            flag = _all_finite(getattr(t, "_local_tensor", t).detach())
            if flag is not None:
                names.append(name)
                flags.append(flag)
        bad = []
        if flags:
            where = flags[0].device
            ok = torch.stack([f.to(where) for f in flags]).tolist()
            bad = [n for n, good in zip(names, ok) if not good]
        if self._pg is not None:
            everyone: list[Any] = [None] * dist.get_world_size(self._pg)
            dist.all_gather_object(everyone, bad, group=self._pg)
            bad = sorted(set().union(*everyone))
        return bad

    def _check_request_finite(self, path: Path, request: dict[str, Any], hint: str) -> None:
        """Every rank, after the read and before any Stateful takes the values: every loaded
        floating tensor other than the model's (those are checked once loaded, with their
        quantized forms: `_check_loaded_finite`) is finite: optimizer moments and masters, TE
        scales and amax histories. A nan there passes every hash (it was saved so) and stops
        the run at its next step as a non-finite loss, on every rerun of the same command.
        One flag per tensor, on its device, and one host sync for all."""
        bad = self._non_finite_everywhere(
            (fqn, value)
            for fqn, value in _flatten(request).items()
            if not fqn.startswith("model.") and isinstance(value, torch.Tensor)
        )
        if bad:
            more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
            saved_so = "; its files match their hashes: saved so" if self.cfg.checksum else ""
            raise ConfigError(
                f"checkpoint {path} holds non-finite values (nan or inf in {bad[0]}{more}"
                f"{saved_so}); {hint}"
            )

    # -- a resumed segment's health (checkpoint/health.py) ------------------------------------

    def watch_resumed_loss(self, records: list[dict] | None, policy: str = "stop") -> None:
        """After `resume`: hold the checkpoints up to the resumed step from pruning until the
        segment's first logged losses are within the range of `records` (rank 0's
        metrics.jsonl; other ranks pass None), judged by `check_resumed_loss`. Nothing to
        watch without a resume in this directory, without enough logged history, or with
        policy off. Call on every rank."""
        loss_range = None
        if self.rank == 0 and records is not None and self._resumed is not None:
            loss_range = LossRange.from_records(records, self._resumed[1])
        loss_range = self._broadcast(loss_range)
        if loss_range is None or policy == "off" or not self.saving or self._resumed is None:
            return
        self._watch, self._watch_policy = ResumeWatch(loss_range), policy
        self._hold = self._resumed[1]

    def check_resumed_loss(self, step: int, loss: float) -> None:
        """Every rank at each log step, with the logged (rank-reduced) loss: releases the hold
        once the resumed segment is healthy; when its first losses are all above the range,
        stops the run in one line naming the checkpoint it resumed from and the older one
        kept (resume.loss_check=stop), or says so and goes on holding them (continue)."""
        if self._watch is None:
            return
        verdict = self._watch.observe(step, loss)
        if verdict == "healthy":
            self._hold = None
            self._log(f"resumed segment healthy: {self._watch.describe()}")
            if self.rank == 0 and self._pruner is not None:
                self._pruner.submit(self._prune)
        if verdict != "unhealthy":
            return
        path, resumed_step = self._resumed
        older = [c for c in store.list_complete(self.root) if c.step < resumed_step]
        kept = (
            f"the older checkpoint {older[-1].path} is kept: resume from it with "
            f"checkpoint.resume={older[-1].path}"
            if older
            else "no older checkpoint is kept (checkpoint.keep_last=1 pruned it before)"
        )
        line = (
            f"the loss after resuming from {path} (step {resumed_step}) is above the range "
            f"this run logged before it: {self._watch.describe()}; that checkpoint may hold "
            "damage its checks cannot see (a changed weight whose hash was rewritten, or "
            f"checkpoint.checksum=false); {kept}"
        )
        if self._watch_policy == "continue":
            self._log(f"warning: {line}; going on (resume.loss_check=continue), holding it")
            return
        try:
            self._wait_all()
        finally:
            self.close()
        raise ConfigError(f"{line}; or go on with resume.loss_check=continue")

    # -- losses -------------------------------------------------------------------------------

    def observe_loss(self, step: int, loss: torch.Tensor) -> None:
        """Remember (on the device, no sync) whether this step's loss was finite."""
        self._guard.observe(step, loss)

    def check_finite(self, step: int) -> None:
        """Every rank at the same step (log steps): stop with a NonFiniteLossError when a loss
        observed so far was not finite. In-flight saves (of earlier, finite steps) are
        committed first; nothing later is saved."""
        if self._guard.first_bad is None:
            return
        bad = self._guard.first(self._ctl)
        if bad is None:
            return
        try:
            self._wait_all()
        finally:
            self.close()
        newest = store.newest_complete(self.root) if self.saving else None
        raise NonFiniteLossError(
            f"the loss is not finite (nan or inf) at step {bad}; training stopped at step {step} "
            f"and nothing from step {bad} on was saved (newest checkpoint: "
            f"{newest.path if newest else 'none'}); lower optim.lr, check the data or the "
            "precision recipe, then resume"
        )

    # -- save ---------------------------------------------------------------------------------

    def maybe_save(
        self, step: int, state: Mapping[str, Any], force: bool = False
    ) -> dict[str, float] | None:
        """Save when `step` is a multiple of checkpoint.interval, or `force` (those wait for a
        busy writer), or a deferred save is due. Returns the timings of this save (what the loop
        waited), or None when not saving. Call on every rank at every step."""
        if not self.saving or step == self._last_saved_step:
            self._poll()
            return None
        due = force or (self.cfg.interval > 0 and step % self.cfg.interval == 0)
        if not due and self._deferred is None:
            self._poll()
            if self._stager is not None and self._sync_staging(state):
                self._stager.prepare(state)  # once: buffers ready before the first save
            return None
        if self.cfg.mode == "sync" or force or self.cfg.when_busy == "wait":
            return self.save(step, state)
        if self._agree():
            if self._deferred is not None:
                self._note(
                    f"step {step}: saving (deferred from step {self._deferred}: the writer was busy)",
                    {"event": "deferred_taken", "step": step, "due_step": self._deferred},
                )
                self._deferred = None
            return self.save(step, state)
        busy = ", ".join(str(p.step) for p in self._pending)
        if self.cfg.when_busy == "skip":
            self._note(
                f"step {step}: save skipped, the writer is busy with step(s) {busy} "
                "(checkpoint.when_busy=skip)",
                {"event": "skipped", "step": step},
            )
        elif due and self._deferred is None:
            self._deferred = step
            self._note(
                f"step {step}: save deferred, the writer is busy with step(s) {busy}; it is "
                "taken at the first step a staging buffer is free (checkpoint.when_busy=defer)",
                {"event": "deferred", "step": step},
            )
        return None

    def _agree(self) -> bool:
        """Whether every rank has a free staging buffer (a collective on `_ctl`). When a save
        failed on any rank, every rank waits for its own saves and raises the failure here,
        at the same step (a failed DCP save fails on every rank)."""
        self._poll()
        failed = any(p.future.done() and p.future.exception() for p in self._pending)
        free, all_ok = self._minimum([self._free_buffers(), int(not failed)])
        if not all_ok:
            self._wait_all()
        return free > 0

    def _minimum(self, values: list[int]) -> list[int]:
        """The element-wise minimum of `values` over every rank (a collective on `_ctl`)."""
        t = torch.tensor(values, dtype=torch.int64)
        if self._ctl is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._ctl)
        return [int(v) for v in t]

    def _buffer_count(self) -> int:
        n = len(self._stager.buffers) if self._stager is not None else 0
        return n or self.cfg.staging_buffers

    def _free_buffers(self) -> int:
        busy = sum(1 for p in self._pending if not p.future.done())
        return max(0, self._buffer_count() - busy)

    def save(self, step: int, state: Mapping[str, Any]) -> dict[str, float]:
        """Save `step` now (on every rank), waiting for a staging buffer if all are busy."""
        t0 = time.perf_counter()
        planned = None
        # sync, and async_process while its writer processes start, write at the step; sync
        # through the staging buffer when it has one (_sync_staging).
        direct = self.cfg.mode == "sync" or self._writer_starting(step)
        staged_direct = self.cfg.mode == "sync" and self._stager is not None
        if (not direct or staged_direct) and self._sync_staging(state):
            # CPU work first, while the device finishes the step: what to copy, where.
            planned = staging.plan(state)
            self._agree()  # raises an earlier failure on every rank alike
        drain = _drain_device()  # the steps already queued on the device
        self.check_finite(step)
        waited = self._wait_for_buffer()
        tmp = self.root / (store.step_name(step) + store.TMP_SUFFIX)
        if self.rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
            train = _find(state, TrainState)
            if train is not None and train.config_yaml:
                (tmp / store.CONFIG_FILE).write_text(train.config_yaml)
        self._saves += 1  # the same count on every rank: save ids need no collective
        save_id = f"{self._token}-{self._saves}-step{step}"
        if direct:
            staged_times = {}
            self._saving_here = step  # for stopped_line: a save the main thread is in
            try:
                if planned is not None:
                    staged = self._stager.stage(planned, 0)
                    staged_times = {
                        "state_dict_s": staged.state_dict_s,
                        "alloc_s": staged.alloc_s,
                        "stage_s": staged.stage_s,
                    }
                    out = self._write_here(self._stager.state_dict(staged), tmp, save_id)
                else:
                    out = self._write_here(state, tmp, save_id)
            except _ERRORS as e:
                raise self._failure(step, tmp, e, _state_bytes(state)) from None
            t_commit = time.perf_counter()
            size = self._commit(tmp, step, out["file_hashes"], save_id) if self.rank == 0 else 0
            self._saving_here = None
            blocking = total = time.perf_counter() - t0
            commit = time.perf_counter() - t_commit
            self._record(
                step,
                blocking_s=blocking,
                total_s=total,
                drain_s=drain,
                **staged_times,
                write_s=out["write_s"],
                commit_s=commit,
                bytes=out["bytes"],
                checkpoint_bytes=size,
                **out["times"],
            )
        else:
            index = self._free_index()
            staged = self._stager.stage(planned, index)
            blocking = time.perf_counter() - t0
            future = self._executor.submit(self._write, staged, tmp, step, save_id)
            pending = _Pending(
                step,
                future,
                t0,
                blocking,
                waited,
                {
                    "drain_s": drain,
                    "state_dict_s": staged.state_dict_s,
                    "alloc_s": staged.alloc_s,
                    "stage_s": staged.stage_s,
                },
                staged.nbytes,
                staged.buffer,
            )
            future.add_done_callback(lambda _: pending.end.append(time.perf_counter()))
            self._pending.append(pending)
        self._last_saved_step = step
        return {"save_blocking_s": blocking, "save_wait_prev_s": waited}

    def _sync_staging(self, state: Mapping[str, Any]) -> bool:
        """Whether this manager stages its saves: always in async modes; in sync mode when a
        copy of the state fits in half of the host memory available on every rank (decided
        once, by all ranks alike: a collective on `_ctl` at the first call, which every rank
        makes at the same step). Otherwise sync writes from the device tensors, logged."""
        if self.cfg.mode != "sync":
            return True
        if self._sync_staged is None:
            need = _state_bytes(state) * int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            available = staging.host_memory_available()
            fits = available is None or need <= available // 2
            self._sync_staged = bool(self._minimum([int(fits)])[0])
            if not self._sync_staged:
                self._log(
                    f"sync saves write from the device tensors (slower): a staging copy of "
                    f"{need / 2**30:.1f} GiB per node exceeds half of the host memory available"
                )
                self._stager = None
        return self._sync_staged

    def _writer_starting(self, step: int) -> bool:
        """async_process: whether the writer process of some rank has not started yet (all
        ranks agree, on `_ctl`). Until every one has, saves are written by this process as in
        sync mode: a save due while the writers start (seconds: the child imports torch) is
        taken at its step, never deferred behind them. No save is in a writer meanwhile, so
        polling its pipe here is safe."""
        if self._writer is None or self._writers_up:
            return False
        (ready,) = self._minimum([int(self._writer.wait_ready(0))])
        self._writers_up = bool(ready)
        if not ready:
            self._log(
                f"step {step}: saving from the training process (sync): the writer process "
                "is still starting"
            )
        return not ready

    def _free_index(self) -> int:
        busy = {p.buffer for p in self._pending if not p.future.done()}
        return next(i for i in range(self._buffer_count()) if i not in busy)

    def _buffers_allocated(self, buffers: list[torch.Tensor]) -> None:
        self._buffer_version += 1
        if self._writer is not None:
            self._writer.set_buffers(buffers, self._buffer_version)

    def _write_here(self, state: Mapping[str, Any], tmp: Path, save_id: str) -> dict[str, Any]:
        """Write `state` (device tensors, or a staging buffer's views) into `tmp` from this
        process: the DCP save with this manager's writer settings."""
        return write_checkpoint(
            state,
            tmp,
            save_id=save_id,
            algorithm=self._algorithm,
            thread_count=self.cfg.write_threads,
            sync_files=self.cfg.sync_files,
            process_group=self._pg,
            no_dist=not self._dist,
        )

    def _write(self, staged, tmp: Path, step: int, save_id: str) -> dict[str, Any]:
        """The writer thread: one save from a staging buffer, then (rank 0) its commit."""
        t_start = time.perf_counter()
        try:
            if self._writer is not None:
                out = self._writer.save(
                    {
                        "version": self._buffer_version,
                        "buffer": staged.buffer,
                        "skeleton": staged.skeleton,
                        "slots": staged.slots,
                        "copied": staged.copied,
                        "path": str(tmp),
                        "save_id": save_id,
                        "algorithm": self._algorithm,
                        "threads": self.cfg.write_threads,
                        "sync_files": self.cfg.sync_files,
                    }
                )
            else:
                with _switch_interval(_WRITE_SWITCH_INTERVAL_S):
                    out = self._write_here(self._stager.state_dict(staged), tmp, save_id)
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # nothing committed; give the space back
            raise
        out["write_start"] = t_start
        if self.rank == 0:
            t_commit = time.perf_counter()
            out["checkpoint_bytes"] = self._commit(tmp, step, out["file_hashes"], save_id)
            out["commit_s"] = time.perf_counter() - t_commit
        return out

    def _commit(self, tmp: Path, step: int, hashes: dict, save_id: str) -> int:
        """Rank 0, after every rank's data is written: manifest, rename, prune. Returns the
        checkpoint's size in bytes."""
        manifest = store.write_manifest(
            tmp,
            step=step,
            world_size=self.world_size,
            checksum=self.cfg.checksum,
            extra={
                "mode": self.cfg.mode,
                "torch": torch.__version__,
                **({"corpus": self.corpus} if self.corpus else {}),
            },
            hashes=hashes,
            algorithm=self._algorithm or "crc32",
            save_id=save_id,
        )
        final = self.root / store.step_name(step)
        store.commit(tmp, final)
        size = sum(f["size"] for f in manifest["files"].values())
        self._log(f"step {step} committed to {final} ({size / 2**20:.1f} MiB)")
        if self._pruner is None:
            self._pruner = ThreadPoolExecutor(1, thread_name_prefix="ckpt-prune")
        self._pruner.submit(self._prune)
        return size

    def _prune(self) -> None:
        """Rank 0's pruner thread: delete committed checkpoints beyond keep_last (never the
        newest; `.tmp` directories being written are not listed)."""
        failed: list[tuple[Path, Path, str]] = []
        try:
            pruned = store.prune(self.root, self.cfg.keep_last, failed, hold=self._hold)
        except OSError as e:  # a checkpoint left behind costs space, never a run
            self._log(f"could not prune old checkpoints in {self.root}: {e}")
            return
        if pruned:
            self._log(f"pruned {', '.join(p.name for p in pruned)}")
        for path, left, error in failed:
            self._log(
                f"could not prune {path.name}: {error}; it is left as {left} (ignored by resume, "
                "taking space until removed); training goes on"
            )

    def _wait_pruned(self) -> None:
        if self._pruner is not None:
            self._pruner.submit(lambda: None).result()

    def _failure(self, step: int, tmp: Path, e: BaseException, rank_bytes: int) -> BaseException:
        """The error a failed save raises: a one-line ConfigError for a full disk."""
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        os_err = os_error_in(e)
        if os_err is not None and os_err.errno == 28:  # ENOSPC
            try:
                free = shutil.disk_usage(self.root).free
            except OSError:
                free = math.nan
            need = rank_bytes * self.world_size
            return ConfigError(
                f"checkpoint save of step {step} failed: no space left on device under "
                f"{self.root} ({format_bytes(free)} free; this checkpoint needs about "
                f"{format_bytes(need)}, {format_bytes(rank_bytes)} of it from rank "
                f"{self.rank}); nothing was committed and the earlier checkpoints are intact; "
                "free space or set checkpoint.dir to a larger filesystem"
            )
        if os_err is not None and os_err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            where = os_err.filename or self.root
            return ConfigError(
                f"checkpoint save of step {step} failed: {os_err.strerror or os_err} ({where}); "
                "nothing was committed and the earlier checkpoints are intact; make "
                f"{self.root} writable (or set checkpoint.dir to a writable filesystem) and "
                "resume"
            )
        return RuntimeError(f"checkpoint save of step {step} failed: {_first_line(e)}")

    def _record(self, step: int, **numbers: float) -> None:
        record = {"save_step": step, "save_mode": self.cfg.mode}
        record.update({f"save_{k}": v for k, v in numbers.items()})
        self._completed.append(record)
        nbytes = numbers.get("bytes", 0)
        rate = lambda n, s: f"{n / s / 1e9:.2f} GB/s" if s and n else "-"  # noqa: E731
        self._log(
            f"step {step} saved ({self.cfg.mode}): blocking {numbers['blocking_s']:.3f}s"
            + (
                f" (staging {numbers['stage_s']:.3f}s, {rate(nbytes, numbers['stage_s'])})"
                if "stage_s" in numbers
                else ""
            )
            + f", write {numbers['write_s']:.3f}s ({rate(nbytes, numbers['write_s'])} "
            f"from this rank), total {numbers['total_s']:.3f}s"
        )
        self._append_log({"event": "saved", **record})

    def _note(self, message: str, record: dict) -> None:
        self._log(message)
        self._append_log({**record, "save_mode": self.cfg.mode})

    def _append_log(self, record: dict) -> None:
        if self.rank != 0:
            return
        try:
            with (self.run_dir / SAVES_LOG).open("a") as f:
                f.write(json.dumps({"time": time.time(), **record}) + "\n")
        except OSError:
            pass  # a log of timings must not stop a run

    def _settle(self, pending: _Pending) -> None:
        try:
            out = pending.future.result()
        except _ERRORS as e:
            # The run stops: let the saves queued behind this one end first (on every rank, so
            # no rank's writer is left inside a collective); their outcome is not raised.
            while self._pending:
                self._pending.popleft().future.exception()
            raise self._failure(
                pending.step,
                self.root / (store.step_name(pending.step) + store.TMP_SUFFIX),
                e,
                pending.bytes,
            ) from None
        end = pending.end[0] if pending.end else time.perf_counter()
        self._record(
            pending.step,
            blocking_s=pending.blocking_s,
            total_s=end - pending.start,
            wait_prev_s=pending.wait_s,
            **pending.staging,
            queue_s=max(0.0, out["write_start"] - (pending.start + pending.blocking_s)),
            **({"start_wait_s": out["start_wait_s"]} if "start_wait_s" in out else {}),
            write_s=out["write_s"],
            **({"commit_s": out["commit_s"]} if "commit_s" in out else {}),
            bytes=pending.bytes,
            checkpoint_bytes=out.get("checkpoint_bytes", 0),
            **out["times"],
        )

    def _poll(self) -> None:
        """Settle the saves that finished, in order, up to the first failed one: failures are
        raised where every rank raises them at the same step (`_agree`, blocking waits)."""
        while self._pending and self._pending[0].future.done():
            if self._pending[0].future.exception() is not None:
                return
            self._settle(self._pending.popleft())

    def _wait_for_buffer(self) -> float:
        """Block until this rank has a free staging buffer (settling saves in order)."""
        t0 = time.perf_counter()
        while self._pending and self._free_buffers() == 0:
            self._settle(self._pending[0])  # listed while waited for (stopped_line)
            self._pending.popleft()
        self._poll()
        return time.perf_counter() - t0

    def _wait_all(self) -> float:
        t0 = time.perf_counter()
        while self._pending:
            self._settle(self._pending[0])  # listed while waited for (stopped_line)
            self._pending.popleft()
        return time.perf_counter() - t0

    # -- end ----------------------------------------------------------------------------------

    def finish(self, step: int, state: Mapping[str, Any], save: bool = True) -> None:
        """End of training: save `step` (checkpoint.save_at_end, unless `save=False` or it was
        just saved), wait for in-flight async saves, close."""
        if self._closed:
            return
        if save and self.saving and self.cfg.save_at_end and step != self._last_saved_step:
            self.save(step, state)
        self._wait_all()
        self._wait_pruned()
        if self._dist:
            dist.barrier(group=self._pg)
        self.close()

    def stopped_line(self, step: int) -> str:
        """What a run stopped at once after `step` leaves behind (rank 0 reads the checkpoint
        directory): the newest committed checkpoint, the steps not saved, the saves in flight
        that are abandoned."""
        newest = store.newest_step(self.root)
        in_flight = sorted(
            {p.step for p in self._pending if not p.future.done()}
            | ({self._saving_here} if self._saving_here is not None else set())
        )
        if newest is None:
            line = f"stopped at once after step {step}; no checkpoint committed in {self.root}"
            if step:
                line += f"; steps 1-{step} not saved"
        elif newest.step >= step:
            line = f"stopped at once after step {step}; checkpoint {newest.path} committed"
        else:
            lost = f"{newest.step + 1}-{step}" if step > newest.step + 1 else str(step)
            line = (
                f"stopped at once after step {step}; checkpoint {newest.path} committed; "
                f"step{'s' if '-' in lost else ''} {lost} not saved"
            )
        if in_flight:
            steps = ", ".join(map(str, in_flight))
            line += f" (the save of step {steps} in flight was abandoned)"
        if newest is not None:
            line += "; run the same command to resume from it"
        return line

    def abandon(self) -> None:
        """For a process about to end at once (a second Ctrl-C): release the run lock and stop
        the writer process without waiting for any save; a save in flight stays an
        uncommitted `.tmp` directory, which the next start removes."""
        self._closed = True
        _OPEN.discard(self)
        if self._writer is not None:
            self._writer.kill()
        if self._lock is not None:
            self._lock.release()

    def close(self) -> None:
        """Wait for saves in flight, stop the writers, free the buffers, release the lock."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        try:
            if self._pending:
                self._wait_all()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            if self._pruner is not None:
                self._pruner.shutdown(wait=True)
            if self._writer is not None:
                self._writer.close()
            if self._stager is not None:
                self._stager.close()
            if self._lock is not None:
                self._lock.release()

    def stats(self) -> dict[str, float]:
        """The newest save completed since the last call, for the metrics log: save_step,
        save_blocking_s (what the loop waited), save_total_s (start to commit), and where
        measured save_stage_s (the copy into the staging buffer; save_state_dict_s and
        save_alloc_s: the Statefuls' state_dict() calls and buffer allocation before it),
        save_drain_s (waiting for the device to finish the step already queued: part of the
        blocking time, though the device was busy anyway),
        save_wait_prev_s (waiting for a free buffer), save_queue_s (staged to write start), save_write_s (the DCP save), save_commit_s
        (rank 0: manifest, rename; old checkpoints are pruned on another thread), save_bytes
        (this rank's bytes), save_file_s / save_write_calls_s / save_hash_s / save_fsync_s
        (this rank's file writing, summed over its files: checkpoint/writer.py),
        save_checkpoint_bytes (rank 0: the whole checkpoint). Empty when none completed."""
        self._poll()
        done, self._completed = self._completed, []
        if not done:
            return {}
        last = dict(done[-1])
        last.pop("save_mode", None)
        return last  # save_step lets the logger release records the checkpoint covers

    # -- helpers ------------------------------------------------------------------------------

    def _broadcast(self, obj: Any) -> Any:
        if self._pg is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._pg)
        return box[0]


def _drain_device() -> float:
    """Wait for the work queued on this rank's GPU (the step just launched); its seconds.
    Part of what the loop waits for at a save, but time the device was busy anyway."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return 0.0
    t0 = time.perf_counter()
    torch.cuda.current_stream().synchronize()
    return time.perf_counter() - t0


def _state_bytes(state: Mapping[str, Any]) -> int:
    """This rank's bytes of model parameters and optimizer states (for the full-disk
    message; no state_dict() calls, which may run collectives)."""
    from checkpoint.state import OptimizerState
    from model.memory import tensor_bytes

    model, optim = _find(state, ModelState), _find(state, OptimizerState)
    tensors = list(model.model.parameters()) if model is not None else []
    if optim is not None:
        tensors += [
            v
            for st in optim.optimizer.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        ]
    return sum(tensor_bytes(getattr(t, "_local_tensor", t)) for t in tensors)


@contextlib.contextmanager
def _switch_interval(seconds: float):
    """The GIL switch interval at most `seconds` for the block (process-wide), then restored."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, seconds))
    try:
        yield
    finally:
        sys.setswitchinterval(before)
