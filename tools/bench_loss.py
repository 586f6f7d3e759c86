"""Time and peak memory of the loss: today's full-logits formula vs model/loss.py's chunked one.

    python tools/bench_loss.py                                  # small CPU-sized shapes
    python tools/bench_loss.py --llama3-1b                      # 32768 x 2048 x 128256 (a GPU)
    python tools/bench_loss.py --tokens 8192 --dim 4096 --vocab 128256 --chunk-tokens 1024

Each variant runs forward + backward of the head and the loss (hidden -> logits -> loss, and
the gradients of hidden and of the head weight) on the current device: CUDA if present, else
CPU. On CUDA the head runs under torch.autocast(bf16) with an fp32 weight and a bf16 hidden, as
in train.py; on CPU in fp32 (or bf16 CPU autocast with --bf16). Peak memory is what the step
allocates above what was allocated before it (inputs, weight and their existing gradients
excluded): torch.cuda.max_memory_allocated on CUDA, the profiler's memory events on CPU (a
separate, untimed run). The two variants' losses and gradients are compared at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.loss import (  # noqa: E402
    cross_entropy_reference,
    default_chunk_tokens,
    fused_linear_cross_entropy,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048, help="tokens (micro batch x seq)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--vocab", type=int, default=16000, help="real vocabulary")
    p.add_argument("--pad-multiple", type=int, default=128, help="head rows padded to this")
    p.add_argument("--llama3-1b", action="store_true", help="32768 tokens x 2048 x 128256")
    p.add_argument("--chunk-tokens", type=int, default=None, help="default: model/loss.py's")
    p.add_argument("--ignore-frac", type=float, default=0.05, help="labels set to ignore_index")
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast on CPU too")
    p.add_argument("--only", choices=["reference", "fused"], default=None)
    args = p.parse_args(argv)
    if args.llama3_1b:
        args.tokens, args.dim, args.vocab = 32768, 2048, 128256
    return args


def make_inputs(args, device):
    padded = -(-args.vocab // args.pad_multiple) * args.pad_multiple
    g = torch.Generator(device=device).manual_seed(0)
    hidden_dtype = torch.bfloat16 if device.type == "cuda" or args.bf16 else torch.float32
    hidden = torch.randn(args.tokens, args.dim, device=device, generator=g).to(hidden_dtype)
    weight = torch.randn(padded, args.dim, device=device, generator=g) * (args.dim**-0.5)
    labels = torch.randint(0, args.vocab, (args.tokens,), device=device, generator=g)
    drop = torch.rand(args.tokens, device=device, generator=g) < args.ignore_frac
    labels = labels.masked_fill(drop, -100)
    return hidden.requires_grad_(), weight.requires_grad_(), labels


def step_fn(kind: str, args, hidden, weight, labels, autocast):
    def step():
        hidden.grad = weight.grad = None
        with autocast():
            if kind == "reference":
                logits = F.linear(hidden, weight)
            else:
                loss = fused_linear_cross_entropy(
                    hidden, weight, labels, vocab_size=args.vocab, chunk_tokens=args.chunk_tokens
                )
        if kind == "reference":  # outside autocast, as train.py does
            loss = cross_entropy_reference(logits, labels, args.vocab)
        loss.backward()
        return loss.detach()

    return step


def cpu_peak_bytes(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def measure(step, device, iters: int, warmup: int) -> tuple[float, int, torch.Tensor]:
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        loss = step()
    sync()
    seconds = (time.perf_counter() - t0) / max(iters, 1)
    if cuda:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = step()
        sync()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = cpu_peak_bytes(step)
    return seconds, peak, loss


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bf16 = device.type == "cuda" or args.bf16
    dtype = torch.bfloat16

    def autocast():
        if bf16:
            return torch.autocast(device.type, dtype=dtype)
        return contextlib.nullcontext()

    hidden, weight, labels = make_inputs(args, device)
    chunk = args.chunk_tokens or default_chunk_tokens(args.tokens, weight.shape[0])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"device={name} tokens={args.tokens} dim={args.dim} vocab={args.vocab} "
        f"padded={weight.shape[0]} matmul={'bf16' if bf16 else 'fp32'} chunk_tokens={chunk} "
        f"({-(-args.tokens // chunk)} chunks)"
    )
    full_logits = args.tokens * weight.shape[0]
    print(
        f"for scale: one (tokens, padded vocab) logits tensor is "
        f"{full_logits * 4 / 2**30:.2f} GiB in fp32, {full_logits * 2 / 2**30:.2f} GiB in bf16"
    )
    kinds = [args.only] if args.only else ["reference", "fused"]
    results = {}
    for kind in kinds:
        step = step_fn(kind, args, hidden, weight, labels, autocast)
        seconds, peak, loss = measure(step, device, args.iters, args.warmup)
        results[kind] = (loss, hidden.grad.clone(), weight.grad.clone())
        print(
            f"{kind:>9}: {seconds * 1e3:9.1f} ms/step  peak {peak / 2**30:8.3f} GiB  loss {loss:.6f}"
        )
        hidden.grad = weight.grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if len(results) == 2:
        (l_ref, dh_ref, dw_ref), (l_f, dh_f, dw_f) = results["reference"], results["fused"]

        def rel(a, b):
            return ((a.double() - b.double()).norm() / b.double().norm()).item()

        print(
            f"fused vs reference: loss {abs(l_f - l_ref).item():.2e} abs, "
            f"dhidden {rel(dh_f, dh_ref):.2e} rel, dweight {rel(dw_f, dw_ref):.2e} rel (norm)"
        )


if __name__ == "__main__":
    main()
