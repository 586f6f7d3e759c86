"""Parallel layouts: the mesh object, FSDP2/HSDP/DDP, tensor parallel for both implementations.

dims = ParallelDims(cfg.parallel, world_size)     # resolves -1, validates degrees
dims.build_mesh("cuda")                           # after init_process_group
model = parallelize(model, dims, cfg.parallel, impl, mixed_precision=True)
"""

from parallel.config import ParallelConfig
from parallel.dims import ParallelDims
from parallel.parallelize import parallelize

__all__ = ["ParallelConfig", "ParallelDims", "parallelize"]
