"""Every recipe x recomputation mode on a multi-GPU layout: trains, and matches no recomputation.

    torchrun --nproc_per_node=2 -m tests.harness.ac_layouts --layouts fsdp hsdp fsdp_tp \
        --jsonl out.jsonl                                                   # GPU, TE, 2 GPUs
    torchrun --nproc_per_node=2 -m tests.harness.ac_layouts --cpu          # gloo, a check of the harness

(from the repository root). One process group, TE imported once: for each layout, each recipe
variant (bf16, and each FP8 recipe this GPU runs with and without quantized_init) and each
recomputation mode (none, full, mlp, selective, full on every 2nd block) it builds the small TE
model the way train.py does (`train.build_parallel_model`: TP, recomputation, FSDP2, init,
quantized weights), takes two optimizer steps on fixed random tokens and records both losses.
Recomputation changes what is kept, not what is computed, so each mode's losses must equal the
same layout's and recipe's losses without recomputation: step 1 (one forward of the same
weights) to STEP1_RTOL, step 2 (after a step whose gradients went through the recompute) to
STEP2_RTOL (bf16 and FP8 backward kernels are not bitwise reproducible run to run on sm_90).

Before the cases, one row shows the gap compat/te.py fixes with TE alone: fp8_cs with
quantized_init and selective recomputation under fsdp with TE's own FSDP2 pre-all-gather hook,
which must fail with TE's "Cannot generate FP8 data" error (the row passes when it does; when
a TE release stops failing, the row says so and compat's fix can go).

`--cpu` runs the reference model (model.impl=torch, bf16, a 64-wide model of the same depth)
over gloo on the CPU, without the TE row: a check of these code paths, not of TE.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import traceback
from contextlib import contextmanager
from datetime import timedelta

from tests.harness.matrix import VARIANTS
from tests.harness.multitier import emit_row

MODES = (("none", 1), ("full", 1), ("mlp", 1), ("selective", 1), ("full", 2))
#: Relative loss difference allowed against no recomputation (see the module docstring).
STEP1_RTOL, STEP2_RTOL = 1e-6, 5e-3
LAYOUTS = {  # conf/parallel's options, resolved for the world size by ParallelDims
    "fsdp": dict(name="fsdp", dp_replicate=1, dp_shard=-1, tp=1),
    "hsdp": dict(name="hsdp", dp_replicate=2, dp_shard=-1, tp=1),
    "fsdp_tp": dict(name="fsdp_tp", dp_replicate=1, dp_shard=-1, tp=2),
    "hsdp_tp": dict(name="hsdp_tp", dp_replicate=2, dp_shard=-1, tp=2),
}


def model_config(cpu: bool = False):
    from model.config import ModelConfig

    if cpu:  # the same depth, CPU-sized widths
        return ModelConfig(
            name="ac-layouts-cpu",
            dim=64,
            n_layers=4,
            n_heads=4,
            n_kv_heads=2,
            ffn_dim=128,
            vocab_size=256,
            max_seq_len=32,
        )
    # Every width a multiple of 128 per TP rank (FP8 GEMMs, 128x128 blocks), 4 blocks so that
    # a resharding block sits between the first and the last (which never reshards).
    return ModelConfig(
        name="ac-layouts",
        dim=512,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=1536,
        vocab_size=1024,
        max_seq_len=256,
    )


def layout_dims(layout: str, device_type: str = "cuda"):
    """The layout's ParallelDims with its mesh (built once per layout: each mesh makes new
    process groups)."""
    from parallel import ParallelConfig, ParallelDims

    dims = ParallelDims(ParallelConfig(**LAYOUTS[layout]), int(os.environ["WORLD_SIZE"]))
    dims.build_mesh(device_type)
    return dims


def run_case(dims, recipe_name: str, qinit: bool, mode: str, every: int, cpu: bool = False) -> dict:
    from dataclasses import replace

    import torch

    from optim import OptimConfig, build_optimizer
    from recipes import build_recipe
    from recipes.config import RecipeConfig
    from steps import train_step
    from train import build_parallel_model

    cfg = model_config(cpu)
    impl = "torch" if cpu else "te"
    recipe = build_recipe(
        RecipeConfig(name=recipe_name, quantized_init=qinit, bf16_layers=[]), cfg.n_layers
    )
    dims.cfg = replace(
        dims.cfg, activation_checkpointing=mode, activation_checkpointing_every=every
    )
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    model, group = build_parallel_model(cfg, impl, recipe, dims, device, seed=5)
    opt = build_optimizer(model, OptimConfig(lr=1e-3), impl, recipe.fused_adam_kwargs())
    recipe.attach_optimizer(model, opt, group)
    # The same tokens on every rank of a data-parallel group; different groups, different rows.
    g = torch.Generator(device=device).manual_seed(11 + dims.dp_rank)
    shape = (2, 2, cfg.max_seq_len + 1)
    tokens = torch.randint(0, cfg.vocab_size, shape, device=device, generator=g)
    autocast = None if cpu else torch.autocast("cuda", dtype=torch.bfloat16)
    losses = []
    for step in range(2):
        loss, _ = train_step(
            model, opt, tokens[step, :, :-1], tokens[step, :, 1:], autocast=autocast
        )
        if dims.loss_group is not None:
            torch.distributed.all_reduce(loss, group=dims.loss_group)
            loss /= dims.loss_size
        losses.append(loss.item())
    del model, opt
    gc.collect()
    if cpu:
        return dict(loss1=losses[0], loss2=losses[1], peak_gib=0.0)
    torch.cuda.empty_cache()
    return dict(
        loss1=losses[0], loss2=losses[1], peak_gib=torch.cuda.max_memory_allocated() / 2**30
    )


@contextmanager
def te_own_pre_all_gather():
    """TE's Float8Tensor FSDP2 hook without compat's wrapper, for the length of the block."""
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

    from compat.te import unpatched_pre_all_gather

    wrapped = Float8Tensor.fsdp_pre_all_gather
    Float8Tensor.fsdp_pre_all_gather = unpatched_pre_all_gather(Float8Tensor)
    try:
        yield
    finally:
        Float8Tensor.fsdp_pre_all_gather = wrapped


def gap_row(dims) -> dict:
    row = dict(case="gap: fsdp fp8_cs+q selective, TE's own hook", expect="TE error")
    try:
        with te_own_pre_all_gather():
            run_case(dims, "fp8_cs", True, "selective", 1)
    except RuntimeError as e:
        row["got"] = str(e).splitlines()[0]
        row["ok"] = "Cannot generate FP8 data" in str(e)
        return row
    row["got"] = "trained: TE no longer has the gap (compat's fix can go)"
    row["ok"] = False
    return row


def compare(row: dict, ref: dict | None) -> dict:
    if ref is None or "error" in ref or "error" in row:
        return dict(row, ok="error" not in row and row["mode"] == "none")
    d1 = abs(row["loss1"] - ref["loss1"]) / abs(ref["loss1"])
    d2 = abs(row["loss2"] - ref["loss2"]) / abs(ref["loss2"])
    return dict(row, rel1=d1, rel2=d2, ok=d1 <= STEP1_RTOL and d2 <= STEP2_RTOL)


def table(rows: list[dict]) -> str:
    out = [
        "| layout | recipe | recompute | loss 1 | loss 2 | vs none: step 1, step 2 | peak GiB | ok |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "case" in r:
            out.append(
                f"| {r['case']} | | | | | {r['got'][:90]} | | {'yes' if r['ok'] else 'NO'} |"
            )
            continue
        lead = f"| {r['layout']} | {r['recipe']} | {r['mode']} |"
        if "error" in r:
            out.append(f"{lead} FAILED: {r['error'][:100]} | | | | NO |")
            continue
        rel = f"{r['rel1']:.1e}, {r['rel2']:.1e}" if "rel1" in r else "(reference)"
        out.append(
            f"{lead} {r['loss1']:.6f} | {r['loss2']:.6f} | {rel} | {r['peak_gib']:.2f} |"
            f" {'yes' if r['ok'] else 'NO'} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", nargs="+", default=["fsdp", "hsdp", "fsdp_tp"])
    ap.add_argument("--recipes", nargs="+", default=sorted({v[0] for v in VARIANTS}))
    ap.add_argument("--no-gap", action="store_true", help="skip the TE-alone row")
    ap.add_argument("--jsonl", default=None)
    ap.add_argument(
        "--cpu",
        action="store_true",
        help="reference model over gloo on the CPU, bf16 only (a check of the harness)",
    )
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    import compat
    from recipes import runnable_recipes
    from recipes.recipe import device_capability

    # A process group that is already there is used and kept (tests/test_harness_smoke.py
    # runs main() in its gloo ranks).
    joined = dist.is_initialized()
    if args.cpu:
        if not joined:
            dist.init_process_group("gloo", timeout=timedelta(seconds=180))
        runnable = ["bf16"]
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if not joined:
            dist.init_process_group("nccl", timeout=timedelta(seconds=180))
        _, capability = device_capability(torch.device("cuda"))
        runnable = runnable_recipes(capability)
    compat.apply_all()  # what train.py does before building a model
    rank = dist.get_rank()
    rows = []

    def emit(row: dict) -> None:
        emit_row(rows, row, rank, args.jsonl)

    if not args.no_gap and "fp8_cs" in runnable:
        emit(gap_row(layout_dims("fsdp")))
    for layout in args.layouts:
        dims = layout_dims(layout, "cpu" if args.cpu else "cuda")
        for recipe, qinit in VARIANTS:
            if recipe not in args.recipes or recipe not in runnable:
                continue
            ref = None
            for mode, every in MODES:
                key = dict(
                    layout=layout,
                    recipe=recipe + (" +q" if qinit else ""),
                    mode=mode + (f" /{every}" if every > 1 else ""),
                )
                try:
                    row = dict(key, **run_case(dims, recipe, qinit, mode, every, args.cpu))
                except Exception as e:  # raised on every rank alike (TE, torch): next case
                    if rank == 0:
                        traceback.print_exc()
                    first = str(e).splitlines()[0] if str(e) else ""
                    row = dict(key, error=f"{type(e).__name__}: {first}")
                row = compare(row, ref)
                if mode == "none":
                    ref = row
                emit(row)
                dist.barrier()
    ok = bool(rows) and all(r["ok"] for r in rows)
    if rank == 0:
        passed = sum(bool(r["ok"]) for r in rows)
        print("\n" + table(rows))
        print(f"\nac_layouts: {passed} passed, {len(rows) - passed} failed")
    if not joined:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
