"""Context parallelism: each sequence split over the cp ranks, and attention across the pieces.

Causal attention's work grows along the sequence, so cutting a sequence into cp pieces would
give the last rank the most work. It is cut into 2 x cp chunks instead, and cp rank r holds
chunks r and 2cp-1-r (one early, one late: equal work on every rank; TE's layout for its
context-parallel attention). Inputs, labels and RoPE positions are split the same way, after
the loader: the cp ranks of one data-parallel group read the same rows, and a checkpoint knows
nothing of cp (parameters are not split along it; FSDP shards them over dp_shard x cp like
data-parallel ranks, parallel/dims.py).

Two splits, one rule:
- Causal rows (`shard_batch`): every row is one sequence; rank r holds the same two chunks of
  every row, (B, S / cp) tokens.
- Documents (`DocumentSharding`, data.document_mask): every document is its own sequence, so
  each is cut into 2 x cp chunks (TE's THD context parallelism, which keeps its documents
  apart with `cu_seqlens`). A document's length is padded up to a multiple of 2 x cp first,
  its padding after its last token, where causal attention never lets a real token see it;
  the micro batch's documents then form one stream of padded documents (rows one after
  another), and a last padding-only segment rounds the stream up so every rank's share is a
  multiple of `align` tokens (sequence parallelism's tp split, FP8 GEMM shapes). Padding is
  labelled -100. A batch whose documents are whole rows gets exactly the causal split.
  Ranks then hold different numbers of real tokens, so each rank's mean loss is scaled by
  its share of the micro batch's tokens (`ContextShard.loss_scale`): the mean of the ranks'
  losses, which FSDP's gradient average computes, stays the mean over every token of the
  global batch, as with cp=1.

Attention:
- TE (`apply_te_cp`): each block's attention gets the cp group (`set_context_parallel_group`)
  and exchanges K/V itself, with the communication of `parallel.cp_comm_type`; TE's fused
  RoPE takes this rank's positions from cp_rank and the full sequence's (or the padded
  documents', `ContextShard.cu_seqlens`) layout.
- Reference (`ContextShard`, model/llama.py): K and V are all-gathered along the sequence from
  the cp ranks and put back in sequence order (its backward reduce-scatters their gradients),
  and the rank's queries attend to them under the mask "key i is visible to the query at
  sequence index j when i <= j and i >= j - position[j]": causal, and with documents
  (position = the query's position in its document) inside the query's document. This is the
  all-gather formulation the Llama 3 paper describes, exact and simple; the cost is one full
  K/V per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
    """This cp rank's part of a batch.

    positions: (B, N) RoPE positions of the rank's tokens (their sequence index, or their
    position in their document); index: (N,) their indices in the (padded) sequence of
    cp x N tokens; group / cp: the cp process group and its size; order: (cp x N,) every
    rank's `index`, in rank order (None: the causal split's, from chunk_index).
    Documents only (B = 1): cu_seqlens, the padded documents' offsets in the whole padded
    stream (int32, TE's THD metadata), max_seqlen, the longest padded document rounded for TE,
    and loss_scale, this rank's share of the micro batch's tokens times cp."""

    positions: torch.Tensor
    index: torch.Tensor
    group: object
    cp: int
    order: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    loss_scale: float = 1.0

    def chunk(self, n: int) -> list[ContextShard]:
        """Split by rows, as the micro batches split the inputs (the causal split)."""
        return [ContextShard(p, self.index, self.group, self.cp) for p in self.positions.chunk(n)]

    def to(self, device) -> ContextShard:
        move = lambda t: None if t is None else to_device(t, device)  # noqa: E731
        return ContextShard(
            move(self.positions), move(self.index), self.group, self.cp, move(self.order),
            move(self.cu_seqlens), self.max_seqlen, self.loss_scale,
        )  # fmt: skip

    def attention_mask(self) -> torch.Tensor:
        """(B, 1, N, cp x N): which keys of the whole sequence each local query sees."""
        seq = self.index.shape[0] * self.cp
        keys = torch.arange(seq, device=self.index.device)[None, None, :]
        query = self.index[None, :, None]
        first = query - self.positions[:, :, None]  # the query's document starts here
        return ((keys <= query) & (keys >= first))[:, None]

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, N, ...) of every cp rank -> (B, cp x N, ...) in sequence order."""
        gathered = gather_from_sp(x, 1, self.group)
        order = self.order
        if order is None:
            seq = self.index.shape[0] * self.cp
            order = torch.cat([chunk_index(seq, self.cp, r) for r in range(self.cp)])
        return gathered.index_select(1, torch.argsort(order).to(x.device))


@dataclass
class DocumentSplit:
    """The per-document split of one micro batch's B x S tokens (see the module docstring),
    all on the CPU. `source[r]`: (N,) for every cp rank r, the index of each of its tokens in
    the row-major flattened micro batch, -1 for padding; `stream_index[r]`: their indices in
    the padded stream; `positions[r]`: their positions in their padded document;
    `cu_seqlens`: the padded documents' offsets in the stream (the padding-only tail segment
    included); `max_len`: the longest padded document."""

    source: list[np.ndarray]
    stream_index: list[np.ndarray]
    positions: list[np.ndarray]
    cu_seqlens: np.ndarray
    max_len: int


def split_documents(positions: np.ndarray, cp: int, align: int) -> DocumentSplit:
    """positions (B, S): each token's position in its document (data.documents). Every
    document padded to a multiple of 2 x cp and cut into 2 x cp chunks, rank r taking chunks r
    and 2cp-1-r of each, document after document; the stream padded with one padding-only
    segment to a multiple of cp x align tokens (align even)."""
    flat = np.asarray(positions).reshape(-1)
    starts = np.flatnonzero(flat == 0)
    lengths = np.diff(np.append(starts, flat.size))
    padded = -(-lengths // (2 * cp)) * (2 * cp)
    total = int(padded.sum())
    tail = -total % (cp * align)
    if tail:
        starts, lengths = np.append(starts, -1), np.append(lengths, 0)
        padded = np.append(padded, tail)
    cu = np.concatenate([[0], np.cumsum(padded)]).astype(np.int64)
    # Every stream position: its document, its position there, its source token (or -1).
    doc = np.repeat(np.arange(len(padded)), padded)
    pos = np.arange(cu[-1]) - cu[doc]
    source = np.where(pos < lengths[doc], starts[doc] + pos, -1)
    # Rank r's stream indices: per document, chunk r then chunk 2cp-1-r (chunk size c = P/2cp).
    size = padded // (2 * cp)
    stream_index = []
    for r in range(cp):
        first = [np.arange(c0 + r * c, c0 + (r + 1) * c) for c0, c in zip(cu[:-1], size)]
        second = [
            np.arange(c0 + (2 * cp - 1 - r) * c, c0 + (2 * cp - r) * c)
            for c0, c in zip(cu[:-1], size)
        ]
        stream_index.append(np.concatenate([x for pair in zip(first, second) for x in pair]))
    return DocumentSplit(
        source=[source[i] for i in stream_index],
        stream_index=stream_index,
        positions=[pos[i] for i in stream_index],
        cu_seqlens=cu.astype(np.int32),
        max_len=int(padded.max()),
    )


@dataclass
class DocumentSharding:
    """Documents of whole rows (data.documents.Documents), split over the cp ranks per micro
    batch when the micro batch runs (`shard`): the padded split depends on the micro batch's
    own documents. `align`: every rank's token count is a multiple of it (even)."""

    documents: object
    cp: int
    rank: int
    group: object
    align: int

    def chunk(self, n: int) -> list[DocumentSharding]:
        return [
            DocumentSharding(d, self.cp, self.rank, self.group, self.align)
            for d in self.documents.chunk(n)
        ]

    def shard(self, inputs: torch.Tensor, labels: torch.Tensor):
        """(inputs (1, N), labels (1, N), ContextShard) of this rank from the micro batch's
        full rows (B, S) on any device; padding tokens are 0 with label -100."""
        split = split_documents(self.documents.positions.numpy(), self.cp, self.align)
        source = torch.from_numpy(split.source[self.rank])
        real = source >= 0
        device = inputs.device
        take = to_device(source.clamp(min=0), device)
        keep = to_device(real, device)
        x = torch.where(keep, inputs.reshape(-1)[take], 0)[None]
        y = torch.where(keep, labels.reshape(-1)[take], -100)[None]
        # TE sizes its kernels by max_seqlen and builds one cuDNN graph per value: a power of
        # two (a multiple of 2 x cp) keeps the values few.
        max_seqlen = max(64, 1 << (split.max_len - 1).bit_length())
        max_seqlen = -(-max_seqlen // (2 * self.cp)) * (2 * self.cp)
        shard = ContextShard(
            positions=torch.from_numpy(split.positions[self.rank])[None],
            index=torch.from_numpy(split.stream_index[self.rank]),
            group=self.group,
            cp=self.cp,
            order=torch.from_numpy(np.concatenate(split.stream_index)),
            cu_seqlens=torch.from_numpy(split.cu_seqlens),
            max_seqlen=max_seqlen,
            loss_scale=float(real.sum()) * self.cp / self.documents.positions.numel(),
        )
        return x, y, shard.to(device)


def shard_batch(inputs, labels, documents, *, cp: int, cp_rank: int, group, align: int = 2):
    """(inputs, labels, documents) of cp rank `cp_rank` from a batch of full rows on the CPU;
    `documents`: their data.documents.Documents (document masking) or None. Causal rows, or
    documents that are whole rows: this rank's (B, S / cp) part and its ContextShard. Other
    documents: the full rows and a DocumentSharding, split per micro batch (steps.split_micro_batches
    calls its `shard`)."""
    b, s = inputs.shape
    if documents is not None and not documents.whole_rows:
        return inputs, labels, DocumentSharding(documents, cp, cp_rank, group, align)
    index = chunk_index(s, cp, cp_rank)
    positions = torch.arange(s).expand(b, s)
    shard = ContextShard(positions[:, index].contiguous(), index, group, cp)
    return inputs[:, index], labels[:, index], shard


def token_align(impl: str, tp: int) -> int:
    """Every cp rank's token count under the per-document split is a multiple of this: tp
    (sequence parallelism splits the rank's tokens over tp) times 2 for the reference model,
    times 64 for TE, whose FP8 GEMMs need token counts in multiples of 16 (MXFP8: 32)."""
    return (64 if impl == "te" else 2) * tp


def check_cp(cp: int, tp: int, comm_type: str, impl: str, mcfg, a2a_size: int | None) -> None:
    """What this recipe's context parallelism does not do, refused in one line before any
    work (the degrees and sequence length are checked by ParallelDims)."""
    if a2a_size is not None and comm_type != "a2a+p2p":
        raise ConfigError(
            f"parallel.cp_a2a_size={a2a_size} is for parallel.cp_comm_type=a2a+p2p only; "
            "remove it (parallel.cp_a2a_size=null)"
        )
    if cp == 1 or impl != "te":
        return  # the reference model's all-gather attention takes every combination
    heads_cp = cp
    if comm_type == "a2a+p2p":
        if a2a_size is None or not (1 < a2a_size < cp and cp % a2a_size == 0):
            raise ConfigError(
                f"parallel.cp_comm_type=a2a+p2p splits parallel.cp={cp} into all-to-all groups "
                f"of parallel.cp_a2a_size ranks and a p2p ring between them: set "
                f"parallel.cp_a2a_size to a divisor of {cp} between 2 and {cp // 2} (or use "
                "p2p, all_gather or a2a)"
            )
        heads_cp = a2a_size
    if comm_type in ("a2a", "a2a+p2p"):
        field = "parallel.cp" if comm_type == "a2a" else "parallel.cp_a2a_size"
        for name, heads in (("n_heads", mcfg.n_heads), ("n_kv_heads", mcfg.n_kv_heads)):
            if (heads // tp) % heads_cp:
                raise ConfigError(
                    f"parallel.cp_comm_type={comm_type} spreads attention heads over "
                    f"{field}={heads_cp} ranks: model.{name}={heads} / parallel.tp={tp} is not "
                    f"divisible by it; use parallel.cp_comm_type=p2p or all_gather"
                )


def a2a_p2p_groups(cp_meshes: torch.Tensor, a2a_size: int, rank: int) -> list:
    """[a2a group, p2p group] of `rank` for TE's hierarchical context parallelism.
    cp_meshes: (groups, cp) the ranks of every cp group in cp order. Within one, cp rank
    i = j x a2a_size + k is in all-to-all group j (consecutive ranks) and p2p ring k: TE
    numbers the rank a2a_size x p2p rank + a2a rank. Every rank creates every group, in the
    same order (torch.distributed.new_group is collective)."""
    mine = []
    for ranks in cp_meshes.tolist():
        grid = torch.tensor(ranks).view(-1, a2a_size)  # (p2p, a2a)
        for members in [*grid.tolist(), *grid.t().tolist()]:
            group = dist.new_group(members)
            if rank in members:
                mine.append(group)
    a2a, p2p = mine
    return [a2a, p2p]


def apply_te_cp(model, dims, cp_comm_type: str, a2a_size: int | None = None) -> None:
    """TE's context-parallel attention in every block of the TE model; for a2a+p2p, the
    [all-to-all, p2p] pair of groups inside this rank's cp group."""
    ranks = dist.get_process_group_ranks(dims.cp_group)
    group = dims.cp_group
    if cp_comm_type == "a2a+p2p":
        cp_meshes = dims.mesh.mesh.movedim(2, -1).reshape(-1, dims.cp)
        group = a2a_p2p_groups(cp_meshes, a2a_size, dist.get_rank())
    stream = torch.cuda.Stream()
    for layer in model.layers:
        layer.set_context_parallel_group(group, ranks, stream, cp_comm_type)
    model.cp_size = len(ranks)
