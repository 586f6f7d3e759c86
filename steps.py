"""What one step is: the training step and the held-out evaluation, for train.py's loop and
for every test and tool that trains (one definition, so they all train the same way).

    loss, grad_norm = train_step(model, optimizer, inputs, labels, grad_accum=2, grad_clip=1.0,
                                 scheduler=scheduler, autocast=torch.autocast("cuda", torch.bfloat16))
    val_loss = evaluate(model, held_out_batches, dp_group=dims.loss_group)

A batch of loader rows becomes this rank's (inputs, labels, documents) through `BatchLayout`:
the document boundaries (data.document_mask) and, under context parallelism, this rank's
part of every row (parallel/cp.py). `documents` is then a data.documents.Documents, a
parallel.cp.ContextShard, a parallel.cp.DocumentSharding (documents under context
parallelism: the rows stay whole and each micro batch is split per document when it runs), or
None.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from data.documents import Documents
from model.flops import batch_attention_pairs
from optim import clip_grad_norm
from parallel.cp import ContextShard, DocumentSharding, shard_batch
from runtime import to_device


class BatchLayout:
    """rows (B, S+1) on the CPU -> (inputs, labels, documents) of this rank, on the CPU."""

    def __init__(
        self, boundaries=None, *, cp: int = 1, cp_rank: int = 0, cp_group=None, align: int = 2
    ):
        """align: under context parallelism with documents, every rank's token count is a
        multiple of it (parallel.cp.split_documents): 2 x tp for the reference model, more
        for TE's GEMMs (train.py)."""
        self.boundaries, self.cp, self.cp_rank, self.cp_group = boundaries, cp, cp_rank, cp_group
        self.align = align
        #: Attention (query, key) pairs of the last batch's rows, per document (model.flops),
        #: counted before the context-parallel split: the data's work, not its padding.
        self.attention_pairs = 0

    def __call__(self, rows: torch.Tensor):
        inputs, labels = rows[:, :-1], rows[:, 1:]
        documents = None if self.boundaries is None else self.boundaries(inputs)
        self.attention_pairs = batch_attention_pairs(
            tuple(inputs.shape), None if documents is None else documents.cu_seqlens
        )
        if self.cp > 1:
            return shard_batch(
                inputs,
                labels,
                documents,
                cp=self.cp,
                cp_rank=self.cp_rank,
                group=self.cp_group,
                align=self.align,
            )
        return inputs, labels, documents


def next_token_loss(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    documents: Documents | None = None,
):
    """Mean cross entropy of the next token over the labels that are not -100, computed by the
    model's head without materialising the logits (model/loss.py). The padding columns of the
    vocabulary are never targets and take no probability. `documents`: attention stays inside
    each document (data.document_mask); None: causal over the whole row."""
    if documents is None:
        return model(inputs, labels=labels)
    return model(inputs, labels=labels, documents=documents)


def split_micro_batches(inputs, labels, documents: Documents | None, n: int, device):
    """The n micro batches of (inputs, labels, documents): documents split on the CPU (where
    their boundaries are known without a sync) and all moved next to the inputs before the
    first forward is queued; under context parallelism, documents are split over the cp
    ranks here, per micro batch."""
    parts = [None] * n if documents is None else documents.chunk(n)
    batches = []
    for x, y, d in zip(inputs.chunk(n), labels.chunk(n), parts):
        if isinstance(d, DocumentSharding):
            batches.append(d.shard(x, y))
        else:
            batches.append((x, y, None if d is None else d.to(device)))
    return batches


def micro_batch_loss(loss_fn, model, x, y, d):
    """`loss_fn`'s mean loss of one micro batch of this rank. Under context parallelism with
    documents the rank's tokens are not an equal share of the micro batch (parallel/cp.py):
    its mean is scaled by its share, so the mean over the cp ranks is the micro batch's."""
    loss = loss_fn(model, x, y) if d is None else loss_fn(model, x, y, d)
    if isinstance(d, ContextShard) and d.loss_scale != 1.0:
        loss = loss * d.loss_scale
    return loss


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
    documents: Documents | None = None,
    reduce_each_micro_batch: bool = True,
    hold_gathered: Sequence[torch.nn.Module] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on this rank's rows: forward and backward over `grad_accum` micro
    batches, clip, step, zero the gradients, advance the schedule. Returns (loss, grad_norm)
    as 0-d tensors on the device (no host sync): the loss is this rank's mean; the caller
    averages it over data-parallel ranks when it logs. `documents`: the document boundaries
    of `inputs` (CPU, data.documents), split into micro batches as the inputs are.
    `reduce_each_micro_batch=False` (parallel.grad_reduce=step): an FSDP2 model reduces its
    gradients once, in the last micro batch's backward, the earlier ones summed unsharded.
    `hold_gathered`: FSDP2 units (parallel.fsdp.gathered_units) that keep their gathered
    weights from the first micro batch's forward to the last one's backward: one all-gather
    each per step instead of one per micro batch."""
    step_loss = torch.zeros((), device=inputs.device)
    once = not reduce_each_micro_batch and grad_accum > 1 and isinstance(model, FSDPModule)
    hold = [u for u in hold_gathered if isinstance(u, FSDPModule)] if grad_accum > 1 else []
    micro = split_micro_batches(inputs, labels, documents, grad_accum, inputs.device)
    for i, (x, y, d) in enumerate(micro):
        last = i == len(micro) - 1
        if once:  # every FSDP unit of the model; True again for the last micro batch
            model.set_requires_gradient_sync(last)
        for unit in hold:  # resharded after the last backward, before the optimizer step
            unit.set_reshard_after_backward(last, recurse=False)
        with autocast if autocast is not None else nullcontext():
            loss = micro_batch_loss(loss_fn, model, x, y, d)
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
    layout: BatchLayout | None = None,
) -> float:
    """Mean next-token loss over this rank's rows of the held-out `batches` (batches, rows,
    seq_len+1), forward only, `micro_batches` forwards per batch as in training and under
    the same autocast; averaged over `dp_group`, the ranks that compute different tokens
    (ParallelDims.loss_group: equal tokens everywhere, no masked labels, so the mean of means
    is the global mean). `layout`: the run's BatchLayout (document masking, context
    parallelism); None: whole rows, causal."""
    layout = layout or BatchLayout()
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for batch in batches:
        inputs, labels, documents = layout(batch)
        inputs, labels = to_device(inputs, device), to_device(labels, device)
        for x, y, d in split_micro_batches(inputs, labels, documents, micro_batches, device):
            with autocast if autocast is not None else nullcontext():
                total += micro_batch_loss(loss_fn, model, x, y, d).float()
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
