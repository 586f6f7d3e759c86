"""torch.profiler around chosen training steps (`train.profile_steps`).

    python train.py model=llama3_1b train.profile_steps=[10,11,12]

writes, for each rank, `<run_dir>/profile/rank<r>_steps<first>-<last>.json` (a Chrome trace:
open it in https://ui.perfetto.dev or chrome://tracing) and `...txt`, the operators and kernels
of those steps sorted by their device time (CPU time on CPU runs). Steps outside the list run
unprofiled, so the trace shows the steady state when the list starts after warm-up.

On a GPU, rank 0 also records the CUDA caching allocator's history over those steps (unless
`train.profile_memory=false`) and writes `...memory.md`: the memory allocated when the first
listed step began (weights, optimizer states, what the previous step left), the peak within the
steps, and the allocations alive at that peak grouped by the Python line that made them
(`memory_summary`).
"""

from __future__ import annotations

from pathlib import Path

import torch


class StepProfiler:
    """`begin(step)` before a step's work and `end(step)` after it; profiles the steps in
    `steps` (a contiguous range: first to last)."""

    def __init__(self, steps, run_dir: Path, rank: int, device: torch.device, memory=True):
        self.steps = sorted(int(s) for s in steps)
        self.run_dir, self.rank, self.device = Path(run_dir), rank, device
        self.memory = memory  # rank 0 records the allocator's history (train.profile_memory)
        self._prof = None

    def begin(self, step: int) -> None:
        if not self.steps or step != self.steps[0]:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
        self._prof.__enter__()
        self._memory_base = None
        if self.device.type == "cuda" and self.rank == 0 and self.memory:
            torch.cuda.synchronize(self.device)
            self._memory_base = torch.cuda.memory_allocated(self.device)
            torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")

    def end(self, step: int) -> Path | None:
        """Stops after the last listed step and writes the files; returns the trace path."""
        if self._prof is None or step != self.steps[-1]:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._prof.__exit__(None, None, None)
        out = self.run_dir / "profile"
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"rank{self.rank}_steps{self.steps[0]}-{self.steps[-1]}"
        self._prof.export_chrome_trace(str(stem.with_suffix(".json")))
        key = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = self._prof.key_averages().table(sort_by=key, row_limit=60, max_name_column_width=90)
        stem.with_suffix(".txt").write_text(table + "\n")
        self._prof = None
        if self._memory_base is not None:
            snapshot = torch.cuda.memory._snapshot(self.device)
            torch.cuda.memory._record_memory_history(enabled=None)
            trace = snapshot["device_traces"][self.device.index or 0]
            text = memory_summary(trace, self._memory_base, self.steps)
            stem.with_name(stem.name + "_memory.md").write_text(text)
        return stem.with_suffix(".json")


#: Frames of these files say what an allocation is for; the first one found names its site.
_OWN_FRAMES = ("/transformer_engine/", "/model/", "/parallel/", "/steps.py", "/recipes/")


def _site(frames: list[dict]) -> str:
    for f in frames:
        name = f.get("filename", "")
        if any(part in name for part in _OWN_FRAMES):
            short = name.split("/transformer_engine/")[-1] if "transformer_engine" in name else name
            short = short.rsplit("/", 2)[-2:] if "/" in short else [short]
            return f"{'/'.join(short)}:{f.get('line')} {f.get('name')}"
    for f in frames:  # else the innermost frame that is not the allocator's own
        if "torch/cuda/memory" not in f.get("filename", ""):
            return f"{f.get('filename', '?').rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"
    return "(no Python frame)"


def memory_summary(trace: list[dict], base: int, steps: list[int], top: int = 25) -> str:
    """Markdown: allocated at the start, the peak, and what is alive at the peak by site.
    `trace`: the allocator's events over the steps (alloc / free_completed with addr, size,
    frames); `base`: bytes allocated when recording began. Frees of blocks allocated before
    recording lower the baseline part."""
    cur = peak = 0
    peak_at = -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            cur += e["size"]
        elif e["action"] == "free_completed":
            cur -= e["size"]
        if cur > peak:
            peak, peak_at = cur, i
    live: dict[int, tuple[int, str]] = {}
    base_freed = 0
    for e in trace[: peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _site(e.get("frames") or []))
        elif e["action"] == "free_completed":
            if e["addr"] in live:
                live.pop(e["addr"])
            else:
                base_freed += e["size"]
    by_site: dict[str, list[int]] = {}
    for size, site in live.values():
        entry = by_site.setdefault(site, [0, 0])
        entry[0] += size
        entry[1] += 1
    within = sum(size for size, _ in live.values())
    gib = 2**30
    lines = [
        f"# Memory over steps {steps[0]}-{steps[-1]} (rank 0)",
        "",
        f"- allocated when step {steps[0]} began: {base / gib:.2f} GiB "
        f"({base_freed / gib:.2f} GiB of it freed before the peak)",
        f"- peak: {(base + peak) / gib:.2f} GiB = the rest of that "
        f"{(base - base_freed) / gib:.2f} GiB + {within / gib:.2f} GiB allocated within the steps",
        "",
        "| allocated at (first frame of TE, model/, parallel/, steps.py, recipes/) | GiB at peak | blocks |",
        "|---|---|---|",
    ]
    for site, (size, count) in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| {site} | {size / gib:.2f} | {count} |")
    rest = sorted(by_site.values(), key=lambda v: -v[0])[top:]
    if rest:
        lines.append(
            f"| (other sites) | {sum(v[0] for v in rest) / gib:.2f} | {sum(v[1] for v in rest)} |"
        )
    return "\n".join(lines) + "\n"
