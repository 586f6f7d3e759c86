"""Step time of CPU runs by thread count, on an idle machine and with cores kept busy.

    python tools/bench_threads.py                          # threads 1,2,4,...,cores; load 0 and cores
    python tools/bench_threads.py --threads 1,2 --busy 0,2,4 --steps 30
    python tools/bench_threads.py --nproc 2 --threads 1,2  # per process under torchrun
    python tools/bench_threads.py --synthetic              # the same model and step, random tokens

Each case runs train.py (the default run: model=tiny, 16 x 256 tokens a step, checkpoint=none)
with OMP_NUM_THREADS=N in a fresh run directory, while `--busy` pure-Python busy loops keep that
many cores occupied (the "loaded machine": other jobs on shared cores), and prints the mean
step time of the logged steps after the first log step (warm-up excluded) and the loss at the
last step (thread counts must not change it). The host's load average before each case is
printed with it. `--synthetic` times the same model (model=tiny, the reference implementation)
and the same step (forward with loss, backward, clipping, AdamW) on random tokens in a plain
loop that needs only torch (for machines without the config and data dependencies). runtime.cpu_threads picks the default thread count from these measurements
(docs/PERFORMANCE.md, CPU threads).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime import launch  # noqa: E402
from tools import benchlib  # noqa: E402


def _spin() -> None:
    while True:
        pass


def synthetic_steps(steps: int) -> None:
    """`--inner`: the default run's model and step on random tokens; prints seconds per step of
    the steps after the first 10, and the last loss."""
    import torch

    from model import build_model, init_weights
    from model.config import ModelConfig

    cfg = ModelConfig(
        name="tiny", dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=258
    )  # conf/model/tiny.yaml
    model = build_model(cfg, "torch")
    init_weights(model, cfg, 1234)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    warm = min(10, steps - 1)
    for step in range(steps):
        if step == warm:
            start = time.perf_counter()
        batch = torch.randint(0, 258, (16, 257), generator=g)
        loss = model(batch[:, :-1], labels=batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    per_step = (time.perf_counter() - start) / (steps - warm)
    print(f"{per_step} {loss.item()} {torch.get_num_threads()}")


def case(threads: int, busy: int, steps: int, nproc: int, root: Path, synthetic=False) -> dict:
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(busy)]
    for p in spinners:
        p.start()
    try:
        time.sleep(1.0 if busy else 0.0)
        load = os.getloadavg()[0]
        name = f"t{threads}-b{busy}-n{nproc}-{time.monotonic_ns()}"
        env = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(threads)}
        if synthetic:
            r = launch([str(steps)], env=env, program=(__file__, "--inner"))
            if r.returncode != 0:
                raise SystemExit(f"{name} failed:\n{r.stderr[-2000:]}")
            step_s, loss, _ = r.stdout.split()
            return dict(
                threads=threads,
                busy=busy,
                nproc=1,
                load=load,
                step_s=float(step_s),
                loss=float(loss),
            )
        args = [f"run.root={root}", f"run.name={name}", f"train.steps={steps}"]
        args += ["checkpoint=none", "train.log_every=10"]
        r = benchlib.run_case(args, run_dir=root / name, nproc=nproc, env=env)
        if not r.ok:
            raise SystemExit(f"{name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        records = r.records
        times = [rec["step_time_s"] for rec in records[1:]] or [records[0]["step_time_s"]]
        return dict(
            threads=threads,
            busy=busy,
            nproc=nproc,
            load=load,
            step_s=sum(times) / len(times),
            loss=records[-1]["loss"],
        )
    finally:
        for p in spinners:
            p.kill()
            p.join()


def main(argv: list[str] | None = None) -> None:
    cores = os.cpu_count() or 1
    counts = sorted({1, 2, 4, 8, cores} & set(range(1, cores + 1)))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default=",".join(map(str, counts)))
    ap.add_argument("--busy", default=f"0,{cores}", help="busy cores per case, comma-separated")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--synthetic", action="store_true")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args(argv)
    if args.inner:
        return synthetic_steps(int(rest[0]))
    print(f"cores: {cores} (os.cpu_count), usable: {len(os.sched_getaffinity(0))}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for busy in map(int, args.busy.split(",")):
            for threads in map(int, args.threads.split(",")):
                r = case(threads, busy, args.steps, args.nproc, Path(tmp), args.synthetic)
                print(
                    f"nproc {r['nproc']} threads {r['threads']:>2} busy cores {r['busy']:>2} "
                    f"(load {r['load']:.2f}): {r['step_s']:.3f} s/step, step {args.steps} loss "
                    f"{r['loss']:.4f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
