"""DCP for DTensors whose local shard is several blocks of the global tensor (fc1 under TP).

Under tensor parallelism a rank holds fc1 rows [gate_r; up_r]: two separate row blocks of the
global [gate; up] (placement _StridedShard(0, split_factor=2), see parallel/tp.py). DCP
describes a DTensor's local shard by one offset and one size, so torch's own save fails
("overlapping chunks") and a load would misplace rows. `dcp_view(state_dict)` returns a
shallow copy of a (nested) state dict in which each such DTensor is replaced by a DTensor on
the same local storage that reports one DCP chunk per contiguous block; DCP asks the local
tensor for its chunks (the `_Checkpointable` hooks DTensor forwards to its local tensor).
Save and load then use the global layout, so a checkpoint written with any tp loads with any
other, and into a single process. Loads land in place in the original parameters / optimizer
states (the views share storage).

Usage (checkpoint code): pass the planners, which apply `dcp_view` to the state dict DCP
plans with (after Stateful.state_dict() and after async staging, whose CPU copies are new
DTensors with the same placements):

    dcp.save(state, planner=BlockSavePlanner(), ...)    # also dcp.async_save
    dcp.load(state, planner=BlockLoadPlanner(), ...)

or call dcp_view(sd) on a plain state dict yourself. Entries needing no change are passed
through as the same objects.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from parallel.indices import contiguous_runs, local_global_indices


def _blocks(dt: DTensor):
    """[(global offsets, sizes, local slices)] of the contiguous blocks of the local shard."""
    per_dim = [contiguous_runs(i) for i in local_global_indices(dt)]
    blocks = [((), (), ())]
    for runs in per_dim:
        blocks = [
            (o + (g,), s + (e - b,), sl + (slice(b, e),)) for o, s, sl in blocks for b, e, g in runs
        ]
    return blocks


def _needs_view(dt: DTensor) -> bool:
    return any(isinstance(p, _StridedShard) for p in dt.placements) and len(_blocks(dt)) > 1


def _multi_chunk_dtensor(dt: DTensor) -> DTensor:
    local = dt._local_tensor
    view = local.view_as(local)  # new tensor object on the same storage
    blocks = [(torch.Size(o), torch.Size(s), sl) for o, s, sl in _blocks(dt)]
    size = dt.size()

    def create_write_items(fqn, _obj):
        props = TensorProperties.create_from_tensor(local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, o),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(o, s), properties=props, size=size
                ),
            )
            for o, s, _ in blocks
        ]

    def create_chunk_list():
        return [ChunkStorageMetadata(o, s) for o, s, _ in blocks]

    def get_tensor_shard(index):
        for o, _, sl in blocks:
            if o == torch.Size(index.offset):
                return local[sl]
        raise ValueError(f"{index.fqn}: no local block at offset {tuple(index.offset)}")

    view.__create_write_items__ = create_write_items
    view.__create_chunk_list__ = create_chunk_list
    view.__get_tensor_shard__ = get_tensor_shard
    return DTensor(view, dt._spec, requires_grad=False)


def dcp_view(state):
    """Shallow copy of a nested state dict with multi-block DTensors made DCP-describable."""
    if isinstance(state, dict):
        return {k: dcp_view(v) for k, v in state.items()}
    if isinstance(state, list):
        return [dcp_view(v) for v in state]
    if isinstance(state, DTensor) and _needs_view(state):
        return _multi_chunk_dtensor(state)
    return state


class BlockSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner that writes multi-block DTensor shards as one chunk per block."""

    # Explicit signature: DCP inspects it for `storage_meta` (and warns when it is absent).
    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.state_dict = dcp_view(self.state_dict)


class BlockLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads multi-block DTensor shards block by block, in place."""

    def set_up_planner(self, *args, **kwargs) -> None:
        super().set_up_planner(*args, **kwargs)
        self.state_dict = dcp_view(self.state_dict)
