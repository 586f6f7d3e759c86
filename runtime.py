"""The process a run lives in: its device, stop signals, peak memory, exit statuses, and
starting train.py as a subprocess (for tools and test harnesses that need whole runs).
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from errors import ConfigError

#: Exit status after a checkpoint saved on a stop signal (Slurm's --signal or SIGTERM);
#: slurm/train.sbatch turns it into `scontrol requeue`.
EXIT_REQUEUE = 3

ROOT = Path(__file__).resolve().parent


def pick_device(name: str) -> torch.device:
    """train.device: auto (CUDA when visible), cpu or cuda (this process's LOCAL_RANK GPU)."""
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA GPU is visible; use train.device=auto")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def usable_cores() -> int:
    """CPU cores this process may use: its affinity mask (taskset, cpusets), bounded by a
    cgroup v2 CPU quota (`docker --cpus`, Kubernetes limits) when there is one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


#: Most intra-op threads a CPU run takes by itself: measured up to 2 (the default run gains
#: 1.4x from a second idle core; docs/PERFORMANCE.md, CPU threads); OMP_NUM_THREADS sets more.
MAX_CPU_THREADS = 2


def cpu_threads(
    environ=None, cores: int | None = None, load: float | None = None
) -> tuple[int, str]:
    """The intra-op thread count of a CPU run's process, and why.

    OMP_NUM_THREADS, when set (by the user, or by torchrun for its workers), is kept.
    Otherwise the cores that are idle when the run starts, shared among this node's processes
    (LOCAL_WORLD_SIZE), at most MAX_CPU_THREADS, at least 1: idle = usable cores minus the
    1-minute load average (the processes running or waiting for a core). Measured with the
    default run (model=tiny; tools/bench_threads.py; docs/PERFORMANCE.md, CPU threads): on 2
    idle cores 2 threads take 0.45 s a step and 1 thread 0.64 s; once other work holds the
    cores, torch's threads wait on each other at every operation and 2 threads fall to 2-5
    times slower than 1, which keeps its speed."""
    env = os.environ if environ is None else environ
    value = env.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value), "OMP_NUM_THREADS"
    cores = usable_cores() if cores is None else cores
    load = os.getloadavg()[0] if load is None else load
    procs = max(1, int(env.get("LOCAL_WORLD_SIZE", 1)))
    idle = max(0.0, cores - load)
    threads = max(1, min(MAX_CPU_THREADS, cores // procs, int(idle + 0.5) // procs))
    per = f" over {procs} processes" if procs > 1 else ""
    return threads, f"{cores} cores, load {load:.1f}: {int(idle + 0.5)} idle{per}"


#: MKL's matrix products in a CPU run: its own code path for this CPU, in its strict
#: reproducibility mode, whose results do not depend on the thread count (MKL documents this
#: for ?gemm on its AVX2 and AVX-512 paths; other paths, e.g. a CPU without AVX2, compute in its
#: ordinary mode). With MKL's default (not strict) the default run's losses on an Intel Xeon
#: differed between 1 and 2 threads from step 3 on, in the last bits, and by step 300 in the
#: printed digits; strict, they were the same bit for bit (docs/RUNS.md, CPU arithmetic).
#: Measured cost of strict: about 5% on the matrix products alone, within the noise on the step.
CPU_ARITHMETIC = {"MKL_CBWR": "AUTO,STRICT"}


def pin_cpu_arithmetic(device: torch.device) -> str | None:
    """On a CPU run, MKL computes its matrix products in its strict mode (CPU_ARITHMETIC), so
    the thread count the run picks from the load at its start does not change its losses; a
    MKL_CBWR the user set is kept. Effective only before this process's first MKL call (MKL
    reads the variable once). ATen's own kernels use the CPU's widest vector unit, which the
    start-up line names (`cpu=avx512`). Returns that (None on GPU)."""
    if device.type != "cpu":
        return None
    for name, value in CPU_ARITHMETIC.items():
        os.environ.setdefault(name, value)
    return f"cpu={torch.backends.cpu.get_cpu_capability().lower()}"


def apply_cpu_threads(device: torch.device) -> str | None:
    """Sets torch's intra-op threads for a CPU run (`cpu_threads`); returns how many and why,
    for the start-up line (None on GPU, where the CPU only feeds the GPU and torch's defaults
    stay)."""
    if device.type != "cpu":
        return None
    threads, why = cpu_threads()
    torch.set_num_threads(threads)
    return f"threads={threads} ({why})"


def matmul_rate(seconds: float = 0.3, size: int = 512) -> float:
    """FLOP/s of fp32 matrix products on this CPU, at torch's current thread count, measured for
    about `seconds` (the speed this process gets now, other work on the cores included)."""
    import time

    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        a @ b
        n += 1
    return 2 * size**3 * n / elapsed


def format_duration(seconds: float) -> str:
    """12s, 3m05s, 2h07m, 3d04h."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def host_memory_gib() -> float | None:
    """This machine's total memory (Linux), else None."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A CPU tensor on `device`. To a GPU through pinned memory without waiting: a copy from
    pageable memory may first wait for every kernel already queued (CUDA's rule for pageable
    host-to-device copies), which would stall the step where the copy is made."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


#: What `train.deterministic=true` sets in the environment (unless already set to a
#: deterministic value): TE's DotProductAttention reads NVTE_ALLOW_NONDETERMINISTIC_ALGO when
#: each attention module is built (it also honours torch's deterministic flag) and then keeps
#: only backends with a deterministic backward (on sm_90 the cuDNN fused kernel stays, run in
#: its deterministic mode); cuBLAS reads CUBLAS_WORKSPACE_CONFIG when a handle is created
#: (the first matmul of a thread on a device), so a fixed workspace split is chosen.
DETERMINISTIC_ENV = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
#: CUBLAS_WORKSPACE_CONFIG values cuBLAS documents as deterministic.
_CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


def deterministic_env(environ=None) -> bool:
    """Whether the environment alone asks for deterministic GPU kernels (both variables set by
    hand to deterministic values): such a run is recorded as train.deterministic=true."""
    env = os.environ if environ is None else environ
    return (
        env.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO") == "0"
        and env.get("CUBLAS_WORKSPACE_CONFIG") in _CUBLAS_DETERMINISTIC
    )


def apply_determinism(on: bool) -> str | None:
    """`train.deterministic`: the one place its settings are made, before any cuBLAS handle or
    TE module exists (train.run calls it first). Sets DETERMINISTIC_ENV (a value the user set
    that is already deterministic is kept), torch.use_deterministic_algorithms(True,
    warn_only=True) (an op without a deterministic kernel warns, naming itself, instead of
    stopping a run; the GPU determinism test compares runs bit for bit) without filling new
    memory with NaN (torch's default under the flag: a cost on every allocation, and nothing
    reads memory it did not write), cuDNN deterministic with autotuning off. NCCL needs nothing
    on one node: its algorithm is chosen from message size and topology, so the same world
    size on the same GPUs reduces in the same order (another world size does not).
    Returns the start-up line, or None when off."""
    if not on:
        return None
    was_initialized = torch.cuda.is_available() and torch.cuda.is_initialized()
    set_here = []
    for name, value in DETERMINISTIC_ENV.items():
        current = os.environ.get(name)
        ok = (
            current in _CUBLAS_DETERMINISTIC
            if name == "CUBLAS_WORKSPACE_CONFIG"
            else current == value
        )
        if not ok:
            os.environ[name] = value
            current = value
        set_here.append(f"{name}={current}")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    line = (
        "deterministic: on (" + ", ".join(set_here) + ", torch.use_deterministic_algorithms, "
        "cudnn.deterministic, cudnn.benchmark=False): runs and resumes repeat bit for bit on the "
        "same GPUs and world size, at some cost in speed and memory (docs/RUNS.md, Determinism)"
    )
    if was_initialized:
        line += (
            "; warning: CUDA was initialized before these settings, so a cuBLAS handle made "
            "earlier keeps its workspace configuration"
        )
    return line


#: ProcessGroupNCCL reads this when it creates a communicator's stream.
NCCL_HIGH_PRIORITY_ENV = "TORCH_NCCL_HIGH_PRIORITY"


def apply_nccl_priority(on: bool, device: torch.device) -> str | None:
    """`parallel.nccl_high_priority`: NCCL's streams at high priority, set in the environment
    before train.run creates its process groups (communicators made by groups that exist
    already keep theirs). Returns the start-up line, or None when off."""
    if not on:
        return None
    os.environ[NCCL_HIGH_PRIORITY_ENV] = "1"
    if device.type != "cuda":
        return f"nccl: {NCCL_HIGH_PRIORITY_ENV}=1 set; no effect here (gloo on CPU)"
    line = f"nccl: high-priority streams ({NCCL_HIGH_PRIORITY_ENV}=1)"
    if dist.is_initialized():
        line += "; warning: the default process group existed before, its streams may keep theirs"
    return line


def collective_timeout(seconds: int) -> timedelta:
    """`parallel.collective_timeout_s` as the timeout of every process group made from now on:
    train.py passes it to init_process_group, and it becomes torch's default for groups made
    later (the device mesh's, the checkpoint's gloo groups, context parallelism's), which
    `new_group` would otherwise give torch's own default (gloo 30 min, NCCL 10 min)."""
    if seconds <= 0:
        raise ConfigError(f"parallel.collective_timeout_s={seconds} must be > 0 (seconds)")
    timeout = timedelta(seconds=seconds)
    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout
    return timeout


#: What gloo raises in a collective whose peer is gone: the timeout (a rank that hangs, or a
#: node that vanished), or the peer's socket closed (its process died on a host still up).
_GLOO_TIMEOUT = re.compile(r"Timed out waiting (\d+)ms for \w+ operation")
_PEER_CLOSED = re.compile(r"(Connection closed by peer|Connection reset by peer)( \[[^\]]*\]:\d+)?")


def lost_peer_line(error: BaseException, timeout_s: int) -> str | None:
    """The one line for a collective that failed because another rank is gone (None for any
    other error): how long it waited, or whose connection closed, and what to do."""
    text = str(error)
    rank = f"rank {os.environ.get('RANK', 0)} of {os.environ.get('WORLD_SIZE', 1)}"
    after = (
        "the run stopped; committed checkpoints are intact and the same command (a requeued "
        "job) resumes from the last one"
    )
    if m := _GLOO_TIMEOUT.search(text):
        waited = int(m[1]) / 1000
        return (
            f"a collective waited {waited:g} s for the other ranks "
            f"(parallel.collective_timeout_s={timeout_s}) on {rank}: a node or rank died or "
            f"hangs? {after}"
        )
    if m := _PEER_CLOSED.search(text):
        return (
            f"a collective lost its connection to another rank ({m[0]}) on {rank}: a node "
            f"or rank died? {after}"
        )
    return None


def out_of_memory_line(error: BaseException) -> str:
    """The one line for this rank's GPU running out of memory: where (torch's first three
    sentences: what it tried to allocate, what the GPU holds) and what frees memory."""
    rank = f"rank {os.environ.get('RANK', 0)} of {os.environ.get('WORLD_SIZE', 1)}"
    what = " ".join(re.split(r"(?<=\.) ", str(error).strip())[:3])
    return (
        f"{rank} ran out of GPU memory: {what} Recompute more in backward "
        "(parallel.activation_checkpointing=selective, mlp or full), lower "
        "train.micro_batch_size, or spread the work over more GPUs (parallel.cp, parallel.tp); "
        "`train.dry_run=true` prints the memory estimate"
    )


def end_process_group(failed: bool) -> None:
    """The end of this process's group. After a failure (an exception on this rank, or a
    non-zero status) NCCL's destroy can wait for collectives that the other ranks are still
    inside, and they wait for this rank: the job hangs with the error printed and no process
    ending, so the launcher never learns of it (issue 56: two of four ranks ran out of memory
    in step 1, the other two sat in an all-reduce until parallel.collective_timeout_s). There
    the communicators are aborted instead: this process exits, and torchrun, seeing a failed
    worker, stops the others. A clean end destroys the group as usual. (gloo's ranks see a
    closed connection at once and need neither.)"""
    if not dist.is_initialized():
        return
    if failed and dist.get_backend() == "nccl":
        with contextlib.suppress(Exception):  # exiting anyway: the failure's own error stands
            c10d._abort_process_group()
    else:
        dist.destroy_process_group()


def check_determinism(on: bool, impl: str, document_mask: bool, device: torch.device) -> None:
    """What train.deterministic cannot keep fast, refused in one line before any work. On
    sm_90, TE 2.20 has no deterministic fused backward for document-masked (THD) attention
    past about 2^30 x documents x heads x max_seqlen^2 (cuDNN's workspace): it falls back to
    its unfused attention, which holds seq^2 scores per head (28 GiB at llama3_1b, seq 8192)
    and runs out of memory at realistic lengths."""
    if not (on and impl == "te" and document_mask and device.type == "cuda"):
        return
    if torch.cuda.get_device_capability(device) == (9, 0):
        raise ConfigError(
            "train.deterministic=true with data.document_mask=true on this sm_90 GPU: TE has "
            "no deterministic fused attention backward for documents here (it falls back to "
            "unfused attention, seq_len^2 memory per head); set data.document_mask=false for "
            "deterministic runs (causal attention is deterministic and fused), or "
            "train.deterministic=false"
        )


def allocator_retries(device: torch.device) -> int | None:
    """How often this run's CUDA caching allocator found no free block, released its cache
    and tried cudaMalloc again (None on CPU and while it never did). Each retry synchronizes
    the device: a count that grows every step means memory so close to full that the step
    slows down, well before it runs out."""
    if device.type != "cuda":
        return None
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0) or None


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated GPU memory, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


class GcSchedule:
    """train.gc_every = N > 0: Python's automatic garbage collection is off during the training
    loop and a full collection runs after every N-th step, on every rank at the same step.
    Automatic collections start whenever the allocation counters of the rank's own process say
    so; with several ranks a pause on one delays every rank at its next collective, at a
    different step each time. Objects alive when the loop starts (model, optimizer, data) are
    frozen (gc.freeze) so the collections skip them. 0: the collector as Python runs it. On
    leaving, the collector is as it was (tools and tests call train.run several times)."""

    def __init__(self, every: int, say=print):
        self.every = every
        self.say = say
        self._was_enabled = None

    def __enter__(self) -> GcSchedule:
        if self.every > 0:
            self._was_enabled = gc.isenabled()
            gc.collect()
            gc.freeze()
            gc.disable()
            self.say(
                f"gc: automatic collection off in the training loop; a full collection "
                f"every {self.every} steps (train.gc_every)",
                flush=True,
            )
        return self

    def after(self, step: int) -> None:
        if self.every > 0 and step % self.every == 0:
            gc.collect()

    def __exit__(self, *exc) -> None:
        if self.every > 0:
            gc.unfreeze()
            if self._was_enabled:
                gc.enable()


#: Exit status after a Ctrl-C (SIGINT): 128 + SIGINT, the shell's status for a process
#: interrupted from the terminal. Not EXIT_REQUEUE: a person stopped the run, and
#: slurm/train.sbatch must not requeue it (a multirun stops too).
EXIT_INTERRUPTED = 128 + signal.SIGINT

#: Prints every thread's stack of a running trainer to its stderr, and the run goes on:
#: `kill -USR2 <pid>` shows where a run that seems stuck is (tools/benchlib.py sends it to a
#: benchmark case past its time limit before stopping it).
STACK_SIGNAL = signal.SIGUSR2


def register_stack_dump() -> None:
    """STACK_SIGNAL prints this process's stacks (faulthandler, safe inside any wait) to
    stderr, or to the process's own stderr where sys.stderr has no file descriptor (a run
    inside a program that captures its output, such as pytest)."""
    import faulthandler

    for out in (sys.stderr, sys.__stderr__):
        try:
            out.fileno()
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
            continue
        faulthandler.register(STACK_SIGNAL, file=out, all_threads=True, chain=False)
        return


#: A second stop signal after a Ctrl-C counts as the second press ("stop now") only when it
#: comes this long after the first. A launcher may deliver one key press twice within
#: milliseconds: the terminal sends SIGINT to its whole foreground process group, and a
#: launcher that leaves its workers in that group also forwards the SIGINT it got itself
#: (torchrun 2.13 starts its workers in sessions of their own, so they see only its forward;
#: a second press there reaches them as SIGTERM: docs/CHECKPOINTING.md, Ctrl-C). A person
#: presses again after seeing the first press not stop the run: far more than a second.
DOUBLE_PRESS_S = 1.0


#: Linux prctl(2) option: the signal this process gets when its parent (thread) ends.
PR_SET_PDEATHSIG = 1
#: The signal a launcher's worker asks the kernel for when its launcher ends: a real-time
#: signal of its own, which nothing else sends. The kernel sends it as each thread of the
#: launcher that holds the worker ends (the worker then passes to another of its threads, or,
#: with the last one, to init), so the handler checks that the launcher is really gone; and
#: a SIGTERM would be ambiguous (torchrun forwards its own SIGTERM to its workers).
PARENT_DEATH_SIGNAL = signal.SIGRTMIN + 2 if hasattr(signal, "SIGRTMIN") else None


def launcher_pid(environ=None) -> int | None:
    """The process that launched this one as a worker, when a launcher did: torchrun's agent
    (its workers' environment has TORCHELASTIC_RUN_ID; slurm/launch.py is torchrun), else
    None (a `python train.py` started by a shell, whose end must not stop the run)."""
    env = os.environ if environ is None else environ
    return os.getppid() if "TORCHELASTIC_RUN_ID" in env else None


def set_parent_death_signal(signum: int) -> bool:
    """Ask the kernel for `signum` when this process's parent ends (Linux PR_SET_PDEATHSIG;
    the parent is the thread that started it: torchrun's agent starts its workers from its
    main thread). False where unavailable (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class StopSignal:
    """Turns SIGUSR1 (Slurm's early warning), SIGTERM (preemption) and a first Ctrl-C
    (SIGINT) into a flag the loop checks at log steps (where it syncs anyway), so every rank
    stops after the same step and the checkpoint is written between steps, never inside one.

    A worker of a launcher (`launcher`: its pid, `launcher_pid`) also hears from the kernel
    when the launcher ends, by any signal, SIGKILL included (PR_SET_PDEATHSIG with
    PARENT_DEATH_SIGNAL): the trainers would otherwise train on, unsupervised, holding the
    GPUs. That stops the run as a SIGTERM does (every rank saves at the next log step and
    exits with EXIT_REQUEUE; the trainers whose launcher is gone are `orphaned` and say so),
    never counts as a second Ctrl-C, and with `save=False` ends the process at once in one
    line (nothing to save, status 1). A launcher already gone when this is set up (the
    process's parent is then init) counts the same.

    After a Ctrl-C, a second SIGINT (or the SIGTERM torchrun's launcher sends its workers on
    a second Ctrl-C) more than DOUBLE_PRESS_S later stops the process at once: `stop_now`
    prints the one line of `self.stopped_line()` (rank 0) and exits with EXIT_INTERRUPTED
    without unwinding, so no save, collective or thread is waited for and nothing prints a
    traceback. `save=False` (checkpoint=none: nothing to save): the first Ctrl-C does that.
    """

    def __init__(self, save: bool = True, launcher: int | None = None):
        self.received: int | None = None
        #: The launcher's pid (None: not a launcher's worker), and whether it is gone.
        self.launcher = launcher
        self.orphaned = False
        #: After `agreed` returned True: the signal's name and the ranks that received one.
        self.name: str | None = None
        self.ranks: list[int] = []
        self.save = save
        self._interrupted_at: float | None = None  # time.monotonic() of the first Ctrl-C
        #: What was and was not saved, for the stop-at-once line (train.run sets it once it
        #: has a checkpoint manager), and what to release before the process ends.
        self.stopped_line: Callable[[], str] = lambda: "stopped at once during setup"
        #: When the stop will be saved, for the line said as the signal arrives (train.py sets
        #: it once the loop runs; it can be wrong only towards earlier).
        self.ahead: Callable[[], str] = lambda: (
            "during setup; the run saves a checkpoint at its first log step and exits"
        )
        self.release: Callable[[], None] = lambda: None
        # checkpoint=none keeps SIGUSR1's and SIGTERM's default meaning (terminate).
        signals = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT) if save else (signal.SIGINT,)
        self._previous = {sig: signal.signal(sig, self._handle) for sig in signals}
        if launcher is not None and PARENT_DEATH_SIGNAL is not None:
            sig = PARENT_DEATH_SIGNAL
            self._previous[sig] = signal.signal(sig, self._launcher_gone)
            if set_parent_death_signal(sig) and (os.getppid() != launcher or launcher == 1):
                self._launcher_gone(sig, None)  # gone before the kernel was asked
        # slurm/run_trainer.py holds stop signals until now: one sent during the imports is
        # delivered here, to the handler (or, checkpoint=none, with its default action).
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1, signal.SIGTERM})

    def restore(self) -> None:
        """The handlers as they were (tools and tests call train.run several times), and no
        signal on the launcher's end."""
        if PARENT_DEATH_SIGNAL in self._previous:
            set_parent_death_signal(0)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _launcher_gone(self, signum, frame):
        """PARENT_DEATH_SIGNAL: a thread of the launcher ended; when the launcher itself is
        gone (this process has another parent now), stop as on SIGTERM, said once."""
        if self.orphaned or os.getppid() == self.launcher:
            return
        self.orphaned = True
        if not self.save:
            self.stop_now(status=1, what="its launcher died (checkpoint=none: nothing to save)")
        self._say_orphaned()
        self.received = max(self.received or 0, signal.SIGTERM)

    def _handle(self, signum, frame):
        now = time.monotonic()
        if signum == signal.SIGINT and not self.save:
            self.stop_now()
        if signum in (signal.SIGINT, signal.SIGTERM) and self._interrupted_at is not None:
            if now - self._interrupted_at > DOUBLE_PRESS_S:
                self.stop_now()
            return  # the same press, delivered twice
        if signum == signal.SIGINT:
            self._interrupted_at = now
        if self.received is None:
            self._say_ahead(signum)
        # SIGTERM (15) or SIGUSR1 (10) after a Ctrl-C (2) names the stop: requeue status.
        self.received = max(self.received or 0, signum)

    def _say_ahead(self, signum: int) -> None:
        """The line said as the first stop signal arrives (on rank 0; a signal only other
        ranks got is said by the stop line): what will be saved, and when. Written to fd 2
        directly: a handler must not re-enter a print the main thread may be in."""
        if int(os.environ.get("RANK", 0)) != 0:
            return
        try:
            line = f"stopping: {signal.Signals(signum).name} received {self.ahead()}"
        except Exception as e:  # the line must not cost the stop
            line = f"stopping: signal {signum} received ({type(e).__name__} reading the step)"
        if signum == signal.SIGINT:
            line += f"; Ctrl-C again (after {DOUBLE_PRESS_S:g} s) stops at once, unsaved"
        with contextlib.suppress(OSError):
            os.write(2, f"{line}\n".encode())

    def _say_orphaned(self) -> None:
        """The line of a launcher's end, said by the first trainer of each node (the launcher
        that died is this node's), on fd 2 (see `_say_ahead`)."""
        if int(os.environ.get("LOCAL_RANK", 0)) != 0:
            return
        try:
            ahead = self.ahead()
        except Exception as e:  # the line must not cost the stop
            ahead = f"({type(e).__name__} reading the step)"
        line = (
            f"stopping: the launcher of this node's trainers (pid {self.launcher}) is gone, "
            f"so nothing would stop them: stopping {ahead}"
        )
        with contextlib.suppress(OSError):
            os.write(2, f"{line}\n".encode())

    def stop_now(self, status: int = EXIT_INTERRUPTED, what: str | None = None) -> None:
        """End this process now (a signal handler: runs in the main thread between bytecodes):
        the line, the run lock released, exit status EXIT_INTERRUPTED (or `status`, with
        `what` saying why). Saves in flight are abandoned: their `.tmp` directories are never
        committed (the next start removes them); committed checkpoints are never touched."""
        try:
            line = self.stopped_line()
        except Exception as e:  # the line must not cost the exit
            line = f"stopped at once ({type(e).__name__} while reading what was saved)"
        if what is not None:
            line = f"{what}; {line}"
        who = "LOCAL_RANK" if what is not None else "RANK"  # a launcher's end: each node's
        if int(os.environ.get(who, 0)) == 0:
            print(f"interrupted: {line}", file=sys.stderr, flush=True)
        try:
            self.release()
        finally:
            sys.stdout.flush()
            os._exit(status)

    def agreed(self, device) -> bool:
        """All ranks stop at the same step if any rank got the signal (one collective: each
        rank's signal number at its index, so every rank also learns which signal, and who
        got it)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        got = torch.zeros(world, device=device)
        got[rank] = float(self.received or 0)
        if dist.is_initialized():
            dist.all_reduce(got, op=dist.ReduceOp.MAX)
        numbers = [int(v) for v in got.tolist()]
        self.ranks = [r for r, n in enumerate(numbers) if n]
        if self.ranks:
            self.name = signal.Signals(max(numbers)).name
        return bool(self.ranks)

    def describe(self, world_size: int) -> str:
        """E.g. "SIGTERM (received by rank 1 of 2)"; "SIGTERM (this node's launcher died;
        received by every rank)" on a rank whose launcher is gone."""
        died = "this node's launcher died; " if self.orphaned else ""
        return f"{self.name} ({died}received by {receivers(self.ranks, world_size)})"


def receivers(ranks: list[int], world_size: int) -> str:
    """Who got a stop signal, as the stop line says it: "every rank", "this process" (one
    process), or "rank 1 of 2" / "ranks 0, 2 of 4"."""
    if len(ranks) == world_size:
        return "every rank" if world_size > 1 else "this process"
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {world_size}"


def report_error(line: str, every_node: bool = False, this_rank: bool = False) -> None:
    """A run that cannot go on, in one line: printed by rank 0 (every rank usually finds the
    same error) as `error: <line>`, and, under torchrun, written to this worker's error file,
    so the launcher's failure summary (which follows the worker's output) names this line as
    the failure's cause instead of pointing at how to get a traceback. `every_node`: by the
    first rank of each node instead (rank 0 may be on a node that died); `this_rank`: by
    this rank, whichever it is (an error of its own, such as its GPU's memory)."""
    who = "LOCAL_RANK" if every_node else "RANK"
    if this_rank or int(os.environ.get(who, 0)) == 0:
        print(f"error: {line}", file=sys.stderr, flush=True)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path and not os.path.exists(path):
        import json
        import time

        info = {"py_callstack": f"error: {line}", "timestamp": str(int(time.time()))}
        try:
            with open(path, "w") as f:
                json.dump({"message": {"message": f"error: {line}", "extraInfo": info}}, f)
        except OSError:
            pass


#: A Python exception's last line (`module.Name: message`), optionally behind torch's
#: `[rankN]:` prefix on a worker's output.
_EXCEPTION_LINE = re.compile(
    r"^(?:\[rank(\d+)\]:\s?)?((?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Interrupt)(?::.*)?)$"
)
#: The launcher's own report of a worker's failure, which names no cause.
_LAUNCHER_NOISE = ("ChildFailedError", "torch.distributed.elastic")


def failure_line(output: str) -> str:
    """The line that says why a train.py (or torchrun) child failed, from its output: the
    project's own `error: ...` line if there is one; else the exception of the first rank
    that raised one (its outermost, when exceptions were chained), as `rank N: Name: message`;
    never torchrun's `ChildFailedError`, which only says that a worker failed. Falls back
    to the last non-empty line."""
    lines = [ln.rstrip() for ln in output.splitlines() if ln.strip()]
    for ln in lines:
        own = re.sub(r"^\[rank\d+\]:\s?", "", ln)
        if own.startswith("error: "):
            return own
    found = [
        (m.group(1), m.group(2))
        for m in map(_EXCEPTION_LINE.match, lines)
        if m and not any(noise in m.group(2) for noise in _LAUNCHER_NOISE)
    ]
    if not found:
        return lines[-1] if lines else "?"
    rank = found[0][0]
    last = [text for r, text in found if r == rank][-1]
    return f"rank {rank}: {last}" if rank is not None else last


def exit_status(statuses: list[int]) -> int:
    """0 when every job succeeded; else the failing jobs' status when they agree, else 1."""
    failed = sorted({s for s in statuses if s != 0})
    return 0 if not failed else failed[0] if len(failed) == 1 else 1


#: What runs `launch`'s train.py (or `-m module`) instead of new interpreters (None: new ones).
#: The test suite sets it (tests/conftest.py) to start the program's processes forked from one
#: that has imported it already (tests/distributed.py, launch_forked): the same program, as
#: __main__, with the environment torchrun gives its workers when nproc > 1, without the ~4 s of
#: imports each new interpreter spends. It returns None for a run it leaves to new processes.
_train_launcher: Callable[..., subprocess.CompletedProcess | None] | None = None


def set_train_launcher(launcher: Callable[..., subprocess.CompletedProcess | None] | None) -> None:
    global _train_launcher
    _train_launcher = launcher


def command(args: Sequence[str], nproc: int = 1, program: Sequence[str] = ("train.py",)) -> list:
    """`python train.py ARGS` (or another `program`), under `torchrun --standalone` when
    nproc > 1."""
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*cmd, *program, *args]


def launch(
    args: list[str],
    *,
    nproc: int = 1,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    program: tuple[str, ...] = ("train.py",),
) -> subprocess.CompletedProcess:
    """Run `program` (train.py, or e.g. ("-m", "tests.harness.matrix")) with `args` (for
    train.py: Hydra overrides) in a new process from the repository root, under `torchrun
    --standalone --nproc_per_node=<nproc>` when nproc > 1; stdout and stderr are captured as
    text. `env` adds to (or replaces in) this process's environment."""
    if _train_launcher is not None:
        done = _train_launcher(args, nproc=nproc, env=env, timeout=timeout, program=program)
        if done is not None:
            return done
    return subprocess.run(
        command(args, nproc, program),
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# -- process identity: lock files name their holder ------------------------------------------


def fsync_dir(path: Path) -> None:
    """The directory's entries on disk (after files in it were created, renamed or removed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def host_id() -> str:
    """This host and its pid namespace: pids are comparable only between equal host ids."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return socket.gethostname()
    return f"{socket.gethostname()}/pidns:{ns}"


def host_name(host: str) -> str:
    """The host name part of a `host_id()` value, for messages."""
    return str(host).split("/")[0]


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (Linux), else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def child_pids(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (Linux /proc)."""
    pids = (int(p.name) for p in Path("/proc").glob("[0-9]*"))
    return [kid for kid in pids if (stat_fields(kid) or [None, None])[1] == str(pid)]


def process_start(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (Linux), else None: with the
    pid it names one process, whose pid the system may later give to another."""
    fields = stat_fields(pid)
    return fields[19] if fields and len(fields) > 19 else None


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host id runs (a zombie, killed but not yet reaped by its
    parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = stat_fields(pid)
    return not fields or fields[0] != "Z"
