"""torchtitan's training log -> this repo's metrics.jsonl, for tools/compare_runs.py.

    python tools/tt_metrics.py tt.log tt.jsonl
    python tools/tt_metrics.py tt.log tt.jsonl --tokens-per-step 32768 --world-size 2 \
        --lr 3e-4 --warmup-steps 30 --total-steps 300 --decay-type cosine --min-lr-factor 0.1
    python tools/compare_runs.py tt.jsonl runs/ours --peer-bounds --plot cmp.png --smooth 20

torchtitan v0.2.2 (its metrics logger) prints one line per log step through
Python logging, in colour unless `metrics.disable_color_printing`:

    [titan] 2026-11-27 10:00:01,234 - root - INFO - step:  5  loss:  9.87654  grad_norm:  1.2345
        memory: 21.34GiB(26.97%)  tps: 12,345  tflops: 98.76  mfu: 9.99%

(one line; torchrun's `--tee 3 --role rank` puts `[rank0]:` in front). Each step line becomes
one record of the fields this repo's train.py writes, where they mean the same thing:

| torchtitan | record | note |
| --- | --- | --- |
| step | step | |
| loss (global mean over the tokens of the step) | loss | |
| grad_norm (before clipping) | grad_norm | |
| tps (tokens/s per GPU) | tokens_per_s_per_device | x `--world-size`: tokens_per_s, and step_time_s with `--tokens-per-step` |
| memory (peak *reserved* GiB) | mem_reserved_gb | not mem_gb, which is peak *allocated* |
| tflops | tflops | |
| mfu (%) | mfu (a fraction) | torchtitan's FLOP count and peak |

It prints neither the learning rate nor the tokens seen. `--tokens-per-step` (global batch x
sequence length) gives tokens_seen = step x that; `--lr` with the schedule flags gives lr
from torchtitan's warmup-stable-decay formula (its LR scheduler),
restated in `tt_lr_factor` below, and recorded as this repo records it: the learning rate in
force *after* the step (the next step's), so the two runs' lr columns compare like with like.

Validation lines (`validate step:`) are skipped. Where more than one rank printed a step, the
first line for it is kept (`--rank N`: only lines prefixed `[...N]:`). Exit status 2 when the
log holds no step line.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

#: Colour codes of torchtitan's `Color` class, e.g. "\x1b[38;2;180;60;0m".
ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: torchrun's prefix of a rank's line under --tee: "[rank0]:", "[default1]:".
RANK_PREFIX = re.compile(r"^\[[A-Za-z_]*(\d+)\]:")
NUMBER = r"[-+]?(?:\d[\d,]*\.?\d*(?:[eE][-+]?\d+)?|nan|inf)"
STEP_LINE = re.compile(
    rf"(?<!validate )step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>{NUMBER})"
    rf"(?:\s+grad_norm:\s*(?P<grad_norm>{NUMBER}))?"
    rf"(?:\s+memory:\s*(?P<memory>{NUMBER})GiB(?:\((?P<memory_pct>{NUMBER})%\))?)?"
    rf"(?:\s+tps:\s*(?P<tps>{NUMBER}))?"
    rf"(?:\s+tflops:\s*(?P<tflops>{NUMBER}))?"
    rf"(?:\s+mfu:\s*(?P<mfu>{NUMBER})%)?"
)
DECAY_TYPES = ("linear", "sqrt", "cosine")


def _number(text: str | None) -> float | None:
    return None if text is None else float(text.replace(",", ""))


def parse_log(text: str, rank: int | None = None) -> list[dict]:
    """The step lines of a torchtitan log as dicts (step, loss, grad_norm, memory_gib,
    memory_pct, tps, tflops, mfu_pct; a field the line lacks is absent), one per step, in
    step order. rank: keep only lines of that torchrun rank prefix."""
    by_step: dict[int, dict] = {}
    for raw in text.splitlines():
        line = ANSI.sub("", raw)
        prefix = RANK_PREFIX.match(line)
        if rank is not None and (prefix is None or int(prefix.group(1)) != rank):
            continue
        m = STEP_LINE.search(line)
        if m is None:
            continue
        step = int(m["step"])
        if step in by_step:
            continue
        rec = {"step": step, "loss": float(m["loss"])}
        for key, group in (
            ("grad_norm", "grad_norm"),
            ("memory_gib", "memory"),
            ("memory_pct", "memory_pct"),
            ("tps", "tps"),
            ("tflops", "tflops"),
            ("mfu_pct", "mfu"),
        ):
            value = _number(m[group])
            if value is not None:
                rec[key] = value
        by_step[step] = rec
    return [by_step[s] for s in sorted(by_step)]


def tt_lr_factor(
    steps_done: int,
    *,
    warmup_steps: int,
    total_steps: int,
    decay_ratio: float | None = None,
    decay_type: str = "linear",
    min_lr_factor: float = 0.0,
) -> float:
    """torchtitan v0.2.2's learning-rate multiplier after `steps_done` scheduler steps
    (LambdaLR's count; step s of training runs at steps_done = s - 1).

    Warmup: linear, (steps_done + 1) / warmup for steps_done < warmup. Then `stable` steps at
    1, where stable = total + 1 - warmup - decay and decay = total - warmup, or
    round(total x decay_ratio) when given (cut so warmup + decay <= total). Then the decay:
    progress = (steps_done + 1 - warmup - stable) / decay, shaped linear (1 - p), sqrt
    (1 - sqrt p) or cosine ((1 + cos(pi p)) / 2), rescaled to [min_lr_factor, 1]. A warmup
    longer than total is cut to total, as torchtitan does."""
    if decay_type not in DECAY_TYPES:
        raise ValueError(f"decay_type {decay_type!r} is not one of {', '.join(DECAY_TYPES)}")
    warmup = min(int(warmup_steps), total_steps)
    if decay_ratio is None:
        decay = total_steps - warmup
    else:
        decay = min(round(total_steps * decay_ratio), total_steps - warmup)
    stable = total_steps + 1 - warmup - decay
    if steps_done < warmup:
        return (steps_done + 1) / warmup
    if steps_done < warmup + stable:
        return 1.0
    progress = (steps_done + 1 - warmup - stable) / decay
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def to_records(
    parsed: Iterable[dict],
    *,
    tokens_per_step: int | None = None,
    world_size: int | None = None,
    lr: float | None = None,
    schedule: dict | None = None,
) -> list[dict]:
    """parse_log's dicts as metrics.jsonl records (module docstring). lr with schedule (the
    keyword arguments of tt_lr_factor) adds lr; tokens_per_step adds tokens_seen; world_size
    adds tokens_per_s (and step_time_s with tokens_per_step)."""
    records = []
    for p in parsed:
        step = p["step"]
        rec: dict = {"step": step, "loss": p["loss"]}
        if "grad_norm" in p:
            rec["grad_norm"] = p["grad_norm"]
        if lr is not None:
            rec["lr"] = lr * tt_lr_factor(step, **(schedule or {}))
        if tokens_per_step is not None:
            rec["tokens_seen"] = step * tokens_per_step
        tps = p.get("tps")
        if tps is not None:
            rec["tokens_per_s_per_device"] = tps
            if world_size is not None:
                rec["tokens_per_s"] = tps * world_size
                if tokens_per_step is not None and tps > 0:
                    rec["step_time_s"] = tokens_per_step / (tps * world_size)
        if "memory_gib" in p:
            rec["mem_reserved_gb"] = p["memory_gib"]
        if "tflops" in p:
            rec["tflops"] = p["tflops"]
        if "mfu_pct" in p:
            rec["mfu"] = p["mfu_pct"] / 100
        records.append(rec)
    return records


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Convert torchtitan's training log into a metrics.jsonl file.",
        epilog="exit status: 0 written, 2 bad input (no step line, bad options)",
    )
    parser.add_argument("log", help="torchtitan's console output (stdout and stderr)")
    parser.add_argument("out", help="metrics.jsonl to write (replaced)")
    parser.add_argument("--rank", type=int, help="only the lines of this torchrun rank prefix")
    parser.add_argument(
        "--tokens-per-step", type=int, help="global batch x sequence length: adds tokens_seen"
    )
    parser.add_argument(
        "--world-size", type=int, help="GPUs of the run: adds tokens_per_s (tps x world size)"
    )
    parser.add_argument("--lr", type=float, help="optimizer.lr: adds lr from the schedule")
    parser.add_argument("--warmup-steps", type=int, default=200, help="lr_scheduler.warmup_steps")
    parser.add_argument(
        "--total-steps", type=int, help="lr_scheduler.total_steps or training.steps (with --lr)"
    )
    parser.add_argument("--decay-ratio", type=float, help="lr_scheduler.decay_ratio")
    parser.add_argument(
        "--decay-type", choices=DECAY_TYPES, default="linear", help="lr_scheduler.decay_type"
    )
    parser.add_argument(
        "--min-lr-factor", type=float, default=0.0, help="lr_scheduler.min_lr_factor"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.lr is not None and args.total_steps is None:
        print("error: --lr needs --total-steps (training.steps)", file=sys.stderr)
        return 2
    path = Path(args.log)
    if not path.is_file():
        print(f"error: {path}: no such file", file=sys.stderr)
        return 2
    parsed = parse_log(path.read_text(errors="replace"), rank=args.rank)
    if not parsed:
        print(f"error: {path}: no torchtitan step line in it", file=sys.stderr)
        return 2
    schedule = dict(
        warmup_steps=args.warmup_steps,
        total_steps=args.total_steps,
        decay_ratio=args.decay_ratio,
        decay_type=args.decay_type,
        min_lr_factor=args.min_lr_factor,
    )
    records = to_records(
        parsed,
        tokens_per_step=args.tokens_per_step,
        world_size=args.world_size,
        lr=args.lr,
        schedule=schedule,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"wrote {out}: {len(records)} steps ({records[0]['step']}..{records[-1]['step']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
