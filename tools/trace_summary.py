"""Where the device time of profiled steps goes, from a torch.profiler Chrome trace.

    python train.py model=llama3_1b data.seq_len=8192 train.profile_steps=[10]
    python tools/trace_summary.py runs/<name>/profile/rank0_steps10-10.json --steps 1

Prints, per step: the window from the first kernel's start to the last one's end; each CUDA
stream's busy time (union of its kernels) and the compute stream's idle time inside the window
(the time the step waits on the host or on communication); the kernel time by kind (GEMM,
attention, NCCL, FP8 quantization, TE elementwise, compiled, copies and casts, optimizer and
foreach, other), on the compute stream and on all streams; how much of the compute stream's
busy time runs while an NCCL kernel runs (kernels sharing the SMs with communication); each
communication operation's time and how much of it the compute stream was busy beside (hidden
behind compute; SendRecv is the context-parallel ring); the
attention kernels by part (forward, the recompute of activation checkpointing, backward) and
precision (fp8 when the kernel's name says so), with their calls per step: under context
parallelism each ring step is one call per block; and the kernels with the most time, each
with the operators that launched most of it (outermost < innermost; the share when other
operators launch the same kernel too).

The compute stream is the stream with the most non-NCCL kernel time.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict

#: (kind, pattern on the kernel name), first match wins.
KINDS = [
    ("nccl", re.compile(r"^nccl", re.I)),
    ("attention", re.compile(r"sdpa|flash|fmha|fused_attn|attn", re.I)),
    ("gemm", re.compile(r"nvjet|gemm|cutlass|xmma|cublas", re.I)),
    ("fp8 quantize", re.compile(r"quantize|cast_transpose|amax|compute_scale|fp8", re.I)),
    ("optimizer/foreach", re.compile(r"adam|multi_tensor", re.I)),
    ("te elementwise", re.compile(r"transformer_engine|rmsnorm|rope|gated_act", re.I)),
    ("compiled", re.compile(r"^triton", re.I)),
    ("copy/cast", re.compile(r"copy|cat|split|memcpy|memset|fill|transpose|convert", re.I)),
]
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def _merged(intervals: list[tuple[float, float]]) -> list[list[float]]:
    """A union of (start_us, end_us) intervals as sorted, disjoint [start, end] pairs."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Total length (ms) of a union of (start_us, end_us) intervals."""
    return sum(end - start for start, end in _merged(intervals)) / 1e3


def overlap_ms(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length (ms) of the intersection of two interval unions."""
    a, b = _merged(a), _merged(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total / 1e3


def launch_paths(events: list[dict]) -> dict[int, str]:
    """correlation id -> 'outer op < inner op' of the CPU operators around the launch call
    (one sweep per thread over operators and launch calls in time order)."""
    per_tid: dict = defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") == "cpu_op":
            per_tid[e.get("tid")].append((e["ts"], 0, e["ts"] + e.get("dur", 0), e["name"]))
        elif e.get("cat") in ("cuda_runtime", "cuda_driver"):
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                per_tid[e.get("tid")].append((e["ts"], 1, corr, None))
    paths = {}
    for items in per_tid.values():
        stack: list[tuple[float, str]] = []  # (end, name) of the operators open at this time
        for ts, is_launch, value, name in sorted(items, key=lambda i: (i[0], i[1])):
            while stack and stack[-1][0] < ts:
                stack.pop()
            if not is_launch:
                stack.append((value, name))
            elif stack:
                outer, inner = stack[0][1], stack[-1][1]
                paths[value] = outer if outer == inner else f"{outer} < {inner}"
    return paths


def _main_path(by_path: dict[str, float]) -> str:
    """The launching path with the most of a kernel's time, and its share when others exist."""
    path, us = max(by_path.items(), key=lambda kv: kv[1])
    share = us / sum(by_path.values())
    return path if share > 0.999 else f"{path} ({share:.0%}; {len(by_path) - 1} other paths)"


_BACKWARD = re.compile(r"bprop|bwd|backward|dgrad", re.I)
_FP8 = re.compile(r"fp8|f8|e4m3|e5m2", re.I)
#: A communication kernel's operation (SendRecv: context parallelism's ring).
_NCCL_OP = re.compile(r"(AllGather|ReduceScatter|AllReduce|SendRecv|Broadcast|AllToAll)", re.I)


def attention_part(name: str, launched_by: str) -> str:
    """An attention kernel's part of the step: "forward", "recompute" (a forward kernel that
    autograd's backward launched: activation checkpointing) or "backward", with its precision
    ("fp8" when the kernel's name says so, else "16-bit")."""
    if _BACKWARD.search(name):
        part = "backward"
    elif "evaluate_function" in launched_by or "Backward" in launched_by:
        part = "recompute"
    else:
        part = "forward"
    return f"{part} {'fp8' if _FP8.search(name) else '16-bit'}"


def summarize(trace: dict, steps: int = 1, top: int = 15) -> dict:
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    # (event, kind, stream) of every device activity
    kernels = [
        (e, kind_of(e["name"]), e.get("args", {}).get("stream", e.get("tid")))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS and e.get("dur", 0) > 0
    ]
    if not kernels:
        raise ValueError("no device kernels in this trace (a CPU run, or CUDA was not profiled)")
    spans: dict = defaultdict(list)
    non_nccl: dict = defaultdict(float)
    nccl = []
    # Communication by operation: its time, and how much of it the compute stream was busy
    # beside.
    nccl_ops: dict = defaultdict(list)
    for k, kind, stream in kernels:
        span = (k["ts"], k["ts"] + k["dur"])
        spans[stream].append(span)
        if kind == "nccl":
            nccl.append(span)
            op = _NCCL_OP.search(k["name"])
            nccl_ops[op.group(1) if op else "other"].append(span)
        else:
            non_nccl[stream] += k["dur"]
    compute = max(spans, key=lambda stream: non_nccl[stream])
    every = [span for stream_spans in spans.values() for span in stream_spans]
    window = (max(end for _, end in every) - min(start for start, _ in every)) / 1e3
    paths = launch_paths(events)
    kinds_all: dict = defaultdict(float)
    kinds_compute: dict = defaultdict(float)
    per_name: dict = {}  # name -> [ms, calls, {launch path: us}, kind]
    attention: dict = defaultdict(lambda: [0.0, 0])  # part -> [ms, calls]
    for k, kind, stream in kernels:
        kinds_all[kind] += k["dur"] / 1e3
        path = paths.get(k.get("args", {}).get("correlation"), "?")
        if kind == "attention":
            part = attention[attention_part(k["name"], path)]
            part[0] += k["dur"] / 1e3
            part[1] += 1
        if stream == compute:
            kinds_compute[kind] += k["dur"] / 1e3
        row = per_name.setdefault(k["name"], [0.0, 0, defaultdict(float), kind])
        row[0] += k["dur"] / 1e3
        row[1] += 1
        row[2][path] += k["dur"]
    tops = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]
    busy = union_ms(spans[compute])
    return {
        "steps": steps,
        "window_ms": window / steps,
        "compute_stream": compute,
        "compute_busy_ms": busy / steps,
        "compute_idle_ms": (window - busy) / steps,
        "compute_with_nccl_ms": overlap_ms(spans[compute], nccl) / steps,
        "streams": {
            str(s): {"busy_ms": union_ms(v) / steps, "kernels": len(v) / steps}
            for s, v in spans.items()
        },
        "kinds_compute_ms": {k: v / steps for k, v in kinds_compute.items()},
        "kinds_all_ms": {k: v / steps for k, v in kinds_all.items()},
        "nccl": {
            op: {
                "ms": union_ms(v) / steps,
                "beside_compute_ms": overlap_ms(v, spans[compute]) / steps,
            }
            for op, v in sorted(nccl_ops.items())
        },
        "attention": {
            part: {"ms": ms / steps, "calls": calls / steps}
            for part, (ms, calls) in sorted(attention.items())
        },
        "top": [
            {
                "name": name,
                "kind": kind,
                "ms": ms / steps,
                "calls": calls / steps,
                "launched_by": _main_path(by_path),
            }
            for name, (ms, calls, by_path, kind) in tops
        ],
    }


def render(s: dict) -> str:
    lines = [
        f"per step ({s['steps']} profiled): window {s['window_ms']:.1f} ms; compute stream "
        f"{s['compute_stream']} busy {s['compute_busy_ms']:.1f} ms, idle "
        f"{s['compute_idle_ms']:.1f} ms, of its busy time {s['compute_with_nccl_ms']:.1f} ms "
        "runs beside NCCL kernels",
        "streams: "
        + "; ".join(
            f"{k}: {v['busy_ms']:.1f} ms busy, {v['kernels']:.0f} kernels"
            for k, v in sorted(s["streams"].items(), key=lambda kv: -kv[1]["busy_ms"])
        ),
        "",
        "| kind | compute stream ms | all streams ms |",
        "| --- | --- | --- |",
    ]
    for kind in sorted(s["kinds_all_ms"], key=lambda k: -s["kinds_all_ms"][k]):
        lines.append(
            f"| {kind} | {s['kinds_compute_ms'].get(kind, 0.0):.1f} | "
            f"{s['kinds_all_ms'][kind]:.1f} |"
        )
    if s.get("nccl"):
        lines += ["", "| communication | ms | of it beside compute |", "| --- | --- | --- |"]
        for op, v in s["nccl"].items():
            lines.append(f"| {op} | {v['ms']:.1f} | {v['beside_compute_ms']:.1f} |")
    if s.get("attention"):
        lines += ["", "| attention kernels | ms | calls |", "| --- | --- | --- |"]
        for part, v in s["attention"].items():
            lines.append(f"| {part} | {v['ms']:.1f} | {v['calls']:.0f} |")
    lines += ["", "| kernel | kind | ms | calls | launched by |", "| --- | --- | --- | --- | --- |"]
    for t in s["top"]:
        lines.append(
            f"| {t['name'][:80]} | {t['kind']} | {t['ms']:.2f} | {t['calls']:.0f} | "
            f"{t['launched_by'][:90]} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("trace", help="a Chrome trace written by train.profile_steps")
    p.add_argument("--steps", type=int, default=1, help="steps the trace covers (per-step figures)")
    p.add_argument("--top", type=int, default=15, help="kernels listed")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    with open(args.trace) as f:
        try:
            summary = summarize(json.load(f), args.steps, args.top)
        except ValueError as e:
            raise SystemExit(f"error: {args.trace}: {e}") from None
    print(render(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
