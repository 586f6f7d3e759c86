"""CheckpointManager: when, how and where to save; what to resume from.

    ckpt = CheckpointManager(cfg.checkpoint, run_dir, rank=rank, world_size=world_size)
    start_step = ckpt.resume(state)       # 0 when starting fresh
    for step in ...:
        ...
        ckpt.maybe_save(step, state)      # every checkpoint.interval steps
    ckpt.finish(step, state)              # final save, wait for async writes, close

Modes: `sync` (dcp.save: the loop waits for the write), `async` (dcp.async_save on a thread:
the loop waits only for a copy of the state into (pinned, when CUDA is present) CPU memory),
`async_process` (the same copy, written by DCP's checkpoint process). All collectives of a save
run on a gloo group of their own, so a background write never interleaves with the training
loop's collectives.

Commit (checkpoint/store.py): every save goes to `step_XXXXXXX.tmp/`; rank 0 writes the
manifest and renames the directory once the save is complete on every rank. DCP's save ends
with a gather of every rank's write results to rank 0 before rank 0 writes `.metadata`, so
rank 0's save returning (sync) or its future completing (async) already means every rank
finished writing: rank 0 commits alone, with no extra barrier; for async saves it does so on
a thread of its own, off the training loop. The next async save waits for the previous one
(and its commit); `finish` waits for the last and then holds every rank at a barrier, so a
finished run always has its last checkpoint committed.

Resume (`checkpoint.resume`): `auto` takes the newest complete checkpoint of this run's
directory (none: start at step 0); `none` starts fresh; anything else is a path. Before
loading, rank 0 checks the manifest (every file present with its size, and its CRC32 when
`checkpoint.checksum` recorded one) and compares the model shape in the checkpoint's
config.yaml with the current config; every rank then checks that each tensor it will load
exists in the checkpoint with the same global shape. Each failure is a one-line ConfigError
on every rank. A damaged checkpoint is never loaded and never skipped silently, in auto mode
too: the error names the previous complete checkpoint to pass as `checkpoint.resume=<path>`
(or the damaged directory can be moved away). Resuming from an older step, or with
resume=none, renames the newer complete checkpoints of this directory to
`*.abandoned-<time>` (kept, ignored) so the new timeline's saves and pruning never mix with
them.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from checkpoint import store
from checkpoint.config import MODES, CheckpointConfig
from checkpoint.planners import BlockLoadPlanner, BlockSavePlanner
from checkpoint.state import TrainState
from errors import ConfigError

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


@dataclass
class _Pending:
    step: int
    future: Future  # rank 0: upload + commit; other ranks: upload
    start: float
    blocking_s: float
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


def request_problems(request: dict, saved: Mapping[str, Any]) -> list[str]:
    """Keys missing from the checkpoint, tensors whose global shape differs, and model or
    optimizer entries of the checkpoint that this run would not load."""
    problems = []
    flat = _flatten(request)
    for fqn in saved:
        if fqn.startswith(COMPLETE_PARTS) and fqn not in flat:
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


def stager_closed(stager: Any) -> bool:
    """True once DefaultStager.close() ran: it empties its copier's dispatch table."""
    inner = getattr(stager, "_state_dict_stager", None)
    table = getattr(inner, "_deepcopy_dispatch", None)
    return table is not None and len(table) == 0


def _find(state: Mapping[str, Any], cls: type):
    return next((v for v in state.values() if isinstance(v, cls)), None)


class CheckpointManager:
    def __init__(
        self,
        cfg: CheckpointConfig,
        run_dir: str | Path,
        rank: int = 0,
        world_size: int = 1,
        *,
        log: Callable[[str], None] | None = None,
    ):
        if cfg.mode not in MODES:
            raise ConfigError(f"checkpoint.mode={cfg.mode!r} is not one of {', '.join(MODES)}")
        if cfg.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last={cfg.keep_last} must be >= 1")
        if cfg.interval < 0:
            raise ConfigError(
                f"checkpoint.interval={cfg.interval} must be >= 0 (0: no periodic saves)"
            )
        self._dist = dist.is_available() and dist.is_initialized()
        if self._dist and (rank, world_size) != (dist.get_rank(), dist.get_world_size()):
            raise ValueError(
                f"CheckpointManager(rank={rank}, world_size={world_size}) does not "
                f"match torch.distributed ({dist.get_rank()}, "
                f"{dist.get_world_size()}): pass the global rank and world size"
            )
        if cfg.mode == "async_process" and not self._dist:
            raise ConfigError(
                "checkpoint.mode=async_process needs torch.distributed (launch with "
                "torchrun); use checkpoint=async for a single process"
            )
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.run_dir = Path(run_dir)
        self.root = checkpoint_root(cfg, self.run_dir)
        self.saving = cfg.mode != "none"
        self._log = (
            log
            if log is not None
            else (
                (lambda msg: print(f"checkpoint: {msg}", flush=True))
                if rank == 0
                else (lambda msg: None)
            )
        )
        # A group of its own: async writes run collectives from a background thread.
        self._pg = dist.new_group(backend="gloo") if self._dist else None
        self._stager = None
        self._committer = (
            ThreadPoolExecutor(1, thread_name_prefix="ckpt-commit")
            if rank == 0 and cfg.mode in ("async", "async_process")
            else None
        )
        self._pending: _Pending | None = None
        self._last_saved_step: int | None = None
        self._completed: list[dict[str, float]] = []
        self._closed = False

    # -- resume -------------------------------------------------------------------------------

    def resume(self, state: Mapping[str, Any]) -> int:
        """Load the checkpoint `checkpoint.resume` points to into `state`; returns its step (0
        when starting fresh). Call once, on every rank, before the first save."""
        decision = None
        if self.rank == 0:
            try:
                decision = self._decide(state)
            except Exception as e:  # every rank must hear of it, or the others wait forever
                decision = {"path": None, "step": 0, "error": None, "crash": repr(e)}
        decision = self._broadcast(decision)
        if decision.get("crash"):
            raise RuntimeError(f"checkpoint resume failed on rank 0: {decision['crash']}")
        if decision["error"]:
            raise ConfigError(decision["error"])
        if decision["path"] is None:
            return 0
        path, step = Path(decision["path"]), decision["step"]
        t0 = time.perf_counter()
        self._load(path, state)
        train = _find(state, TrainState)
        if train is not None and train.step != step:
            raise ConfigError(
                f"checkpoint {path}: its manifest says step {step} but its train "
                f"state says {train.step}; the checkpoint is inconsistent"
            )
        if self.rank == 0 and self.saving and self.cfg.resume != "auto":
            for p in store.abandon_newer(self.root, step):
                self._log(f"newer checkpoint of the old timeline moved aside: {p}")
        if self._dist:
            dist.barrier(group=self._pg)
        same_dir = path.resolve().parent == self.root.resolve()
        self._last_saved_step = step if same_dir else None
        self._log(f"resumed from {path} (step {step}) in {time.perf_counter() - t0:.2f}s")
        return step

    def _decide(self, state: Mapping[str, Any]) -> dict[str, Any]:
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
            found = store.newest_complete(self.root)
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
        problem = store.verify(found.path, checksum=True)
        if problem:
            older = [c for c in store.list_complete(found.path.parent) if c.step < found.step]
            hint = (
                f"pass checkpoint.resume={older[-1].path} to resume from the previous "
                "complete checkpoint"
                if older
                else "there is no earlier complete checkpoint; use checkpoint.resume=none to "
                "start fresh"
            )
            return {
                "path": None,
                "step": 0,
                "error": (
                    f"checkpoint {found.path} is damaged ({problem}) and was not loaded; {hint}, "
                    "or move the damaged directory away"
                ),
            }
        train = _find(state, TrainState)
        saved_yaml = found.path / store.CONFIG_FILE
        mismatches = model_shape_mismatches(
            saved_yaml.read_text() if saved_yaml.is_file() else None,
            train.config_yaml if train is not None else None,
        )
        if mismatches:
            return {
                "path": None,
                "step": 0,
                "error": (
                    f"{'; '.join(mismatches)} (checkpoint {found.path}); resume with the "
                    "checkpoint's model settings, or set checkpoint.resume=none to start fresh"
                ),
            }
        return {"path": str(found.path), "step": found.step, "error": None}

    def _load(self, path: Path, state: Mapping[str, Any]) -> None:
        saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        request: dict[str, Any] = {}
        for key, part in state.items():
            if hasattr(part, "load_request"):
                prefix = key + "."
                request[key] = part.load_request(
                    {k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix)}
                )
            else:
                request[key] = part.state_dict()
        problems = request_problems(request, saved)
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
        dcp.load(
            request,
            checkpoint_id=str(path),
            planner=BlockLoadPlanner(),
            process_group=self._pg,
            no_dist=not self._dist,
        )
        for key, part in state.items():
            part.load_state_dict(request[key])

    # -- save ---------------------------------------------------------------------------------

    def maybe_save(
        self, step: int, state: Mapping[str, Any], force: bool = False
    ) -> dict[str, float] | None:
        """Save when `step` is a multiple of checkpoint.interval (or `force`). Returns the
        timings of this save (what the loop waited), or None when not saving."""
        self._poll()
        if not self.saving or step == self._last_saved_step:
            return None
        if force or (self.cfg.interval > 0 and step % self.cfg.interval == 0):
            return self.save(step, state)
        return None

    def save(self, step: int, state: Mapping[str, Any]) -> dict[str, float]:
        t0 = time.perf_counter()
        waited = self._wait_pending()
        tmp = self.root / (store.step_name(step) + store.TMP_SUFFIX)
        if self.rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
            train = _find(state, TrainState)
            if train is not None and train.config_yaml:
                (tmp / store.CONFIG_FILE).write_text(train.config_yaml)
        writer = FileSystemWriter(str(tmp))
        if self.cfg.mode == "sync":
            dcp.save(
                state,
                storage_writer=writer,
                planner=BlockSavePlanner(),
                process_group=self._pg,
                no_dist=not self._dist,
            )
            blocking = time.perf_counter() - t0
            if self.rank == 0:
                self._commit(tmp, step)
            self._record(step, blocking, time.perf_counter() - t0)
        else:
            kind = (
                AsyncCheckpointerType.PROCESS
                if self.cfg.mode == "async_process"
                else AsyncCheckpointerType.THREAD
            )
            upload = dcp.async_save(
                state,
                storage_writer=writer,
                planner=BlockSavePlanner(),
                process_group=self._pg,
                async_checkpointer_type=kind,
                async_stager=self._get_stager(),
                no_dist=not self._dist,
            )
            blocking = time.perf_counter() - t0
            if self._committer is not None:
                upload = self._committer.submit(self._commit_when_written, upload, tmp, step)
            pending = _Pending(step, upload, t0, blocking)
            upload.add_done_callback(lambda _: pending.end.append(time.perf_counter()))
            self._pending = pending
        self._last_saved_step = step
        return {"save_blocking_s": blocking, "save_wait_prev_s": waited}

    def _get_stager(self):
        # Some torch releases (2.11) close the stager handed to dcp.async_save once it has
        # staged; a closed stager cannot stage again, so a new one replaces it.
        if self._stager is not None and stager_closed(self._stager):
            self._stager = None
        if self._stager is None:
            try:
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            except ImportError:  # older torch: DCP's built-in staging
                return None
            cuda = torch.cuda.is_available()
            # Staging completes before async_save returns (use_async_staging=False): the next
            # optimizer step may then overwrite the parameters while the copy is written.
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=self.cfg.mode == "async_process",
                    use_async_staging=False,
                    use_non_blocking_copy=cuda,
                )
            )
        return self._stager

    def _commit_when_written(self, upload: Future, tmp: Path, step: int) -> None:
        upload.result()
        self._commit(tmp, step)

    def _commit(self, tmp: Path, step: int) -> None:
        """Rank 0, after every rank's data is written: manifest, rename, prune."""
        manifest = store.write_manifest(
            tmp,
            step=step,
            world_size=self.world_size,
            checksum=self.cfg.checksum,
            extra={"mode": self.cfg.mode, "torch": torch.__version__},
        )
        final = self.root / store.step_name(step)
        store.commit(tmp, final)
        size = sum(f["size"] for f in manifest["files"].values())
        pruned = store.prune(self.root, self.cfg.keep_last)
        self._log(
            f"step {step} committed to {final} ({size / 2**20:.1f} MiB)"
            + (f"; pruned {', '.join(p.name for p in pruned)}" if pruned else "")
        )

    def _record(self, step: int, blocking: float, total: float) -> None:
        self._completed.append(
            {"save_step": step, "save_blocking_s": blocking, "save_total_s": total}
        )
        self._log(
            f"step {step} saved ({self.cfg.mode}): blocking {blocking:.3f}s, total {total:.3f}s"
        )

    def _settle(self, pending: _Pending) -> None:
        try:
            pending.future.result()
        except Exception as e:
            raise RuntimeError(f"checkpoint save of step {pending.step} failed: {e}") from e
        # The done-callback may not have run yet when result() returns: then now is close.
        end = pending.end[0] if pending.end else time.perf_counter()
        self._record(pending.step, pending.blocking_s, end - pending.start)

    def _poll(self) -> None:
        if self._pending is not None and self._pending.future.done():
            pending, self._pending = self._pending, None
            self._settle(pending)

    def _wait_pending(self) -> float:
        if self._pending is None:
            return 0.0
        t0 = time.perf_counter()
        pending, self._pending = self._pending, None
        self._settle(pending)
        return time.perf_counter() - t0

    # -- end ----------------------------------------------------------------------------------

    def finish(self, step: int, state: Mapping[str, Any], save: bool = True) -> None:
        """End of training: save `step` (checkpoint.save_at_end, unless `save=False` or it was
        just saved), wait for in-flight async saves, close."""
        if self._closed:
            return
        if save and self.saving and self.cfg.save_at_end and step != self._last_saved_step:
            self.save(step, state)
        self._wait_pending()
        if self._dist:
            dist.barrier(group=self._pg)
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pending is not None:
            self._wait_pending()
        if self._committer is not None:
            self._committer.shutdown(wait=True)
        if self._stager is not None:
            self._stager.close()

    def stats(self) -> dict[str, float]:
        """The newest save committed since the last call, for the metrics log: save_step,
        save_blocking_s (what the loop waited) and save_total_s (start to commit). Empty when
        none completed."""
        self._poll()
        done, self._completed = self._completed, []
        if not done:
            return {}
        last = done[-1]
        return dict(last)  # save_step lets the logger release records the checkpoint covers

    # -- helpers ------------------------------------------------------------------------------

    def _broadcast(self, obj: Any) -> Any:
        if self._pg is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._pg)
        return box[0]
