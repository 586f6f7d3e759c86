"""parallel.grad_reduce=step: under gradient accumulation FSDP2 reduces the gradients once per
optimizer step instead of after every micro batch. On 2 gloo ranks (fsdp) and 4 (hsdp 2x2),
three AdamW steps of 4 micro batches each: the step mode issues one reduce-scatter per FSDP
unit and step (micro_batch mode: one per micro batch), and its losses and weights equal the
micro_batch mode's to fp32 rounding (only the order of the gradient sums differs); train.py
on 2 processes with accumulation gives the same losses in both modes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from errors import ConfigError
from model.config import ModelConfig
from model.init import init_weights
from model.llama import Llama
from parallel.config import ParallelConfig
from parallel.dims import GRAD_REDUCE, ParallelDims
from parallel.parallelize import parallelize
from runlog import read_metrics
from runtime import launch
from steps import train_step
from tests.distributed import run_distributed
from tests.helpers import CPU_ENV, TINY_RUN

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
STEPS, ACCUM, ROWS, SEQ = 3, 4, 8, 16


def _train(pcfg: ParallelConfig, world: int, reduce_each: bool):
    dims = ParallelDims(pcfg, world)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = Llama(CFG)
    model = parallelize(model, dims, pcfg, "torch", mixed_precision=False)
    model.to_empty(device="cpu")
    model.reset_buffers()
    init_weights(model, CFG, seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    calls = 0
    # FSDP2's reduce-scatter: reduce_scatter_single in newer torch, reduce_scatter_tensor before.
    names = [n for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n)]
    real = {n: getattr(dist, n) for n in names}

    def counting(name):
        def call(*args, **kwargs):
            nonlocal calls
            calls += 1
            return real[name](*args, **kwargs)

        return call

    for n in names:
        setattr(dist, n, counting(n))
    losses = []
    try:
        for _ in range(STEPS):  # the same rows each step (the loss must fall); every rank
            g = torch.Generator().manual_seed(dist.get_rank())  # is a data-parallel rank here
            tokens = torch.randint(0, CFG.vocab_size, (ROWS, SEQ + 1), generator=g)
            loss, _ = train_step(
                model,
                optimizer,
                tokens[:, :-1],
                tokens[:, 1:],
                grad_accum=ACCUM,
                grad_clip=1.0,
                reduce_each_micro_batch=reduce_each,
            )
            dist.all_reduce(loss)
            losses.append(loss.item() / world)
    finally:
        for n in names:
            setattr(dist, n, real[n])
    weights = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
        for n, p in model.named_parameters()
    }
    units = sum(1 for m in model.modules() if isinstance(m, FSDPModule))
    return losses, weights, calls, units


def _worker(rank, world, layout, out):
    pcfg = ParallelConfig(**layout)
    each_losses, each_weights, each_calls, units = _train(pcfg, world, True)
    once_losses, once_weights, once_calls, _ = _train(pcfg, world, False)
    worst = max((each_weights[n] - once_weights[n]).abs().max().item() for n in each_weights)
    if rank == 0:
        Path(out).write_text(
            json.dumps(
                dict(
                    each=each_losses,
                    once=once_losses,
                    each_calls=each_calls,
                    once_calls=once_calls,
                    units=units,
                    weights=worst,
                )
            )
        )


@pytest.mark.parametrize(
    "layout, world",
    [
        (dict(name="fsdp"), 2),
        (dict(name="hsdp", dp_replicate=2, dp_shard=2), 4),
    ],
    ids=["fsdp2", "hsdp2x2"],
)
def test_step_mode_reduces_once_per_step_with_the_same_result(tmp_path, layout, world):
    out = tmp_path / "report.json"
    run_distributed(_worker, world, layout, str(out))
    r = json.loads(out.read_text())
    print(f"\n{layout}: {r}")
    assert r["units"] > 1
    assert r["each_calls"] == STEPS * ACCUM * r["units"]
    assert r["once_calls"] == STEPS * r["units"]
    assert max(abs(a - b) for a, b in zip(r["each"], r["once"])) < 1e-5
    # Adam divides by the gradient's own scale, so a last-bit difference in a sum can move a
    # weight by a little more than rounding: 5e-5 against updates of ~1e-2 per step.
    assert r["weights"] < 5e-5
    assert r["each"][-1] < r["each"][0]  # it trains (the same rows every step)


def test_bad_value_is_one_line():
    with pytest.raises(ConfigError, match=r"parallel.grad_reduce='layer' is not one of"):
        ParallelDims(ParallelConfig(name="fsdp", grad_reduce="layer"), 2)


def test_train_py_step_mode_matches(tmp_path):
    """train.py on 2 processes with accumulation (2 micro batches per rank): the same losses."""
    losses = {}
    for mode in GRAD_REDUCE:
        r = launch(
            [
                f"run.root={tmp_path}",
                f"run.name={mode}",
                "train.steps=4",
                *TINY_RUN,
                "train.global_batch_size=8",
                "train.micro_batch_size=2",
                f"parallel.grad_reduce={mode}",
            ],
            nproc=2,
            env=CPU_ENV,
            timeout=300,
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        assert "grad_accum=2" in r.stdout
        losses[mode] = [m["loss"] for m in read_metrics(tmp_path / mode / "metrics.jsonl")]
    assert len(losses["step"]) == 4
    assert max(abs(a - b) for a, b in zip(losses["step"], losses["micro_batch"])) < 1e-5
