"""Context parallelism: each sequence split over the cp ranks, and attention across the pieces.

Causal attention's work grows along the sequence, so cutting a sequence into cp pieces would
give the last rank the most work. It is cut into 2 x cp chunks instead, and cp rank r holds
chunks r and 2cp-1-r (one early, one late: equal work on every rank; TE's layout for its
context-parallel attention). Inputs, labels and RoPE positions are split the same way
(`shard_batch`), after the loader: the cp ranks of one data-parallel group read the same rows,
and a checkpoint knows nothing of cp (parameters are not split along it; FSDP shards them
over dp_shard x cp like data-parallel ranks, parallel/dims.py).

Every rank holds the same number of tokens of every row, so the mean of the ranks' mean
losses, which FSDP's gradient average over dp_shard x cp computes, is the mean over every
token of the global batch, as with cp=1.

Attention:
- TE (`apply_te_cp`): each block's attention gets the cp group (`set_context_parallel_group`)
  and exchanges K/V itself, with the communication of `parallel.cp_comm_type`; TE's fused
  RoPE takes this rank's positions from cp_rank and the full sequence's frequencies.
- Reference (`ContextShard`, model/llama.py): K and V are all-gathered along the sequence from
  the cp ranks and put back in sequence order (its backward reduce-scatters their gradients),
  and the rank's queries attend to them under the mask "key i is visible to the query at
  sequence index j when i <= j and i >= j - position[j]": causal, and with document masking
  (position = the query's position in its document) inside the query's document. This is the
  all-gather formulation the Llama 3 paper describes, exact and simple; the cost is one full
  K/V per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from errors import ConfigError
from parallel.tp import gather_from_sp
from runtime import to_device


def chunk_index(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Sequence indices (seq_len / cp,) of cp rank `rank`'s tokens: chunks r and 2cp-1-r of
    2 x cp equal chunks, in that order."""
    size = seq_len // (2 * cp)
    first = torch.arange(rank * size, (rank + 1) * size)
    second = torch.arange((2 * cp - 1 - rank) * size, (2 * cp - rank) * size)
    return torch.cat([first, second])


@dataclass
class ContextShard:
    """This cp rank's part of a (B, S) batch, for the reference model's attention.

    positions: (B, S / cp) RoPE positions of the rank's tokens (their sequence index, or their
    position in their document with document masking); index: (S / cp,) their sequence
    indices; group / cp: the cp process group and its size."""

    positions: torch.Tensor
    index: torch.Tensor
    group: object
    cp: int

    def chunk(self, n: int) -> list[ContextShard]:
        """Split by rows, as the micro batches split the inputs."""
        return [ContextShard(p, self.index, self.group, self.cp) for p in self.positions.chunk(n)]

    def to(self, device) -> ContextShard:
        return ContextShard(
            to_device(self.positions, device), to_device(self.index, device), self.group, self.cp
        )

    def attention_mask(self) -> torch.Tensor:
        """(B, 1, S / cp, S): which keys of the whole sequence each local query sees."""
        seq = self.index.shape[0] * self.cp
        keys = torch.arange(seq, device=self.index.device)[None, None, :]
        query = self.index[None, :, None]
        first = query - self.positions[:, :, None]  # the query's document starts here
        return ((keys <= query) & (keys >= first))[:, None]

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, S / cp, ...) of every cp rank -> (B, S, ...) in sequence order."""
        gathered = gather_from_sp(x, 1, self.group)
        seq = self.index.shape[0] * self.cp
        order = torch.cat([chunk_index(seq, self.cp, r) for r in range(self.cp)])
        return gathered.index_select(1, torch.argsort(order).to(x.device))


def shard_batch(inputs, labels, documents, *, cp: int, cp_rank: int, group):
    """(inputs, labels, ContextShard) of cp rank `cp_rank` from a batch of full rows on the
    CPU; `documents`: their data.documents.Documents (document masking) or None."""
    b, s = inputs.shape
    index = chunk_index(s, cp, cp_rank)
    positions = documents.positions if documents is not None else torch.arange(s).expand(b, s)
    shard = ContextShard(positions[:, index].contiguous(), index, group, cp)
    return inputs[:, index], labels[:, index], shard


def check_cp(cp: int, tp: int, comm_type: str, impl: str, mcfg, document_mask: bool) -> None:
    """What this recipe's context parallelism does not do, refused in one line before any
    work (the degrees and sequence length are checked by ParallelDims)."""
    if cp == 1 or impl != "te":
        return  # the reference model's all-gather attention takes every combination
    if document_mask:
        raise ConfigError(
            f"parallel.cp={cp} with data.document_mask=true on model.impl=te is not supported "
            "yet: TE's context parallelism for documents (THD) splits every document into "
            "2 x cp chunks, this recipe splits whole rows; set data.document_mask=false, or "
            "parallel.cp=1, or model.impl=torch"
        )
    if comm_type == "a2a+p2p":
        raise ConfigError(
            "parallel.cp_comm_type=a2a+p2p needs two levels of cp groups, which this recipe "
            "does not build; use p2p, all_gather or a2a"
        )
    if comm_type == "a2a":
        for field, heads in (("n_heads", mcfg.n_heads), ("n_kv_heads", mcfg.n_kv_heads)):
            if (heads // tp) % cp:
                raise ConfigError(
                    f"parallel.cp_comm_type=a2a spreads attention heads over the cp ranks: "
                    f"model.{field}={heads} / parallel.tp={tp} is not divisible by "
                    f"parallel.cp={cp}; use parallel.cp_comm_type=p2p or all_gather"
                )


def apply_te_cp(model, cp_group, cp_comm_type: str) -> None:
    """TE's context-parallel attention in every block of the TE model."""
    ranks = dist.get_process_group_ranks(cp_group)
    stream = torch.cuda.Stream()
    for layer in model.layers:
        layer.set_context_parallel_group(cp_group, ranks, stream, cp_comm_type)
    model.cp_size = len(ranks)
