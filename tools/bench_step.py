"""Training-step benchmark: tokens/s per GPU, MFU and peak memory for a list of cases.

    python tools/bench_step.py                                        # the default 1-GPU cases
    python tools/bench_step.py --case llama3_1b:fsdp:bf16:none:4 --case llama3_1b:fsdp:fp8_cs:full:4
    torchrun is started for you with --nproc 2:
    python tools/bench_step.py --nproc 2 --case llama3_8b:fsdp:bf16:none:1 --case llama3_8b:fsdp:fp8_cs:mlp:1
    python tools/bench_step.py --case tiny:fsdp:bf16:none:16 --seq 256 --steps 6 --warmup 2   # CPU

A case is `model:layout:recipe:activation_checkpointing:micro_batch[:documents]`, where recipe
may end in `+q` (recipe.quantized_init=true) and activation_checkpointing is none, full, mlp or
selective, optionally with `/N` for every N-th block (`full/2`). `documents` sets the document
lengths: `fixed/N` (every document N tokens), `exp/N` (lengths drawn from a geometric
distribution with mean N), `logn/N` (log-normal, mean N, data.doc_len_sigma 1) or `rows/N`
(every document ceil(N / (seq + 1)) whole rows: no boundary inside a row, long context's
causal-equivalent case), on data=synthetic with document-masked attention, or `causal` (the
same synthetic data, causal attention across documents: data.document_mask=false):

    python tools/bench_step.py --case llama3_1b:fsdp:bf16:none:4:causal \
        --case llama3_1b:fsdp:bf16:none:4:fixed/8192 --case llama3_1b:fsdp:bf16:none:4:exp/2048

Without it a case trains on the embedded data with train.py's default masking. A case may end
in train.py overrides of its own, each after an `@` (they win over the common ones), e.g. the
levers of one recipe side by side:

    python tools/bench_step.py --nproc 2 --global-batch 128 --steps 5 --warmup 2 \
        --case llama3_8b:fsdp:fp8_cs+q:selective:2 \
        --case llama3_8b:fsdp:fp8_cs+q:selective:2@parallel.reduce_dtype=bf16 \
        --case llama3_8b:fsdp:fp8_cs+q:selective:2@train.gc_every=20

Each case runs `train.py` in its own process (or torchrun job) with `checkpoint=none`, global
batch = micro batch x data-parallel size (no accumulation) unless `--global-batch` sets it
(then each step accumulates), `--steps` steps logged every step; the figures
are the medians over the steps after `--warmup` (tokens/s per device and MFU as train.py
reports them: MFU against the GPU's dense bf16 peak, 989 TFLOP/s on H100/H200), and the peak
allocated memory of the run. Prints one markdown table last; `--json` appends one record
per case. `--repo DIR` runs another checkout's train.py (a before/after comparison in one
session); `--profile-steps 10-11` records those steps with torch.profiler (train.py's
`train.profile_steps`) and writes the kernel table, tools/trace_summary.py's breakdown and, on
a GPU, rank 0's memory at the peak of those steps by allocation site next to the JSON.
`--timeout S` stops a case after S seconds: its ranks first print their stacks (train.py's
`kill -USR2`), and its row says the last step it logged and where each rank was; with
`--json`, each case's output is kept beside it (`<json stem>_case<i>.out`, `.err`) as it runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools import benchlib, trace_summary  # noqa: E402

DEFAULT_CASES = [
    "llama3_1b:fsdp:bf16:none:4",
    "llama3_1b:fsdp:fp8_delayed:none:4",
    "llama3_1b:fsdp:fp8_cs:none:4",
    "llama3_1b:fsdp:fp8_cs+q:none:4",
    "llama3_1b:fsdp:fp8_block:none:4",
]


DOC_LENGTHS = {"fixed": "fixed", "exp": "exponential", "logn": "lognormal", "rows": "whole_rows"}


def parse_documents(text: str) -> dict:
    """A case's documents field -> train.py's data settings ({} for the default data)."""
    if not text:
        return {}
    if text == "causal":
        return {"data": "synthetic", "data.document_mask": "false"}
    dist, _, mean = text.partition("/")
    if dist not in DOC_LENGTHS or int(mean) < 2:
        raise ValueError(text)
    return {
        "data": "synthetic",
        "data.document_mask": "true",
        "data.doc_len": mean,
        "data.doc_len_dist": DOC_LENGTHS[dist],
    }


def parse_case(text: str) -> dict:
    head, *extra = text.split("@")
    try:
        if any("=" not in e for e in extra):
            raise ValueError(text)
        model, layout, recipe, ac, mbs, *documents = head.split(":")
        if len(documents) > 1:
            raise ValueError(text)
        mode, _, every = ac.partition("/")
        return dict(
            case=text,
            model=model,
            layout=layout,
            recipe=recipe.removesuffix("+q"),
            quantized_init=recipe.endswith("+q"),
            ac=mode,
            ac_every=int(every or 1),
            mbs=int(mbs),
            documents=documents[0] if documents else "",
            data=parse_documents(documents[0] if documents else ""),
            extra=extra,
        )
    except ValueError:
        raise SystemExit(
            f"--case {text!r}: expected model:layout:recipe[+q]:none|full|mlp|selective[/N]:"
            "micro_batch[:causal|fixed/N|exp/N|logn/N|rows/N][@key=value...]"
        ) from None


def profiled_steps(args) -> list[int]:
    """--profile-steps "10-11" (or "10") as the list of steps."""
    first, _, last = args.profile_steps.partition("-")
    return list(range(int(first), int(last or first) + 1))


def overrides(case: dict, nproc: int, args, run_root: str) -> list[str]:
    out = [
        f"model={case['model']}",
        f"parallel={case['layout']}",
        f"recipe={case['recipe']}",
        f"train.micro_batch_size={case['mbs']}",
        f"train.global_batch_size={args.global_batch or case['mbs'] * nproc}",
        f"data.seq_len={args.seq}",
        f"train.steps={args.steps}",
        "train.log_every=1",
        "checkpoint=none",
        "logger=default",
        f"run.root={run_root}",
        f"run.name=bench{case['index']}",
    ]
    out += [f"{key}={value}" for key, value in case["data"].items()]
    if case["quantized_init"]:
        out.append("recipe.quantized_init=true")
    if case["ac"] != "none":  # older checkouts have no such field: leave it out when off
        out.append(f"parallel.activation_checkpointing={case['ac']}")
        out.append(f"parallel.activation_checkpointing_every={case['ac_every']}")
    if case["layout"] in ("tp", "fsdp_tp", "hsdp_tp"):
        out.append(f"parallel.tp={min(nproc, 2)}")
    if args.profile_steps:
        out.append(f"train.profile_steps=[{','.join(map(str, profiled_steps(args)))}]")
    return out + list(args.overrides) + case["extra"]  # the case's own overrides win


def run_case(case: dict, args, run_root: str) -> dict:
    repo = Path(args.repo).resolve() if args.repo else ROOT
    run_dir = Path(run_root) / f"bench{case['index']}"
    label = f"{args.label}_" if args.label else ""
    # named after the JSON file too: two benchmarks writing beside each other keep their logs
    log = None
    if args.json:
        log = Path(args.json).with_name(f"{Path(args.json).stem}_{label}case{case['index']}")
    ran = benchlib.run_case(
        overrides(case, args.nproc, args, run_root),
        run_dir=run_dir,
        nproc=args.nproc,
        repo=repo,
        timeout=args.timeout,
        log=log,
    )
    records = ran.records
    steady = [r for r in records if r["step"] > args.warmup]
    result = dict(
        case,
        nproc=args.nproc,
        seq=args.seq,
        global_batch=args.global_batch or case["mbs"] * args.nproc,
        wall_s=round(ran.seconds, 1),
        repo=str(repo),
    )
    if not ran.ok or not steady:
        # A run that failed or was stopped says what it did: the line that says why (for one
        # past --timeout, the last step it logged and where each rank was), the steps it
        # logged, and its last lines.
        result["error"] = ran.failure() if not ran.ok else "no step after the warm-up logged"
        result["steps_logged"] = [r["step"] for r in records]
        result["log_tail"] = ran.tail(40)
        return result
    result.update(
        tokens_per_s_per_gpu=statistics.median(r["tokens_per_s_per_device"] for r in steady),
        mfu=statistics.median(r["mfu"] for r in steady) if steady[0].get("mfu") else None,
        peak_gib=max(r["mem_gb"] for r in records),
        # the allocator's cache flushes (runtime.allocator_retries): memory so full it slows
        alloc_retries=max(r.get("alloc_retries") or 0 for r in records),
        loss_last=records[-1]["loss"],
        steps_measured=len(steady),
    )
    for memory in (run_dir / "profile").glob("*_memory.md") if args.json else []:
        shutil.copy(
            memory, Path(args.json).with_name(f"profile_{label}case{case['index']}_{memory.name}")
        )
    for prof in (run_dir / "profile").glob("*.txt") if args.json else []:
        dest = Path(args.json).with_name(f"profile_{label}case{case['index']}_{prof.name}")
        shutil.copy(prof, dest)
        trace = prof.with_suffix(".json")
        try:  # where the step's device time goes (none on a CPU run)
            with open(trace) as f:
                summary = trace_summary.summarize(json.load(f), len(profiled_steps(args)))
        except (OSError, ValueError):
            continue
        dest.with_suffix(".summary.md").write_text(trace_summary.render(summary) + "\n")
    return result


def table(results: list[dict]) -> str:
    docs = any(r.get("documents") for r in results)
    extra = any(r.get("extra") for r in results)
    head = ["model", "layout", "GPUs", "recipe", "act. ckpt", "mbs"]
    head += (["documents"] if docs else []) + (["overrides"] if extra else [])
    head += ["tokens/s/GPU", "MFU", "peak GiB"]
    retries = any(r.get("alloc_retries") for r in results)
    head += ["alloc retries"] if retries else []
    rows = []
    for r in results:
        recipe = r["recipe"] + (" +q" if r["quantized_init"] else "")
        ac = r["ac"] + (f" /{r['ac_every']}" if r["ac_every"] > 1 else "")
        lead = [r["model"], r["layout"], r["nproc"], recipe, ac, r["mbs"]]
        if docs:
            lead.append(r.get("documents") or "default data")
        if extra:
            lead.append(" ".join(r.get("extra") or []) or "-")
        if "error" in r:
            rows.append([*lead, f"FAILED: {str(r['error'])[:300]}", "", ""] + [""] * retries)
            continue
        mfu = benchlib.cell(r["mfu"], "{:.1%}")
        row = [*lead, f"{r['tokens_per_s_per_gpu']:,.0f}", mfu, f"{r['peak_gib']:.1f}"]
        rows.append(row + ([r["alloc_retries"]] if retries else []))
    return benchlib.table(head, rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--case", action="append", help="model:layout:recipe[+q]:ac[/N]:mbs")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument(
        "--global-batch",
        type=int,
        help="sequences per optimizer step (gradient accumulation); default micro batch x ranks",
    )
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--repo", help="run another checkout's train.py (before/after comparisons)")
    p.add_argument("--profile-steps", help="e.g. 10-11: torch.profiler over those steps")
    p.add_argument(
        "--timeout",
        type=float,
        help="seconds a case may run; then its ranks print their stacks, it is stopped, and "
        "its row says the last step it logged and where each rank was",
    )
    p.add_argument("--json", help="append one JSON record per case to this file")
    p.add_argument("--label", default="", help="a name for these cases in the JSON records")
    p.add_argument("overrides", nargs="*", help="extra train.py overrides for every case")
    args = p.parse_args(argv)
    cases = [parse_case(c) for c in (args.case or DEFAULT_CASES)]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_step_") as run_root:
        for i, case in enumerate(cases):
            case["index"] = i
            r = run_case(case, args, run_root)
            r["label"] = args.label
            results.append(r)
            summary = r.get("error") or f"{r['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU"
            print(f"[{i + 1}/{len(cases)}] {case['case']}: {summary} ({r['wall_s']} s)", flush=True)
            if "error" in r:
                print(r["log_tail"], flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps({k: v for k, v in r.items() if k != "log_tail"}) + "\n")
    print()
    print(table(results))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
