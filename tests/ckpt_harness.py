"""A small training harness for the checkpoint safety and async tests (kept apart from
tests/test_checkpoint.py's): the tiny reference Llama, a deterministic loader whose state is
the number of samples consumed, AdamW, and a loop that drives a CheckpointManager the way
train.py does (observe_loss every step, check_finite at log steps, maybe_save, finish)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoint import CheckpointManager, TrainState, training_state
from checkpoint.config import CheckpointConfig
from model.config import ModelConfig
from model.init import init_weights
from model.llama import Llama

SEQ, BATCH, VOCAB = 32, 8, 258
MODEL = ModelConfig(max_seq_len=64, rope_scaling=None)


class Loader:
    def __init__(self, dp_rank: int = 0, dp_size: int = 1):
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed = 0

    def next_batch(self) -> torch.Tensor:
        local = BATCH // self.dp_size
        start = self.consumed + self.dp_rank * local
        self.consumed += BATCH
        rows = []
        for i in range(start, start + local):
            g = torch.Generator().manual_seed(7919 * i + 1)
            rows.append(torch.randint(0, VOCAB, (SEQ + 1,), generator=g))
        return torch.stack(rows)

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, sd: dict) -> None:
        self.consumed = int(sd["consumed"])


def config_yaml(cfg: ModelConfig = MODEL) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured({"model": cfg}))


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
        self.loader = loader or Loader()
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
        batch = self.loader.next_batch()
        loss = self.model(batch[:, :-1], labels=batch[:, 1:])
        if corrupt is not None:
            loss = corrupt(step, loss)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.train_state.step = step
        self.ckpt.observe_loss(step, loss.detach())
        return loss.detach()

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
