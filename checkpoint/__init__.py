"""Checkpointing: DCP sync/async saves, complete resume state, commit/prune, resharding, and
the fixes TE needs for quantized parameters.

    from checkpoint import CheckpointManager, TrainState, training_state
    train_state = TrainState(config_yaml=resolved_yaml)
    state = training_state(model, optimizer, scheduler, loader, train_state)
    ckpt = CheckpointManager(cfg.checkpoint, run_dir, rank=rank, world_size=world_size)
    start_step = ckpt.resume(state)
    ...  ckpt.maybe_save(step, state) ...
    ckpt.finish(step, state)

Files: manager.py (policy: when, how, where, resume), state.py (what is saved), layout.py
(directories, manifest, commit, prune), te_compat.py (TE fixes, applied only where missing).
"""

# Exports resolve lazily: config.py imports checkpoint.config while this package imports
# config (for ConfigError), and `import config` must not pull in torch.distributed.
_EXPORTS = {
    "CheckpointManager": "checkpoint.manager",
    "TrainState": "checkpoint.state",
    "training_state": "checkpoint.state",
    "CheckpointConfig": "checkpoint.config",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'checkpoint' has no attribute {name!r}")
