"""torch.profiler around chosen training steps (`train.profile_steps`).

    python train.py model=llama3_1b train.profile_steps=[10,11,12]

writes, for each rank, `<run_dir>/profile/rank<r>_steps<first>-<last>.json` (a Chrome trace:
open it in https://ui.perfetto.dev or chrome://tracing) and `...txt`, the operators and kernels
of those steps sorted by their device time (CPU time on CPU runs). Steps outside the list run
unprofiled, so the trace shows the steady state when the list starts after warm-up.
"""

from __future__ import annotations

from pathlib import Path

import torch


class StepProfiler:
    """`begin(step)` before a step's work and `end(step)` after it; profiles the steps in
    `steps` (a contiguous range: first to last)."""

    def __init__(self, steps, run_dir: Path, rank: int, device: torch.device):
        self.steps = sorted(int(s) for s in steps)
        self.run_dir, self.rank, self.device = Path(run_dir), rank, device
        self._prof = None

    def begin(self, step: int) -> None:
        if not self.steps or step != self.steps[0]:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
        self._prof.__enter__()

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
        return stem.with_suffix(".json")
