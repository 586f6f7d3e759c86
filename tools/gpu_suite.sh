#!/usr/bin/env bash
# GPU suite: run on a machine with CUDA + TransformerEngine, from the repository root.
#
#   bash tools/gpu_suite.sh single        # 1 GPU: tests, recipes, resume, save (the stages below)
#   bash tools/gpu_suite.sh tests recipes # any of: tests recipes resume save
#   bash tools/gpu_suite.sh multi         # 2-4 GPUs: layout parity (bf16, fp8_cs), FP8 all-gather, 4 -> 2 resume
#
# Logs and JSON go to $OUT (default: ./gpu-suite-out). Each stage prints its table last.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-gpu-suite-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
status=0

# shellcheck disable=SC2329  # stages are called by name from the loop below
stage() { echo; echo "=== $1 ==="; }

tests() {
    stage "gpu tests (1 GPU)"
    "$PY" -m pytest -m gpu tests -q -p no:cacheprovider -s 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 || status=1
}

recipes() {
    stage "recipes: small model, 200 steps, embedded data"
    "$PY" tools/bench_recipes.py --steps 200 --out "$OUT/bench_recipes.json" 2>&1 \
        | tee "$OUT/bench_recipes.log" | grep -v '^{' || status=1
}

resume() {
    stage "resume parity per recipe (tiny model; one process per recipe, in parallel)"
    local pids=()
    for r in bf16 fp8_delayed fp8_cs fp8_block; do
        "$PY" tools/resume_check.py --steps 20 --recipes "$r" --quantized-init both \
            --modes sync async -- model=tiny train.global_batch_size=16 \
            > "$OUT/resume_$r.log" 2>&1 &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || status=1; done
    echo "| case | resumed | steps compared | max abs loss diff | bitwise |"
    echo "|---|---|---|---|---|"
    grep -h '^| [a-z]' "$OUT"/resume_*.log | grep -v '^| case'
}

save() {
    stage "checkpoint blocking time: small model, sync vs async"
    for mode in sync async; do
        "$PY" train.py model=small checkpoint="$mode" checkpoint.interval=10 train.steps=30 \
            train.log_every=10 train.global_batch_size=32 data.seq_len=1024 \
            run.root=/tmp/gpu-suite run.name="save-$mode" checkpoint.resume=none > "$OUT/save_$mode.log" 2>&1 || status=1
        grep -h "saved (" "$OUT/save_$mode.log" | tail -3
    done
}

# shellcheck disable=SC2329
multi() {
    stage "layout parity vs 1 GPU ($NGPU GPUs)"
    for n in 2 4; do
        [[ $n -le $NGPU ]] || continue
        torchrun --standalone --nproc_per_node="$n" tools/gpu_parallel_check.py --json "$OUT/parallel_$n.json" \
            2>&1 | tee "$OUT/parallel_$n.log" | tail -25 || status=1
    done
    if [[ $NGPU -ge 4 ]]; then
        stage "save on 4 GPUs (fsdp), resume on 2 (fsdp)"
        "$PY" tools/resume_check.py --steps 20 --nproc 4 --resume-nproc 2 --recipes bf16 fp8_cs \
            --modes async -- model=small train.global_batch_size=16 data.seq_len=512 \
            2>&1 | tee "$OUT/reshard.log" | tail -8 || status=1
    fi
}

[[ $# -gt 0 ]] || set -- single
for what in "$@"; do
    case "$what" in
        single) tests; recipes; resume; save ;;
        tests|recipes|resume|save|multi) "$what" ;;
        *) echo "usage: $0 single|multi|tests|recipes|resume|save ..." >&2; exit 2 ;;
    esac
done
exit $status
