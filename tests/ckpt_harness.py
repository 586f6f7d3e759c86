"""A small training harness for the checkpoint safety and async tests: tests/helpers.py's tiny
reference Llama and FakeLoader, AdamW at a constant lr, steps.train_step, and a loop that
drives a CheckpointManager the way train.py does (observe_loss every step, check_finite at
log steps, maybe_save, finish)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from checkpoint import CheckpointManager, TrainState, training_state
from checkpoint.config import CheckpointConfig
from errors import ConfigError
from model.init import init_weights
from model.llama import Llama
from steps import next_token_loss, train_step
from tests.helpers import MODEL, FakeLoader, config_yaml


def ckpt_cfg(**kw) -> CheckpointConfig:
    base = dict(mode="sync", interval=2, keep_last=5, resume="auto")
    base.update(kw)
    return CheckpointConfig(**base)


class Run:
    """Model, optimizer, state and manager of one (segment of a) run on this process."""

    def __init__(self, run_dir: Path, *, model=None, loader=None, log=None, **kw):
        torch.manual_seed(0)
        random.seed(0)
        if model is None:
            model = Llama(MODEL)
            init_weights(model, MODEL, 0)
        self.model = model
        self.loader = loader or FakeLoader()
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0)
        self.train_state = TrainState(config_yaml=config_yaml())
        self.state = training_state(
            model, self.optimizer, self.scheduler, self.loader, self.train_state
        )
        self.messages: list[str] = []
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.ckpt = CheckpointManager(
            ckpt_cfg(**kw), run_dir, rank, world, log=log or self.messages.append
        )

    def step(
        self, step: int, *, corrupt: Callable[[int, torch.Tensor], torch.Tensor] | None = None
    ):
        def loss_fn(model, x, y):
            loss = next_token_loss(model, x, y)
            return loss if corrupt is None else corrupt(step, loss)

        batch = self.loader.next_batch()
        loss, _ = train_step(
            self.model,
            self.optimizer,
            batch[:, :-1],
            batch[:, 1:],
            scheduler=self.scheduler,
            loss_fn=loss_fn,
        )
        self.train_state.step = step
        self.ckpt.observe_loss(step, loss)
        return loss

    def train(
        self,
        end: int,
        *,
        log_every: int = 1000,
        on_step: Callable[[int], None] | None = None,
        corrupt=None,
        finish: bool = True,
    ) -> tuple[int, list[float]]:
        start = self.ckpt.resume(self.state)
        losses = []
        for step in range(start + 1, end + 1):
            loss = self.step(step, corrupt=corrupt)
            losses.append(float(loss))
            if step % log_every == 0:
                self.ckpt.check_finite(step)
            self.ckpt.maybe_save(step, self.state)
            if on_step is not None:
                on_step(step)
        if finish:
            self.ckpt.finish(end, self.state)
        return start, losses


def committed(root: Path) -> list[int]:
    from checkpoint import store

    return [c.step for c in store.list_complete(root)]


#: train.py overrides of a small quick run for the checkpoint tests that launch train.py.
SMALL = ["data.seq_len=64", "data.max_bytes=400000", "train.global_batch_size=8"]


def small_cfg(tmp: Path, name: str, *extra: str):
    """The root config of a SMALL CPU run `name` under `tmp`, with `extra` overrides."""
    from config import compose_config

    return compose_config(
        [f"run.root={tmp}", f"run.name={name}", "train.device=cpu", *SMALL, *extra]
    )


def no_model(*args, **kwargs):
    """train.build_training where a run must stop before it builds its model."""
    raise AssertionError("the model was built before the run stopped")


def two_checkpoints(run_dir: Path, **kw) -> Path:
    """Steps 2 and 4 committed; returns the checkpoint directory."""
    Run(run_dir, **kw).train(4)
    root = run_dir / "checkpoints"
    assert committed(root) == [2, 4]
    return root


def refused(run_dir: Path, **kw) -> str:
    """The one-line ConfigError a `Run` of 6 steps in `run_dir` stops with."""
    with pytest.raises(ConfigError) as e:
        Run(run_dir, **kw).train(6)
    assert "\n" not in str(e.value)
    return str(e.value)


def previous_hint(root: Path) -> str:
    """The way out a refusal names when step 4 is refused and step 2 is complete."""
    return (
        f"pass checkpoint.resume={root / 'step_0000002'} to resume from the previous complete "
        "checkpoint"
    )
