"""What several test files share: a tiny training setup whose steps are train.train_step.

    from tests.helpers import MODEL, FakeLoader, build_training, full_logits_loss, run_steps

The checkpoint tests (test_checkpoint.py, test_checkpoint_dist.py) train the reference Llama
(MODEL: tiny, seq SEQ, global batch BATCH) on FakeLoader's samples with AdamW + the trainer's
warmup-cosine schedule (optim.build_scheduler), one train_step per step (run_steps);
test_parallel_matrix.py uses full_logits_loss; tests that start train.py subprocesses
pass CPU_ENV. Process-group helpers are in tests/distributed.py.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from checkpoint import TrainState, training_state
from model.config import ModelConfig
from optim import OptimConfig, build_scheduler
from runtime import receivers
from steps import train_step

#: Environment for train.py subprocesses of CPU tests (runtime.launch(..., env=CPU_ENV)).
CPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def forwarded_receivers(nproc: int) -> set[str]:
    """Whom a stop line ("stop signal SIGINT (received by WHO): ...") may name when a launcher
    forwarded one signal to its `nproc` trainers. It signals them one after another, and a
    trainer already waiting in the step's stop agreement (a collective) runs its handler only
    once that collective returns, so the agreement counts the ranks whose handler had run by
    then: any non-empty set of the ranks, worded by runtime.receivers."""
    sets = (r for k in range(1, nproc + 1) for r in itertools.combinations(range(nproc), k))
    return {receivers(list(ranks), nproc) for ranks in sets}


SEQ, BATCH, VOCAB = 32, 8, 258
#: train.py overrides for the smallest model the CLI tests train (1 layer, dim 64, seq 32,
#: 200 kB of the embedded corpus, 4 sequences per step, every step logged).
TINY_RUN = [
    "model.dim=64",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.ffn_dim=128",
    "data.seq_len=32",
    "data.max_bytes=200000",
    "train.global_batch_size=4",
    "train.log_every=1",
]
#: A short CPU run of the tiny model, as the launcher tests (Ctrl-C, Slurm) start it: add
#: train.steps and the checkpoint fields.
LAUNCHED_RUN = [
    "model=tiny",
    "data.seq_len=64",
    "data.max_bytes=400000",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.log_every=1",
    "optim.warmup_steps=2",
    "train.device=cpu",
]
MODEL = ModelConfig(max_seq_len=64, rope_scaling=None)
#: The checkpoint tests' optimizer and schedule: 5 warmup steps, cosine to 0.1 x lr at step 40.
OPTIM = OptimConfig(lr=3e-3, warmup_steps=5, min_lr_ratio=0.1)
SCHEDULE_STEPS = 40


class FakeLoader:
    """Sample i of the global order is a fixed random sequence; rank r of dp reads rows
    [consumed + r*local, ...) of each global batch. State: global samples consumed."""

    def __init__(self, dp_rank: int = 0, dp_size: int = 1, global_batch: int = BATCH):
        self.dp_rank, self.dp_size, self.global_batch = dp_rank, dp_size, global_batch
        self.local = global_batch // dp_size
        self.consumed = 0
        self.last_ids: list[int] = []

    @staticmethod
    def sample(i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1_000_003 * i + 7)
        return torch.randint(0, VOCAB, (SEQ + 1,), generator=g)

    def next_batch(self) -> torch.Tensor:
        start = self.consumed + self.dp_rank * self.local
        self.last_ids = list(range(start, start + self.local))
        self.consumed += self.global_batch
        return torch.stack([self.sample(i) for i in self.last_ids])

    def state_dict(self) -> dict:
        return {"samples_consumed": self.consumed}

    def load_state_dict(self, sd: dict) -> None:
        self.consumed = int(sd["samples_consumed"])


def config_yaml(cfg: ModelConfig = MODEL) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured({"model": cfg}))


def full_logits_loss(
    model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, documents=None
):
    """A train_step loss_fn: mean cross entropy over every logit column, the vocabulary
    padding included (labels of -100 ignored). These tests have always computed their loss
    this way; train.next_token_loss leaves the padding columns out, which would change
    every loss they compare. `documents`: document-masked attention (data/documents.py)."""
    logits = model(inputs) if documents is None else model(inputs, documents=documents)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def build_training(model: torch.nn.Module, loader, cfg: ModelConfig = MODEL):
    """AdamW over one parameter group (decay on every tensor, as these tests always had it),
    the trainer's LR schedule, and the checkpointed state."""
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=OPTIM.lr,
        betas=(OPTIM.beta1, OPTIM.beta2),
        eps=OPTIM.eps,
        weight_decay=OPTIM.weight_decay,
    )
    scheduler = build_scheduler(optimizer, OPTIM, SCHEDULE_STEPS)
    train_state = TrainState(config_yaml=config_yaml(cfg))
    state = training_state(model, optimizer, scheduler, loader, train_state)
    return optimizer, scheduler, train_state, state


def run_steps(
    model,
    optimizer,
    scheduler,
    loader,
    train_state,
    start: int,
    end: int,
    *,
    ckpt=None,
    state=None,
    dp_group=None,
    mask_labels: bool = True,
    on_step=None,
) -> tuple[list[float], list[list[int]]]:
    """Steps start+1..end, each one train.train_step (clipping at 1.0, the schedule).
    Returns per-step losses (mean over data-parallel ranks) and the global sample ids of
    each step. mask_labels sets ~10% of the labels to -100 with the global RNG, so a resume
    that does not restore RNG states changes the losses."""
    losses, ids = [], []
    dp = dist.get_world_size(dp_group) if dp_group is not None else 1
    for step in range(start + 1, end + 1):
        batch = loader.next_batch()
        x, y = batch[:, :-1], batch[:, 1:]
        if mask_labels:
            y = y.masked_fill(torch.rand(y.shape) < 0.1, -100)
        loss, _ = train_step(
            model, optimizer, x, y, grad_clip=1.0, scheduler=scheduler, loss_fn=full_logits_loss
        )
        train_state.step = step
        train_state.tokens_seen += BATCH * SEQ
        step_ids = [loader.last_ids]
        if dp_group is not None:
            dist.all_reduce(loss, group=dp_group)
            loss /= dp
            step_ids = [None] * dp
            dist.all_gather_object(step_ids, loader.last_ids, group=dp_group)
        losses.append(loss.item())
        ids.append([i for part in step_ids for i in part])
        if on_step is not None:
            on_step(step)
        if ckpt is not None:
            ckpt.maybe_save(step, state)
    return losses, ids
