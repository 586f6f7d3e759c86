"""The one mesh object (docs/ARCHITECTURE.md, decision 3): degrees, validation, DeviceMesh, groups.

Rank layout: the mesh is ("dp_replicate", "dp_shard", "cp", "tp") in row-major order, so tp is
the fastest-varying dim (tp ranks are neighbours, i.e. inside one node), then cp, and

    rank = ((replicate_idx * dp_shard + shard_idx) * cp + cp_idx) * tp + tp_idx
    dp_rank = rank // (cp * tp),  cp_rank = (rank // tp) % cp,  tp_rank = rank % tp

Views derived from it (nothing else in the repo builds process groups):

    fsdp mesh           ("dp_replicate", "dp_shard_cp"), or ("dp_shard_cp",) when dp_replicate
                        == 1: parameters are sharded over dp_shard x cp (context-parallel ranks
                        hold the same weights and see different tokens, so they shard them as
                        data-parallel ranks would) and gradients are averaged over every rank
                        of it
    tp mesh             ("tp",)
    cp group            ("cp",): the ranks that split one sequence (parallel/cp.py)
    dp group            dp_replicate x dp_shard flattened: the ranks that read different samples
    loss group          dp_replicate x dp_shard x cp flattened: the ranks that compute different
                        tokens, over which the logged and evaluated losses are averaged
    weight_shard group  dp_shard x cp x tp flattened: the ranks that hold pieces of one weight,
                        the amax-reduction group of per-tensor-scaled recipes (never
                        dp_replicate, whose ranks hold identical copies)
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from errors import ConfigError
from parallel.ac import check_mode
from parallel.config import ParallelConfig

DIM_NAMES = ("dp_replicate", "dp_shard", "cp", "tp")
#: TE's context-parallel communication types (parallel.cp_comm_type).
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
#: parallel.grad_reduce: after every micro batch, or once per optimizer step.
GRAD_REDUCE = ("micro_batch", "step")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LAYOUTS = ("ddp", "fsdp", "hsdp", "tp", "fsdp_tp", "hsdp_tp")

#: One mesh per (device type, degrees) and default process group in a process. A process that
#: runs train.run again with the same layout (a Hydra multirun's jobs, the test harnesses)
#: reuses it: a new mesh would make new process groups each time, and every earlier run's
#: NCCL communicators would stay allocated (9-16 GiB per rank after a dozen runs on H100s).
#: Destroying them instead is not safe: caches that compare meshes by shape still reach them.
_MESHES: dict = {}


def _new_mesh(device_type: str, degrees: tuple[int, int, int, int]) -> tuple:
    """The root mesh and its views: (root, dp, dp x cp for the loss, dp_shard x cp x tp
    weight shards, the mesh FSDP2 shards over)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, degrees, mesh_dim_names=DIM_NAMES)
    # Keep the flattened views: slicing them back out of the root mesh is deprecated.
    dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    loss_mesh = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    weight_shard_mesh = mesh["dp_shard", "cp", "tp"]._flatten("weight_shard")
    fsdp_mesh = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    if degrees[0] > 1:
        # FSDP x TP needs the 2-D (replicate, shard) mesh as a slice of the root mesh, the
        # one the tp mesh comes from; its shard dim is the flattened dp_shard x cp.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fsdp_mesh = mesh["dp_replicate", "dp_shard_cp"]
    return mesh, dp_mesh, loss_mesh, weight_shard_mesh, fsdp_mesh


def dtype_of(name: str, field: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"parallel.{field}={name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


class ParallelDims:
    """Resolved degrees of a layout on `world_size` ranks. Construction validates them."""

    def __init__(self, cfg: ParallelConfig, world_size: int):
        self.cfg = cfg
        self.world_size = world_size
        self.dp_replicate, self.dp_shard, self.cp, self.tp = self._resolve(cfg, world_size)
        self.mesh = None
        self.dp_mesh = None
        self.weight_shard_mesh = None
        self._fsdp_mesh = None
        self._dp_group = None
        self._loss_group = None
        self._weight_shard_group = None

    @staticmethod
    def _resolve(cfg: ParallelConfig, world_size: int) -> tuple[int, int, int, int]:
        if cfg.name not in LAYOUTS:
            raise ConfigError(f"parallel.name={cfg.name!r} is not one of {', '.join(LAYOUTS)}")
        if cfg.cp_comm_type not in CP_COMM_TYPES:
            raise ConfigError(
                f"parallel.cp_comm_type={cfg.cp_comm_type!r} is not one of "
                f"{', '.join(CP_COMM_TYPES)}"
            )
        degrees = {
            "dp_replicate": cfg.dp_replicate,
            "dp_shard": cfg.dp_shard,
            "cp": cfg.cp,
            "tp": cfg.tp,
        }
        for name, d in degrees.items():
            if d == 0 or d < -1:
                raise ConfigError(f"parallel.{name}={d} must be a positive degree or -1 (infer)")
        inferred = [n for n, d in degrees.items() if d == -1]
        if len(inferred) > 1:
            raise ConfigError(
                f"parallel.{' and parallel.'.join(inferred)} are all -1; at most one degree "
                "may be inferred, set the others"
            )
        known = 1
        for d in degrees.values():
            known *= d if d != -1 else 1
        if inferred:
            if world_size % known:
                fixed = " x ".join(f"parallel.{n}={d}" for n, d in degrees.items() if d != -1)
                raise ConfigError(
                    f"{fixed} = {known} does not divide the world size {world_size}, "
                    f"so parallel.{inferred[0]}=-1 cannot be inferred; change them or launch a "
                    f"multiple of {known} processes"
                )
            degrees[inferred[0]] = world_size // known
        product = 1
        for d in degrees.values():
            product *= d
        if product != world_size:
            terms = " x ".join(f"parallel.{n}={d}" for n, d in degrees.items())
            raise ConfigError(
                f"{terms} = {product} != world size {world_size}; set one of them to -1 or "
                f"launch {product} processes"
            )
        if cfg.name.startswith("hsdp") and degrees["dp_replicate"] < 2:
            raise ConfigError(
                f"parallel.dp_replicate={degrees['dp_replicate']} with parallel={cfg.name}: "
                "HSDP needs dp_replicate > 1; raise it or use parallel=fsdp"
            )
        check_mode(cfg.activation_checkpointing, cfg.activation_checkpointing_every)
        if cfg.keep_gathered_blocks < 0:
            raise ConfigError(
                f"parallel.keep_gathered_blocks={cfg.keep_gathered_blocks} must be >= 0 (the "
                "last N blocks keep their gathered weights; 0: only the last)"
            )
        dtype_of(cfg.param_dtype, "param_dtype")
        dtype_of(cfg.reduce_dtype, "reduce_dtype")
        if cfg.grad_reduce not in GRAD_REDUCE:
            raise ConfigError(
                f"parallel.grad_reduce={cfg.grad_reduce!r} is not one of "
                f"{', '.join(GRAD_REDUCE)} (when gradients are reduced under accumulation)"
            )
        return degrees["dp_replicate"], degrees["dp_shard"], degrees["cp"], degrees["tp"]

    def validate_seq_len(self, seq_len: int, field: str = "data.seq_len") -> None:
        """Context parallelism cuts each sequence into 2 x cp chunks; sequence parallelism
        splits a rank's part of it over the tp ranks."""
        if self.cp > 1 and seq_len % (2 * self.cp):
            raise ConfigError(
                f"{field}={seq_len} is not divisible by 2 x parallel.cp={2 * self.cp} (context "
                f"parallelism cuts each sequence into 2 x cp chunks); change one of them"
            )
        local = seq_len // self.cp
        if self.sequence_parallel and local % self.tp:
            raise ConfigError(
                f"{field}={seq_len} / parallel.cp={self.cp} = {local} tokens per rank is not "
                f"divisible by parallel.tp={self.tp}, which sequence parallelism needs; change "
                "it or set parallel.sequence_parallel=false"
            )

    # ---- sizes and coordinates (valid before build_mesh; rank from the process group) ----

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def dp_rank(self) -> int:
        """Data-parallel index: the cp and tp ranks of one data-parallel group share it (same
        samples)."""
        return self.rank // (self.cp * self.tp)

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp) % self.cp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def loss_size(self) -> int:
        """Ranks that compute different tokens of the global batch (dp x cp)."""
        return self.dp_size * self.cp

    @property
    def sequence_parallel(self) -> bool:
        """Sequence parallelism is on: asked for and tp > 1."""
        return self.cfg.sequence_parallel and self.tp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    # ---- mesh and groups ----

    def build_mesh(self, device_type: str):
        """Builds the 3-D DeviceMesh and its flattened views. Needs a process group when
        world_size > 1; a single process without one gets no mesh (everything stays local)."""
        if not dist.is_initialized():
            if self.world_size > 1:
                raise RuntimeError("build_mesh: world_size > 1 needs torch.distributed initialized")
            return None
        if dist.get_world_size() != self.world_size:
            raise ConfigError(
                f"ParallelDims was built for {self.world_size} ranks but the process group has "
                f"{dist.get_world_size()}"
            )
        degrees = (self.dp_replicate, self.dp_shard, self.cp, self.tp)
        key = (device_type, degrees)
        default = dist.group.WORLD
        cached = _MESHES.get(key)
        if cached is None or cached[0] is not default:
            cached = _MESHES[key] = (default, _new_mesh(device_type, degrees))
        mesh, self.dp_mesh, loss_mesh, self.weight_shard_mesh, self._fsdp_mesh = cached[1]
        self.mesh = mesh
        self._dp_group = self.dp_mesh.get_group()
        self._loss_group = loss_mesh.get_group()
        self._weight_shard_group = self.weight_shard_mesh.get_group()
        return mesh

    def warm_up_groups(self, device) -> None:
        """One one-element all-reduce over each group of the mesh, right after it is built.
        NCCL creates a group's communicator (and its connections) at the group's first
        collective and needs GPU memory for it; a group first used after the first step (the
        data-parallel group of the log step's all-reduce) finds memory the caching allocator
        holds and fails there (issue 56: llama3_8b at 32k, cp=4, FP8 attention, "Failed to CUDA
        calloc async 24 bytes" at step 1's log step). Done while memory is free, it costs a
        few milliseconds (and on gloo as on NCCL, so the CPU tests run it)."""
        if self.mesh is None:
            return
        groups = [self._dp_group, self._loss_group, self._weight_shard_group]
        groups += [self.tp_group, self.cp_group, *self._fsdp_mesh.get_all_groups()]
        seen = set()
        for group in groups:
            if id(group) in seen:
                continue
            seen.add(id(group))
            dist.all_reduce(torch.zeros(1, device=device), group=group)

    @property
    def fsdp_mesh(self):
        """Mesh handed to fully_shard: 2-D (replicate, dp_shard x cp) for HSDP/DDP, 1-D
        (dp_shard x cp) otherwise."""
        return self._fsdp_mesh

    @property
    def tp_mesh(self):
        return None if self.mesh is None else self.mesh["tp"]

    @property
    def dp_group(self):
        return self._dp_group

    @property
    def loss_group(self):
        return self._loss_group

    @property
    def tp_group(self):
        return None if self.mesh is None else self.mesh["tp"].get_group()

    @property
    def cp_group(self):
        return None if self.mesh is None else self.mesh["cp"].get_group()

    @property
    def weight_shard_group(self):
        return self._weight_shard_group

    def __repr__(self) -> str:
        return (
            f"ParallelDims({self.cfg.name}: dp_replicate={self.dp_replicate}, "
            f"dp_shard={self.dp_shard}, cp={self.cp}, tp={self.tp}, "
            f"world_size={self.world_size})"
        )
