"""Resume reads each byte once (checkpoint/reader.py): the data files are hashed by the reader
that loads them, no separate hashing pass runs, the resumed run continues bit for bit, and
damage anywhere in a file (an item's zip header, a pickled object, a tensor's data) still stops
the resume with the one line naming the checkpoint; on two ranks every data file is verified
by exactly one rank. Sync saves go through the staging buffer (the async writer's path)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import checkpoint.resume as resume_mod
from checkpoint import hashing, store
from checkpoint.reader import CheckpointReader, _ItemTensors
from errors import ConfigError
from tests.ckpt_harness import Run, committed
from tests.distributed import run_distributed
from tests.helpers import FakeLoader

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Recording(CheckpointReader):
    made: list[CheckpointReader] = []

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        _Recording.made.append(self)


@pytest.fixture
def readers(monkeypatch):
    _Recording.made = []
    monkeypatch.setattr(resume_mod, "CheckpointReader", _Recording)
    return _Recording.made


def _data_files(ckpt: Path) -> dict[str, int]:
    manifest = store.read_manifest(ckpt)
    return {
        rel: e["size"] for rel, e in manifest["files"].items() if rel.endswith(store.DATA_SUFFIX)
    }


def test_resume_reads_each_byte_once_and_continues_bitwise(tmp_path, readers, monkeypatch):
    _, reference = Run(tmp_path / "ref").train(6)
    Run(tmp_path / "run").train(4)
    ckpt = tmp_path / "run" / "checkpoints" / "step_0000004"
    hashed = []
    real_hash = hashing.hash_file
    monkeypatch.setattr(
        hashing, "hash_file", lambda p, a: hashed.append(Path(p).name) or real_hash(p, a)
    )
    run = Run(tmp_path / "run")
    start, losses = run.train(6)
    assert start == 4 and losses == reference[4:]  # bit for bit
    files = _data_files(ckpt)
    assert set(hashed) <= {".metadata", store.CONFIG_FILE}  # no data file read for hashing
    (reader,) = readers
    assert reader.verify and sorted(reader.verified) == sorted(files)
    assert reader.bytes_read == sum(files.values())  # every data byte, once
    assert reader._tensors.views > 0 and reader._tensors.loads == 0  # no torch.load copies
    assert any("verified the hashes of" in m and "as they were loaded" in m for m in run.messages)


def _item_equal(a, b) -> bool:
    if not isinstance(a, torch.Tensor):
        return a == b
    return (
        type(b) is torch.Tensor
        and (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride())
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _saved(t) -> memoryview:
    buf = io.BytesIO()
    torch.save(t, buf)
    return memoryview(bytearray(buf.getvalue()))


def test_item_views_equal_torch_load(tmp_path):
    """Every item of a checkpoint this recipe wrote, and items of plain torch.save (CRCs on,
    other shapes, a transposed storage, a view with a storage offset, bf16), read through
    _ItemTensors equal torch.load's tensors (dtype, shape, strides, bytes), as views of the
    item's bytes; an item whose pickled shape was changed is refused as torch.load refuses it,
    and a non-tensor item is torch.load's."""
    Run(tmp_path).train(2)
    ckpt = tmp_path / "checkpoints" / "step_0000002"
    storage = FileSystemReader(str(ckpt)).read_metadata().storage_data
    tensors = _ItemTensors()
    n_tensors = 0
    for info in sorted(storage.values(), key=lambda i: (i.relative_path, i.offset)):
        with open(ckpt / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = memoryview(bytearray(f.read(info.length)))
        want = torch.load(io.BytesIO(data), weights_only=True)
        n_tensors += isinstance(want, torch.Tensor)
        assert _item_equal(want, tensors.tensor(data)), info
    # Every tensor item a view; the pickled objects (steps, param groups) torch.load's.
    assert n_tensors > 50 and tensors.views == n_tensors, (n_tensors, tensors.views)
    assert tensors.loads == len(storage) - n_tensors

    tensors = _ItemTensors()
    gen = torch.Generator().manual_seed(0)
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(True)  # what other writers leave on
    try:
        items = [_saved(torch.randn(128, 256, generator=gen)) for _ in range(6)]
        items.append(_saved(torch.randn(256, 128, generator=gen)))  # same length, other shape
        items.append(_saved(torch.randn(128, 256, generator=gen).t()))  # transposed storage
        items.append(_saved(torch.randn(128, 256, generator=gen).to(torch.bfloat16).view(-1)))
        items.append(_saved(torch.randn(40, 256, generator=gen)[3:, 5:]))  # storage offset
        other = _saved({"a": torch.arange(5)})
        changed = _saved(torch.randn(128, 256, generator=gen))
    finally:
        torch.serialization.set_crc32_options(crc)
    for data in items:
        got = tensors.tensor(data)
        assert _item_equal(torch.load(io.BytesIO(data), weights_only=True), got)
    assert tensors.views == len(items) and tensors.loads == 0
    assert torch.equal(tensors.tensor(other)["a"], torch.arange(5)) and tensors.loads == 1
    # The pickled shape (128, 256) changed to (256, 128), same length: torch.load refuses the
    # strides (256, 1) for it, and so does the reader (no view of too few bytes).
    p = bytes(changed).index(b"K\x80M\x00\x01\x86")
    changed[p : p + 5] = b"M\x00\x01K\x80"
    views = tensors.views
    with pytest.raises(RuntimeError):
        torch.load(io.BytesIO(changed), weights_only=True)
    with pytest.raises(RuntimeError):
        tensors.tensor(changed)
    assert tensors.views == views


def test_checksum_false_reads_only_the_items(tmp_path, readers):
    Run(tmp_path).train(4)
    files = _data_files(tmp_path / "checkpoints" / "step_0000004")
    Run(tmp_path, checksum=False).train(6)
    (reader,) = readers
    assert not reader.verify and reader.verified == []
    # the items, not the trailers (64 bytes a file)
    assert reader.bytes_read == sum(files.values()) - store.TRAILER_SIZE * len(files)


def _items(ckpt: Path):
    md = FileSystemReader(str(ckpt)).read_metadata()
    return {k.fqn: (ckpt / v.relative_path, v.offset, v.length) for k, v in md.storage_data.items()}


def _flip(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize(
    "where",
    ["tensor zip header", "tensor data", "pickled object"],
)
def test_damage_anywhere_is_refused_with_the_one_line(tmp_path, where):
    Run(tmp_path).train(4)
    root = tmp_path / "checkpoints"
    items = _items(root / "step_0000004")
    if where == "pickled object":
        fqn = next(k for k in items if k.startswith("train."))
        path, offset, length = items[fqn]
        at = offset + length // 2
    else:
        path, offset, length = items["model.lm_head.weight"]
        at = offset + 1 if where == "tensor zip header" else offset + length - 200
    _flip(path, at)
    with pytest.raises(ConfigError) as e:
        Run(tmp_path).train(6)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(
        f"checkpoint {root / 'step_0000004'} is damaged (file {path.name} fails its "
        f"{hashing.LABELS[hashing.default_algorithm()]} check (corrupted)) and was not loaded; "
        f"pass checkpoint.resume={root / 'step_0000002'}"
    ), msg
    assert committed(root) == [2, 4]


def _two_ranks(rank, world_size, tmp):
    import torch.distributed as dist

    import checkpoint.resume as m

    made = []

    class Rec(CheckpointReader):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    m.CheckpointReader = Rec
    tmp = Path(tmp)
    Run(tmp, loader=FakeLoader(rank, world_size)).train(4)
    dist.barrier()
    _, losses = Run(tmp, loader=FakeLoader(rank, world_size)).train(6)
    (reader,) = made
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (sorted(reader.verified), reader.bytes_read))
    if rank == 0:
        files = _data_files(tmp / "checkpoints" / "step_0000004")
        verified = [f for v, _ in everyone for f in v]
        assert sorted(verified) == sorted(files), everyone  # each file by one rank
        # The harness's model is replicated (no FSDP): each rank loads every item, and reads
        # each byte at most once (its own loads and the files it verifies share the reads).
        assert all(n <= sum(files.values()) for _, n in everyone), (everyone, files)


def test_two_ranks_verify_each_file_once(tmp_path):
    run_distributed(_two_ranks, 2, str(tmp_path))


def test_sync_saves_are_staged(tmp_path):
    run = Run(tmp_path)
    run.train(4)
    assert any("staging: 1 buffer(s)" in m for m in run.messages), run.messages
    saved = [m for m in run.messages if "saved (sync)" in m]
    assert len(saved) == 2 and all("(staging " in m for m in saved), saved
