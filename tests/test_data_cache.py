"""data/token_cache.py: the memory-mapped token cache against the in-memory path, one preparer
among concurrent processes, stale locks and mismatched entries, and per-rank memory at scale.

The reference everywhere is the in-memory path the loader used before the cache:
`pack_dataset` (itself checked against a tokenization that does not use data.packing) and a
`PackedLoader` over its array.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import multiprocessing
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from config import ConfigError
from data import ByteTokenizer, DataConfig, PackedLoader, build_loader, build_tokenizer, token_cache
from data.packing import pack_dataset
from data.sources import embedded_dataset, hf_dataset
from data.token_cache import CacheEntry, load_tokens
from tests.test_data import (
    DOCS,
    expected_stream,
    global_batches,
    hf_cfg,
    make_local_tokenizer,
    tiny_embedded,
    write_files,
)


def in_memory_loaders(cfg, tok, dp_size, G, tokens=None):
    """The pre-cache loader: every rank holds `pack_dataset`'s array."""
    tokens = pack_dataset(hf_dataset(cfg), tok, cfg.text_field) if tokens is None else tokens
    return [
        PackedLoader(
            tokens,
            shuffle=cfg.shuffle,
            shuffle_seed=cfg.shuffle_seed,
            more_data_hint="-",
            seq_len=cfg.seq_len,
            global_batch_size=G,
            dp_rank=r,
            dp_size=dp_size,
        )
        for r in range(dp_size)
    ]


def cache_files(cfg) -> list[str]:
    root = token_cache.cache_root(cfg)
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


# --- (1) the memmapped path is the in-memory path ----------------------------------------


@pytest.mark.parametrize("tokenizer", ["byte", "words"])
def test_memmap_equals_in_memory_tokens_order_and_resume(tmp_path, tokenizer):
    root = write_files(tmp_path / "j", "jsonl")
    name = "byte" if tokenizer == "byte" else make_local_tokenizer(tmp_path / "tok")
    tok = build_tokenizer(DataConfig(tokenizer=name))
    seq_len = 32 if tokenizer == "byte" else 7
    cfg = hf_cfg(tmp_path, root, tokenizer=name, seq_len=seq_len, shuffle=True, shuffle_seed=5)
    ref_tokens = pack_dataset(hf_dataset(cfg), tok, "text")
    np.testing.assert_array_equal(ref_tokens, expected_stream(tok, DOCS))

    loader = build_loader(cfg, tok, global_batch_size=4, dp_rank=0, dp_size=1)
    assert isinstance(loader._samples, np.memmap)  # read from the file, not copied
    assert not loader._samples.flags.writeable
    (meta_name,) = [n for n in cache_files(cfg) if n.endswith(".json")]
    entry = token_cache.cache_root(cfg) / meta_name
    meta = json.loads(entry.read_text())
    assert meta["num_tokens"] == len(ref_tokens) and meta["dtype"] == "uint16"
    assert meta["num_documents"] == len(DOCS) and meta["source"]["path"] == str(root)
    assert entry.with_suffix(".tokens").read_bytes() == ref_tokens.tobytes()  # byte-identical
    assert cache_files(cfg) == sorted([meta_name, entry.with_suffix(".tokens").name])

    # Same sample order over two epochs at dp 1 and 2, and the same positions.
    ref_loaders = in_memory_loaders(cfg, tok, 1, 4, ref_tokens)
    n = ref_loaders[0].samples_per_epoch
    assert loader.samples_per_epoch == n
    steps = 2 * n // 4 + 1
    ref, _ = global_batches(cfg, tok, steps, 1, G=4, loaders=ref_loaders)
    got, _ = global_batches(cfg, tok, steps, 1, G=4, loaders=[loader])
    got2, mm2 = global_batches(cfg, tok, steps, 2, G=4)
    for t, (a, b, c) in enumerate(zip(ref, got, got2)):
        assert torch.equal(a, b) and torch.equal(a, c), f"global batch {t} differs"
    assert mm2[0].state_dict() == ref_loaders[0].state_dict()

    # A state saved by the in-memory loader resumes the memmapped one exactly (and back).
    k = n // 4 + 1
    mem = in_memory_loaders(cfg, tok, 2, 4, ref_tokens)
    first, _ = global_batches(cfg, tok, k, 2, G=4, loaders=mem)
    resumed = build_loader(cfg, tok, global_batch_size=4, dp_rank=0, dp_size=1)
    resumed.load_state_dict(mem[1].state_dict())
    rest, _ = global_batches(cfg, tok, steps - k, 1, G=4, loaders=[resumed])
    assert all(torch.equal(a, b) for a, b in zip(ref, first + rest))


def test_one_entry_serves_every_seq_len(tmp_path):
    root = write_files(tmp_path / "j", "jsonl")
    tok = ByteTokenizer()
    cfg = hf_cfg(tmp_path, root, seq_len=32, shuffle=True)
    build_loader(cfg, tok, global_batch_size=4, dp_rank=0, dp_size=1)
    files = cache_files(cfg)
    stamps = [(token_cache.cache_root(cfg) / f).stat().st_mtime_ns for f in files]
    for seq_len in (16, 45):
        short = dataclasses.replace(cfg, seq_len=seq_len)
        got, _ = global_batches(short, tok, 5, 2, G=4)
        ref, _ = global_batches(short, tok, 5, 1, G=4, loaders=in_memory_loaders(short, tok, 1, 4))
        assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert cache_files(cfg) == files  # no new entry, nothing rewritten
    assert stamps == [(token_cache.cache_root(cfg) / f).stat().st_mtime_ns for f in files]


def test_byte_corpus_num_proc_and_uint32(tmp_path):
    # The embedded (stdlib, byte tokenizer) corpus through the cache: the same array.
    tok = ByteTokenizer()
    cfg = dataclasses.replace(
        tiny_embedded(max_bytes=300_000), cache_dir=str(tmp_path / "c1"), num_proc=1
    )
    ref = pack_dataset(embedded_dataset(cfg), tok, "text")
    one, meta, _ = load_tokens(cfg, embedded_dataset(cfg), tok, log=lambda m: None)
    assert isinstance(one, np.memmap) and one.dtype == np.uint16
    np.testing.assert_array_equal(one, ref)
    # num_proc=2 tokenizes two contiguous shards in two processes: the same bytes.
    cfg2 = dataclasses.replace(cfg, cache_dir=str(tmp_path / "c2"), num_proc=2)
    two, meta2, _ = load_tokens(cfg2, embedded_dataset(cfg2), tok, log=lambda m: None)
    np.testing.assert_array_equal(two, ref)
    assert meta2["prepared"]["num_proc"] == 2 and meta["num_tokens"] == meta2["num_tokens"]

    # A vocabulary over 65,536 ids is stored as uint32.
    wide = WideByteTokenizer()
    ref32 = pack_dataset(embedded_dataset(cfg), wide, "text")
    got32, meta32, entry = load_tokens(cfg, embedded_dataset(cfg), wide, log=lambda m: None)
    assert ref32.dtype == np.uint32 and got32.dtype == np.uint32 and meta32["dtype"] == "uint32"
    np.testing.assert_array_equal(got32, ref32)
    assert entry.tokens.stat().st_size == 4 * len(ref32) and got32[0] == wide.bos_id


class WideByteTokenizer(ByteTokenizer):
    vocab_size = 70_000
    bos_id = 69_998
    eos_id = 69_999
    fingerprint = "wide-byte-v1"


# --- (2) one preparer, stale locks, mismatched entries ---------------------------------------


class CountingTokenizer(ByteTokenizer):
    """The byte tokenizer (same fingerprint, so the same cache entry) that appends its pid to
    a file on every batch it encodes; optionally slow, or hanging after a marker file."""

    def __init__(self, count_file, delay: float = 0.0, hang_marker=None):
        self.count_file, self.delay, self.hang_marker = str(count_file), delay, hang_marker

    def encode_batch(self, texts):
        with open(self.count_file, "a") as f:
            f.write(f"{os.getpid()}\n")
        if self.hang_marker:
            Path(self.hang_marker).touch()
            time.sleep(3600)
        time.sleep(self.delay)
        return super().encode_batch(texts)


def tokenizing_pids(count_file) -> set[int]:
    p = Path(count_file)
    return {int(x) for x in p.read_text().split()} if p.exists() else set()


def many_docs(tmp_path, n=3000):
    """n documents in one jsonl: n/1000 tokenization batches."""
    root = tmp_path / "many"
    root.mkdir()
    with open(root / "a.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": DOCS[i % len(DOCS)] + f" #{i}"}) + "\n")
    return root


def _load_in_child(cfg, tok, out_dir, name, barrier):
    with open(Path(out_dir) / f"{name}.log", "w") as f, contextlib.redirect_stdout(f):
        if barrier is not None:
            barrier.wait()
        loader = build_loader(cfg, tok, global_batch_size=4, dp_rank=0, dp_size=1)
        rows = np.stack([loader.next_batch().numpy() for _ in range(3)])
    np.save(Path(out_dir) / f"{name}.npy", rows)


@pytest.fixture
def fast_polling(monkeypatch):
    # Forked children inherit these.
    monkeypatch.setattr(token_cache, "POLL_S", 0.05)
    monkeypatch.setattr(token_cache, "POLL_MAX_S", 0.1)
    monkeypatch.setattr(token_cache, "REPORT_S", 0.5)
    monkeypatch.delenv("LOCAL_RANK", raising=False)  # waiting lines come from local rank 0


def test_two_concurrent_processes_tokenize_once(tmp_path, fast_polling):
    root = many_docs(tmp_path)
    cfg = hf_cfg(tmp_path, root, seq_len=32, shuffle=True)
    hf_dataset(cfg)  # the Arrow conversion of the jsonl (datasets' own cache), before forking
    count = tmp_path / "count"
    tok = CountingTokenizer(count, delay=1.0)  # 3 batches: the preparer takes >= 3 s
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = {
        name: ctx.Process(target=_load_in_child, args=(cfg, tok, tmp_path, name, barrier))
        for name in ("a", "b")
    }
    for p in procs.values():
        p.start()
    for p in procs.values():
        p.join(120)
    assert [p.exitcode for p in procs.values()] == [0, 0]

    pids = tokenizing_pids(count)
    assert len(pids) == 1, f"tokenized by {pids}"
    (preparer,) = [n for n, p in procs.items() if p.pid in pids]
    waiter = "b" if preparer == "a" else "a"
    entry_tokens = [n for n in cache_files(cfg) if n.endswith(".tokens")]
    assert cache_files(cfg) == sorted(entry_tokens + [entry_tokens[0][:-7] + ".json"])  # no lock
    prep_log = (tmp_path / f"{preparer}.log").read_text()
    wait_log = (tmp_path / f"{waiter}.log").read_text()
    assert "data: prepared" in prep_log and "tokens/s" in prep_log
    tokens_path = token_cache.cache_root(cfg) / entry_tokens[0]
    assert f"data: waiting for {tokens_path} (prepared by pid {procs[preparer].pid} on " in wait_log
    assert "data: prepared" not in wait_log

    ref = in_memory_loaders(cfg, ByteTokenizer(), 1, 4)[0]
    want = np.stack([ref.next_batch().numpy() for _ in range(3)])
    for name in procs:
        np.testing.assert_array_equal(np.load(tmp_path / f"{name}.npy"), want)


def test_killed_preparer_is_detected_and_redone(tmp_path, fast_polling):
    root = many_docs(tmp_path, 1500)
    cfg = hf_cfg(tmp_path, root, seq_len=32)
    ds = hf_dataset(cfg)
    count, marker = tmp_path / "count", tmp_path / "tokenizing"
    hanging = CountingTokenizer(count, hang_marker=marker)
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=_load_in_child, args=(cfg, hanging, tmp_path, "killed", None))
    proc.start()
    deadline = time.time() + 60
    while not marker.exists():
        assert proc.is_alive() and time.time() < deadline, "the preparer never started"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    entry = CacheEntry.for_dataset(cfg, ds, ByteTokenizer())
    assert entry.lock.exists() and not entry.meta.exists()  # a lock without a commit
    assert json.loads(entry.lock.read_text())["pid"] == proc.pid
    partial = entry.root / f"{entry.key}.tokens.tmp-{proc.pid}"
    partial.write_bytes(b"\0" * 1000)  # as if it had died while writing the tokens

    logs = []
    tokens, meta, _ = load_tokens(cfg, ds, CountingTokenizer(count), log=logs.append)
    assert tokenizing_pids(count) == {proc.pid, os.getpid()}  # redone here
    assert any(f"is stale (its process {proc.pid} is gone)" in m for m in logs), logs
    np.testing.assert_array_equal(tokens, pack_dataset(ds, ByteTokenizer(), "text"))
    assert not entry.lock.exists() and not partial.exists() and not entry.parts.exists()
    assert meta["num_tokens"] == len(tokens)


def test_lock_of_another_host_waits_for_heartbeat_then_is_broken(tmp_path, fast_polling):
    root = write_files(tmp_path / "j", "jsonl")
    cfg = hf_cfg(tmp_path, root, seq_len=32)
    ds, tok = hf_dataset(cfg), ByteTokenizer()
    entry = CacheEntry.for_dataset(cfg, ds, tok)
    entry.root.mkdir(parents=True)
    foreign = {"host": "elsewhere", "pid": os.getpid(), "nonce": "x", "since": "then"}
    # A live preparer on another host: its heartbeat keeps the lock fresh; we wait for it.
    entry.lock.write_text(json.dumps(foreign))
    stop = threading.Event()

    def heartbeat():
        while not stop.wait(0.05):
            os.utime(entry.lock)

    beat = threading.Thread(target=heartbeat)
    beat.start()
    logs = []
    threading.Timer(1.0, lambda: (stop.set(), entry.lock.unlink())).start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(token_cache, "STALE_AFTER_S", 0.4)
        start = time.monotonic()
        tokens, _, _ = load_tokens(cfg, ds, tok, log=logs.append)
        waited = time.monotonic() - start
        beat.join()
        assert waited >= 0.9 and not any("stale" in m for m in logs), logs
        assert any("waiting for" in m and "pid" in m and "elsewhere" in m for m in logs)
        np.testing.assert_array_equal(tokens, expected_stream(tok, DOCS))

        # A dead one (no heartbeat): broken after STALE_AFTER_S by the waiter's clock.
        entry.meta.unlink()
        entry.lock.write_text(json.dumps(foreign))
        logs.clear()
        tokens, _, _ = load_tokens(cfg, ds, tok, log=logs.append)
        assert any("stale (not touched for" in m for m in logs), logs
        np.testing.assert_array_equal(tokens, expected_stream(tok, DOCS))
        assert not entry.lock.exists()


def test_mismatched_or_truncated_entry_is_not_reused(tmp_path):
    root = write_files(tmp_path / "j", "jsonl")
    cfg = hf_cfg(tmp_path, root, seq_len=32)
    ds, byte = hf_dataset(cfg), ByteTokenizer()
    want = expected_stream(byte, DOCS)
    count, logs = tmp_path / "count", []
    _, _, entry = load_tokens(cfg, ds, CountingTokenizer(count), log=logs.append)
    assert tokenizing_pids(count) == {os.getpid()}
    count.unlink()

    # A cache hit does not tokenize.
    tokens, _, _ = load_tokens(cfg, ds, CountingTokenizer(count), log=logs.append)
    assert not count.exists()
    np.testing.assert_array_equal(tokens, want)

    # The meta names another tokenizer: not used, prepared again.
    meta = json.loads(entry.meta.read_text())
    entry.meta.write_text(json.dumps({**meta, "tokenizer_fingerprint": "hf-0123456789abcdef"}))
    tokens, meta2, _ = load_tokens(cfg, ds, CountingTokenizer(count), log=logs.append)
    assert tokenizing_pids(count) == {os.getpid()}
    assert "tokenizer_fingerprint='hf-0123456789abcdef' is not the expected 'byte-v1'" in logs[-2]
    np.testing.assert_array_equal(tokens, want)
    assert meta2["tokenizer_fingerprint"] == "byte-v1"
    count.unlink()

    # A truncated tokens file: prepared again.
    with open(entry.tokens, "r+b") as f:
        f.truncate(entry.tokens.stat().st_size - 2)
    tokens, _, _ = load_tokens(cfg, ds, CountingTokenizer(count), log=logs.append)
    assert tokenizing_pids(count) == {os.getpid()} and "the meta says" in logs[-2]
    np.testing.assert_array_equal(tokens, want)

    # Another tokenizer is another entry; the byte entry stays and is still used as is.
    words = build_tokenizer(DataConfig(tokenizer=make_local_tokenizer(tmp_path / "tok")))
    stamp = entry.tokens.stat().st_mtime_ns
    w_tokens, w_meta, w_entry = load_tokens(cfg, ds, words, log=logs.append)
    assert w_entry.key != entry.key and w_meta["tokenizer_fingerprint"] == words.fingerprint
    np.testing.assert_array_equal(w_tokens, expected_stream(words, DOCS))
    count.unlink()
    tokens, _, _ = load_tokens(cfg, ds, CountingTokenizer(count), log=logs.append)
    assert not count.exists() and entry.tokens.stat().st_mtime_ns == stamp
    np.testing.assert_array_equal(tokens, want)


def test_errors(tmp_path):
    root = write_files(tmp_path / "j", "jsonl")
    tok = ByteTokenizer()
    cfg = hf_cfg(tmp_path, root, num_proc=0)
    with pytest.raises(ConfigError, match=r"^data.num_proc=0 must be >= 1") as info:
        build_loader(cfg, tok, global_batch_size=4, dp_rank=0, dp_size=1)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = hf_cfg(tmp_path, root, cache_dir=str(blocker))
    with pytest.raises(ConfigError, match=r"^data.cache_dir: cannot write the token cache") as info:
        load_tokens(cfg, hf_dataset(hf_cfg(tmp_path, root)), tok)
    assert "\n" not in str(info.value) and "set data.cache_dir to a writable" in str(info.value)


def test_prepare_data_tool(tmp_path, capsys):
    root = write_files(tmp_path / "j", "jsonl")
    common = [
        "data=hf",
        f"data.path={root}",
        "data.tokenizer=byte",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]

    from tools.prepare_data import main

    def tool(*args):
        status = main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, status, out, err)

    r = tool(*common, "data.seq_len=32")
    assert r.returncode == 0, r.stderr
    assert "data: prepared" in r.stdout and "tokens/s" in r.stdout
    n = len(expected_stream(ByteTokenizer(), DOCS))
    assert f"tokens     {n:,} in {len(DOCS)} documents" in r.stdout
    assert f"samples    {n // 33:,} at data.seq_len=32" in r.stdout
    cfg = hf_cfg(tmp_path, root)
    (tokens_file,) = [n for n in cache_files(cfg) if n.endswith(".tokens")]
    raw = np.fromfile(token_cache.cache_root(cfg) / tokens_file, dtype=np.uint16)
    np.testing.assert_array_equal(raw, expected_stream(ByteTokenizer(), DOCS))

    r = tool(*common)  # present: report only
    assert r.returncode == 0 and "data: prepared" not in r.stdout and "tokens/s" in r.stdout
    r = tool("--list", f"data.cache_dir={tmp_path / 'cache'}")
    assert r.returncode == 0 and f"{n:,} tokens" in r.stdout and "| ok" in r.stdout
    r = tool("data=embedded")
    assert r.returncode == 2 and r.stderr.startswith("error: data.name='embedded': only data=hf")
    r = tool(*common, "data.streaming=true")
    assert r.returncode == 2 and "nothing to prepare" in r.stderr


# --- (3) at scale: per-rank memory, in memory vs memory-mapped -------------------------------

SCALE_TOKENS = 50_000_000


def write_random_corpus(root: Path, n_bytes: int, parts: int = 4, seed: int = 0) -> int:
    """Random words (a 4,000-word vocabulary) in `parts` jsonl files, documents of 100 to
    1,000 words, about `n_bytes` of text in all. Returns the number of documents."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    vocab = [rng.choice(letters, size=int(k)).tobytes().decode() for k in rng.integers(2, 11, 4000)]
    mean_word = np.mean([len(w) + 1 for w in vocab])
    words = rng.integers(0, len(vocab), size=int(n_bytes / mean_word))
    cuts = np.cumsum(rng.integers(100, 1001, size=len(words) // 100 + 1))
    cuts = cuts[cuts < len(words)]
    docs = np.split(words, cuts)
    root.mkdir(parents=True)
    per_part = -(-len(docs) // parts)
    for p in range(parts):
        with open(root / f"part{p}.jsonl", "w") as f:
            for doc in docs[p * per_part : (p + 1) * per_part]:
                f.write(json.dumps({"text": " ".join(vocab[i] for i in doc)}) + "\n")
    return len(docs)


def memory_kb() -> dict[str, int]:
    """This process's RssAnon, RssFile (/proc/self/status) and Pss (smaps_rollup), in kB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                out[key] = int(value.split()[0])
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Pss", "Pss_Anon", "Pss_File"):
                out[key] = int(value.split()[0])
    return out


def _read_an_epoch(rank, world_size, cfg, mode, out_dir):
    """One rank: build the loader (`mode` memmap: build_loader; in_memory: the pre-cache path,
    `pack_dataset` loading datasets' tokenized Arrow cache), read a whole epoch, and record
    memory before/after and a digest of every batch."""
    import torch.distributed as dist

    tok = ByteTokenizer()
    ds = hf_dataset(cfg)
    dist.barrier()
    before = memory_kb()
    G = 16
    if mode == "memmap":
        loader = build_loader(cfg, tok, global_batch_size=G, dp_rank=rank, dp_size=world_size)
    else:
        tokens = pack_dataset(ds, tok, cfg.text_field)
        loader = in_memory_loaders(cfg, tok, world_size, G, tokens)[rank]
    built = memory_kb()
    start = time.perf_counter()
    steps = loader.samples_per_epoch // G
    digests = [
        hashlib.sha256(loader.next_batch().numpy().tobytes()).hexdigest() for _ in range(steps)
    ]
    read_s = time.perf_counter() - start
    dist.barrier()  # both ranks have read their epoch: the file pages are shared now
    after = memory_kb()
    result = dict(before=before, built=built, after=after, read_s=read_s, digests=digests)
    (Path(out_dir) / f"{mode}-{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_memory_per_rank_at_scale_memmap_vs_in_memory(tmp_path):
    from tests.distributed import run_distributed

    t0 = time.perf_counter()
    n_docs = write_random_corpus(tmp_path / "corpus", SCALE_TOKENS)
    gen_s = time.perf_counter() - t0
    cfg = hf_cfg(tmp_path, tmp_path / "corpus", seq_len=2048, shuffle=True, num_proc=2)
    ds, tok = hf_dataset(cfg), ByteTokenizer()

    # Prepare once (what tools/prepare_data.py does), and the in-memory path's tokenization.
    t0 = time.perf_counter()
    _, meta, entry = load_tokens(cfg, ds, tok)
    prep_s = time.perf_counter() - t0
    n = meta["num_tokens"]
    assert n >= SCALE_TOKENS and meta["num_documents"] == n_docs
    t0 = time.perf_counter()
    ref = pack_dataset(ds, tok, cfg.text_field)  # writes datasets' tokenized Arrow cache
    pack_s = time.perf_counter() - t0
    assert len(ref) == n and np.array_equal(np.fromfile(entry.tokens, dtype=np.uint16), ref)
    del ref
    token_mb = n * 2 / 2**20

    runs = {}
    for mode in ("in_memory", "memmap"):
        t0 = time.perf_counter()
        run_distributed(_read_an_epoch, 2, cfg, mode, str(tmp_path))
        runs[mode] = time.perf_counter() - t0
    res = {
        (mode, r): json.loads((tmp_path / f"{mode}-{r}.json").read_text())
        for mode in ("in_memory", "memmap")
        for r in range(2)
    }

    print(
        f"\ncorpus: {n:,} tokens ({token_mb:.0f} MiB as uint16), {n_docs:,} documents, "
        f"written in {gen_s:.1f} s"
    )
    print(
        f"prepare (num_proc=2): {prep_s:.1f} s = {n / prep_s:,.0f} tokens/s; "
        f"in-memory tokenization (num_proc=1, Arrow cache): {pack_s:.1f} s = "
        f"{n / pack_s:,.0f} tokens/s"
    )
    print("memory growth per rank over loader build + one epoch (MiB):")
    print("  path       rank  RssAnon  RssFile  Pss   Pss_Anon  Pss_File  build+epoch")
    for (mode, r), x in res.items():
        d = {k: (x["after"][k] - x["before"][k]) / 1024 for k in x["after"]}
        print(
            f"  {mode:<10} {r:>4} {d['RssAnon']:>8.1f} {d['RssFile']:>8.1f} {d['Pss']:>5.1f} "
            f"{d['Pss_Anon']:>9.1f} {d['Pss_File']:>9.1f}  {runs[mode]:.1f} s (2 ranks, "
            f"{x['read_s']:.1f} s reading)"
        )

    for r in range(2):
        mem, mm = res["in_memory", r], res["memmap", r]
        assert mem["digests"] == mm["digests"]  # every batch of the epoch, both paths
        grow = {m: (x["after"]["RssAnon"] - x["before"]["RssAnon"]) / 1024 for m, x in res.items()}
        assert grow["in_memory", r] > 0.9 * token_mb  # the whole array, in every rank
        assert grow["memmap", r] < 0.05 * token_mb  # only a batch and the permutation
    assert res["memmap", 0]["digests"] != res["memmap", 1]["digests"]
    assert len(res["memmap", 0]["digests"]) == n // 2049 // 16
