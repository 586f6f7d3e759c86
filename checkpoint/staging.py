"""Staging: a rank's state copied into CPU buffers allocated once, for a background writer.

    stager = Stager(buffers=2, shared=False)
    staged = stager.stage(state, index)      # the loop waits for this copy only
    sd = stager.state_dict(staged)           # what dcp.save writes (a thread of this process)
    # or, in another process: materialize(staged.skeleton, make_views(buffer, staged.slots),
    #                                     staged.copied)

`plan` walks the state dict the Statefuls return and keeps its structure (so DCP flattens it to
the same keys as a live save). Every plain tensor leaf (a DTensor's local shard included)
gets a slot in one flat byte buffer: offset, dtype, shape, and how its bytes map into the
global tensor (DCP chunks: a DTensor's one shard, or its several blocks under a strided TP
placement, checkpoint/planners.py). Tensor subclasses (TE quantized tensors) are copied with
`.cpu()` at every save instead (their type is kept, nothing is dequantized); other leaves are
copied as objects.

The buffers (one or two, see CheckpointConfig.staging_buffers) are allocated for the first
plan and reused while the plan's slots stay the same: pinned (cudaHostRegister) when CUDA is
present; in shared memory for the writer process (`shared`), and for writer threads when
/dev/shm has room: on an H200 host, four threads of the training process
writing files from its private pinned memory spent 1.4-3.6x the kernel time in `write` that
they spent on the same bytes from shared memory (docs/PERFORMANCE.md). A copy is one
`copy_(non_blocking=True)` per tensor and one synchronize. Without CUDA the same code runs on
plain CPU buffers.

The staged tensors are views (`torch.frombuffer`, so each has a storage of exactly its own
bytes and torch.save writes nothing else) carrying DCP's `_Checkpointable` hooks
(`__create_write_items__`, `__create_chunk_list__`, `__get_tensor_shard__`): DCP plans them
like the DTensors they stand for, without a device mesh, in any process.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from checkpoint.planners import _blocks, _needs_view
from errors import ConfigError

_ALIGN = 64

#: One block of a tensor: (global offsets, sizes, local slices as (start, stop) per dim, or
#: None for the whole local tensor).
Block = tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, int], ...] | None]


@dataclass(frozen=True)
class Slot:
    """Where one tensor leaf lives in the staging buffer and what DCP is told about it."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    #: None: a plain tensor (one item at offset 0); else the DTensor's blocks.
    blocks: tuple[Block, ...] | None
    global_size: tuple[int, ...] | None
    props: TensorProperties

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class SlotRef:
    index: int


@dataclass(frozen=True)
class CopiedRef:
    index: int


@dataclass
class Copied:
    """A tensor subclass leaf: copied to CPU at each save (type kept), with its DCP chunks."""

    tensor: torch.Tensor
    blocks: tuple[Block, ...] | None
    global_size: tuple[int, ...] | None
    props: TensorProperties


@dataclass
class Staged:
    """One staged save: the state dict's structure with SlotRef / CopiedRef leaves, the slots,
    the buffer they were copied into, and the subclass copies."""

    skeleton: Any
    slots: list[Slot]
    buffer: int
    copied: list[Copied]
    nbytes: int
    #: Seconds: the copies and their synchronize; the Statefuls' state_dict() calls and the
    #: walk (plan); waiting for (or doing) the buffer allocation.
    stage_s: float = 0.0
    state_dict_s: float = 0.0
    alloc_s: float = 0.0


@dataclass
class _Plan:
    skeleton: Any
    slots: list[Slot]
    sources: list[torch.Tensor]
    copied: list[tuple[torch.Tensor, Copied]]
    nbytes: int
    signature: tuple = field(default=())
    seconds: float = 0.0


# -- planning --------------------------------------------------------------------------------


def _is_plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def _describe(t: torch.Tensor):
    """(local tensor, blocks, global size, properties) of a tensor leaf."""
    if isinstance(t, DTensor):
        if any(p.is_partial() for p in t.placements):
            raise ValueError("a DTensor with Partial placements cannot be checkpointed")
        local = t._local_tensor
        props = TensorProperties.create_from_tensor(local)
        if t.device_mesh.get_coordinate() is None:  # this rank holds none of it
            return local, (), tuple(t.shape), props
        if _needs_view(t):
            blocks = tuple(
                (tuple(o), tuple(s), tuple((sl.start, sl.stop) for sl in sls))
                for o, s, sls in _blocks(t)
            )
        else:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            sizes, offsets = compute_local_shape_and_global_offset(
                t.shape, t.device_mesh, t.placements
            )
            blocks = ((tuple(offsets), tuple(sizes), None),)
        return local, blocks, tuple(t.shape), props
    return t, None, None, TensorProperties.create_from_tensor(t)


def plan(state: Mapping[str, Any]) -> _Plan:
    """Walk the state (Statefuls asked for their state_dict) into a plan; no copies yet."""
    t0 = time.perf_counter()
    slots: list[Slot] = []
    sources: list[torch.Tensor] = []
    copied: list[tuple[torch.Tensor, Copied]] = []
    offset = 0

    def walk(v):
        nonlocal offset
        if isinstance(v, torch.Tensor):
            local, blocks, gsize, props = _describe(v)
            local = local.detach()
            if _is_plain(local):
                slot = Slot(offset, local.dtype, tuple(local.shape), blocks, gsize, props)
                offset += -(-slot.nbytes // _ALIGN) * _ALIGN
                slots.append(slot)
                sources.append(local)
                return SlotRef(len(slots) - 1)
            copied.append((local, Copied(local, blocks, gsize, props)))
            return CopiedRef(len(copied) - 1)
        if isinstance(v, Mapping):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, tuple):
            return tuple(walk(x) for x in v)
        return copy.deepcopy(v)

    skeleton = {
        k: walk(part.state_dict() if isinstance(part, Stateful) else part)
        for k, part in state.items()
    }
    signature = tuple((s.dtype, s.shape, s.blocks) for s in slots)
    return _Plan(skeleton, slots, sources, copied, offset, signature, time.perf_counter() - t0)


# -- buffers and views ---------------------------------------------------------------------


def _pin(buf: torch.Tensor) -> bool:
    if not torch.cuda.is_available() or buf.numel() == 0:
        return False
    # cudaHostRegisterPortable: pinned for every CUDA context of the process.
    err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 1))
    return err == 0


def _unpin(buf: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


def allocate(nbytes: int, *, shared: bool) -> tuple[torch.Tensor, bool]:
    """A flat uint8 CPU buffer (shared memory if `shared`), pinned when CUDA is present.
    Returns (buffer, pinned)."""
    n = max(nbytes, 1)
    if shared:
        storage = torch.UntypedStorage._new_shared(n)
        buf = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (n,), (1,))
    else:
        buf = torch.empty(n, dtype=torch.uint8)
    pinned = _pin(buf)  # registering pins (and so maps) every page
    if not pinned:
        buf.zero_()  # map the pages now, not during the first save's copy
    return buf, pinned


def make_views(buffer: torch.Tensor, slots: list[Slot]) -> list[torch.Tensor]:
    """A tensor per slot over `buffer`, each with a storage of exactly its own bytes."""
    raw = buffer.numpy()
    views = []
    for s in slots:
        numel = math.prod(s.shape)
        if numel == 0:
            views.append(torch.empty(s.shape, dtype=s.dtype))
        else:
            t = torch.frombuffer(raw, dtype=s.dtype, count=numel, offset=s.offset)
            views.append(t.view(s.shape))
    return views


def attach_hooks(t: torch.Tensor, blocks, global_size, props: TensorProperties) -> torch.Tensor:
    """Give `t` DCP's _Checkpointable hooks: its write items are those of the tensor it stands
    for (a plain tensor: one item; a DTensor: its blocks with the global size), with the live
    tensor's properties."""
    if blocks is None:
        size = t.size()
        zeros = torch.Size([0] * t.dim())
        items = [(zeros, size, None, WriteItemType.TENSOR)]
        gsize = size
    else:
        gsize = torch.Size(global_size)
        items = [(torch.Size(o), torch.Size(s), sl, WriteItemType.SHARD) for o, s, sl in blocks]

    def create_write_items(fqn, _obj):
        return [
            WriteItem(
                index=MetadataIndex(fqn, o),
                type=kind,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(o, s), properties=props, size=gsize
                ),
            )
            for o, s, _, kind in items
        ]

    def create_chunk_list():
        return [ChunkStorageMetadata(o, s) for o, s, _, _ in items]

    def get_tensor_shard(index):
        for o, _, sl, _ in items:
            if index.offset is None or o == torch.Size(index.offset):
                return t if sl is None else t[tuple(slice(a, b) for a, b in sl)]
        raise ValueError(f"{index.fqn}: no staged block at offset {tuple(index.offset)}")

    t.__create_write_items__ = create_write_items
    t.__create_chunk_list__ = create_chunk_list
    t.__get_tensor_shard__ = get_tensor_shard
    return t


def materialize(skeleton, views: list[torch.Tensor], copied: list[Copied], slots: list[Slot]):
    """The state dict DCP saves: the skeleton with staged tensors (hooked) at its leaves."""

    def walk(v):
        if isinstance(v, SlotRef):
            s = slots[v.index]
            return attach_hooks(views[v.index], s.blocks, s.global_size, s.props)
        if isinstance(v, CopiedRef):
            c = copied[v.index]
            return attach_hooks(c.tensor, c.blocks, c.global_size, c.props)
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, tuple):
            return tuple(walk(x) for x in v)
        return v

    return walk(skeleton)


def shared_memory_free() -> int | None:
    """Free bytes of /dev/shm, where shared staging buffers live (None where unknown)."""
    try:
        return shutil.disk_usage("/dev/shm").free
    except OSError:
        return None


def host_memory_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# -- the stager ---------------------------------------------------------------------------


class Stager:
    """Owns the staging buffers of one manager. `buffers`: how many (1 or 2; 2 drops to 1 when
    twice this rank's state times the ranks of this node would take more than half of the
    host's available memory). `shared`: buffers in shared memory (writer process); else in
    shared memory when /dev/shm has room for them with a tenth to spare, private otherwise.
    `agree`: the element-wise minimum of a list of integers over every rank (a
    collective), so that the first allocation is placed alike on every rank and said once (by
    `log`, rank 0's); None (one process, or a reallocation): this rank decides alone and says
    so with `warn` (default `log`). `in_shared`: where the current buffers are."""

    def __init__(
        self,
        *,
        buffers: int = 2,
        shared: bool = False,
        log: Callable[[str], None] = lambda m: None,
        warn: Callable[[str], None] | None = None,
        on_allocate: Callable[[list[torch.Tensor]], None] | None = None,
        before_reallocate: Callable[[], None] | None = None,
        agree: Callable[[list[int]], list[int]] | None = None,
    ):
        self.wanted = buffers
        self.shared = shared
        self._log = log
        self._warn = warn or log
        self._on_allocate = on_allocate
        self._before_reallocate = before_reallocate
        self._agree = agree
        self.signature: tuple | None = None
        self.buffers: list[torch.Tensor] = []
        self.pinned = False
        self.views: list[list[torch.Tensor]] = []
        self.slots: list[Slot] = []
        self._alloc: Future | None = None
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        """Buffers in use (0 before the first allocation)."""
        if self._alloc is not None:
            self._alloc.result()
        return len(self.buffers)

    def _placement(self, nbytes: int, agree: bool) -> tuple[int, bool]:
        """(how many buffers, whether in shared memory) for buffers of `nbytes` on this rank,
        every local rank needing as much. With `agree` (and the `agree` collective), every
        rank decides from the same figures, read by every rank before any allocates (so no
        rank counts another's buffers as used): the least free /dev/shm and host memory and
        the most bytes and local ranks over the job; rank 0 says what was decided."""
        unknown = 1 << 62
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        shm = shared_memory_free()
        available = host_memory_available()
        figures = [unknown if x is None else x for x in (shm, available)] + [-nbytes, -local]
        agreed = agree and self._agree is not None
        if agreed:
            figures = self._agree(figures)
        shm, available = (None if x >= unknown else x for x in figures[:2])
        nbytes, local = -figures[2], -figures[3]
        say = self._log if agreed else self._warn  # agreed: rank 0's line speaks for all
        least = " on the job's fullest node" if agreed else ""
        size = f"{nbytes / 2**30:.2f} GiB per rank x {local} local ranks"
        shm_free = "unknown" if shm is None else f"{shm / 2**30:.1f} GiB free{least}"
        # async_process needs its buffers in /dev/shm; async keeps a tenth of it spare.
        limit = None if shm is None else (shm if self.shared else 0.9 * shm)

        def fits(count: int) -> bool:
            return limit is not None and count * nbytes * local <= limit

        if self.shared and shm is not None and not fits(1):
            # Touching shared memory beyond /dev/shm's size kills the process (SIGBUS).
            raise ConfigError(
                f"checkpoint.mode=async_process: a staging buffer of {size} does not fit in "
                f"/dev/shm ({shm_free}); enlarge /dev/shm (docker --shm-size) or use "
                "checkpoint=async"
            )
        count = self.wanted
        if count == 2 and available is not None and 2 * nbytes * local > available // 2:
            say(
                f"staging: 1 buffer, not 2: 2 x {size} exceed half of the "
                f"{available / 2**30:.1f} GiB of host memory available{least}"
            )
            count = 1
        if count == 2 and self.shared and shm is not None and not fits(2):
            say(f"staging: 1 buffer, not 2: 2 x {size} do not fit in /dev/shm ({shm_free})")
            count = 1
        if self.shared or fits(count):
            return count, True
        say(
            f"staging: {count} x {size} does not fit in /dev/shm ({shm_free}; a tenth is kept "
            "spare); staging in private memory, where writes from threads of the training "
            "process are slower (enlarge /dev/shm, e.g. docker --shm-size)"
        )
        return count, False

    @property
    def in_shared(self) -> bool:
        """Whether the current buffers are in shared memory."""
        return bool(self.buffers) and self.buffers[0].untyped_storage().is_shared()

    def _allocate(self, p: _Plan, count: int, shared: bool) -> None:
        t0 = time.perf_counter()
        buffers, pinned = [], []
        for _ in range(count):
            buf, pin = allocate(p.nbytes, shared=shared)
            buffers.append(buf)
            pinned.append(pin)
        self.buffers = buffers
        self.pinned = all(pinned) and bool(pinned)
        self.views = [make_views(b, p.slots) for b in buffers]
        self.slots = list(p.slots)
        self.signature = p.signature
        if torch.cuda.is_available() and not self.pinned:
            self._log("staging: could not pin the buffers (cudaHostRegister); copies are slower")
        self._log(
            f"staging: {count} buffer(s) of {p.nbytes / 2**30:.3f} GiB "
            f"({'pinned' if self.pinned else 'pageable'}"
            f"{', shared' if shared else ''}) in {time.perf_counter() - t0:.2f}s"
        )
        if self._on_allocate is not None:
            self._on_allocate(self.buffers)

    def prepare(self, state: Mapping[str, Any]) -> None:
        """Plan now and allocate on a background thread, so the first save finds its buffers
        ready. Call on every rank at the same step (Statefuls may run collectives)."""
        if self.signature is not None or self._alloc is not None:
            return
        p = plan(state)
        count, shared = self._placement(p.nbytes, agree=True)  # on this thread: a collective
        # The thread keeps its own reference: stage() takes self._alloc away to wait on it.
        self._alloc = done = Future()
        # A new thread starts on device 0: keep this rank's device (no context on another GPU).
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

        def run():
            try:
                if device is not None:
                    torch.cuda.set_device(device)
                self._allocate(p, count, shared)
                done.set_result(None)
            except BaseException as e:  # surfaced by the next stage()
                done.set_exception(e)

        threading.Thread(target=run, name="ckpt-stage-alloc", daemon=True).start()

    def stage(self, state: Mapping[str, Any] | _Plan, index: int) -> Staged:
        """Copy the state (or its `plan`, made earlier) into buffer `index` (allocating on
        first use or when the tensors changed). Returns when the copy is complete."""
        t0 = time.perf_counter()
        p = state if isinstance(state, _Plan) else plan(state)
        t_plan = time.perf_counter()
        if self._alloc is not None:
            alloc, self._alloc = self._alloc, None
            alloc.result()
        if p.signature != self.signature or not self.buffers:
            # The first allocation happens at the same save on every rank, so its placement
            # is agreed; a later one (the state's tensors changed) is this rank's own.
            first = self.signature is None
            if not first:
                self._log("staging: the state's tensors changed; staging buffers reallocated")
                if self._before_reallocate is not None:
                    self._before_reallocate()  # no write may still read the old buffers
            self.close()
            self._allocate(p, *self._placement(p.nbytes, agree=first))
        t_alloc = time.perf_counter()
        index = min(index, len(self.buffers) - 1)
        views = self.views[index]
        devices = set()
        with torch.no_grad():
            for view, src in zip(views, p.sources):
                if src.device.type == "cuda":
                    devices.add(src.device)
                view.copy_(src, non_blocking=src.device.type == "cuda")
            copies = [Copied(src.cpu(), c.blocks, c.global_size, c.props) for src, c in p.copied]
        for d in devices:
            torch.cuda.current_stream(d).synchronize()
        return Staged(
            skeleton=p.skeleton,
            slots=self.slots,
            buffer=index,
            copied=copies,
            nbytes=p.nbytes + sum(c.tensor.nbytes for c in copies),
            stage_s=time.perf_counter() - t_alloc,
            state_dict_s=p.seconds + (t_plan - t0),
            alloc_s=t_alloc - t_plan,
        )

    def state_dict(self, staged: Staged) -> dict:
        return materialize(staged.skeleton, self.views[staged.buffer], staged.copied, staged.slots)

    def close(self) -> None:
        if self.pinned:
            for b in self.buffers:
                _unpin(b)
        self.buffers, self.views, self.pinned, self.signature = [], [], False, None
