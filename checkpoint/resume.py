"""The resume side of a CheckpointManager: which checkpoint (find, decide), loading it
(verified as it is read), the checks after the load, and the watch on a resumed segment's
first losses.

    resumer = Resumer(ctx)                      # checkpoint/context.py
    step = resumer.plan_resume(config_yaml, check, accept_corpus)   # before the model exists
    step = resumer.resume(state)                # loads what plan_resume decided

Why a module of its own: resuming reads, the save side writes; they share nothing but the
manager's context, the step a resume leaves as saved (`loaded`, `resumed`) and the record of
an unconfirmed resume that pruning reads (`watch_loss`, `judge_loss`: store.UNCONFIRMED).

The decision (rank 0, filesystem only: `decide`) is a chain of checks, each a function that
returns the one-line error every rank raises, or None: `_locate` (the spec: auto, a path),
`_integrity_error` (entry, manifest, hashes of the small files, `.metadata`), `_step_error`
(directory name against manifest), `_config_error` (model shape, another run's directory),
`_corpus_error` and the caller's `check`. The first error wins, in that order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpoint import hashing, store
from checkpoint.config import CheckpointConfig
from checkpoint.context import ERRORS, Context, checkpoint_root, find, first_line
from checkpoint.health import Recent, ResumeWatch, logged_losses
from checkpoint.planners import BlockLoadPlanner
from checkpoint.reader import CheckpointReader, first_problem
from checkpoint.state import ModelState, TrainState
from errors import ConfigError

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
#: Parts whose every saved entry must be loaded: an entry the run does not ask for would be
#: dropped without a word (e.g. moments of an optimizer whose state is only partly built).
COMPLETE_PARTS = ("model.", "optimizer.")


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


def damaged(path: Path, problem: str, hint: str) -> str:
    """The one line of a damaged checkpoint: what is wrong, what to resume from instead."""
    return (
        f"checkpoint {path} is damaged ({problem}) and was not loaded; {hint}, "
        "or move the damaged directory away"
    )


# -- the decision (rank 0, filesystem only) ------------------------------------------------------


def _refused(error: str) -> dict[str, Any]:
    return {"path": None, "step": 0, "error": error}


def _fresh() -> dict[str, Any]:
    return {"path": None, "step": 0, "error": None}


def decide(
    ctx: Context,
    config_yaml: str | None,
    check: Callable[[str, int], Any] | None = None,
    accept_corpus: bool = False,
) -> dict[str, Any]:
    """Rank 0: which checkpoint to load, or the one-line error every rank will raise. The
    decision: {"path", "step", "error"} and, for a checkpoint to load, "hint" (what to resume
    from should the load find it damaged)."""
    spec = str(ctx.cfg.resume)
    if ctx.saving:
        for p in store.clean_partial(ctx.root):
            ctx.log(f"removed partial checkpoint {p}")
    if spec == "none":
        if ctx.saving:
            for p in store.abandon_newer(ctx.root, -1):
                ctx.log(f"checkpoint.resume=none: existing checkpoint moved aside: {p}")
            store.clear_unconfirmed(ctx.root)  # a fresh timeline: nothing of it to judge
        return _fresh()
    found, error = _locate(ctx, spec)
    if error is not None:
        return _refused(error)
    if found is None:
        if ctx.saving and spec == "auto":
            store.clear_unconfirmed(ctx.root)  # no checkpoint left that it could be about
        return _fresh()
    hint = _previous_hint(found)
    error = _integrity_error(ctx, found.path, hint) or _step_error(found.path, hint)
    if error is None:
        saved_file = found.path / store.CONFIG_FILE
        saved_yaml = saved_file.read_text() if saved_file.is_file() else None
        error = (
            _config_error(ctx, spec, found.path, saved_yaml, config_yaml, hint)
            or _corpus_error(ctx, found.path, accept_corpus)
            or _check_error(check, saved_yaml, found.step)
        )
    if error is not None:
        return _refused(error)
    return {"path": str(found.path), "step": found.step, "error": None, "hint": hint}


def _locate(ctx: Context, spec: str) -> tuple[Any, str | None]:
    """The checkpoint `spec` (auto or a path) names, or None (auto: nothing to resume); with
    a path that holds none, the error. Auto announces step directories renamed by hand."""
    if spec == "auto":
        found = store.newest_step(ctx.root)
        for c in store.renamed_steps(ctx.root):
            if found is None or c.step > found.step:
                ctx.log(
                    f"{c.path} is not resumed from: its name is not a step directory's "
                    f"(renamed?); "
                    + (f"resuming from {found.path}" if found else "starting fresh")
                    + f" (rename it back to {store.step_name(c.step)} to resume from it)"
                )
        return found, None
    found = store.find_checkpoint(Path(spec).expanduser())
    if found is None:
        return None, (
            f"checkpoint.resume={spec}: no checkpoint there (expected a step_XXXXXXX "
            f"directory with {store.MANIFEST}, or a directory holding them); fix the "
            "path, or use checkpoint.resume=auto|none"
        )
    return found, None


def _previous_hint(found) -> str:
    """What a refusal of `found` suggests: the previous complete checkpoint, or none."""
    older = [c for c in store.list_complete(found.path.parent) if c.step < found.step]
    return (
        f"pass checkpoint.resume={older[-1].path} to resume from the previous complete checkpoint"
        if older
        else "there is no earlier complete checkpoint; use checkpoint.resume=none to start fresh"
    )


def _integrity_error(ctx: Context, path: Path, hint: str) -> str | None:
    """The entry (a readable directory), its files against the manifest, the hashes of the
    small files rank 0 reads next (checkpoint.checksum) and `.metadata`."""
    problem = store.entry_problem(path)
    if problem and "cannot read" in problem:
        return (
            f"checkpoint {path}: {problem}; give this run read access to it "
            f"(chmod/chown), or {hint}"
        )
    if problem:
        return damaged(path, problem, hint)
    problem = store.verify_layout(path)
    if not problem and ctx.cfg.checksum:  # the small files rank 0 reads next, first
        manifest = store.read_manifest(path)
        small = [n for n in (".metadata", store.CONFIG_FILE) if n in manifest["files"]]
        try:
            problem = store.verify_hashes(path, small, manifest)
        except ConfigError as e:  # e.g. xxh3-64 recorded, xxhash missing: not damage
            return f"checkpoint {path}: {e}"
    problem = problem or metadata_problem(path)
    return damaged(path, problem, hint) if problem else None


def metadata_problem(path: Path) -> str | None:
    """`.metadata` unreadable, or written by another save than the manifest's."""
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except ERRORS as e:
        return f".metadata is unreadable ({first_line(e)})"
    want = (store.read_manifest(path) or {}).get("save_id")
    got = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
    if want and got != want:
        return ".metadata belongs to another save than the manifest (swapped in?)"
    return None


def _step_error(path: Path, hint: str) -> str | None:
    """A step directory whose name and manifest disagree on the step."""
    named = store.dir_step(path)
    recorded = (store.read_manifest(path) or {}).get("step")
    if named is None or recorded == named:
        return None
    if isinstance(recorded, int):
        # Either side may be the true one: say what differs and what each case needs.
        back = store.step_name(recorded)
        rename = (
            f"move {back} away first to rename it back"
            if (path.parent / back).exists()
            else f"then rename it back to {back}"
        )
        return (
            f"checkpoint {path}: its {store.MANIFEST} says step {recorded} but the directory "
            f"is {path.name}: the manifest was edited, or the directory renamed ({rename}); "
            f"{hint}, or move it away"
        )
    return f"checkpoint {path}: its {store.MANIFEST} records no step; {hint}, or move it away"


def _config_error(
    ctx: Context,
    spec: str,
    path: Path,
    saved_yaml: str | None,
    config_yaml: str | None,
    hint: str,
) -> str | None:
    """The saved config: readable, of this run (auto with a checkpoint directory outside the
    run directory: the same run.name), with this run's model shape."""
    try:
        mismatches = model_shape_mismatches(saved_yaml, config_yaml)
        # Checkpoints in this run's directory are its own (a copied run directory
        # included); an absolute checkpoint.dir outside it may be another run's.
        shared = not ctx.root.resolve().is_relative_to(ctx.run_dir.resolve())
        owner = _run_name(saved_yaml) if spec == "auto" and shared else None
    except (yaml.YAMLError, AttributeError, TypeError, UnicodeDecodeError) as e:
        problem = f"{store.CONFIG_FILE} is not a readable config ({first_line(e)})"
        return damaged(path, problem, hint)
    mine = _run_name(config_yaml)
    if owner is not None and mine is not None and owner != mine:
        return (
            f"checkpoint.dir={ctx.cfg.dir}: {ctx.root} holds the checkpoints of run "
            f"{owner} (newest: {path}), not of run.name={mine}; give this run a "
            f"checkpoint.dir of its own, or resume from it on purpose with "
            f"checkpoint.resume={path}"
        )
    if mismatches:
        return (
            f"{'; '.join(mismatches)} (checkpoint {path}); resume with the "
            "checkpoint's model settings, or train this model as a separate run with "
            "another run.name (checkpoint.resume=none would move this run's "
            "checkpoints aside)"
        )
    return None


def _corpus_error(ctx: Context, path: Path, accept_corpus: bool) -> str | None:
    """The corpus the checkpoint was trained on against this run's (logged when accepted)."""
    saved_corpus = (store.read_manifest(path) or {}).get("corpus")
    if not (saved_corpus and ctx.corpus and saved_corpus != ctx.corpus):
        return None
    if not accept_corpus:
        return (
            f"checkpoint {path} was trained on another corpus ({saved_corpus}; "
            f"this run's is {ctx.corpus}), so the run would continue on different "
            "data; resume with the data it was trained on (data=embedded: under "
            "the Python version it names), or accept the change on purpose with "
            "resume.accept=[data]"
        )
    ctx.log(
        f"corpus: {saved_corpus} in checkpoint {path}, {ctx.corpus} now; "
        "continuing on the new one (resume.accept)"
    )
    return None


def _check_error(
    check: Callable[[str, int], Any] | None, saved_yaml: str | None, step: int
) -> str | None:
    """The caller's config comparison (train.py's), as its one-line error."""
    if check is None or not saved_yaml:
        return None
    try:
        check(saved_yaml, step)
    except ConfigError as e:
        return str(e)
    return None


# -- the resumer --------------------------------------------------------------------------------


class Resumer:
    """Plans and loads a resume, and watches the resumed segment's first losses. After a
    load: `loaded` (the checkpoint's step) and `resumed` ((path, step) when the checkpoint is
    in this manager's directory: its saves go on from it)."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self._planned: dict[str, Any] | None = None
        self.loaded: int | None = None
        #: (path, step) of the checkpoint resumed from, in this manager's directory.
        self.resumed: tuple[Path, int] | None = None
        self._watch: ResumeWatch | None = None
        self._watch_policy = "off"
        #: The step of the resume being judged (an earlier one than `resumed`'s when a
        #: segment saved after it stopped before its verdict: `watch_loss`).
        self._judged_from: int | None = None

    def plan_resume(
        self,
        config_yaml: str | None = None,
        check: Callable[[str, int], Any] | None = None,
        accept_corpus: bool = False,
    ) -> int:
        """CheckpointManager.plan_resume: rank 0 decides (`decide`), every rank hears it."""
        ctx = self.ctx
        decision = None
        if ctx.rank == 0:
            try:
                decision = decide(ctx, config_yaml, check, accept_corpus)
            except OSError as e:  # e.g. a file of the checkpoint this run may not read
                decision = _refused(
                    f"checkpoint.resume={ctx.cfg.resume}: cannot read "
                    f"{e.filename or ctx.root} ({e.strerror or e}); give this run access "
                    "to it (chmod/chown), or pass checkpoint.resume=<another checkpoint>"
                )
            except Exception as e:  # every rank must hear of it, or the others wait forever
                decision = {"path": None, "step": 0, "error": None, "crash": first_line(e)}
        decision = ctx.broadcast(decision)
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
        """CheckpointManager.resume: load what `plan_resume` decided (planning first if it
        was not called), check it, and move a newer timeline aside."""
        ctx = self.ctx
        self.loaded = None
        if self._planned is None:
            train = find(state, TrainState)
            self.plan_resume(train.config_yaml if train is not None else None)
        decision, self._planned = self._planned, None
        if decision["path"] is None:
            return 0
        path, step = Path(decision["path"]), decision["step"]
        t0 = time.perf_counter()
        self._load(path, state, step, decision["hint"])
        self._check_loaded_finite(path, state, decision["hint"])
        self._check_train_step(path, state, step, decision["hint"])
        if ctx.rank == 0 and ctx.saving and ctx.cfg.resume != "auto":
            for p in store.abandon_newer(ctx.root, step):
                ctx.log(f"newer checkpoint of the old timeline moved aside: {p}")
        ctx.barrier()
        same_dir = path.resolve().parent == ctx.root.resolve()
        self.loaded = step
        self.resumed = (path, step) if same_dir else None
        seconds = time.perf_counter() - t0
        ctx.log(f"resumed from {path} (step {step}) in {seconds:.2f}s")
        if ctx.saving:  # a reading manager (train.eval_only, checkpoint=none) writes nothing
            manifest = store.read_manifest(path) or {"files": {}}
            ctx.append_log(
                {
                    "event": "resumed",
                    "step": step,
                    "path": str(path),
                    "seconds": seconds,
                    "bytes": sum(e.get("size", 0) for e in manifest["files"].values()),
                    "verified": bool(ctx.cfg.checksum),
                }
            )
        return step

    def _check_train_step(self, path: Path, state: Mapping[str, Any], step: int, hint: str) -> None:
        """The loaded train state's step is the step the checkpoint was chosen as."""
        train = find(state, TrainState)
        if train is not None and train.step != step:
            # decide made the directory name and the manifest agree (where the name is a
            # step directory's): both are named as the source of `step`.
            source = "directory name and manifest say" if store.dir_step(path) else "manifest says"
            raise ConfigError(
                f"checkpoint {path}: its {source} step {step} but its train state (the step "
                f"the saved training had reached) says {train.step}; the checkpoint is "
                f"inconsistent and was not resumed from; {hint}"
            )

    def reload(self, path: Path, step: int, state: Mapping[str, Any]) -> None:
        """CheckpointManager.reload's load: `path` (committed, of `step`) into `state`."""
        ctx = self.ctx
        ctx.barrier()
        if store.read_manifest(path) is None:
            raise RuntimeError(f"checkpoint {path} of the recipe switch is not committed")
        t0 = time.perf_counter()
        self._load(path, state, step, "the recipe switch cannot go on")
        ctx.barrier()
        ctx.log(f"reloaded {path} (step {step}) in {time.perf_counter() - t0:.2f}s")

    # -- loading ----------------------------------------------------------------------------

    def _reader(self, path: Path) -> CheckpointReader:
        """The DCP reader of a resume: with checkpoint.checksum it verifies every data file's
        hash with the bytes it loads (checkpoint/reader.py: each byte is read once; `.metadata`
        and config.yaml were verified by rank 0 before, in `decide`)."""
        manifest = store.read_manifest(path) or {"files": {}}
        hashed = any(hashing.recorded(e) for e in manifest["files"].values())
        if hashed and not self.ctx.cfg.checksum:
            self.ctx.log(f"not verifying the hashes of {path} (checkpoint.checksum=false)")
        return CheckpointReader(
            str(path),
            manifest=manifest,
            verify=self.ctx.cfg.checksum and hashed,
            threads=self.ctx.cfg.write_threads,
        )

    def _load(self, path: Path, state: Mapping[str, Any], step: int, hint: str) -> None:
        """Load `path` into `state`, verifying the hashes as it reads (`_reader`); every rank
        fails together, with one line naming the checkpoint, when a file of any rank is
        damaged."""
        request = self._request(path, state, step)
        reader = self._reader(path)
        t0 = time.perf_counter()
        failed = None
        try:
            dcp.load(
                request,
                checkpoint_id=str(path),
                storage_reader=reader,
                planner=BlockLoadPlanner(),
                process_group=self.ctx.pg,
                no_dist=not self.ctx.dist,
            )
        except ERRORS as e:
            failed = e
        self._raise_read_problems(path, reader, failed, hint)
        if reader.verify:
            files = reader.manifest["files"]
            size = sum(e["size"] for e in files.values())
            self.ctx.log(
                f"verified the hashes of {len(files)} files ({size / 2**30:.2f} GiB) of {path} "
                f"as they were loaded ({time.perf_counter() - t0:.2f}s, this rank read "
                f"{reader.bytes_read / 2**30:.2f} GiB; {reader.phases()})"
            )
        self._check_request_finite(path, request, hint)
        for key, part in state.items():
            part.load_state_dict(request[key])

    def _request(self, path: Path, state: Mapping[str, Any], step: int) -> dict[str, Any]:
        """What each part of `state` loads from `path` (its `load_request`, or its state
        dict), checked against the checkpoint's entries on every rank: every rank fails
        together, with the first problem of any rank, or none does."""
        try:
            saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        except ERRORS as e:
            raise ConfigError(
                f"checkpoint {path} is damaged (.metadata is unreadable: {first_line(e)})"
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
        everyone = self.ctx.gather(problems)  # every rank must fail together, or none
        if everyone is not None:
            problems = next((p for p in everyone if p), [])
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise ConfigError(
                f"checkpoint {path} does not fit this run: {problems[0]}{more}; "
                "resume with the settings it was saved with"
            )
        return request

    def _raise_read_problems(
        self, path: Path, reader: CheckpointReader, failed: BaseException | None, hint: str
    ) -> None:
        """After the read: the damage any rank's reader found (every rank reports every
        rank's damage alike), or the load's own failure."""
        found = list(reader.problems)
        everyone = self.ctx.gather(found)
        if everyone is not None:
            found = [p for ps in everyone for p in ps]
        first = first_problem(found)
        if first is not None:
            kind, problem = first
            if kind == "error":  # e.g. xxh3-64 recorded, xxhash missing: not damage
                raise ConfigError(f"checkpoint {path}: {problem}")
            raise ConfigError(damaged(path, problem, hint))
        if failed is not None:
            raise ConfigError(
                f"checkpoint {path} could not be loaded ({first_line(failed)}); it may be "
                "damaged: resume with checkpoint.checksum=true to check its files"
            ) from failed

    # -- finite values ----------------------------------------------------------------------

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
        everyone = self.ctx.gather(bad)
        if everyone is not None:
            bad = sorted(set().union(*everyone))
        return bad

    def _check_loaded_finite(self, path: Path, state: Mapping[str, Any], hint: str) -> None:
        """Every rank, right after a load: the model's weights (this rank's shards) are finite.
        A checkpoint whose hashes match but which holds nan or inf was saved that way; it
        would stop the run at its first step with a non-finite loss instead."""
        verified = self.ctx.cfg.checksum
        model = find(state, ModelState)
        bad = self._non_finite_everywhere(model.model.named_parameters() if model else ())
        if bad:
            more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
            raise ConfigError(
                f"checkpoint {path} holds non-finite weights (nan or inf in model.{bad[0]}"
                f"{more}{'; its files match their hashes: saved so' if verified else ''}); "
                f"{hint}"
            )

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
            saved_so = "; its files match their hashes: saved so" if self.ctx.cfg.checksum else ""
            raise ConfigError(
                f"checkpoint {path} holds non-finite values (nan or inf in {bad[0]}{more}"
                f"{saved_so}); {hint}"
            )

    # -- a resumed segment's health (checkpoint/health.py) ----------------------------------

    def watch_loss(
        self, records: list[dict] | None, policy: str = "stop"
    ) -> tuple[str | None, str]:
        """CheckpointManager.watch_resumed_loss: start judging this resume, on disk first.

        A resume of checkpoint s in this directory is judged by the first losses logged after
        it, against what the run logged up to it. The judgment is recorded in the checkpoint
        directory (store.UNCONFIRMED, rank 0) before anything is saved: checkpoints from s on
        are unconfirmed until the healthy verdict, and pruning keeps the newest one older than
        s. When that record already names an earlier step r <= s (a run that stopped, or
        reached train.steps, after saving but before its verdict), this resume goes on judging
        r: the losses logged after r (metrics.jsonl, up to s) count as judged ones, not as
        history, and the verdict may come at once. Returns what `judge_loss` does: a verdict
        reached already ("healthy", "stop") or (None, ""). A collective (rank 0 reads and
        decides; every rank hears it)."""
        ctx = self.ctx
        plan = None
        if ctx.rank == 0:
            plan = self._watch_plan(records)
        plan = ctx.broadcast(plan)
        if plan is None:
            return None, ""
        if plan.get("error"):
            raise ConfigError(plan["error"])
        recent, judged_from = plan["recent"], plan["from"]
        if recent is None or policy == "off" or not ctx.saving:
            if ctx.rank == 0 and ctx.saving and store.clear_unconfirmed(ctx.root):
                why = "resume.loss_check=off" if policy == "off" else "too few losses logged"
                ctx.log(
                    f"checkpoints from step {judged_from} on are taken as confirmed ({why}: "
                    "their resume is not judged)"
                )
            return None, ""
        self._watch = ResumeWatch(recent, seen=list(plan["seen"]))
        self._watch_policy, self._judged_from = policy, judged_from
        if ctx.rank == 0:
            store.write_unconfirmed(
                ctx.root,
                {"resumed_from": judged_from, "resumed_at": self.resumed[1], "time": time.time()},
            )
        if self._watch.seen and judged_from != self.resumed[1]:
            steps = [s for s, _ in self._watch.seen]
            at = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
            ctx.log(
                f"the resume from step {judged_from} is not judged yet: its losses at {at} "
                f"were logged before {store.step_name(self.resumed[1])} was saved; they are "
                "judged with this segment's"
            )
        return self._verdict(self._watch.decide())

    def _watch_plan(self, records: list[dict] | None) -> dict | None:
        """Rank 0: what `watch_loss` judges (None: not a resume of this directory)."""
        ctx = self.ctx
        if self.resumed is None:
            return None
        step = self.resumed[1]
        judged_from = step
        if ctx.saving:
            try:
                record = store.read_unconfirmed(ctx.root)
            except store.UnreadableRecord as e:
                return {
                    "error": f"cannot read which checkpoints are unconfirmed ({e}); remove "
                    f"{ctx.root / store.UNCONFIRMED} to take every checkpoint there as "
                    "confirmed, or resume an older checkpoint with checkpoint.resume=PATH"
                }
            if record is not None and record["resumed_from"] <= step:
                judged_from = record["resumed_from"]
        records = records or []
        return {
            "from": judged_from,
            "recent": Recent.from_records(records, judged_from),
            "seen": [(s, v) for s, v in logged_losses(records, step) if s > judged_from],
        }

    def judge_loss(self, step: int, loss: float) -> tuple[str | None, str]:
        """The watch's verdict on a logged loss: ("healthy", "") once the segment is healthy
        (logged; the checkpoints are confirmed), ("stop", line) when the run must stop with
        `line`, (None, "") otherwise (nothing watched, still judging, or unhealthy under
        resume.loss_check=continue: logged, still unconfirmed)."""
        if self._watch is None:
            return None, ""
        return self._verdict(self._watch.observe(step, loss))

    def _verdict(self, verdict: str | None) -> tuple[str | None, str]:
        ctx = self.ctx
        if verdict == "healthy":
            ctx.log(f"resumed segment healthy: {self._watch.describe()}")
            if ctx.rank == 0:
                store.clear_unconfirmed(ctx.root)
            return "healthy", ""
        if verdict != "unhealthy":
            return None, ""
        line = self._unhealthy_line()
        if self._watch_policy == "continue":
            ctx.log(
                f"warning: {line}; going on (resume.loss_check=continue), keeping it and "
                "leaving the checkpoints since unconfirmed"
            )
            return None, ""
        return "stop", f"{line}; or go on with resume.loss_check=continue"

    def pending_line(self) -> str | None:
        """At the end of a segment whose resume is not judged yet: what stays unconfirmed and
        what is kept for it (None: nothing pending)."""
        watch = self._watch
        if watch is None or watch.verdict is not None:
            return None
        confirmed = store.newest_confirmed(store.list_complete(self.ctx.root), self._judged_from)
        kept = f"; {confirmed.path} is kept until then" if confirmed else ""
        return (
            f"the resume from step {self._judged_from} is not judged yet ({len(watch.seen)} of "
            f"the {watch.needed} logged losses it takes): the checkpoints from step "
            f"{self._judged_from} on stay unconfirmed, and the next resume judges it{kept}"
        )

    def _unhealthy_line(self) -> str:
        path, resumed_step = self.resumed
        judged = self._judged_from
        confirmed = store.newest_confirmed(store.list_complete(self.ctx.root), judged)
        kept = (
            f"the older checkpoint {confirmed.path} is kept: resume from it with "
            f"checkpoint.resume={confirmed.path}"
            if confirmed
            else "no older checkpoint is kept (checkpoint.keep_last=1 pruned it before)"
        )
        if judged != resumed_step:
            path = path.with_name(store.step_name(judged))
            via = (
                f"; this run resumed from {store.step_name(resumed_step)}, saved after it "
                "before its losses were judged"
            )
        else:
            via = ""
        return (
            f"the loss after resuming from {path} (step {judged}{via}) is above what this "
            f"run logged just before it: {self._watch.describe()}; that checkpoint may hold "
            "damage its checks cannot see (a changed weight whose hash was rewritten, or "
            f"checkpoint.checksum=false); {kept}"
        )
