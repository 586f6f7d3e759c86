"""Checkpoint benchmark: real training with saves, per checkpoint mode, against the machine's
device-to-host and disk ceilings measured in the same run.

    python tools/bench_checkpoint.py -- model=tiny data.seq_len=64               # CPU, tiny model
    python tools/bench_checkpoint.py --root /ckpt/bench -- model=llama3_1b data.seq_len=8192 \
        train.micro_batch_size=4 train.global_batch_size=4                          # 1 GPU
    torchrun --nproc_per_node=2 tools/bench_checkpoint.py --root /ckpt/bench -- \
        model=llama3_1b data.seq_len=8192 train.micro_batch_size=4 train.global_batch_size=8

First the ceilings: pinned device-to-host copy (one large copy per rank, all ranks at once;
on CPU a host memcpy instead) and the disk (every rank writes --disk-gb / ranks of data to the
benchmark directory in 16 MiB writes, handing every 256 MiB to the kernel's writeback as the
checkpoint writer does, and fsyncs, once with one stream per rank and once with
checkpoint.write_threads streams per rank; the faster counts). The disk is measured before
every mode and after the last, and a mode's disk ceiling is the mean of the measurements just
before and just after it (virtual disks drift by a quarter within minutes: one measurement
taken minutes away says little). Then, for each mode,
train.py's `run()` in this process (`--steps` steps, a save every `--interval`, the final save
included, checkpoint.keep_last=1) and the per-save records the checkpoint manager writes to
<run_dir>/checkpoint_saves.jsonl (rank 0). Prints each save, then the summary table last:

- bytes: the checkpoint (all ranks, from its manifest);
- staging GB/s: rank 0's bytes / its staging copy time (the copies and their synchronize;
  the Statefuls' state_dict() calls before it are listed per save) (async modes);
- write GB/s: checkpoint bytes / the DCP save time (rank 0's save returns after every rank
  wrote, so this is the aggregate rate to compare with the disk ceiling);
- blocked/save: what the training loop waited per periodic save, less "device drain" (the
  wait for the GPU to finish the step already queued when the save began: the GPU was busy
  with it anyway, and the loop would have waited for it at its next sync); mean, with the
  first save and the final save apart (the final save may wait for a busy writer by design);
- total/save: save start to commit, mean; "queued" is the time a save waited for a free
  staging buffer or behind the previous save for the writer (staging_buffers=2), so
  total - queued (less the device drain) is the save's own time (staging + write + commit).

Then the resume (issue #28; `--no-resume` skips it): the last mode's final checkpoint is
evicted from the page cache (posix_fadvise DONTNEED on its files, and /proc/sys/vm/drop_caches
where writable) and train.py's run() resumes it with nothing left to train; its time (the
manager's `resumed` record: pick, load with the hashes verified as the bytes are read,
checks) is compared with the disk's read rate, measured just before and after (every rank
reads --disk-gb / ranks of files it wrote and evicted, in write_threads streams: as many files
as the resume reads at once).

Targets (issues #14, #28), checked at the end: async blocked/save <= 0.5 s and <= 5% of sync's;
total - queued <= 1.25 x bytes / disk ceiling; staging >= 70% of the D2H ceiling; write >= 80%
of the disk ceiling (sync too: it writes from a staging buffer); resume <= 1.25 x bytes / disk
read rate. Extra train.py overrides go after `--`; `--json` appends the results.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runlog import read_metrics  # noqa: E402
from tools import benchlib  # noqa: E402

MODES = ("sync", "async", "async_process")
_CHUNK = 16 << 20


def _dist():
    import torch.distributed as dist

    return dist if dist.is_initialized() else None


def _barrier():
    d = _dist()
    if d is not None:
        d.barrier()


def _max_over_ranks(value: float) -> float:
    import torch

    d = _dist()
    if d is None:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    d.all_reduce(t, op=d.ReduceOp.MAX, group=_cpu_group())
    return float(t.item())


_GROUP = None


def _cpu_group():
    global _GROUP
    if _GROUP is None:
        _GROUP = _dist().new_group(backend="gloo")
    return _GROUP


def d2h_ceiling(nbytes: int) -> tuple[str, float]:
    """(what, GB/s) of one large copy to pinned host memory per rank (all ranks at once);
    a host memcpy without CUDA."""
    import torch

    if torch.cuda.is_available():
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        what = "pinned device-to-host, one copy"
    else:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        what = "host memcpy (no CUDA)"
    best = float("inf")
    for _ in range(3):
        _barrier()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return what, nbytes / best / 1e9


def _write_stream(path: Path, nbytes: int, block: bytes) -> None:
    from checkpoint.writer import WRITEBACK_BYTES, start_writeback  # as the writer does

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(block)
        left, written, handed = nbytes, 0, 0
        while left > 0:
            piece = view[: min(left, len(view))]
            while len(piece):
                piece = piece[os.write(fd, piece) :]
            left -= min(left, len(view))
            written += min(nbytes - written, len(view))
            if written - handed >= WRITEBACK_BYTES:
                start_writeback(fd, handed, written)
                handed = written
        os.fsync(fd)
    finally:
        os.close(fd)


def disk_ceiling(directory: Path, total_bytes: int, streams: int, rank: int, world: int) -> float:
    """Aggregate GB/s of every rank writing total_bytes / world in `streams` files, fsync'ed."""
    directory.mkdir(parents=True, exist_ok=True)
    per_stream = max(total_bytes // world // streams, _CHUNK)
    block = os.urandom(_CHUNK)
    paths = [directory / f"disk-probe-r{rank}-s{i}" for i in range(streams)]
    _barrier()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=_write_stream, args=(p, per_stream, block)) for p in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = _max_over_ranks(time.perf_counter() - t0)
    for p in paths:
        p.unlink(missing_ok=True)
    return per_stream * streams * world / elapsed / 1e9


class GilProbe(threading.Thread):
    """--gil-probe: a thread of the trainer that sleeps 1 ms at a time and records how late it
    wakes, which is how long any thread of the process waits to take the GIL back after a
    call that released it (plus the timer's slack, about 0.1 ms). An `async` save's writer
    threads wait like this after every hash and write call."""

    def __init__(self):
        super().__init__(daemon=True, name="gil-probe")
        self.late: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            time.sleep(1e-3)
            self.late.append(time.perf_counter() - t0 - 1e-3)

    def summary(self) -> dict:
        self.stop.set()
        self.join()
        cuts = statistics.quantiles(self.late if len(self.late) > 1 else [0.0, 0.0], n=100)
        return {
            "p50_ms": cuts[49] * 1e3,
            "p90_ms": cuts[89] * 1e3,
            "p99_ms": cuts[98] * 1e3,
            "samples": len(self.late),
        }


def run_mode(mode: str, args, overrides: list[str], root: Path) -> dict:
    import torch

    import train
    from config import compose_config

    name = f"bench-{mode}"
    run_dir = root / name
    if int(os.environ.get("RANK", 0)) == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
    _barrier()
    cfg = compose_config(
        [
            *overrides,
            f"checkpoint={mode}",
            f"checkpoint.interval={args.interval}",
            "checkpoint.keep_last=1",
            "checkpoint.resume=none",
            f"train.steps={args.steps}",
            f"train.log_every={args.interval}",
            f"run.root={root}",
            f"run.name={name}",
        ]
    )
    probe = GilProbe() if args.gil_probe else None
    if probe is not None:
        probe.start()
    t0 = time.perf_counter()
    status = train.run(cfg)
    seconds = time.perf_counter() - t0
    gil = probe.summary() if probe is not None else None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    _barrier()
    records = read_metrics(run_dir / "checkpoint_saves.jsonl")
    metrics = read_metrics(run_dir / "metrics.jsonl")
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    step_s = [tokens / m["tokens_per_s"] for m in metrics if m.get("tokens_per_s")]
    out = {
        "mode": mode,
        "status": status,
        "seconds": seconds,
        "saves": [r for r in records if r.get("event") == "saved"],
        "deferred": sum(r.get("event") == "deferred" for r in records),
        "skipped": sum(r.get("event") == "skipped" for r in records),
        "step_s": statistics.median(step_s) if step_s else None,
        "write_threads": cfg.checkpoint.write_threads,
        "gil": gil,
    }
    keep_for_resume = args.resume and mode == args.modes[-1]
    if int(os.environ.get("RANK", 0)) == 0 and not args.keep and not keep_for_resume:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return out


def drop_cached(paths: list[Path]) -> str:
    """Evict `paths` from the page cache, so the next read comes from the disk: every page of
    each file through posix_fadvise(DONTNEED) (no root needed; the files are fsync'ed, so their
    pages are clean), and the whole cache through /proc/sys/vm/drop_caches where writable
    (root). Returns what was done."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "page cache dropped (drop_caches and fadvise)"
    except OSError:
        return "checkpoint files evicted with posix_fadvise(DONTNEED) (drop_caches needs root)"


def _read_stream(path: Path, out: list) -> None:
    buf = bytearray(_CHUNK)
    n = 0
    with open(path, "rb", buffering=0) as f:
        while got := f.readinto(buf):
            n += got
    out.append(n)


def read_probe_files(directory: Path, total_bytes: int, streams: int, rank: int, world: int):
    """This rank's share of total_bytes in `streams` files, written and fsync'ed, for
    disk_read_ceiling."""
    directory.mkdir(parents=True, exist_ok=True)
    per_stream = max(total_bytes // world // streams, _CHUNK)
    block = os.urandom(_CHUNK)
    paths = [directory / f"read-probe-r{rank}-s{i}" for i in range(streams)]
    for p in paths:
        _write_stream(p, per_stream, block)
    return paths


def disk_read_ceiling(paths: list[Path], world: int) -> float:
    """Aggregate GB/s of every rank reading its probe files (one thread each) after evicting
    them from the page cache (drop_cached)."""
    drop_cached(paths)
    _barrier()
    got: list[int] = []
    t0 = time.perf_counter()
    threads = [threading.Thread(target=_read_stream, args=(p, got)) for p in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = _max_over_ranks(time.perf_counter() - t0)
    return sum(got) * world / elapsed / 1e9


def measure_resume(mode: str, args, overrides: list[str], root: Path, threads: int) -> dict:
    """Resume the last mode's final checkpoint (train.py's run() with nothing left to train:
    the resume is all it does) from a cold page cache, against the disk's read rate measured
    just before and after. The manager's `resumed` record gives the time (decide, load with
    the hashes verified as the bytes are read, checks)."""
    import torch

    import train
    from checkpoint import store
    from config import compose_config

    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    run_dir = root / f"bench-{mode}"
    # Read with as many streams per rank as the resume reads files (checkpoint.write_threads).
    probes = read_probe_files(root / "disk-probe", int(args.disk_gb * 1e9), threads, rank, world)
    reads = [disk_read_ceiling(probes, world)]
    newest = store.newest_complete(run_dir / "checkpoints")
    if newest is None:
        for p in probes:
            p.unlink(missing_ok=True)
        return {"error": f"no checkpoint in {run_dir / 'checkpoints'} to resume"}
    how = drop_cached(sorted(p for p in newest.path.rglob("*") if p.is_file()))
    _barrier()
    cfg = compose_config(
        [
            *overrides,
            f"checkpoint={mode}",
            "checkpoint.resume=auto",
            f"train.steps={args.steps}",
            f"run.root={root}",
            f"run.name=bench-{mode}",
        ]
    )
    status = train.run(cfg)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    _barrier()
    reads.append(disk_read_ceiling(probes, world))
    for p in probes:
        p.unlink(missing_ok=True)
    record = next(
        (
            r
            for r in reversed(read_metrics(run_dir / "checkpoint_saves.jsonl"))
            if r.get("event") == "resumed"
        ),
        None,
    )
    if rank == 0 and not args.keep:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return {"status": status, "cache": how, "reads": reads, "record": record}


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _f(x, fmt="{:.2f}"):
    return benchlib.cell(x, fmt)


def _files(s: dict) -> str:
    from checkpoint.writer import WRITE_TIMES  # file_s, write_calls_s, hash_s, fsync_s

    parts = [s.get(f"save_{k}") for k in WRITE_TIMES]
    if None in parts:
        return "-"
    total, calls, hashed, fsync = parts
    rest = total - calls - hashed - fsync
    return f"{total:.2f} ({calls:.2f}; {hashed:.2f}; {fsync:.2f}; {rest:.2f})"


def _own_blocking(s: dict) -> float:
    """What a save blocked the loop for, less the wait for the device to finish the step that
    was already queued (the device was busy with it anyway)."""
    return s["save_blocking_s"] - s.get("save_drain_s", 0.0)


def summarize(result: dict, steps: int) -> dict:
    saves = result["saves"]
    periodic = [s for s in saves if s["save_step"] != steps]
    rest = periodic[1:] if len(periodic) > 1 else periodic
    gib = _mean([s.get("save_checkpoint_bytes") for s in saves])
    stage = [s["save_bytes"] / s["save_stage_s"] / 1e9 for s in saves if s.get("save_stage_s")]
    write = [
        s["save_checkpoint_bytes"] / s["save_write_s"] / 1e9
        for s in saves
        if s.get("save_write_s") and s.get("save_checkpoint_bytes")
    ]
    own = [
        s["save_total_s"]
        - s.get("save_queue_s", 0.0)
        - s.get("save_wait_prev_s", 0.0)
        - s.get("save_drain_s", 0.0)
        for s in saves
    ]
    return {
        "mode": result["mode"],
        "saves": len(saves),
        "bytes": gib,
        "stage_gbps": _mean(stage),
        "write_gbps": _mean(write),
        "blocked_first": _own_blocking(periodic[0]) if periodic else None,
        "blocked_mean": _mean([_own_blocking(s) for s in rest]),
        "blocked_final": next((_own_blocking(s) for s in saves if s["save_step"] == steps), None),
        "drain_mean": _mean([s.get("save_drain_s") for s in saves]),
        "total_mean": _mean([s["save_total_s"] for s in saves]),
        "queued_mean": _mean(
            [s.get("save_queue_s", 0.0) + s.get("save_wait_prev_s", 0.0) for s in saves]
        ),
        "own_mean": _mean(own),
        "write_s_mean": _mean([s.get("save_write_s") for s in saves]),
        "deferred": result["deferred"],
        "skipped": result["skipped"],
        "step_s": result["step_s"],
        "status": result["status"],
        "disk_gbps": statistics.mean(result["disk_around"]) if "disk_around" in result else None,
        "disk_around": result.get("disk_around"),
        "gil": result.get("gil"),
    }


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(the tool's arguments, the train.py overrides after `--`)."""
    argv, overrides = benchlib.split_overrides(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--root", default="runs/bench_checkpoint", help="run root (the disk tested)")
    p.add_argument("--disk-gb", type=float, default=4.0, help="bytes written by the disk test")
    p.add_argument("--d2h-gb", type=float, default=2.0, help="bytes of the D2H copy per rank")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    p.add_argument("--json", help="append the results (one JSON line) to this file")
    p.add_argument(
        "--gil-probe", action="store_true", help="measure GIL take-back waits (GilProbe)"
    )
    p.add_argument(
        "--no-resume",
        dest="resume",
        action="store_false",
        help="skip the resume measurement (the last mode's checkpoint, cold page cache)",
    )
    return p.parse_args(argv), overrides


def main(argv: list[str]) -> int:
    args, overrides = parse_args(argv)

    import torch
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    root = Path(args.root).resolve()

    from config import compose_config

    threads = compose_config(overrides).checkpoint.write_threads
    what, d2h = d2h_ceiling(int(args.d2h_gb * 1e9))
    d2h = min(d2h, -_max_over_ranks(-d2h))  # the slowest rank
    disk_total = int(args.disk_gb * 1e9)

    def measure_disk(when: str) -> float:
        one = disk_ceiling(root / "disk-probe", disk_total, 1, rank, world)
        many = disk_ceiling(root / "disk-probe", disk_total, threads, rank, world)
        if rank == 0:
            print(
                f"disk {when} (write + fsync of {args.disk_gb:g} GB in {root}): "
                f"{one:.2f} GB/s with 1 stream per rank, {many:.2f} GB/s with {threads} per rank",
                flush=True,
            )
        return max(one, many)

    if rank == 0:
        print(f"ceiling: {what} {d2h:.2f} GB/s per rank", flush=True)
    results = []
    disks = [measure_disk(f"before {args.modes[0]}")]
    for i, m in enumerate(args.modes):
        results.append(run_mode(m, args, overrides, root))
        after = args.modes[i + 1] if i + 1 < len(args.modes) else None
        disks.append(measure_disk(f"after {m}" + (f", before {after}" if after else "")))
        results[-1]["disk_around"] = disks[-2:]
    resume = measure_resume(args.modes[-1], args, overrides, root, threads) if args.resume else None
    if rank != 0:
        return 0
    rows = [summarize(r, args.steps) for r in results]
    print_saves(results)
    print_targets(rows, resume, d2h)
    print_table(rows, world, f"{what} {d2h:.2f} GB/s/rank", threads)
    if args.json:
        with open(args.json, "a") as f:
            f.write(
                json.dumps(
                    {
                        "ranks": world,
                        "d2h_gbps": d2h,
                        "disk_gbps_measured": disks,
                        "overrides": overrides,
                        "rows": rows,
                        "saves": {r["mode"]: r["saves"] for r in results},
                        "resume": resume,
                    }
                )
                + "\n"
            )
    return 0


def print_saves(results: list[dict]) -> None:
    """Each save of each mode, as rank 0 recorded it."""
    print(
        "\nper save (rank 0): mode | step | blocked s (of it: device finishing the queued step; "
        "waiting for a free buffer; state_dict() calls; buffer allocation; the copy) | "
        "queued s | writer start wait s | write s | commit s | total s | rank 0's files, "
        "summed over its writer threads: s (in write calls; hashing; fsync; the rest: Python, "
        "torch.save, GIL waits)"
    )
    for r in results:
        for s in r["saves"]:
            parts = "; ".join(
                _f(s.get(f"save_{k}"), "{:.3f}")
                for k in ("drain_s", "wait_prev_s", "state_dict_s", "alloc_s", "stage_s")
            )
            print(
                f"  {r['mode']} | {s['save_step']} | {s['save_blocking_s']:.3f} ({parts}) | "
                f"{_f(s.get('save_queue_s'), '{:.3f}')} | "
                f"{_f(s.get('save_start_wait_s'), '{:.3f}')} | "
                f"{s['save_write_s']:.3f} | {_f(s.get('save_commit_s'), '{:.3f}')} | "
                f"{s['save_total_s']:.3f} | {_files(s)}"
            )


def print_targets(rows: list[dict], resume: dict | None, d2h: float) -> None:
    """The targets (module docstring) met or not, per mode and for the resume; then the GIL
    take-back waits (--gil-probe)."""
    sync = next((r for r in rows if r["mode"] == "sync"), None)
    print("\ntargets:")
    for r in rows:
        if r["mode"] == "sync":  # the loop waits for the save by design: the write rate counts
            if r["write_gbps"] and r["disk_gbps"]:
                share = r["write_gbps"] / r["disk_gbps"]
                print(f"  sync: write {share:.0%} of disk (>= 80%): {share >= 0.8}")
            continue
        if r["blocked_mean"] is None:
            continue
        checks = [f"blocked {r['blocked_mean']:.3f}s <= 0.5s: {r['blocked_mean'] <= 0.5}"]
        if sync and sync["blocked_mean"]:
            ratio = r["blocked_mean"] / sync["blocked_mean"]
            checks.append(f"<= 5% of sync: {ratio:.1%} {ratio <= 0.05}")
        disk = r["disk_gbps"]
        if r["bytes"] and r["own_mean"]:
            bound = 1.25 * r["bytes"] / 1e9 / disk
            checks.append(
                f"total-queued {r['own_mean']:.2f}s <= {bound:.2f}s: {r['own_mean'] <= bound}"
            )
        if r["stage_gbps"]:
            checks.append(f"staging {r['stage_gbps'] / d2h:.0%} of D2H (>= 70%)")
        if r["write_gbps"]:
            checks.append(f"write {r['write_gbps'] / disk:.0%} of disk (>= 80%)")
        print(f"  {r['mode']}: " + "; ".join(checks))
    if resume is not None:
        rec = resume.get("record")
        if rec is None:
            print(f"  resume: not measured ({resume.get('error') or 'no resumed record'})")
        else:
            read = statistics.mean(resume["reads"])
            one_read = rec["bytes"] / 1e9 / read
            bound = 1.25 * one_read
            print(
                f"  resume: {rec['seconds']:.2f}s for {rec['bytes'] / 2**30:.2f} GiB "
                f"({'hashes verified' if rec['verified'] else 'no hash check'}; "
                f"{resume['cache']}) <= 1.25 x bytes / read rate ({read:.2f} GB/s, one read "
                f"{one_read:.2f}s) = {bound:.2f}s: {rec['seconds'] <= bound}"
            )
    for r in rows:
        if r["gil"]:
            g = r["gil"]
            print(
                f"GIL take-back wait in {r['mode']}, whole run (rank 0, {g['samples']} samples): "
                f"p50 {g['p50_ms']:.2f} ms, p90 {g['p90_ms']:.2f} ms, p99 {g['p99_ms']:.2f} ms"
            )


def print_table(rows: list[dict], world: int, ceiling: str, threads: int) -> None:
    """The summary table, last (tests/gpu/suite.sh prints from `per save` on)."""
    header = [
        "mode",
        "ranks",
        "saves (deferred/skipped)",
        "GiB/save",
        "staging GB/s/rank",
        "disk GB/s (before; after)",
        "write GB/s",
        "blocked/save s (first; mean rest; final)",
        "device drain s",
        "total/save s",
        "queued s",
        "total-queued s",
        "step s",
    ]
    print(
        f"\nceilings: {ceiling}; disk per mode in the table: the mean of "
        f"the measurements just before and after it (each the faster of 1 and {threads} "
        "streams per rank)\n"
    )
    lines = []
    for r in rows:
        cells = [
            r["mode"],
            world,
            f"{r['saves']} ({r['deferred']}/{r['skipped']})",
            _f(r["bytes"] and r["bytes"] / 2**30, "{:.2f}"),
            _f(r["stage_gbps"]),
            f"{_f(r['disk_gbps'])} ({_f(r['disk_around'][0])}; {_f(r['disk_around'][1])})",
            _f(r["write_gbps"]),
            f"{_f(r['blocked_first'], '{:.3f}')}; {_f(r['blocked_mean'], '{:.3f}')}; "
            f"{_f(r['blocked_final'], '{:.3f}')}",
            _f(r["drain_mean"], "{:.3f}"),
            _f(r["total_mean"]),
            _f(r["queued_mean"]),
            _f(r["own_mean"]),
            _f(r["step_s"], "{:.3f}"),
        ]
        status = "" if r["status"] == 0 else f" (exit status {r['status']})"
        lines.append(benchlib.row(cells) + status)
    print(benchlib.table(header, lines))


if __name__ == "__main__":
    code = main(sys.argv[1:])
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)
