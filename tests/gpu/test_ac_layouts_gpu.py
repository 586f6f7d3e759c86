"""Every recipe this GPU runs x every recomputation mode, under fsdp, hsdp and fsdp_tp on 2 GPUs.

    source .device/setup.sh && python3 -m pytest -m gpu tests/gpu/test_ac_layouts_gpu.py -q -s

Runs tests/harness/ac_layouts.py under torchrun on 2 processes: the small TE model built as
train.py builds it, two optimizer steps per case, each mode's losses against the same layout's
and recipe's without recomputation (the harness's STEP1_RTOL, STEP2_RTOL). Before compat's
`ensure_recompute_gathers_rowwise`, every FP8 recipe with quantized_init failed here in any
recompute mode with TE's "Cannot generate FP8 data, even from FP8 data transpose"; the
harness's first row still shows that error with TE's own hook.
"""

from __future__ import annotations

import json

import pytest
import torch

from model import te_available
from runtime import launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not te_available(), reason="needs a CUDA GPU and TransformerEngine"),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 GPUs"),
]

NO_MULTICAST = dict(
    NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1"
)


def test_every_recipe_and_recompute_mode_trains_on_two_gpus(tmp_path):
    out = tmp_path / "rows.jsonl"
    proc = launch(
        ["--jsonl", str(out)],
        nproc=2,
        program=("-m", "tests.harness.ac_layouts"),
        env=NO_MULTICAST,
        timeout=900,
    )
    print(proc.stdout[-12000:])
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    bad = [r for r in rows if not r["ok"]]
    # 7 recipe variants x 5 modes x 3 layouts (fewer FP8 variants on a GPU that runs fewer).
    assert len(rows) >= 1 + 5 * 3 and not bad and proc.returncode == 0, (
        f"failed rows: {bad}\n{proc.stderr[-4000:]}"
    )
