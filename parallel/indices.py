"""Which entries of a DTensor's global tensor this rank holds, as index lists and runs.

`local_global_indices` reads Shard and _StridedShard placements the way DTensor lays out a
local shard (left to right over the mesh dims), so it also describes fc1 under tensor
parallelism ([gate_r; up_r], parallel/tp.py) and FSDP x TP shards. Checkpoint planners use it
to describe multi-block shards to DCP, Hugging Face loading to read exactly this rank's rows.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def _chunk_padded(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    # torch.chunk may return fewer than n pieces; DTensor pads with empty ones.
    parts = list(t.chunk(n))
    return parts + [t[:0]] * (n - len(parts))


def local_global_indices(dt: DTensor) -> list[torch.Tensor]:
    """For each tensor dim, the global indices of this rank's local entries, in local order
    (DTensor's left-to-right reading of Shard and _StridedShard placements)."""
    idx = [torch.arange(s) for s in dt.shape]
    coord = dt.device_mesh.get_coordinate()
    for mesh_dim, p in enumerate(dt.placements):
        n, c = dt.device_mesh.size(mesh_dim), coord[mesh_dim]
        if isinstance(p, _StridedShard):
            groups = _chunk_padded(idx[p.dim], p.split_factor)
            idx[p.dim] = torch.cat([_chunk_padded(g, n)[c] for g in groups])
        elif isinstance(p, Shard):
            idx[p.dim] = _chunk_padded(idx[p.dim], n)[c]
    return idx


def contiguous_runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """Contiguous runs of a list of global indices: (local start, local end, global start)."""
    if index.numel() == 0:
        return []
    breaks = (torch.nonzero(index.diff() != 1).flatten() + 1).tolist()
    starts, ends = [0, *breaks], [*breaks, index.numel()]
    return [(s, e, int(index[s])) for s, e in zip(starts, ends)]
