import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed


def _allreduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == world_size * (world_size + 1) / 2


def _fails(rank, world_size):
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    dist.barrier()


def test_run_distributed_allreduce():
    run_distributed(_allreduce, 2)


def test_run_distributed_reports_failure():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_distributed(_fails, 2, timeout=60)
