"""FP8 attention under context parallelism across GPUs: train.py at cp=2 and cp=4 trains, in the
time a step should take, and its losses follow bf16 attention's.

    python -m pytest -m gpu tests/gpu/test_cp_fp8_attention_gpu.py -q -s   # 4 GPUs (cp=4 and 2)

Issue 56: llama3_8b at seq 32k with cp=4, no recomputation, fp8_cs + quantized_init and FP8
attention never finished a step in 150 s and 330 s (bf16 took 48 s for the whole case), and the
benchmark printed nothing. These cases run the same settings (causal rows, NCCL between GPUs,
TE's p2p ring) on a model of CASE_LAYERS blocks of llama3_8b's shape, through
tools/benchlib.run_case with a time limit: a run that hangs or crawls fails with the step it
reached and where each rank waited (its stacks), instead of holding the machine.

Each FP8-attention run is compared with the same run in bf16 attention: the mean loss of its
steps within LOSS_RTOL (both start from the same seeded weights; FP8 attention rounds Q, K, V,
the softmax output and their gradients to FP8, which moves early losses by far less).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from model import te_available
from tools import benchlib

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not te_available(), reason="needs CUDA GPUs and TransformerEngine"),
]

SEQ = 32768
#: Blocks of llama3_8b's shape (dim 4096, 32 heads, 8 KV heads, head_dim 128).
CASE_LAYERS = 4
STEPS = 4
#: Seconds a case may take: model build, cuDNN's graphs for the ring's three attention shapes
#: (diagonal, lower, upper) in fp8 and bf16, and STEPS steps of about a second each.
CASE_TIMEOUT = 240
#: Relative difference allowed between the mean losses of FP8 and bf16 attention over the
#: steps (a bound on FP8 rounding over a few steps from a random init, where the loss is
#: about ln(vocab), not a measured spread).
LOSS_RTOL = 0.02


def _run(tmp_path: Path, cp: int, fp8_attention: bool) -> benchlib.Case:
    name = f"cp{cp}-{'fp8' if fp8_attention else 'bf16'}-attention"
    args = [
        "model=llama3_8b",
        f"model.n_layers={CASE_LAYERS}",
        f"model.max_seq_len={SEQ}",
        "recipe=fp8_cs",
        "recipe.quantized_init=true",
        f"recipe.fp8_attention={str(fp8_attention).lower()}",
        "parallel=fsdp",
        f"parallel.cp={cp}",
        "data=synthetic",
        "data.document_mask=false",
        f"data.seq_len={SEQ}",
        "train.micro_batch_size=1",
        f"train.global_batch_size={4 // cp}",
        f"train.steps={STEPS}",
        "train.log_every=1",
        "checkpoint=none",
        "logger=default",
        f"run.root={tmp_path}",
        f"run.name={name}",
    ]
    case = benchlib.run_case(
        args,
        run_dir=tmp_path / name,
        nproc=4,
        timeout=CASE_TIMEOUT,
        log=tmp_path / "logs" / name,
    )
    steps = [r["step"] for r in case.records]
    print(f"\n{name}: exit {case.returncode} in {case.seconds:.0f} s, steps {steps}")
    assert case.ok, f"{name}: {case.failure()}\n{case.tail(30)}"
    assert steps == list(range(1, STEPS + 1)), steps
    return case


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
@pytest.mark.parametrize("cp", [4, 2])
def test_fp8_attention_trains_under_cp_across_gpus(tmp_path, cp):
    fp8 = _run(tmp_path, cp, fp8_attention=True)
    bf16 = _run(tmp_path, cp, fp8_attention=False)
    mean = [statistics.fmean(r["loss"] for r in c.records) for c in (fp8, bf16)]
    times = [statistics.median(r["step_time_s"] for r in c.records[1:]) for c in (fp8, bf16)]
    print(f"cp={cp}: mean loss fp8 {mean[0]:.4f} bf16 {mean[1]:.4f}; step s {times}")
    assert abs(mean[0] - mean[1]) <= LOSS_RTOL * mean[1], mean
