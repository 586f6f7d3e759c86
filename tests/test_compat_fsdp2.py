"""FSDP2 with weights that all-gather data + block scales (compat/fsdp2.py).

TE's block-scaled tensors cannot run here, so the FSDP2 tests use a small stand-in with the
same all-gather contract: row-wise data plus a compact scale tensor with one column per block
of BLOCK columns, padded to a multiple of PAD (Float8BlockwiseQTensor: 128 and 4). Its
value is data * scale. Each test first shows torch's own failure, then, with the fix, that the
FSDP2-gathered weight equals the weight built on one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.testing._internal.two_tensor import TwoTensor

from compat import fsdp2
from tests.distributed import run_distributed

BLOCK, PAD = 2, 4


def _pad(n: int) -> int:
    return -(-n // PAD) * PAD


def _compact_scales(per_element: torch.Tensor) -> torch.Tensor:
    """(rows, cols) per-element scales -> (rows, cols / BLOCK padded to PAD), padding -1."""
    rows, cols = per_element.shape
    scale = torch.full((rows, _pad(cols // BLOCK)), -1.0)
    scale[:, : cols // BLOCK] = per_element[:, ::BLOCK]
    return scale


class BlockScaled(TwoTensor):
    """a: data; b: each element's block scale. All-gathers (data, compact scales)."""

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        return (self.a.contiguous(), _compact_scales(self.b)), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        # Like TE: the unsharded weight's inner tensors are the buffers handed in, which FSDP2
        # frees after use and re-allocates (to their size) before the next all-gather.
        data, scale = all_gather_outputs  # torch's one-rank path passes only the data
        blocks = data.shape[1] // BLOCK
        value = data * scale[:, :blocks].repeat_interleave(BLOCK, dim=1)
        if out is not None:
            out.copy_(value)
            return None
        return value, all_gather_outputs


class Linear(nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        return x @ self.weight.t()


def _weight(rows: int, cols: int):
    g = torch.Generator().manual_seed(0)
    data = torch.randn(rows, cols, generator=g)
    per_block = torch.rand(rows, cols // BLOCK, generator=g) + 0.5
    scales = per_block.repeat_interleave(BLOCK, dim=1)
    return BlockScaled(data, scales), data * scales


def _sharded_model(mesh, rows, cols, dim: int):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    weight, full = _weight(rows, cols)
    inner = Linear(weight)
    model = nn.Sequential(inner)
    placement = (lambda p: Shard(dim)) if dim else None
    fully_shard(inner, mesh=mesh, shard_placement_fn=placement)  # reshards after each forward
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    return model, full


def _forward_twice(model, full, cols):
    """Two forwards: the first unshard builds the weight, the second refills it (out=)."""
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), x @ full.t())


def _dim1_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    # 3 blocks per shard (scale padded 3 -> 4); the full weight has 3 * world blocks.
    rows, cols = 4, 3 * BLOCK * world_size
    assert fsdp2.dim1_copy_out_views_every_output()
    model, full = _sharded_model(mesh, rows, cols, dim=1)
    with pytest.raises(RuntimeError, match="invalid for input of size"):
        _forward_twice(model, full, cols)  # torch views the scales in the data's shard shape

    assert fsdp2.enable_dim1_block_gather(BlockScaled, lambda t: (BLOCK, PAD))
    model, full = _sharded_model(mesh, rows, cols, dim=1)
    _forward_twice(model, full, cols)
    # Dim-0 sharding of the same class goes through torch's own path, unchanged.
    model, full = _sharded_model(mesh, 2 * world_size, cols, dim=0)
    _forward_twice(model, full, cols)


@pytest.mark.parametrize("world_size", [2, 4])
def test_dim1_sharded_block_scaled_weight_gathers_whole(world_size):
    run_distributed(_dim1_worker, world_size)


def _one_rank_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    # HSDP with one rank per shard group: what ddp, tp and hsdp_tp 2x1x2 give FSDP2.
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    rows, cols = 4, 4 * BLOCK
    assert fsdp2.one_rank_drops_extra_inputs()
    model, full = _sharded_model(mesh, rows, cols, dim=0)
    with pytest.raises(ValueError, match="not enough values to unpack"):
        _forward_twice(model, full, cols)

    assert fsdp2.ensure_one_rank_keeps_all_inputs()
    model, full = _sharded_model(mesh, rows, cols, dim=0)
    _forward_twice(model, full, cols)


def test_one_rank_shard_mesh_passes_every_input():
    run_distributed(_one_rank_worker, 2)


@pytest.mark.parametrize("world,blocks,rows", [(2, 3, 4), (4, 1, 3), (4, 4, 2), (3, 5, 1)])
def test_regroup_dim1_blocks_matches_the_unsharded_layout(world, blocks, rows):
    """What torch's copy-out leaves for dim-1 shards gathered in dim-0 order, regrouped, is
    the full weight's data and its compact scales (padding zeroed)."""
    cols = world * blocks * BLOCK
    g = torch.Generator().manual_seed(world * 100 + blocks)
    data = torch.randn(rows, cols, generator=g)
    per_element = (torch.rand(rows, cols // BLOCK, generator=g) + 0.5).repeat_interleave(BLOCK, 1)
    shards = data.chunk(world, dim=1)
    scale_shards = [_compact_scales(s) for s in per_element.chunk(world, dim=1)]
    gathered = torch.cat(shards, dim=0)  # dim-0 order: (world * rows, cols / world)
    gathered_scales = torch.cat(scale_shards, dim=0)
    full, full_scale = fsdp2.regroup_dim1_blocks(gathered, gathered_scales, world, BLOCK, PAD)
    assert torch.equal(full, data)
    want = _compact_scales(per_element)
    want[want == -1] = 0
    assert torch.equal(full_scale, want)
    assert full.data_ptr() == gathered.data_ptr()  # written over the buffers FSDP2 frees
    assert full_scale.data_ptr() == gathered_scales.data_ptr()
    with pytest.raises(ValueError, match="not a multiple of the scale block"):
        fsdp2.regroup_dim1_blocks(torch.zeros(world * rows, 3), gathered_scales, world, 2, PAD)
