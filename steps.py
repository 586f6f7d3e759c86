"""What one step is: the training step and the held-out evaluation, for train.py's loop and
for every test and tool that trains (one definition, so they all train the same way).

    loss, grad_norm = train_step(model, optimizer, inputs, labels, grad_accum=2, grad_clip=1.0,
                                 scheduler=scheduler, autocast=torch.autocast("cuda", torch.bfloat16))
    val_loss = evaluate(model, held_out_batches, dp_group=dims.dp_group)
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from optim import clip_grad_norm


def next_token_loss(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor):
    """Mean cross entropy of the next token over the labels that are not -100, computed by the
    model's head without materialising the logits (model/loss.py). The padding columns of the
    vocabulary are never targets and take no probability."""
    return model(inputs, labels=labels)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    grad_accum: int = 1,
    grad_clip: float = 0.0,
    scheduler=None,
    autocast: AbstractContextManager | None = None,
    loss_fn=next_token_loss,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on this rank's rows: forward and backward over `grad_accum` micro
    batches, clip, step, zero the gradients, advance the schedule. Returns (loss, grad_norm)
    as 0-d tensors on the device (no host sync): the loss is this rank's mean; the caller
    averages it over data-parallel ranks when it logs."""
    step_loss = torch.zeros((), device=inputs.device)
    for x, y in zip(inputs.chunk(grad_accum), labels.chunk(grad_accum)):
        with autocast if autocast is not None else nullcontext():
            loss = loss_fn(model, x, y)
        (loss / grad_accum).backward()
        step_loss += loss.detach() / grad_accum
    grad_norm = clip_grad_norm(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()
    return step_loss, grad_norm


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: torch.Tensor,
    *,
    micro_batches: int = 1,
    autocast: AbstractContextManager | None = None,
    dp_group=None,
    loss_fn=next_token_loss,
) -> float:
    """Mean next-token loss over this rank's rows of the held-out `batches` (batches, rows,
    seq_len+1), forward only, `micro_batches` forwards per batch as in training and under
    the same autocast; averaged over the data-parallel ranks (equal rows everywhere, no
    masked labels, so the mean of means is the global mean)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for batch in batches:
        batch = batch.to(device, non_blocking=True)
        for rows in batch.chunk(micro_batches):
            with autocast if autocast is not None else nullcontext():
                total += loss_fn(model, rows[:, :-1], rows[:, 1:]).float()
    total /= len(batches) * micro_batches
    # Without a backward, FSDP2 units that keep their weights gathered after forward (the
    # root, the last block) would stay gathered: leave them sharded, as a training step does.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    if dp_group is not None:
        dist.all_reduce(total, group=dp_group)
        total /= dist.get_world_size(dp_group)
    model.train(was_training)
    return total.item()
