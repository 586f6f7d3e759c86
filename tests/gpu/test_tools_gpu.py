"""train.dry_run, train.eval_only and tools/sample.py on one GPU with TransformerEngine.

    python -m pytest -m gpu tests/gpu/test_tools_gpu.py -q

1. Dry run of a TE run (fp8_cs): exit 0, the memory estimate names the GPU's memory, nothing
   written.
2. Eval only of a TE checkpoint (fp8_cs, bf16 autocast): the held-out loss printed equals the
   val_loss the training run logged at that step (same GPU, same kernels).
3. tools/sample.py on that run's checkpoint with --device cuda (the reference model in fp32
   on the GPU, from the fp32 masters/weights) gives the same greedy tokens as on the CPU.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from model import te_available
from runlog import read_metrics
from runtime import ROOT, launch
from tests.test_resume_config import snapshot

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not te_available(), reason="needs a CUDA GPU and TransformerEngine"),
]

RUN = [
    "model=tiny",
    "model.impl=te",
    "recipe=fp8_cs",
    "data.seq_len=128",
    "data.max_bytes=2000000",
    "data.eval_fraction=0.05",  # 1% of this small corpus packs into no held-out sample
    "train.global_batch_size=8",
    "train.steps=6",
    "train.log_every=1",
    "optim.warmup_steps=2",
    "eval.every=3",
    "eval.batches=2",
    "checkpoint=sync",
]


def test_dry_run_eval_only_and_sample_on_gpu(tmp_path):
    args = [*RUN, f"run.root={tmp_path}", "run.name=r"]
    r = launch([*args, "train.dry_run=true"], timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^memory: about .* GiB per GPU \(.*\) of \d+ GiB", r.stdout, re.M), r.stdout
    assert "impl=te" in r.stdout and not (tmp_path / "r").exists()

    r = launch(args, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = {x["step"]: x.get("val_loss") for x in read_metrics(tmp_path / "r" / "metrics.jsonl")}
    before = snapshot(tmp_path / "r")
    r = launch([*args, "train.eval_only=true"], timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"eval: step 6 val_loss {ref[6]:.4f} on 2 held-out batches" in r.stdout, r.stdout
    assert snapshot(tmp_path / "r") == before

    def sample(device):
        cmd = [sys.executable, "tools/sample.py", str(tmp_path / "r"), "--prompt", "def "]
        out = subprocess.run(
            [*cmd, "--max-new-tokens", "32", "--temperature", "0", "--device", device],  # greedy
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert sample("cuda") == sample("cpu")
