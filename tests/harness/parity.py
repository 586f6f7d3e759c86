"""GPU parity of the parallel layouts for the TE implementation (launch with torchrun).

    torchrun --nproc_per_node=4 -m tests.harness.parity              # every layout that fits
    torchrun --nproc_per_node=2 -m tests.harness.parity --layouts fsdp,tp --recipes bf16
    torchrun --nproc_per_node=4 -m tests.harness.parity --json out.json
    torchrun --nproc_per_node=4 -m tests.harness.parity --layouts fsdp+cp2,tp+cp2+docs,tp+docs
    torchrun --nproc_per_node=2 -m tests.harness.parity --cpu --layouts fsdp+cp2+docs   # gloo

(from the repository root; `-m` runs it as a module, which puts the root on sys.path).

For each layout (fsdp, hsdp, ddp, tp, fsdp_tp, hsdp_tp; those whose degrees fit the GPU count)
and recipe (bf16, fp8_cs, fp8_block with quantized weights), trains the same small TE Llama
for --steps AdamW steps on the same global batches as a single-GPU run, exactly the way
train.py does (meta device, parallelize, init_weights, recipe contexts, FusedAdam,
clip_grad_norm), and compares the loss curves. The single-GPU reference runs on every rank,
without a process group, on the same device.

A layout may carry context parallelism and document masking: `NAME[+cpN][+docs]` (`fsdp+cp2`:
parallel=fsdp with parallel.cp=2, dp_shard inferred; `tp+cp2+docs`: cp=2 x tp=2 on 4 GPUs with
document masking). With `+docs` every row holds several documents (EOS tokens at fixed random
places) and both the layout and the single-GPU reference attend per document (train.py's
BatchLayout: the loader's boundaries, then this rank's context-parallel part); the logged loss
is averaged over the dp x cp ranks as train.py logs it. `--cpu` runs the reference model
(model.impl=torch, bf16 recipe) over gloo on the CPU: a check of these code paths, not of TE.

All-gather check (--gather-recipes, fp8_cs and fp8_block by default): the model is built with
quantized_init, weights quantized on their FSDP/TP shards (amax group from recipes), then FSDP2
all-gathers a block and every FP8 weight must equal the FP8 quantization of the full weight
done on one GPU (same values once dequantized, same scales; for 128x128 blocks, the scales of
the blocks this rank holds). A wrong amax group (shards with their own scales) breaks the
fp8_cs rows; shards gathered in the wrong order (fc1 under TP, sharded along dim 1) or
scales dropped (one-rank shard mesh) break the fp8_block rows.

Prints one table on rank 0; exit status 1 if any row fails.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import compat
from config import compose_config, validate_tp_split
from data.documents import DocumentBoundaries
from errors import ConfigError
from model.config import ModelConfig
from model.init import full_init_value
from optim import OptimConfig, build_optimizer
from parallel import ParallelConfig, ParallelDims
from parallel.cp import token_align
from parallel.dims import GRAD_REDUCE, LAYOUTS
from parallel.fsdp import gathered_units
from parallel.indices import local_global_indices
from recipes import build_recipe
from recipes.config import RecipeConfig
from steps import BatchLayout, train_step  # noqa: E402
from train import build_parallel_model

#: Relative loss tolerance per recipe: every step's |loss - reference| / reference. Layouts
#: change the order of bf16 sums (TP partial sums, reduce-scatter) and FP8 scales are per
#: shard of activations under SP, so the curves agree to rounding, not bitwise.
STEP1_RTOL = {"bf16": 5e-3, "fp8_cs": 1e-2, "fp8_block": 1e-2}
CURVE_RTOL = {"bf16": 2e-2, "fp8_cs": 3e-2, "fp8_block": 3e-2}
SEED = 1234
#: With +docs: the document separator (the last token of the vocabulary) and how many of them
#: each row holds.
EOS_PER_ROW = 3


def parse_layout(spec: str) -> tuple[str, int, bool]:
    """'tp+cp2+docs' -> ('tp', 2, True): conf/parallel option, cp degree, document masking."""
    name, *mods = spec.split("+")
    cp, docs = 1, False
    for m in mods:
        if m == "docs":
            docs = True
        elif m.startswith("cp") and m[2:].isdigit() and int(m[2:]) >= 1:
            cp = int(m[2:])
        else:
            raise ValueError(f"layout {spec!r}: {m!r} is neither cpN nor docs")
    return name, cp, docs


def model_cfg() -> ModelConfig:
    # Every tp-local weight dim and every FSDP shard of one stays a multiple of 128 up to
    # tp=4 or dp_shard=4, so 128x128 FP8 blocks of shards and slices are blocks of the full
    # weight (recipes.check_recipe_layout).
    return ModelConfig(
        name="check",
        dim=512,
        n_layers=2,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=1024,
        vocab_size=1000,
        pad_vocab_multiple=128,
        max_seq_len=256,
    )


def batches(cfg: ModelConfig, steps: int, global_batch: int, seq: int) -> torch.Tensor:
    """Learnable sequences (arithmetic progressions mod vocab with random start and stride), so
    the loss falls steeply and a wrong gradient shows in the curve, not only in step 1."""
    g = torch.Generator().manual_seed(SEED)
    start = torch.randint(0, cfg.vocab_size, (steps, global_batch, 1), generator=g)
    stride = torch.randint(1, 8, (steps, global_batch, 1), generator=g)
    return (start + stride * torch.arange(seq + 1)) % (cfg.vocab_size - 1)


def with_documents(cfg: ModelConfig, data: torch.Tensor) -> torch.Tensor:
    """`data` with EOS_PER_ROW document separators (token vocab_size - 1, which `batches`
    never draws) at random places of every row: several documents per row."""
    g = torch.Generator().manual_seed(SEED + 1)
    out = data.clone()
    steps, rows, length = data.shape
    where = torch.rand(steps, rows, length - 2, generator=g).argsort(-1)[..., :EOS_PER_ROW] + 1
    out.scatter_(-1, where, cfg.vocab_size - 1)
    return out


def boundaries(cfg: ModelConfig) -> DocumentBoundaries:
    return DocumentBoundaries(None, cfg.vocab_size - 1)


def build(cfg, recipe, dims, device):
    """The model exactly as train.py builds it; dims None: the one-GPU reference (no mesh)."""
    impl = "te" if device.type == "cuda" else "torch"
    return build_parallel_model(
        cfg, impl, recipe, dims or ParallelDims(ParallelConfig(), 1), device, SEED
    )


def name_of(spec: str) -> str:
    return spec.partition("+")[0]


def recipe_config(spec: str) -> RecipeConfig:
    """'fp8_cs' or 'fp8_cs+q' (quantized_init)."""
    return RecipeConfig(name=name_of(spec), quantized_init=spec.endswith("+q"))


def train_curve(
    cfg, spec, dims, device, data, lr, docs: bool = False, grad_accum: int = 1
) -> list[float]:
    """Loss per step of `data`'s global batches; `docs`: attention per document. The rows go
    through train.py's BatchLayout (document boundaries, this rank's context-parallel part).
    `grad_accum`: micro batches per step, with the layout's grad_reduce and its FSDP2 units
    held gathered through them, as train.py runs them."""
    recipe = build_recipe(recipe_config(spec), cfg.n_layers)
    model, group = build(cfg, recipe, dims, device)
    impl = "te" if device.type == "cuda" else "torch"
    opt = build_optimizer(
        model, OptimConfig(lr=lr, weight_decay=0.1), impl, recipe.fused_adam_kwargs()
    )
    recipe.attach_optimizer(model, opt, group)
    dp_rank, dp_size = (dims.dp_rank, dims.dp_size) if dims is not None else (0, 1)
    found = boundaries(cfg) if docs else None
    if dims is not None and dims.cp > 1:
        layout = BatchLayout(
            found,
            cp=dims.cp,
            cp_rank=dims.cp_rank,
            cp_group=dims.cp_group,
            align=token_align(impl, dims.tp),
        )
    else:
        layout = BatchLayout(found)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None
    per_rank = data.shape[1] // dp_size
    losses = []
    for step in range(data.shape[0]):
        inputs, labels, documents = layout(
            data[step, dp_rank * per_rank : (dp_rank + 1) * per_rank]
        )
        logged, _ = train_step(
            model,
            opt,
            inputs.to(device),
            labels.to(device),
            grad_accum=grad_accum,
            grad_clip=1.0,
            autocast=autocast,
            documents=documents,
            reduce_each_micro_batch=dims is None or dims.cfg.grad_reduce == "micro_batch",
            hold_gathered=() if dims is None else gathered_units(model, dims.cfg),
        )
        if dims is not None and dims.loss_group is not None:  # dp x cp, as train.py logs
            dist.all_reduce(logged, group=dims.loss_group)
            logged = logged / dims.loss_size
        losses.append(logged.item())
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return losses


def _module_weight_quantizer(module, pname):
    index = module.param_init_meta[pname].fp8_meta_index
    return module.quantizers["scaling_fwd"][index]


def _scales(t: torch.Tensor, rows, cols) -> torch.Tensor:
    """The scales that describe `t`'s values, for entries rows x cols of the full weight:
    per-tensor FP8 has one; 128x128 blocks one per block (padding columns dropped)."""
    if not hasattr(t, "_rowwise_scale_inv"):
        return t._scale_inv.float().reshape(-1)
    scale = t._rowwise_scale_inv.float()
    return scale[rows[::128] // 128][:, cols[::128] // 128]


def _compare_weight(cfg, module, mod_name, pname, device) -> dict:
    p = getattr(module, pname)  # unsharded: FP8 tensor, or a tp DTensor of one
    is_dt = hasattr(p, "device_mesh")
    local = p._local_tensor if is_dt else p
    full = full_init_value(cfg, f"layers.0.{mod_name}.{pname}", p.shape, SEED, device)
    quantizer = _module_weight_quantizer(module, pname)
    ref_q = quantizer.copy() if hasattr(quantizer, "copy") else copy.copy(quantizer)
    ref_q.internal = False  # a full tensor with dequantize(), not internal storage
    if hasattr(ref_q, "with_amax_reduction"):
        ref_q.with_amax_reduction, ref_q.amax_reduction_group = False, None
    ref_q.set_usage(rowwise=True, columnwise=False)
    ref = ref_q(full)
    want = ref.dequantize(dtype=torch.float32)
    i0, i1 = local_global_indices(p) if is_dt else map(torch.arange, p.shape)
    i0, i1 = i0.to(device), i1.to(device)
    want = want[i0][:, i1]
    got = local.dequantize(dtype=torch.float32) if hasattr(local, "dequantize") else None
    row = {"fp8": got is not None}
    if got is not None:
        if got.shape != want.shape:
            raise RuntimeError(
                f"unsharded local FP8 weight has shape {tuple(got.shape)}, the "
                f"full weight's slice {tuple(want.shape)}"
            )
        row["max_abs_diff"] = (got - want).abs().max().item()
        row["equal"] = bool(torch.equal(got, want))
        here = torch.arange(got.shape[0], device=device), torch.arange(got.shape[1], device=device)
        row["scale_equal"] = bool(torch.equal(_scales(local, *here), _scales(ref, i0, i1)))
    row["ok"] = bool(row.get("equal") and row.get("scale_equal"))
    return row


@torch.no_grad()
def fp8_allgather_check(cfg, dims, device, recipe_name) -> list[dict]:
    """After FSDP2 all-gathers block 0 from its FP8 shards, each FP8 weight equals the FP8
    cast of the full weight on one GPU."""
    recipe = build_recipe(RecipeConfig(name=recipe_name, quantized_init=True), cfg.n_layers)
    model, _ = build(cfg, recipe, dims, device)
    # One forward runs FSDP2's lazy init, which adopts the parameters quantize_weights swapped in.
    tokens = torch.zeros(max(1, dims.tp), 16 * dims.tp, dtype=torch.long, device=device)
    with torch.autocast("cuda", dtype=torch.bfloat16), recipe.autocast():
        model(tokens)
    block = model.layers[0]
    block.unshard()
    rows = []
    for mod_name, pname in (
        ("self_attention.layernorm_qkv", "weight"),
        ("self_attention.proj", "weight"),
        ("layernorm_mlp", "fc1_weight"),
        ("layernorm_mlp", "fc2_weight"),
    ):
        row = {"weight": f"layers.0.{mod_name}.{pname}"}
        try:
            row.update(_compare_weight(cfg, block.get_submodule(mod_name), mod_name, pname, device))
        except Exception as e:  # one weight's failure must not hide the others' results
            row.update(fp8=None, ok=False, error=f"{type(e).__name__}: {e}")
        rows.append(row)
    block.reshard()
    del model
    torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--layouts",
        default=",".join(LAYOUTS),
        help="conf/parallel options, each with optional +cpN (context parallel) and +docs",
    )
    ap.add_argument(
        "--recipes", default="bf16,fp8_cs,fp8_block+q", help="curves to compare; +q: quantized_init"
    )
    ap.add_argument(
        "--gather-recipes",
        default="fp8_cs,fp8_block",
        help="recipes of the all-gather check ('' for none)",
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    # 1e-3: at 3e-3 this tiny model's curves amplify rounding-order differences after ~10
    # steps for any data-parallel layout (also on CPU in fp32), which hides real errors.
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--no-sequence-parallel", action="store_true")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro batches per step")
    ap.add_argument("--grad-reduce", default="micro_batch", choices=GRAD_REDUCE)
    ap.add_argument(
        "--keep-gathered", action="store_true", help="parallel.reshard_after_forward=false"
    )
    ap.add_argument("--json", default=None, help="write the results here (rank 0)")
    ap.add_argument(
        "--cpu",
        action="store_true",
        help="reference model over gloo on the CPU, bf16 only (a check of the harness)",
    )
    args = ap.parse_args(argv)
    specs = [(s, *parse_layout(s)) for s in args.layouts.split(",")]

    # A process group that is already there is used and kept (tests/test_harness_smoke.py runs
    # main() in its gloo ranks).
    joined = dist.is_initialized()
    if args.cpu:
        device = torch.device("cpu")
        if not joined:
            dist.init_process_group("gloo")
        args.recipes, args.gather_recipes = "bf16", ""
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        if not joined:
            dist.init_process_group("nccl", device_id=device)
    compat.apply_all()  # what train.py does before building a model
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = model_cfg()
    data = batches(cfg, args.steps, args.global_batch, args.seq_len)
    doc_data = with_documents(cfg, data)
    recipes = args.recipes.split(",")

    ref_docs = sorted({docs for *_, docs in specs})
    refs = {
        (r, docs): train_curve(
            cfg, r, None, device, doc_data if docs else data, args.lr, docs, args.grad_accum
        )
        for docs in ref_docs
        for r in recipes
    }
    results = {
        "world_size": world,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "curves": [],
        "fp8_allgather": [],
        "reference": {f"{r}{'+docs' if docs else ''}": v for (r, docs), v in refs.items()},
    }
    for name, base, cp, docs in specs:
        pcfg = dataclasses.replace(
            compose_config([f"parallel={base}", f"parallel.cp={cp}"]).parallel,
            sequence_parallel=not args.no_sequence_parallel,
            grad_reduce=args.grad_reduce,
            reshard_after_forward=not args.keep_gathered,
        )
        try:
            dims = ParallelDims(pcfg, world)
            validate_tp_split(cfg, dims.tp)
            dims.validate_seq_len(args.seq_len)
        except ConfigError as e:
            results["curves"].append({"layout": name, "skipped": str(e)})
            continue
        dims.build_mesh(device.type)
        degrees = f"{dims.dp_replicate}x{dims.dp_shard}x{dims.tp}"
        degrees += f"xcp{dims.cp}" if dims.cp > 1 else ""
        for r in recipes:
            row = {"layout": name, "degrees": degrees, "recipe": r}
            ref = refs[(r, docs)]
            t0 = time.time()
            try:
                got = train_curve(
                    cfg, r, dims, device, doc_data if docs else data, args.lr, docs, args.grad_accum
                )
                rel = [abs(a - b) / abs(b) for a, b in zip(got, ref)]
                row.update(
                    losses=got,
                    reference=ref,
                    step1_rel=rel[0],
                    max_rel=max(rel),
                    max_abs=max(abs(a - b) for a, b in zip(got, ref)),
                    ok=rel[0] <= STEP1_RTOL[name_of(r)] and max(rel) <= CURVE_RTOL[name_of(r)],
                )
            except Exception:
                row.update(ok=False, error=traceback.format_exc(limit=3).strip().splitlines()[-1])
                if rank == 0:
                    traceback.print_exc()
            row["seconds"] = round(time.time() - t0, 1)
            results["curves"].append(row)
        # The all-gather check is a property of the weights' sharding: base layouts only.
        for r in filter(None, args.gather_recipes.split(",")) if (cp, docs) == (1, False) else ():
            where = {"layout": name, "degrees": degrees, "recipe": r}
            try:
                for row in fp8_allgather_check(cfg, dims, device, r):
                    results["fp8_allgather"].append({**where, **row})
            except Exception:
                results["fp8_allgather"].append(
                    {
                        **where,
                        "ok": False,
                        "error": traceback.format_exc(limit=3).strip().splitlines()[-1],
                    }
                )
                if rank == 0:
                    traceback.print_exc()
        dist.barrier()

    ok = all(r.get("ok", True) for r in results["curves"] + results["fp8_allgather"])
    if rank == 0:
        print(
            f"\n{world} x {results['gpu']}, {args.steps} steps, global batch "
            f"{args.global_batch} x {args.seq_len} in {args.grad_accum} micro batches "
            f"(grad_reduce={args.grad_reduce}, keep gathered: {args.keep_gathered}), "
            f"tolerances step-1 {STEP1_RTOL}, curve {CURVE_RTOL} (relative)"
        )
        print(
            f"{'layout':13} {'rxsxt':11} {'recipe':11} {'ref loss 1->N':>17} {'loss 1->N':>17} "
            f"{'step1 rel':>9} {'max rel':>9} {'max abs':>9}  status"
        )
        for r in results["curves"]:
            if "skipped" in r:
                print(f"{r['layout']:13} skipped: {r['skipped']}")
                continue
            if "error" in r:
                print(f"{r['layout']:13} {r['degrees']:11} {r['recipe']:11} ERROR {r['error']}")
                continue
            print(
                f"{r['layout']:13} {r['degrees']:11} {r['recipe']:11} "
                f"{r['reference'][0]:8.4f}->{r['reference'][-1]:7.4f} "
                f"{r['losses'][0]:8.4f}->{r['losses'][-1]:7.4f} "
                f"{r['step1_rel']:9.2e} {r['max_rel']:9.2e} {r['max_abs']:9.2e}  "
                f"{'ok' if r['ok'] else 'FAIL'}"
            )
        if results["fp8_allgather"]:
            print(
                "\nFSDP2 all-gather of FP8 shards (quantized_init) vs FP8 cast of the full weight "
                "on one GPU"
            )
            for r in results["fp8_allgather"]:
                if "error" in r:
                    print(
                        f"{r['layout']:9} {r['degrees']:7} {r['recipe']:9} "
                        f"{r.get('weight', ''):44} ERROR {r['error']}"
                    )
                    continue
                print(
                    f"{r['layout']:9} {r['degrees']:7} {r['recipe']:9} {r['weight']:44} "
                    f"fp8={r['fp8']} "
                    f"equal={r.get('equal')} scale_equal={r.get('scale_equal')} "
                    f"max|diff|={r.get('max_abs_diff', float('nan')):.2e}  "
                    f"{'ok' if r['ok'] else 'FAIL'}"
                )
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        print("\nALL OK" if ok else "\nSOME CHECKS FAILED")
    if not joined:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
