"""Recipe x layout x checkpoint-mode matrix: train, save, resume, compare; one torchrun job.

    torchrun --nproc_per_node=4 -m tests.harness.matrix --layout fsdp_tp --jsonl out.jsonl \
        -- model.dim=512 model.ffn_dim=1536                                          # GPU, TE
    torchrun --nproc_per_node=4 -m tests.harness.matrix --layout tp --name tp+cp2 \
        -- parallel.cp=2 model.dim=512 model.ffn_dim=1536                  # cp=2 x tp=2, GPU
    torchrun --nproc_per_node=4 -m tests.harness.matrix --layout hsdp --recipes bf16 \
        --modes sync async async_process -- model.impl=torch data.seq_len=64            # CPU
    python -m tests.harness.matrix --table a.jsonl b.jsonl                      # table only

(from the repository root; `-m` puts it on sys.path). For every recipe variant (bf16, and each
FP8 recipe with and without quantized_init) it runs tests/harness/resume.py's protocol
(`resume_case`) with train.py's `run()` in this process (one process group, TE imported once,
so a case costs seconds): run A trains --steps steps with a checkpoint every steps/2 in the
case's checkpoint mode; run B starts from a copy of A's directory that holds only the middle
checkpoint and resumes it with the same command; the losses after the middle must be bitwise
equal. The checkpoint mode rotates over --modes with the recipe and --layout-index, so a set
of jobs over all layouts covers every recipe and every layout with every mode (--all-modes
runs the full product instead).

Each finished case is appended to --jsonl on rank 0 as it completes (a later case that hangs
or kills the job keeps the earlier rows); `--table a.jsonl b.jsonl ...` prints the table of
several jobs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path

from tests.harness.multitier import emit_row
from tests.harness.resume import case_overrides, format_table, resume_case

VARIANTS = (
    ("bf16", False),
    ("fp8_delayed", False),
    ("fp8_delayed", True),
    ("fp8_cs", False),
    ("fp8_cs", True),
    ("fp8_block", False),
    ("fp8_block", True),
)


def run_in_process(overrides: list[str], label: str) -> str | None:
    """train.run() on the composed config (a resume_case runner): None, or the error."""
    import torch

    import train
    from config import compose_config

    status = train.run(compose_config(overrides))
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return None if status == 0 else f"run {label} exited with status {status}"


def cases(args) -> list[tuple[str, bool, str]]:
    variants = [v for v in VARIANTS if v[0] in args.recipes]
    out = []
    for i, (recipe, qinit) in enumerate(variants):
        modes = (
            args.modes
            if args.all_modes
            else [args.modes[(i + args.layout_index) % len(args.modes)]]
        )
        out += [(recipe, qinit, m) for m in modes]
    return out


def run_case(tmp: Path, recipe: str, qinit: bool, mode: str, args, rank: int) -> dict:
    import torch.distributed as dist

    name, common = case_overrides(
        recipe, qinit, mode, args.steps, tmp, [f"parallel={args.layout}", *args.overrides]
    )
    row = dict(
        layout=args.name or args.layout,
        recipe=recipe,
        quantized_init=qinit,
        mode=mode,
        case=f"{args.name or args.layout}/{name}",
    )
    # Every rank runs A and B; rank 0 copies between them (the others wait) and compares.
    return dict(
        row,
        **resume_case(
            run_in_process, tmp, name, common, args.steps // 2, leader=rank == 0, sync=dist.barrier
        ),
    )


def passed(row: dict) -> bool:
    """Resumed and bitwise, or refused up front by the config check (a documented limit)."""
    return bool(row.get("refused") or (row.get("bitwise") and row.get("resumed")))


def format_rows(rows: list[dict]) -> str:
    return format_table(rows, keys=("layout", "recipe", "quantized_init", "mode"), timing=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", help="conf/parallel option for this job")
    ap.add_argument(
        "--name", default=None, help="the layout's name in the rows (default: --layout)"
    )
    ap.add_argument("--layout-index", type=int, default=0, help="shifts the mode rotation")
    ap.add_argument("--recipes", nargs="+", default=sorted({v[0] for v in VARIANTS}))
    ap.add_argument("--modes", nargs="+", default=["sync", "async", "async_process"])
    ap.add_argument("--all-modes", action="store_true")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--jsonl", default=None)
    ap.add_argument("--table", nargs="+", metavar="JSONL", help="only print the table of these")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.table:
        rows = [
            json.loads(line)
            for f in args.table
            if Path(f).is_file()
            for line in Path(f).read_text().splitlines()
            if line.strip()
        ]
        print(format_rows(rows))
        return 0 if rows and all(passed(r) for r in rows) else 1

    import torch
    import torch.distributed as dist

    from config import ConfigError

    cuda = torch.cuda.is_available() and "model.impl=torch" not in args.overrides
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
    # A rank stuck in a collective (another rank failed asymmetrically) ends the job after
    # the timeout instead of holding the GPUs; finished rows are already on disk.
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=180))
    rank = dist.get_rank()
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as t:
        box = [t]
        dist.broadcast_object_list(box, src=0)  # one directory for all ranks
        tmp = Path(box[0])
        for recipe, qinit, mode in cases(args):
            key = dict(
                layout=args.name or args.layout, recipe=recipe, quantized_init=qinit, mode=mode
            )
            try:
                row = run_case(tmp, recipe, qinit, mode, args, rank)
            except ConfigError as e:  # a combination the config check refuses, by design
                row = dict(key, refused=str(e))
            except Exception as e:  # raised on every rank alike (TE, torch): next case
                if rank == 0:
                    traceback.print_exc()
                first = str(e).splitlines()[0] if str(e) else ""
                row = dict(key, error=f"{type(e).__name__}: {first}")
            emit_row(rows, row, rank, args.jsonl)
            dist.barrier()
    ok = [all(passed(r) for r in rows)]  # rank 0 compares
    dist.broadcast_object_list(ok, src=0)
    if rank == 0:
        print("\n" + format_rows(rows))
    dist.destroy_process_group()
    return 0 if ok[0] else 1


if __name__ == "__main__":
    code = main()
    # DCP's checkpoint process (async_process) can fail the interpreter's teardown after a
    # successful job; every row is written and flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
