"""Parallel layouts of the TE implementation on 2-4 GPUs vs one GPU (tests/harness/parity.py).

    source .device/setup.sh && python3 -m pytest -m gpu tests/gpu/test_parallel_gpu.py -q -s

Runs the parity harness under torchrun (`-m tests.harness.parity`) on min(4, GPUs) processes:
fsdp, hsdp, ddp, tp, fsdp_tp, hsdp_tp (those that fit), bf16 and fp8_cs, 20 steps each against
the single-GPU curve, and the fp8_cs FSDP2 all-gather check (FP8 shards gathered == FP8 cast of
the full weight); then fsdp, hsdp and fsdp_tp with 4 micro batches a step (grad_reduce=step
with every block kept gathered, and micro_batch with the default), whose FSDP2 units stay
gathered through the micro batches. The table is printed with -s; tolerances are the
harness's (STEP1_RTOL, CURVE_RTOL).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model import te_available

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not te_available(), reason="needs a CUDA GPU and TransformerEngine"),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 GPUs"),
]


def _run(nproc: int, out: Path, *extra: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "tests.harness.parity",
        "--json",
        str(out),
        *extra,
    ]
    env = dict(
        os.environ,
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NVSHMEM_DISABLE_NVLS="1",
    )
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    print(proc.stdout[-8000:])
    assert out.exists(), f"the parity harness wrote no results:\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    bad = [r for r in result["curves"] + result["fp8_allgather"] if not r.get("ok", True)]
    assert proc.returncode == 0 and not bad, f"failed rows: {bad}\n{proc.stderr[-4000:]}"
    return result


def test_layouts_match_single_gpu(tmp_path):
    nproc = min(4, torch.cuda.device_count())
    result = _run(nproc, tmp_path / "parallel.json")
    ran = {r["layout"] for r in result["curves"] if "skipped" not in r}
    # Every layout the issue names must have run (hsdp_tp needs 4 GPUs).
    expected = {"fsdp", "hsdp", "tp", "fsdp_tp"} | ({"hsdp_tp"} if nproc >= 4 else set())
    assert expected <= ran, f"layouts not run: {expected - ran}"
    assert {r["recipe"] for r in result["curves"] if "recipe" in r} == {
        "bf16",
        "fp8_cs",
        "fp8_block+q",
    }
    gathered = {(r["layout"], r["recipe"]) for r in result["fp8_allgather"]}
    assert {(layout, r) for layout in expected for r in ("fp8_cs", "fp8_block")} <= gathered


def test_layouts_without_sequence_parallel(tmp_path):
    nproc = min(4, torch.cuda.device_count())
    _run(
        nproc,
        tmp_path / "nosp.json",
        "--layouts",
        "tp,fsdp_tp",
        "--recipes",
        "bf16",
        "--no-sequence-parallel",
        "--gather-recipes",
        "",
    )


@pytest.mark.parametrize(
    "reduce, keep", [("step", True), ("micro_batch", False)], ids=["step-keep", "micro_batch"]
)
def test_layouts_with_gradient_accumulation(tmp_path, reduce, keep):
    """4 micro batches a step, the kept FSDP2 units held gathered through them (all blocks
    with keep, else the last one and the root), against one GPU accumulating the same."""
    nproc = min(4, torch.cuda.device_count())
    result = _run(
        nproc,
        tmp_path / "accum.json",
        "--layouts",
        "fsdp,hsdp,fsdp_tp",
        "--recipes",
        "bf16,fp8_cs+q,fp8_block+q",
        "--gather-recipes",
        "",
        "--grad-accum",
        "4",
        "--grad-reduce",
        reduce,
        *(["--keep-gathered"] if keep else []),
    )
    ran = {(r["layout"], r["recipe"]) for r in result["curves"] if "skipped" not in r}
    assert {("fsdp", r) for r in ("bf16", "fp8_cs+q", "fp8_block+q")} <= ran
    assert ("fsdp_tp", "fp8_cs+q") in ran
