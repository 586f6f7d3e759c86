"""Checkpointing: DCP sync/async saves, complete resume state, commit/prune, resharding.

    from checkpoint import CheckpointManager, TrainState, training_state
    train_state = TrainState(config_yaml=resolved_yaml)
    state = training_state(model, optimizer, scheduler, loader, train_state)
    ckpt = CheckpointManager(cfg.checkpoint, run_dir, rank=rank, world_size=world_size)
    start_step = ckpt.resume(state)
    ...  ckpt.maybe_save(step, state) ...
    ckpt.finish(step, state)

Files: manager.py (CheckpointManager: the facade train.py calls; the policy in its docstring;
non-finite losses), resume.py (Resumer: find, plan, decide, load, verify, the resumed-loss
watch), save.py (Saver: when, stage, write; InFlight: saves in flight; Committer: commit,
prune, a failed save's error; SaveRecords: timings), context.py (what both sides share:
settings, log, gloo groups), state.py (what is saved), staging.py (CPU staging buffers for
async saves), writer.py (the DCP storage writer: parallel files hashed while written),
writer_process.py (async_process's writer process), hashing.py (xxh3-64 / CRC32), store.py
(directories, manifest, verification, commit, prune), preflight.py (run directory checks
before the model is built), runlock.py (one run per run directory), planners.py (DCP planners
for DTensors whose local shard is several blocks), te_state.py (TE scaling state and optimizer
states DCP cannot take as TE leaves them), hf.py (Hugging Face weights: model.init_from into
the sharded model, and a committed checkpoint exported as an HF folder).
"""

from checkpoint.config import MODES, CheckpointConfig
from checkpoint.manager import CheckpointManager
from checkpoint.state import TrainState, training_state

__all__ = ["MODES", "CheckpointConfig", "CheckpointManager", "TrainState", "training_state"]
