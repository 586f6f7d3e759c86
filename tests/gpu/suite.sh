#!/usr/bin/env bash
# GPU suite: run on a machine with CUDA + TransformerEngine (`make gpu-suite` runs `single`).
#
#   bash tests/gpu/suite.sh single        # 1 GPU: tests, recipes, resume, save (the stages below)
#   bash tests/gpu/suite.sh tests recipes # any of: tests recipes resume save
#   bash tests/gpu/suite.sh multi         # 2-4 GPUs: layout parity (bf16, fp8_cs), FP8 all-gather
#   bash tests/gpu/suite.sh ac            # 2 GPUs: every recipe x recomputation mode under fsdp, hsdp, fsdp_tp
#                                         # (small model, 2 steps each, against no recomputation; AC_LAYOUTS="fsdp")
#   bash tests/gpu/suite.sh matrix        # 4 GPUs: every recipe x layout x checkpoint mode, resume bitwise
#                                         # (MATRIX_LAYOUTS="tp fsdp_tp", MATRIX_RECIPES="fp8_cs" for a subset)
#   bash tests/gpu/suite.sh step          # training-step table (tools/bench_step.py): llama3_1b on 1 GPU,
#                                         # llama3_8b FSDP on 2 (STEP_CASES="model:layout:recipe:ac:mbs ..." for others)
#   bash tests/gpu/suite.sh ckpt          # checkpoint benchmark (tools/bench_checkpoint.py): llama3_1b, 1 GPU or 2
#   bash tests/gpu/suite.sh switch        # 1 GPU: recipe switch demonstration (tools/recipe_switch_demo.py)
#   bash tests/gpu/suite.sh determinism   # 1 GPU: train.deterministic, two runs and a resume bitwise per sm_90 recipe
#                                         # (small model test), then tools/bench_determinism.py: llama3_1b seq 8192
#                                         # (DET_RECIPES="bf16 fp8_cs" for a subset)
#   bash tests/gpu/suite.sh cp2           # 2 GPUs: llama3_1b train.py with parallel.cp=2 against cp=1, per recipe, masking
#                                         # and cp_comm_type (CP2_RECIPES="bf16", CP2_COMMS="p2p a2a" for subsets)
#   bash tests/gpu/suite.sh cpseq         # 2 GPUs: tokens/s at seq 32k and 64k with cp=2, then the longest sequence
#                                         # that trains per layout (cp=1 on 1 GPU, fsdp x2, cp=2, cp=2 + full recompute)
#   bash tests/gpu/suite.sh peer8b        # 2 GPUs: llama3_8b FSDP seq 8192 against torchtitan v0.2.2 (compiled bf16
#                                         # and float8) in one call; needs the peer's bundle in .peers/ (docs/PERFORMANCE.md)
#   bash tests/gpu/suite.sh peer128       # 2 or 4 GPUs: llama3_8b FSDP over 2, seq 8192, global batch 128, torchtitan
#                                         # (compiled bf16, float8) beside grad_reduce=step + reduce_dtype=bf16
#                                         # (+ reshard_after_forward=false); two lanes side by side on 4 GPUs
#   bash tests/gpu/suite.sh cp8b          # 4 GPUs: llama3_8b causal, seq 32k with cp=4 and cp=2 x FSDP 2, bf16 and FP8,
#                                         # against torchtitan v0.2.2 (compiled, its context parallelism) in one call,
#                                         # FP8 also with FP8 attention, then 8k tokens per GPU at cp=1/2/4
#                                         # (CP8B_SEQS, CP8B_CPS, CP8B_RECIPES, CP8B_AC, CP8B_FP8_ATTENTION=0|1)
#   bash tests/gpu/suite.sh peercurve     # 1-8 GPUs: this recipe against torchtitan v0.2.2 from the same HF weights
#                                         # (exported once by tools/convert_hf.py), same text, tokenizer and batches:
#                                         # flavor 80M, 300 steps of 32k tokens, PEERCURVE_RUNS=4 runs a side per case,
#                                         # one run per GPU, all within PEERCURVE_BUDGET=460 s; then each case's noise
#                                         # verdict (compare_runs --vs, bound 1%), plot and one table
#                                         # (docs/PEER_CURVE.md); PEERCURVE_CASES="bf16 fp8" (recipe[:seq[:cp]],
#                                         # "bf16:32768:2" for 32k with cp=2), PEERCURVE_DETERMINISTIC=1,
#                                         # PEERCURVE_FLAVOR=1B, PEERCURVE_REFERENCE=ours, PEERCURVE_REUSE=1
#   bash tests/gpu/suite.sh levers        # 2 GPUs: llama3_8b FSDP seq 8192, global batch 128 (accumulation): recipes x
#                                         # recomputation, then one lever at a time (LEVER_CASES="case ..." for a subset)
#   bash tests/gpu/suite.sh scale         # 4 GPUs: small model hsdp 2x2 vs 1 GPU; save on 4, resume on 4 (fsdp_tp) and 2 (fsdp)
#                                         # (SCALE_RECIPES="bf16 fp8_block-q" for others; -q: quantized_init)
#   bash tests/gpu/suite.sh multitier     # 2-4 GPUs, every multi-GPU check in one call, side by side: the gpu tests
#                                         # that need 2+ GPUs, recomputation (ac), layout parity vs 1 GPU incl. cp
#                                         # and documents, the resume matrix (6 layouts + cp=2 x fsdp, cp=2 x tp),
#                                         # resharding 4 -> 2 -> 1 and 1 -> 4 per recipe (+quantized_init), kill -9
#                                         # of a rank mid async save then an exact resume, two nodes on one
#                                         # host (twonode: 2 agents x 2 GPUs vs 1 x 4, hsdp_tp and fsdp_tp,
#                                         # tests/harness/two_node.py); one table last
#                                         # ($OUT/multitier_table.md, logs in $OUT/multitier_logs.tgz). A part
#                                         # that needs more GPUs is "not run"; exit 1 on any failed or not-run row
#                                         # (MULTITIER_ALLOW_NOT_RUN=1: only failures). MULTITIER_PARTS="parity
#                                         # kill9" for a subset, MULTITIER_TIMEOUT=420 s per job, MULTITIER_WAVES
#                                         # the parts run together ("tests,ac,parity,reshard,kill9 matrix
#                                         # twonode": three waves); MULTITIER_DRY=4 prints the commands of 4 GPUs instead
#
# Logs and JSON go to $OUT (default: ./gpu-suite-out). Each stage prints its table last.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2  # the repository root: the harnesses run as modules
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
        "$PY" -m tests.harness.resume --steps 20 --recipes "$r" --quantized-init both \
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
step() {
    local n=1 cases=()
    read -r -a cases <<< "${STEP_CASES:-}"
    if [[ ${#cases[@]} -eq 0 ]]; then
        if [[ $NGPU -ge 2 ]]; then
            n=2
            cases=(llama3_8b:fsdp:bf16:none:1 llama3_8b:fsdp:fp8_delayed:none:1
                   llama3_8b:fsdp:fp8_cs+q:none:1 llama3_8b:fsdp:bf16:selective:1
                   llama3_8b:fsdp:fp8_delayed:selective:1 llama3_8b:fsdp:bf16:full:1
                   llama3_8b:fsdp:fp8_cs:full:1)
        else
            cases=(llama3_1b:fsdp:bf16:none:4 llama3_1b:fsdp:fp8_delayed:none:4
                   llama3_1b:fsdp:fp8_cs:none:4 llama3_1b:fsdp:fp8_cs+q:none:4
                   llama3_1b:fsdp:fp8_block:none:4 llama3_1b:fsdp:bf16:selective:4
                   llama3_1b:fsdp:fp8_delayed:selective:4 llama3_1b:fsdp:bf16:full:4
                   llama3_1b:fsdp:fp8_cs:full:4)
        fi
    fi
    stage "training step, seq 8192, $n GPU(s): tokens/s per GPU, MFU, peak memory"
    local args=()
    for c in "${cases[@]}"; do args+=(--case "$c"); done
    # shellcheck disable=SC2086  # STEP_OVERRIDES are words
    "$PY" tools/bench_step.py --nproc "$n" "${args[@]}" --json "$OUT/bench_step.json" \
        ${STEP_OVERRIDES:-} 2>&1 | tee "$OUT/bench_step.log" | tail -$((${#cases[@]} + 3)) || status=1
}

# shellcheck disable=SC2329
ckpt() {
    # tools/bench_checkpoint.py: sync, async, async_process saves of llama3_1b (seq 8192, mbs 4,
    # 14 GiB per checkpoint) against the D2H and disk ceilings, then the resume of the last
    # mode's checkpoint from a cold page cache against the disk's read rate; on 2 GPUs when there are 2+.
    local n=1 launch=("$PY")
    if [[ $NGPU -ge 2 ]]; then n=2; launch=(torchrun --standalone --nproc_per_node=2); fi
    stage "checkpoint saves, llama3_1b seq 8192, $n GPU(s): blocked and total per save vs ceilings"
    "${launch[@]}" tools/bench_checkpoint.py --root "${CKPT_ROOT:-/tmp/gpu-suite-ckpt}" \
        --steps "${CKPT_STEPS:-30}" --json "$OUT/bench_checkpoint.json" -- model=llama3_1b \
        data.seq_len=8192 train.micro_batch_size=4 train.global_batch_size=$((4 * n)) 2>&1 \
        | tee "$OUT/bench_checkpoint.log" | sed -n '/^per save/,$p' || status=1
}

# shellcheck disable=SC2329
multi() {
    stage "layout parity vs 1 GPU ($NGPU GPUs; 2 and 4 GPUs run side by side)"
    local pids=() n
    for n in 2 4; do
        [[ $n -le $NGPU ]] || continue
        timeout "${MULTI_TIMEOUT:-420}" torchrun --standalone --nproc_per_node="$n" -m tests.harness.parity \
            --json "$OUT/parallel_$n.json" > "$OUT/parallel_$n.log" 2>&1 &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || status=1; done
    for n in 2 4; do
        [[ -f "$OUT/parallel_$n.log" ]] && sed -n '/ x .*steps, global batch/,$p' "$OUT/parallel_$n.log"
    done
}

# shellcheck disable=SC2329
ac() {
    stage "recomputation x recipe on 2 GPUs (fsdp, hsdp, fsdp_tp): trains and matches no recomputation"
    if [[ $NGPU -lt 2 ]]; then echo "ac: not run: needs 2 GPUs, this machine has $NGPU"; status=1; return; fi
    rm -f "$OUT/ac_layouts.jsonl"
    # shellcheck disable=SC2086  # AC_LAYOUTS are words
    CUDA_VISIBLE_DEVICES=${AC_GPUS:-0,1} timeout "${AC_TIMEOUT:-480}" torchrun --standalone --nproc_per_node=2 \
        -m tests.harness.ac_layouts --layouts ${AC_LAYOUTS:-fsdp hsdp fsdp_tp} --jsonl "$OUT/ac_layouts.jsonl" \
        > "$OUT/ac_layouts.log" 2>&1 || status=1
    sed -n '/^| layout/,$p' "$OUT/ac_layouts.log"
}

#: Matrix model: TE-friendly local GEMM sizes up to tp=4 (multiples of 128 for fp8_block).
MATRIX_MODEL=(model=tiny model.dim=512 model.n_heads=8 model.n_kv_heads=4 model.ffn_dim=1536
              data.seq_len=256 train.global_batch_size=8)

# shellcheck disable=SC2329
matrix() {
    stage "recipe x layout x checkpoint mode on $NGPU GPUs: resume bitwise (one job per layout, side by side)"
    local pids=() i=-1 layout
    for layout in ddp fsdp hsdp tp fsdp_tp hsdp_tp; do
        i=$((i + 1))  # the mode rotation follows the position in this list
        [[ " ${MATRIX_LAYOUTS:-ddp fsdp hsdp tp fsdp_tp hsdp_tp} " == *" $layout "* ]] || continue
        rm -f "$OUT/matrix_$layout.jsonl"
        timeout "${MATRIX_TIMEOUT:-420}" torchrun --standalone --nproc_per_node="$NGPU" -m tests.harness.matrix \
            --layout "$layout" --layout-index "$i" --jsonl "$OUT/matrix_$layout.jsonl" \
            ${MATRIX_RECIPES:+--recipes $MATRIX_RECIPES} \
            -- "${MATRIX_MODEL[@]}" > "$OUT/matrix_$layout.log" 2>&1 &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || status=1; done
    "$PY" -m tests.harness.matrix --table "$OUT"/matrix_*.jsonl || status=1
}

# shellcheck disable=SC2329  # called by scale
# One recipe of the scale stage: 1 GPU reference, hsdp 2x2 (saves at 20), fsdp_tp 2x2, and the
# hsdp checkpoint of step 20 resumed on 4 GPUs (fsdp_tp 2x2) and on 2 GPUs (fsdp).
scale_one() {
    local r=$1 gpu=$2 root=$3; shift 3
    # lr 1e-3: at the default 3e-3 the first warmup steps spike (loss 5.9 -> 8.1 at step 3),
    # which amplifies rounding-order differences between layouts.
    local common=(model=small "$@" optim.lr=1e-3 checkpoint=async checkpoint.interval=20
                  checkpoint.keep_last=4 train.steps=40 train.log_every=1 "run.root=$root")
    local t=${SCALE_TIMEOUT:-200}
    local tr=(timeout "$t" torchrun --standalone)
    CUDA_VISIBLE_DEVICES=$gpu timeout "$t" "$PY" train.py "${common[@]}" parallel=fsdp run.name="$r-1gpu" \
        > "$OUT/scale_$r-1gpu.log" 2>&1 &
    local ref=$!
    "${tr[@]}" --nproc_per_node=4 train.py "${common[@]}" parallel=hsdp parallel.dp_replicate=2 \
        parallel.dp_shard=2 run.name="$r-hsdp" > "$OUT/scale_$r-hsdp.log" 2>&1 || return 1
    local to
    for to in fsdp_tp fsdp2; do
        "$PY" -m tests.harness.resume --copy-checkpoint "$root/$r-hsdp" "$root/$r-hsdp-to-$to" 20 \
            || return 1
    done
    "${tr[@]}" --nproc_per_node=4 train.py "${common[@]}" parallel=fsdp_tp parallel.dp_shard=2 \
        parallel.tp=2 run.name="$r-fsdp_tp" > "$OUT/scale_$r-fsdp_tp.log" 2>&1 &
    local a=$!
    "${tr[@]}" --nproc_per_node=4 train.py "${common[@]}" parallel=fsdp_tp parallel.dp_shard=2 \
        parallel.tp=2 run.name="$r-hsdp-to-fsdp_tp" > "$OUT/scale_$r-hsdp-to-fsdp_tp.log" 2>&1 &
    local b=$!
    "${tr[@]}" --nproc_per_node=2 train.py "${common[@]}" parallel=fsdp \
        run.name="$r-hsdp-to-fsdp2" > "$OUT/scale_$r-hsdp-to-fsdp2.log" 2>&1 &
    local c=$!
    local rc=0 p
    for p in $ref $a $b $c; do wait "$p" || rc=1; done
    return "$rc"
}

# shellcheck disable=SC2329
scale() {
    stage "small model on 4 GPUs: hsdp 2x2 and fsdp_tp 2x2 vs 1 GPU; hsdp step 20 resumed on 4 (fsdp_tp) and 2 (fsdp)"
    local root=/tmp/gpu-suite-scale pids=() g=0 r
    rm -rf "$root"
    declare -A extra=([bf16]="recipe=bf16" [fp8_delayed]="recipe=fp8_delayed"
                      [fp8_cs-q]="recipe=fp8_cs recipe.quantized_init=true" [fp8_block]="recipe=fp8_block"
                      [fp8_block-q]="recipe=fp8_block recipe.quantized_init=true")
    # At most 4 recipes at a time: each keeps one GPU for its 1-GPU reference.
    for r in ${SCALE_RECIPES:-bf16 fp8_delayed fp8_cs-q fp8_block}; do
        # shellcheck disable=SC2086  # the recipe overrides are words
        scale_one "$r" "$g" "$root" ${extra[$r]} &
        pids+=($!)
        g=$((g + 1))
    done
    for p in "${pids[@]}"; do wait "$p" || status=1; done
    "$PY" -m tests.harness.scale "$root" || status=1
}

# shellcheck disable=SC2329
cp2() {
    stage "context parallelism: llama3_1b seq 8192, cp=2 on 2 GPUs against cp=1 on 1 GPU (global batch 4, 20 steps)"
    # The cp=1 run is the reference; a second cp=1 run measures the run-to-run noise of TE's
    # attention (not deterministic by default), which the cp=2 differences are read against.
    local root=/tmp/gpu-suite-cp2 common recipe masked comm name
    rm -rf "$root"
    common=(model=llama3_1b data.seq_len=8192 train.global_batch_size=4 train.micro_batch_size=4
            train.steps=20 train.log_every=1 checkpoint=none "run.root=$root")
    # shellcheck disable=SC2206  # CP2_ARGS are words (extra overrides, e.g. a smaller model)
    common+=(${CP2_ARGS:-})
    echo "| recipe | documents | run | max abs loss diff vs cp=1 | last loss |"
    echo "|---|---|---|---|---|"
    for recipe in ${CP2_RECIPES:-bf16 fp8_cs}; do
        for masked in true false; do
            local base="$recipe-docs_$masked" runs=()
            for name in cp1 cp1b; do
                timeout "${CP2_TIMEOUT:-300}" "$PY" train.py "${common[@]}" recipe="$recipe" \
                    data.document_mask="$masked" run.name="$base-$name" > "$OUT/cp2_$base-$name.log" 2>&1 \
                    || status=1
                runs+=("$root/$base-$name")
            done
            for comm in ${CP2_COMMS:-p2p all_gather a2a}; do
                name="cp2-$comm"
                timeout "${CP2_TIMEOUT:-300}" torchrun --standalone --nproc_per_node=2 train.py \
                    "${common[@]}" recipe="$recipe" data.document_mask="$masked" parallel.cp=2 \
                    parallel.cp_comm_type="$comm" run.name="$base-$name" \
                    > "$OUT/cp2_$base-$name.log" 2>&1 || status=1
                runs+=("$root/$base-$name")
            done
            "$PY" - "$recipe" "$masked" "${runs[@]}" <<'PYEOF' || status=1
import sys
from pathlib import Path
from runlog import read_metrics
recipe, masked, ref, *others = sys.argv[1:]
want = {m["step"]: m["loss"] for m in read_metrics(Path(ref) / "metrics.jsonl")}
for run in others:
    got = {m["step"]: m["loss"] for m in read_metrics(Path(run) / "metrics.jsonl")}
    common = sorted(set(want) & set(got))
    worst = max(abs(got[s] - want[s]) for s in common) if common else float("nan")
    last = f"{got[common[-1]]:.4f} (cp=1: {want[common[-1]]:.4f})" if common else "-"
    print(f"| {recipe} | {masked} | {Path(run).name} | {worst:.2e} over {len(common)} steps | {last} |")
PYEOF
        done
    done
}

# shellcheck disable=SC2329
cpseq() {
    local c seq args
    for seq in 32768 65536; do
        stage "context parallelism, llama3_1b seq $seq, cp=2 on 2 GPUs: tokens/s per GPU, MFU, peak memory"
        args=()
        for c in bf16 fp8_cs; do
            args+=(--case "llama3_1b:fsdp:$c:none:1@parallel.cp=2@model.max_seq_len=$seq")
        done
        "$PY" tools/bench_step.py --nproc 2 --seq "$seq" --steps 8 --warmup 3 "${args[@]}" \
            --json "$OUT/cpseq_$seq.json" 2>&1 | tee "$OUT/cpseq_$seq.log" | tail -4 || status=1
    done
    stage "longest sequence that trains (llama3_1b bf16, 3 steps, micro batch 1), per layout"
    echo "| layout | GPUs | longest seq | peak GiB there |"
    echo "|---|---|---|---|"
    local layout name n case_ best peak
    for layout in "cp1:1:llama3_1b:fsdp:bf16:none:1" "fsdp2:2:llama3_1b:fsdp:bf16:none:1" \
                  "cp2:2:llama3_1b:fsdp:bf16:none:1@parallel.cp=2" \
                  "cp2+full:2:llama3_1b:fsdp:bf16:full:1@parallel.cp=2"; do
        name=${layout%%:*}; n=${layout#*:}; case_=${n#*:}; n=${n%%:*}
        best=-; peak=-
        for seq in 16384 32768 65536 131072 262144; do
            timeout "${CPSEQ_TIMEOUT:-400}" "$PY" tools/bench_step.py --nproc "$n" --seq "$seq" \
                --steps 3 --warmup 1 --case "$case_@model.max_seq_len=$seq" \
                --json "$OUT/cpseq_longest.json" > "$OUT/cpseq_${name}_$seq.log" 2>&1 || break
            best=$seq
            peak=$(tail -1 "$OUT/cpseq_${name}_$seq.log" | awk -F'|' '{print $(NF-1)}')
        done
        echo "| $name | $n | $best | $peak |"
    done
}

# shellcheck disable=SC2329
levers() {
    stage "llama3_8b FSDP on 2 GPUs, seq 8192, global batch 128 (gradient accumulation): tokens/s per GPU"
    # Targets (issue #29): FP8 >= 14,500 and BF16 >= 10,700 tokens/s/GPU. One optimizer step
    # is 128 x 8192 tokens (about 40 s on 2 GPUs): few steps per case.
    local cases=() args=() c
    read -r -a cases <<< "${LEVER_CASES:-}"
    if [[ ${#cases[@]} -eq 0 ]]; then
        local m=${LEVER_MBS:-1} base
        base=llama3_8b:fsdp:fp8_cs+q:selective:$m
        cases=(llama3_8b:fsdp:bf16:none:"$m" llama3_8b:fsdp:bf16:selective:"$m"
               llama3_8b:fsdp:fp8_delayed:none:"$m" llama3_8b:fsdp:fp8_delayed:selective:"$m"
               llama3_8b:fsdp:fp8_cs+q:none:"$m" "$base"
               "$base@parallel.grad_reduce=step" "$base@parallel.reduce_dtype=bf16"
               "$base@parallel.reshard_after_forward=false"
               "$base@parallel.activation_checkpointing_every=2" "$base@train.gc_every=1"
               "$base@parallel.nccl_high_priority=true")
    fi
    for c in "${cases[@]}"; do args+=(--case "$c"); done
    "$PY" tools/bench_step.py --nproc 2 --global-batch 128 --steps "${LEVER_STEPS:-4}" --warmup 1 \
        "${args[@]}" --json "$OUT/levers.json" 2>&1 | tee "$OUT/levers.log" \
        | tail -$((${#cases[@]} + 3)) || status=1
}

# torchtitan's float8 (torchao tensorwise, FP8 all-gather under FSDP2): the peer stages' flags.
TT_FP8=(--model.converters quantize.linear.float8 --quantize.linear.float8.filter_fqns output
        --quantize.linear.float8.enable_fsdp_float8_all_gather
        --quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp)

# shellcheck disable=SC2329
peers_ready() {  # stage GPUs doc: the peer's bundle sourced, or a "not run" line (status 1)
    if [[ ! -f .peers/setup.sh || $NGPU -lt $2 ]]; then
        echo "$1: not run: needs $2 GPUs and torchtitan's bundle in .peers/ ($3)"; status=1; return 1
    fi
    # shellcheck disable=SC1091  # the peer's bundle, copied in by hand
    source .peers/setup.sh
}

# shellcheck disable=SC2329
peer8b() {
    stage "llama3_8b FSDP on 2 GPUs, seq 8192, global batch ${PEER_GB:-8}: torchtitan (compiled) and this recipe, one call"
    peers_ready peer8b 2 docs/PERFORMANCE.md || return
    local gb=${PEER_GB:-8} b=llama3_8b:fsdp name
    rm -f "$OUT/peer8b_torchtitan.jsonl"
    for name in bf16 float8; do
        local tt_args=()
        [[ $name == float8 ]] && tt_args=("${TT_FP8[@]}")
        timeout 300 "$PY" .peers/tt_bench.py --tt /tmp/tt --name "tt-$name" --mbs 1 --nproc 2 --steps 10 \
            --from-step 4 --timeout 290 --jsonl "$OUT/peer8b_torchtitan.jsonl" --logdir "$OUT" -- \
            --model.flavor 8B --compile.enable --activation_checkpoint.mode none \
            --training.global_batch_size "$gb" --metrics.log_freq 2 "${tt_args[@]}" || status=1
    done
    "$PY" tools/bench_step.py --nproc 2 --global-batch "$gb" --steps 5 --warmup 2 --case "$b:bf16:none:1" \
        --case "$b:fp8_cs+q:none:1" --case "$b:fp8_cs+q:none:1@parallel.reduce_dtype=bf16" \
        --case "$b:bf16:none:1@parallel.reduce_dtype=bf16" --case "$b:fp8_cs+q:selective:1" \
        --json "$OUT/peer8b_ours.json" 2>&1 | tee "$OUT/peer8b_ours.log" | tail -8 || status=1
    "$PY" - "$OUT/peer8b_torchtitan.jsonl" <<'PYEOF'
import json, sys
print("| torchtitan | tokens/s/GPU | peak allocated GiB |\n|---|---|---|")
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"| {r['name']} | {r.get('tokens_per_s_per_gpu', 0):,.0f} | {r.get('peak_alloc_gib_run')} |")
PYEOF
}

# shellcheck disable=SC2329
p128_lane() {  # devices tt-name fp8|bf16 case...: torchtitan, then each of our cases, on one lane
    local dev=$1 name=$2 tt_args=() c
    [[ $3 == fp8 ]] && tt_args=("${TT_FP8[@]}")
    shift 3
    CUDA_VISIBLE_DEVICES=$dev timeout 330 "$PY" .peers/tt_bench.py --tt /tmp/tt --name "$name" --mbs 1 \
        --nproc 2 --steps 2 --from-step 2 --timeout 320 --jsonl "$OUT/peer128_torchtitan.jsonl" \
        --logdir "$OUT" -- --model.flavor 8B --compile.enable --activation_checkpoint.mode none \
        --training.global_batch_size 128 --metrics.log_freq 1 "${tt_args[@]}" > "$OUT/peer128_$name.log" 2>&1
    for c in "$@"; do
        CUDA_VISIBLE_DEVICES=$dev "$PY" tools/bench_step.py --nproc 2 --global-batch 128 --steps 2 \
            --warmup 1 --label "$name" --case "$c" --json "$OUT/peer128_ours.json" >> "$OUT/peer128_$name.log" 2>&1
    done
}

# shellcheck disable=SC2329
peer128() {
    stage "llama3_8b FSDP on 2 GPUs, seq 8192, global batch 128: torchtitan (compiled) beside the FSDP levers"
    peers_ready peer128 2 docs/PERFORMANCE.md || return
    rm -f "$OUT/peer128_torchtitan.jsonl" "$OUT/peer128_ours.json"
    local m=llama3_8b:fsdp lv=:none:1@parallel.grad_reduce=step@parallel.reduce_dtype=bf16
    local keep=@parallel.reshard_after_forward=false m16=@optim.moment_dtype=bf16
    # The last two FP8 rows: at torchtitan's memory (bf16 moments), and under 74 GiB.
    local fp8_cases=("$m:fp8_cs$lv" "$m:fp8_cs+q$lv$keep" "$m:fp8_cs+q$lv$keep$m16"
        "$m:fp8_cs+q:selective:1@${lv#*@}$keep$m16")
    local bf16_cases=("$m:bf16$lv" "$m:bf16$lv$keep" "$m:bf16$lv$keep$m16")
    if [[ $NGPU -ge 4 ]]; then  # two lanes side by side; on 2 GPUs one after the other
        p128_lane 0,1 tt-float8 fp8 "${fp8_cases[@]}" &
        p128_lane 2,3 tt-bf16 bf16 "${bf16_cases[@]}" &
        wait
    else
        p128_lane 0,1 tt-float8 fp8 "${fp8_cases[@]}"
        p128_lane 0,1 tt-bf16 bf16 "${bf16_cases[@]}"
    fi
    "$PY" - "$OUT/peer128_torchtitan.jsonl" "$OUT/peer128_ours.json" <<'PYEOF' || status=1
import json, os, sys
rows = {}
for path in sys.argv[1:]:
    for line in open(path) if os.path.exists(path) else []:
        r = json.loads(line)
        rows.setdefault(r.get("label") or r["name"], []).append(r)
print("| run | tokens/s/GPU | vs torchtitan | peak GiB | vs torchtitan |\n|---|---|---|---|---|")
failed = 0
for tt in ("tt-float8", "tt-bf16"):
    ref = next((r for r in rows.get(tt, []) if "runner" in r), None)
    speed, mem = (ref or {}).get("tokens_per_s_per_gpu"), (ref or {}).get("peak_alloc_gib_run")
    print(f"| {tt} | {speed:,.0f} | 1.00 | {mem} | 1.00 |" if speed else f"| {tt} | not run | | | |")
    for r in (r for r in rows.get(tt, []) if "runner" not in r):
        s, m = r.get("tokens_per_s_per_gpu"), r.get("peak_gib")
        failed += not s
        if not s:
            print(f"| {r['case']} | FAILED: {r.get('error', '')} | | | |")
        elif speed and mem:
            print(f"| {r['case']} | {s:,.0f} | {s / speed:.3f} | {m:.1f} | {m / mem:.3f} |")
        else:
            print(f"| {r['case']} | {s:,.0f} | | {m:.1f} | |")
    failed += not speed
sys.exit(1 if failed else 0)
PYEOF
}

# shellcheck disable=SC2329
cp8b() {
    stage "llama3_8b on 4 GPUs, causal attention, context parallelism: torchtitan (compiled) and this recipe, one call"
    peers_ready cp8b 4 docs/CONTEXT_PARALLEL.md || return
    local ac=${CP8B_AC:-none} seq cp recipe gb tt_args ours eager="" attention cases
    # torchtitan's trainer for one row: name, then its extra flags (seq, cp, gb, ac, tt_args
    # from the loop below).
    cp8b_peer() {
        timeout 200 "$PY" .peers/tt_bench.py --tt /tmp/tt --name "$1" --mbs 1 --nproc 4 --seq "$seq" \
            --steps 8 --from-step 4 --timeout 190 --jsonl "$OUT/cp8b_torchtitan.jsonl" --logdir "$OUT" -- \
            --model.flavor 8B "${@:2}" --activation_checkpoint.mode "$ac" \
            --parallelism.context_parallel_degree "$cp" --training.global_batch_size "$gb" \
            --metrics.log_freq 2 "${tt_args[@]}" 2>&1 | tail -1
    }
    rm -f "$OUT/cp8b_torchtitan.jsonl" "$OUT/cp8b_ours.json"
    # Both sides: micro batch 1, data-parallel size 4 / cp, global batch = that size (no
    # accumulation), FSDP over dp x cp, the same recomputation.
    for seq in ${CP8B_SEQS:-32768}; do
        for cp in ${CP8B_CPS:-4 2}; do
            gb=$((4 / cp))
            for recipe in ${CP8B_RECIPES:-bf16 fp8}; do
                tt_args=(); ours=bf16
                [[ $recipe == fp8 ]] && { tt_args=("${TT_FP8[@]}"); ours=fp8_cs+q; }
                # Compiled, as torchtitan is measured elsewhere; should its compile fail under cp
                # (not out of memory), this and the later peer rows run uncompiled, named -eager.
                if [[ -z $eager ]] && ! cp8b_peer "tt-$recipe-$seq-cp$cp" --compile.enable; then
                    status=1
                    grep -q '"oom": true' <(tail -1 "$OUT/cp8b_torchtitan.jsonl") || eager=-eager
                fi
                [[ -n $eager ]] && { cp8b_peer "tt-$recipe-$seq-cp$cp$eager" || status=1; }
                # FP8: a second row with FP8 attention (recipe.fp8_attention), unless
                # CP8B_FP8_ATTENTION=0.
                cases=("")
                [[ $recipe == fp8 && ${CP8B_FP8_ATTENTION:-1} == 1 ]] && cases+=("@recipe.fp8_attention=true")
                for attention in "${cases[@]}"; do
                    timeout 200 "$PY" tools/bench_step.py --nproc 4 --seq "$seq" --global-batch "$gb" --steps 6 \
                        --warmup 2 --case "llama3_8b:fsdp:$ours:$ac:1:causal@parallel.cp=$cp@model.max_seq_len=$seq$attention" \
                        --json "$OUT/cp8b_ours.json" >> "$OUT/cp8b_ours.log" 2>&1 || status=1
                    tail -1 "$OUT/cp8b_ours.log"
                done
            done
        done
    done
    if [[ ${CP8B_SCALING:-1} == 1 ]]; then
        # 8k tokens per GPU: seq 8k cp=1 x FSDP 4, 16k cp=2 x FSDP 2 (32k cp=4 is above)
        for cp in 1 2; do
            seq=$((8192 * cp))
            timeout 200 "$PY" tools/bench_step.py --nproc 4 --seq "$seq" --global-batch $((4 / cp)) --steps 6 \
                --warmup 2 --case "llama3_8b:fsdp:bf16:$ac:1:causal@parallel.cp=$cp@model.max_seq_len=$seq" \
                --json "$OUT/cp8b_ours.json" >> "$OUT/cp8b_ours.log" 2>&1 || status=1
            tail -1 "$OUT/cp8b_ours.log"
        done
    fi
    "$PY" - "$OUT/cp8b_torchtitan.jsonl" "$OUT/cp8b_ours.json" <<'PYEOF'
import json, sys
from pathlib import Path
print("| run | tokens/s/GPU | MFU | peak allocated GiB |\n|---|---|---|---|")
for path in sys.argv[1:]:
    for line in Path(path).read_text().splitlines() if Path(path).is_file() else []:
        r = json.loads(line)
        name = r.get("name") or r.get("case")
        if r.get("ok") is False or r.get("error"):
            print(f"| {name} | FAILED: {r.get('error') or r.get('tried')} | | |")
            continue
        mfu = r.get("mfu")
        mfu = f"{mfu:.1%}" if mfu is not None else f"{r.get('mfu_torchtitan', 0):.1f}% (its own count)"
        peak = r.get("peak_gib", r.get("peak_alloc_gib_run"))
        print(f"| {name} | {r['tokens_per_s_per_gpu']:,.0f} | {mfu} | {peak} |")
PYEOF
}

# The peer curve (docs/PEER_CURVE.md): this recipe and torchtitan trained from the same
# Hugging Face weights on the same text, tokenizer and batches, PEERCURVE_RUNS runs a side, one
# run per lane of GPUs, and the two groups compared against the spread between runs of a group
# (tools/compare_runs.py --vs). PC_* are set by peercurve() below.
# shellcheck disable=SC2329
pc_ours() {  # devices nproc name recipe seq cp gb timeout: this recipe's train.py
    local ours=(recipe=bf16) launch=("$PY") model
    [[ $4 == fp8 ]] && ours=(recipe=fp8_cs recipe.quantized_init=true)
    (($2 > 1)) && launch=(torchrun --standalone --nproc_per_node="$2")
    read -r -a model <<< "${PC_MODEL[$5]}"
    CUDA_VISIBLE_DEVICES=$1 timeout -k 10 "$8" "${launch[@]}" train.py "${PC_COMMON[@]}" "${model[@]}" \
        "${ours[@]}" data.seq_len="$5" parallel.cp="$6" train.global_batch_size="$7" \
        optim.lr="$PC_LR" train.steps="$PC_STEPS" train.log_every=1 model.init_from="$PC_ROOT/hf" \
        checkpoint=none run.name="$3" "${PC_OURS_EXTRA[@]}" > "$PC_OUT/$3.log" 2>&1
    local rc=$?
    cp "$PC_ROOT/runs/$3/metrics.jsonl" "$PC_OUT/$3.jsonl" 2>/dev/null
    return "$rc"
}

# shellcheck disable=SC2329
pc_tt() {  # devices nproc name recipe seq cp gb timeout: torchtitan's trainer (eager)
    local spec=llama3_same_order tt_args=() data=() rc
    [[ $PC_ORDER == own ]] && spec=llama3
    [[ $4 == fp8 ]] && tt_args=("${TT_FP8[@]}")
    [[ $PC_TEXT != c4_test ]] && data=(--training.dataset_path "$PC_ROOT/text")
    # Its assets (tokenizer, c4_test) are relative to /tmp/tt; tools/ holds the custom import
    # (tt_peercurve: the flavors, this recipe's sample order, the samples `pack` prepared).
    (cd /tmp/tt && CUDA_VISIBLE_DEVICES=$1 PYTORCH_ALLOC_CONF=expandable_segments:True \
        TT_PEERCURVE_CACHE="$PC_ROOT/samples-tt" \
        PYTHONPATH="$PC_REPO/tools:$PC_REPO/.peers:/tmp/tt${PYTHONPATH:+:$PYTHONPATH}" \
        env "${PC_TT_ENV[@]}" timeout -k 10 "$8" torchrun --standalone --nproc_per_node="$2" --local-ranks-filter 0 \
        --role rank --tee 3 -m torchtitan.train --job.config_file "$PC_REPO/.peers/tt_llama3.toml" \
        --job.dump_folder "$PC_ROOT/tt-$3" --experimental.custom_import tt_peercurve \
        --model.name "$spec" --model.flavor "$PC_FLAVOR" --training.seq_len "$5" \
        --training.local_batch_size $(($7 * $6 / $2)) --training.global_batch_size "$7" \
        --training.steps "$PC_STEPS" --training.max_norm 1.0 --training.dataset c4_test "${data[@]}" \
        --parallelism.context_parallel_degree "$6" --activation_checkpoint.mode none \
        --optimizer.name AdamW --optimizer.lr "$PC_LR" --optimizer.beta1 0.9 --optimizer.beta2 0.95 \
        --optimizer.eps 1e-8 --optimizer.weight_decay "$PC_WD" --lr_scheduler.warmup_steps "$PC_WARMUP" \
        --lr_scheduler.decay_type cosine --lr_scheduler.min_lr_factor "$PC_MIN_LR" \
        --metrics.log_freq 1 --checkpoint.enable --checkpoint.load_only \
        --checkpoint.initial_load_path "$PC_ROOT/hf" --checkpoint.initial_load_in_hf \
        "${tt_args[@]}" "${PC_TT_EXTRA[@]}") > "$PC_OUT/$3.log" 2>&1
    rc=$?
    "$PY" tools/tt_metrics.py "$PC_OUT/$3.log" "$PC_OUT/$3.jsonl" --tokens-per-step "$PC_TOKENS" \
        --world-size "$2" --lr "$PC_LR" --warmup-steps "$PC_WARMUP" --total-steps "$PC_STEPS" \
        --decay-type cosine --min-lr-factor "$PC_MIN_LR" >> "$PC_OUT/tt_metrics.log" 2>&1
    return "$rc"
}

# shellcheck disable=SC2329
pc_case_args() {  # case: "name recipe seq cp gb" of recipe[:seq[:cp]], or a line saying why not
    local recipe seq cp gb
    IFS=: read -r recipe seq cp <<< "$1"
    seq=${seq:-$PC_SEQ} cp=${cp:-1}
    gb=$((PC_TOKENS / seq))
    if [[ $recipe != bf16 && $recipe != fp8 ]] || ((gb < 1 || PC_NPROC % cp || gb * cp % PC_NPROC)); then
        echo "peercurve: case $1: recipe bf16|fp8, cp at most the $PC_NPROC GPUs of a run, and" \
            "$PC_TOKENS tokens a step must fill whole rows per rank" >&2
        return 1
    fi
    echo "$recipe-$seq-cp$cp $recipe $seq $cp $gb"
}

# shellcheck disable=SC2329
pc_lane() {  # devices: runs jobs of the queue ($PC_ROOT/queue) until none is left, starting
    # one only while the budget leaves time for it (the longest run so far, plus 10 s)
    local dev=$1 j name side i recipe seq cp gb left need t start rc
    for ((j = 0; j < ${#PC_JOBS[@]}; j++)); do
        mkdir "$PC_ROOT/queue/$j" 2>/dev/null || continue
        read -r name side i recipe seq cp gb <<< "${PC_JOBS[$j]}"
        left=$((PC_BUDGET - SECONDS))
        need=$(awk 'BEGIN {m = 0} $4 > m {m = $4} END {print m ? m + 10 : 0}' "$PC_OUT/jobs.txt")
        if ((left < need || left < 20)); then
            echo "$name.$side$i skipped - 0 $dev ($left s left, a run took up to $((need - 10)) s)" \
                >> "$PC_OUT/jobs.txt"
            continue
        fi
        t=$((left < PC_TIMEOUT ? left : PC_TIMEOUT))
        start=$SECONDS
        if [[ $side == ref && $PC_REFERENCE == torchtitan ]]; then
            pc_tt "$dev" "$PC_NPROC" "$name.$side$i" "$recipe" "$seq" "$cp" "$gb" "$t"
        else
            pc_ours "$dev" "$PC_NPROC" "$name.$side$i" "$recipe" "$seq" "$cp" "$gb" "$t"
        fi
        rc=$?
        echo "$name.$side$i exit $rc $((SECONDS - start)) $dev (started at $start s)" >> "$PC_OUT/jobs.txt"
    done
}

# shellcheck disable=SC2329
pc_verdict() {  # name: the runs that reached the last step, as many a side, against each other
    local name=$1 side i n ref=() ours=() runs
    for side in ref ours; do
        runs=()
        for ((i = 1; i <= PC_RUNS; i++)); do
            [[ $(tail -1 "$PC_OUT/$name.$side$i.jsonl" 2>/dev/null) == "{\"step\": $PC_STEPS,"* ]] \
                && runs+=("$PC_OUT/$name.$side$i.jsonl")
        done
        if [[ $side == ref ]]; then ref=("${runs[@]}"); else ours=("${runs[@]}"); fi
    done
    n=$((${#ref[@]} < ${#ours[@]} ? ${#ref[@]} : ${#ours[@]}))
    echo "--- $name: $n + $n complete runs compared (of ${#ref[@]} $PC_REF_NAME, ${#ours[@]} ours)"
    if ((n == 0)); then
        echo "$name: no complete run on a side: not compared" | tee "$PC_OUT/$name.verdict.txt"
        status=1; return
    fi
    # Equal groups: the first n runs of each side (unequal ones would need a higher threshold).
    "$PY" tools/compare_runs.py "${ref[@]:0:n}" --vs "${ours[@]:0:n}" --names "$PC_REF_NAME,ours" \
        --metrics loss --window "$((PC_STEPS / 2 + 1)):$PC_STEPS" --bound "$PC_BOUND" --first-rtol 1e-3 \
        --json "$PC_OUT/$name.verdict.json" --plot "$OUT/peercurve_$name.png" --smooth 10 2>&1 \
        | tee "$PC_OUT/$name.verdict.txt" || status=1
    # The schedules: torchtitan's formula (tools/tt_metrics.py) against the lr train.py logged.
    "$PY" tools/compare_runs.py "${ref[0]}" "${ours[0]}" --metrics lr --rtol 1e-6 2>&1 | tail -2 \
        | tee -a "$PC_OUT/$name.verdict.txt" || status=1
}

# shellcheck disable=SC2329
peercurve() {
    stage "peer curve: flavor ${PEERCURVE_FLAVOR:-80M} from the same HF weights in both trainers, ${PEERCURVE_RUNS:-4} runs a side per case"
    PC_REPO=$PWD PC_ROOT=${PEERCURVE_ROOT:-/tmp/peercurve} PC_STEPS=${PEERCURVE_STEPS:-300}
    PC_FLAVOR=${PEERCURVE_FLAVOR:-80M} PC_SEQ=${PEERCURVE_SEQ:-2048} PC_TOKENS=${PEERCURVE_TOKENS:-32768}
    PC_LR=${PEERCURVE_LR:-3e-4} PC_WARMUP=${PEERCURVE_WARMUP:-30} PC_MIN_LR=${PEERCURVE_MIN_LR:-0.1}
    PC_WD=${PEERCURVE_WD:-0.1} PC_ORDER=${PEERCURVE_ORDER:-same} PC_RUNS=${PEERCURVE_RUNS:-4}
    PC_TIMEOUT=${PEERCURVE_TIMEOUT:-180} PC_BUDGET=${PEERCURVE_BUDGET:-460} PC_BOUND=${PEERCURVE_BOUND:-1%}
    PC_TEXT=${PEERCURVE_TEXT:-python} PC_TOKENIZER=${PEERCURVE_TOKENIZER:-/tmp/tt/tests/assets/tokenizer}
    PC_REFERENCE=${PEERCURVE_REFERENCE:-torchtitan} PC_OUT=$PC_ROOT/out
    local device=${PEERCURVE_DEVICE:-cuda} lanes=() cases=() names=() c i r side n_lanes
    local t0=$SECONDS line pack_pid=
    if [[ $device == cpu ]]; then
        # The stage's smallest form (tests/test_peercurve.py): processes instead of GPUs, and
        # this recipe as the reference too (torchtitan needs CUDA).
        PC_REFERENCE=ours
        for ((i = 0; i < ${PEERCURVE_LANES:-2}; i++)); do lanes+=(""); done
    fi
    PC_REF_NAME=torchtitan
    [[ $PC_REFERENCE == ours ]] && PC_REF_NAME="ours-again"
    read -r -a cases <<< "${PEERCURVE_CASES:-bf16 fp8}"
    # GPUs per run: the largest cp of the cases (PEERCURVE_GPUS to ask for more: FSDP over them).
    PC_NPROC=${PEERCURVE_GPUS:-1}
    for c in "${cases[@]}"; do
        IFS=: read -r _ _ r <<< "$c"
        ((${r:-1} > PC_NPROC)) && PC_NPROC=${r:-1}
    done
    if [[ $device != cpu ]]; then
        if [[ $PC_REFERENCE == torchtitan ]]; then
            peers_ready peercurve "$PC_NPROC" docs/PEER_CURVE.md || return
        fi
        for ((i = 0; i + PC_NPROC <= NGPU; i += PC_NPROC)); do
            lanes+=("$(seq -s, "$i" $((i + PC_NPROC - 1)))")
        done
        ((${#lanes[@]})) || { echo "peercurve: not run: needs $PC_NPROC GPUs a run"; status=1; return; }
    fi
    # NVLink multicast off (NCCL NVLS, symmetric memory), as the multi-GPU tests run.
    local -x NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    PC_OURS_EXTRA=() PC_TT_EXTRA=() PC_TT_ENV=()
    if [[ ${PEERCURVE_DETERMINISTIC:-0} == 1 ]]; then
        PC_OURS_EXTRA=(train.deterministic=true)
        PC_TT_EXTRA=(--debug.deterministic --debug.deterministic_warn_only)
        PC_TT_ENV=(CUBLAS_WORKSPACE_CONFIG=:4096:8)
    fi
    read -r -a r <<< "${PEERCURVE_OURS_ARGS:-}"; PC_OURS_EXTRA+=("${r[@]}")
    read -r -a r <<< "${PEERCURVE_TT_ARGS:-}"; PC_TT_EXTRA+=("${r[@]}")
    # The queue: the first 3 runs a side of each case in turn (3 + 3 decide; a budget cut then
    # leaves the first cases decided rather than every case short), then run 4, 5, ... of
    # every case.
    PC_JOBS=()
    for c in "${cases[@]}"; do
        line=$(pc_case_args "$c") || { status=1; return; }
        names+=("$line")
    done
    for line in "${names[@]}"; do
        read -r c _ <<< "$line"
        for ((i = 1; i <= PC_RUNS && i <= 3; i++)); do
            for side in ref ours; do PC_JOBS+=("$c $side $i ${line#* }"); done
        done
    done
    for ((i = 4; i <= PC_RUNS; i++)); do
        for line in "${names[@]}"; do
            read -r c _ <<< "$line"
            for side in ref ours; do PC_JOBS+=("$c $side $i ${line#* }"); done
        done
    done
    n_lanes=${#lanes[@]}
    local waves=$(((${#PC_JOBS[@]} + n_lanes - 1) / n_lanes)) tokens=$((PC_STEPS * PC_TOKENS))
    echo "plan: ${#cases[@]} case(s) (${cases[*]}) x ($PC_RUNS $PC_REF_NAME + $PC_RUNS ours) =" \
        "${#PC_JOBS[@]} runs of $PC_STEPS steps x $PC_TOKENS tokens ($tokens tokens each), flavor" \
        "$PC_FLAVOR, $PC_NPROC GPU(s) a run on $device, $n_lanes at a time: $waves wave(s)"
    local queue=() job
    for job in "${PC_JOBS[@]}"; do read -r c side i _ <<< "$job"; queue+=("$c.$side$i"); done
    echo "plan: queue ${queue[*]}"
    echo "plan: text, export and tokenization first (about 60-90 s on GPUs); every run ends by" \
        "$PC_BUDGET s after the suite began (PEERCURVE_BUDGET) and within $PC_TIMEOUT s" \
        "(PEERCURVE_TIMEOUT); a run is not started when the budget cannot hold the longest run so" \
        "far; then the comparisons (about 10 s a case). Now at $SECONDS s."
    # Fresh run directories, outputs and torchtitan dump folders (a checkpoint folder there
    # would be loaded instead of the HF weights); the text and the export stay with REUSE=1.
    if [[ ${PEERCURVE_REUSE:-0} != 1 || ! -f $PC_ROOT/hf/config.json ]]; then rm -rf "$PC_ROOT"; fi
    rm -rf "$PC_ROOT/runs" "$PC_ROOT"/tt-*/ "$PC_OUT" "$PC_ROOT/queue"
    mkdir -p "$PC_OUT" "$PC_ROOT/queue"
    : > "$PC_OUT/jobs.txt"
    local text=/tmp/tt/tests/assets/c4_test/data.json sources=()
    if [[ $PC_TEXT != c4_test ]]; then
        # Python source of this machine's installation, enough for every step's tokens once
        # (1.46 bytes a token with the test tokenizer on the standard library; 2 to spare).
        text=$PC_ROOT/text/data.json
        read -r -a sources <<< "${PEERCURVE_TEXT_FROM:-stdlib torch}"
        [[ -f $text ]] || "$PY" tools/tt_peercurve.py text "$PC_ROOT/text" --bytes $((tokens * 2)) \
            --from "${sources[@]}" --info "$PC_OUT/text.json" || { status=1; return; }
    fi
    # Both sides: the flavor's shape (untied head, RoPE as torchtitan's default scaling), its
    # tokenizer and text in file order, causal attention, AdamW with its betas/eps, linear
    # warmup then cosine to lr x min ratio, clipping at 1.0.
    PC_COMMON=(data=hf data.path="$text" data.tokenizer="$PC_TOKENIZER" data.shuffle=false
        data.document_mask=false data.cache_dir="$PC_ROOT/cache" data.num_proc="${PEERCURVE_NUM_PROC:-8}" run.root="$PC_ROOT/runs"
        optim.beta1=0.9 optim.beta2=0.95 optim.eps=1e-8 optim.grad_clip=1.0 optim.weight_decay="$PC_WD"
        optim.warmup_steps="$PC_WARMUP" optim.min_lr_ratio="$PC_MIN_LR")
    declare -gA PC_MODEL=()
    for line in "${names[@]}"; do
        read -r _ _ r _ <<< "$line"
        [[ -n ${PC_MODEL[$r]:-} ]] || PC_MODEL[$r]=$("$PY" tools/tt_peercurve.py overrides "$PC_FLAVOR" --seq-len "$r")
    done
    if [[ $PC_REFERENCE == torchtitan ]]; then
        # torchtitan's tokenization, once for every run (and this recipe's, to check them equal);
        # torchtitan's package is in /tmp/tt (.peers/setup.sh puts only its wheels on the path).
        local seqs=() folder=${text%/*}
        for line in "${names[@]}"; do read -r _ _ r _ <<< "$line"; seqs+=("$r"); done
        PYTHONPATH="/tmp/tt${PYTHONPATH:+:$PYTHONPATH}" "$PY" tools/tt_peercurve.py pack \
            --dataset-path "$folder" --tokenizer "$PC_TOKENIZER" --seq-len "${seqs[@]}" \
            --cache "$PC_ROOT/samples-tt" --check-ours > "$PC_OUT/pack.log" 2>&1 &
        pack_pid=$!
    fi
    if [[ -f $PC_ROOT/hf/config.json ]]; then
        echo "initial weights: $PC_ROOT/hf of an earlier call on this machine (PEERCURVE_REUSE=1)"
    else
        # The initial weights, once: this recipe's seeded init through one step at lr 1e-9
        # (which leaves them as they were, to fp32 rounding), its checkpoint exported in fp32.
        # The step also prepares this recipe's token cache for every run, and (with the first
        # case's batch, when it fits one GPU) compiles its loss kernels for those shapes.
        local gb
        read -r _ _ c r gb <<< "${names[0]}"
        ((r == 1 && PC_NPROC == 1)) || gb=1
        read -r -a r <<< "${PC_MODEL[$c]}"
        CUDA_VISIBLE_DEVICES=${lanes[0]%%,*} timeout 300 "$PY" train.py "${PC_COMMON[@]}" "${r[@]}" \
            recipe=bf16 optim.lr=1e-9 data.seq_len="$c" train.global_batch_size="$gb" train.steps=1 \
            run.name=init > "$PC_OUT/init.log" 2>&1 \
            && "$PY" tools/convert_hf.py export "$PC_ROOT/runs/init" "$PC_ROOT/hf" --dtype fp32 \
                >> "$PC_OUT/init.log" 2>&1
        if [[ ! -f $PC_ROOT/hf/config.json ]]; then
            echo "peercurve: the initial weights were not exported (tail of $PC_OUT/init.log):"
            tail -5 "$PC_OUT/init.log"; status=1; return
        fi
        echo "initial weights in $PC_ROOT/hf at $((SECONDS - t0)) s"
    fi
    if [[ -n $pack_pid ]]; then
        local packed=0
        wait "$pack_pid" || packed=$?
        cat "$PC_OUT/pack.log"
        if ((packed == 3)); then
            echo "peercurve: the two tokenizers read the text differently: not run"; status=1; return
        elif ((packed != 0)); then
            # Not packed ahead: each torchtitan run then tokenizes the text itself (slower).
            echo "peercurve: pack failed (exit $packed; tail of $PC_OUT/pack.log above); torchtitan's runs tokenize on their own"
        fi
    fi
    local begun=$SECONDS
    echo "runs begin at $begun s"
    local pids=()
    for c in "${lanes[@]}"; do pc_lane "$c" & pids+=($!); done
    for c in "${pids[@]}"; do wait "$c"; done
    echo "runs done at $SECONDS s:"
    cat "$PC_OUT/jobs.txt"
    for line in "${names[@]}"; do read -r c _ <<< "$line"; pc_verdict "$c"; done
    local settings="flavor $PC_FLAVOR, $PC_STEPS steps of $PC_TOKENS tokens, lr $PC_LR (warmup"
    settings+=" $PC_WARMUP, cosine to x$PC_MIN_LR), weight decay $PC_WD, text $PC_TEXT, order $PC_ORDER,"
    settings+=" deterministic ${PEERCURVE_DETERMINISTIC:-0}, $PC_NPROC GPU(s) a run; runs from $begun s"
    settings+=" to $SECONDS s of the suite; window steps $((PC_STEPS / 2 + 1))-$PC_STEPS"
    pc_table "$device" "$settings" "${names[@]}" | tee "$OUT/peercurve_verdict.md"
    tar czf "$OUT/peercurve_logs.tgz" -C "$PC_ROOT" out 2>/dev/null
    echo "peercurve: done at $SECONDS s (outputs: $OUT/peercurve_verdict.md, $OUT/peercurve_<case>.png, $OUT/peercurve_logs.tgz)"
}

# shellcheck disable=SC2329
pc_table() {  # device settings case-line...: one table of every case's verdict, last
    local device=$1 settings=$2 gpu=cpu
    shift 2
    [[ $device != cpu ]] && gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
    "$PY" - "$PC_OUT" "$gpu" "$PC_REF_NAME" "$settings" "$@" <<'PYEOF'
import json, sys
from pathlib import Path
out, gpu, ref, settings = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
print(f"\npeer curve on {gpu}: {ref} (A) against ours (B), each run's mean loss over the window")
print(f"({settings})")
print("| case | runs a side | step 1 | A mean, spread | B mean, spread | d | k (threshold) | d ± threshold x s | verdict | bound |")
print("|---|---|---|---|---|---|---|---|---|---|")
for line in sys.argv[5:]:
    case = line.split()[0]
    f = out / f"{case}.verdict.json"
    if not f.is_file():
        print(f"| {case} | - | - | - | - | - | - | - | not compared | - |")
        continue
    v = json.loads(f.read_text().splitlines()[-1])
    (na, a), (nb, b) = v["groups"].items()
    def mean(g):
        spread = "-" if g["spread"] is None else f"{g['spread']:.2%}"
        return f"{g['mean']:.4f}, {spread}"
    k = "-" if v["k"] is None else f"{float(v['k']):.2f} ({v['threshold']:.2f})"
    iv = "-" if v["interval"] is None else f"{v['interval'][0]:+.2%} .. {v['interval'][1]:+.2%}"
    first = v.get("first_step", {}).get("line", "-").split("relative difference ")[-1]
    bound = "-" if v["bound"] is None else f"{v['bound_verdict']} (±{v['bound']:.1%})"
    print(f"| {case} | {len(a['means'])} | {first} | {mean(a)} | {mean(b)} | {v['difference']:+.2%} "
          f"| {k} | {iv} | {v['summary']} | {bound} |")
PYEOF
}

# shellcheck disable=SC2329
switch() {
    stage "recipe switch: llama3_1b seq 8192, fp8_cs + quantized_init -> bf16 at 80% of ${SWITCH_STEPS:-25} steps"
    "$PY" tools/recipe_switch_demo.py --steps "${SWITCH_STEPS:-25}" --out "$OUT/recipe_switch" 2>&1 \
        | tee "$OUT/recipe_switch.log" || status=1
}

# shellcheck disable=SC2329
determinism() {
    stage "train.deterministic: small model, two runs and a resume bitwise per sm_90 recipe"
    "$PY" -m pytest -m gpu tests/gpu/test_determinism_gpu.py -q -p no:cacheprovider -s 2>&1 \
        | tee "$OUT/determinism_test.log" | grep -E "bitwise equal|passed|failed|Error" || status=1
    stage "train.deterministic: llama3_1b seq 8192 mbs 4, runs a / b, resumed, cost per recipe"
    # shellcheck disable=SC2086  # DET_RECIPES are words
    "$PY" tools/bench_determinism.py --out "${DET_ROOT:-/tmp/gpu-suite-det}" \
        ${DET_RECIPES:+--recipes $DET_RECIPES} --json "$OUT/bench_determinism.json" 2>&1 \
        | tee "$OUT/bench_determinism.log" || status=1
}

# -- multitier: every multi-GPU check in one call (tests/harness/multitier.py makes the table) --

MT_PARTS=(tests ac parity matrix reshard kill9 twonode)

# shellcheck disable=SC2329
mt_py() { "$PY" -m tests.harness.multitier "$@"; }

# shellcheck disable=SC2329
# mt_needs PART CASE N: true when this machine has N GPUs; else one not-run row (and line).
mt_needs() {
    [[ $NGPU -ge $3 ]] && return 0
    mt_py notrun --part "$1" --case "$2" --reason "needs $3 GPUs, this machine has $NGPU" \
        --out "$MT/rows_$1.jsonl"
    return 1
}

# shellcheck disable=SC2329
# mt_job PART JOB LOG CMD...: CMD under `timeout` (MULTITIER_TIMEOUT), its output in LOG; prints
# the exit status (124 / 137: timed out) for `multitier rows --rc`.
mt_job() {
    local log=$3; shift 3
    if [[ -n ${MULTITIER_DRY:-} ]]; then  # the plumbing only: the command goes to its log
        echo "$*" > "$log"; echo "dry: $*" >&2; echo 0; return
    fi
    timeout -k 15 "$MT_T" "$@" > "$log" 2>&1
    echo $?
}

# shellcheck disable=SC2329
mt_tests() {  # the gpu tests that need 2 GPUs (test_parallel_gpu.py: its harness runs in mt_parity,
              # test_ac_layouts_gpu.py: in mt_ac); test_cp_gpu runs cp=2 / 4 over gloo on GPU 0
    mt_needs tests "pytest (2 GPUs)" 2 || return 0
    local rc xdist=()
    # test_cp_gpu's ten torchrun launches one after another outran 265 and 420 s beside the
    # other parts; pytest-xdist (in the GPU image) runs four at a time.
    "$PY" -c "import xdist" 2>/dev/null && xdist=(-n 4)
    rc=$(CUDA_VISIBLE_DEVICES=0,1 mt_job tests pytest "$MT/tests.log" "$PY" -m pytest -m gpu -q \
        -p no:cacheprovider "${xdist[@]}" --junitxml="$MT/tests.xml" \
        tests/gpu/test_checkpoint_gpu.py::test_fused_adam_reshards_2_to_1_gpus tests/gpu/test_cp_gpu.py)
    # pytest's status 1 is "a test failed": the rows say which
    [[ $rc == 1 ]] && rc=0
    mt_py rows junit "$MT/tests.xml" --part tests --job pytest --rc "$rc" --timeout "$MT_T" \
        --out "$MT/rows_tests.jsonl"
}

# shellcheck disable=SC2329
mt_ac() {
    mt_needs ac "recomputation x recipe (2 GPUs)" 2 || return 0
    local rc vis=2,3  # beside mt_tests' 0,1
    [[ $NGPU -ge 4 ]] || vis=0,1
    rc=$(CUDA_VISIBLE_DEVICES=$vis mt_job ac ac "$MT/ac.log" torchrun --standalone --nproc_per_node=2 \
        -m tests.harness.ac_layouts --jsonl "$MT/ac.jsonl")
    mt_py rows ac "$MT/ac.jsonl" --part ac --job ac_layouts --rc "$rc" --timeout "$MT_T" \
        --out "$MT/rows_ac.jsonl"
}

# shellcheck disable=SC2329
mt_parity() {
    local pids=() job
    # name:GPUs:visible:harness args (the 2-GPU job: layouts that fit 2, so a skipped row is real)
    local jobs=(
        "2gpu:2:0,1:--layouts ddp,fsdp,hsdp,tp,fsdp_tp,fsdp+cp2,fsdp+cp2+docs,tp+docs"
        "4gpu:4:0,1,2,3:--layouts ddp,fsdp,hsdp,tp,fsdp_tp,hsdp_tp"
        "4gpu_cp_docs:4:0,1,2,3:--gather-recipes= --layouts fsdp+cp2,fsdp+cp2+docs,tp+cp2,tp+cp2+docs,hsdp+cp2,tp+docs,fsdp_tp+docs,hsdp_tp+docs"
        "4gpu_nosp:4:0,1,2,3:--gather-recipes= --recipes bf16 --no-sequence-parallel --layouts tp,fsdp_tp"
    )
    for job in "${jobs[@]}"; do
        local name=${job%%:*} rest=${job#*:}
        local n=${rest%%:*}; rest=${rest#*:}
        local vis=${rest%%:*} hargs=${rest#*:}
        mt_needs parity "$name: every layout vs 1 GPU" "$n" || continue
        (
            # shellcheck disable=SC2086  # hargs are words
            rc=$(CUDA_VISIBLE_DEVICES=$vis mt_job parity "$name" "$MT/parity_$name.log" torchrun \
                --standalone --nproc_per_node="$n" -m tests.harness.parity --json "$MT/parity_$name.json" $hargs)
            mt_py rows parity "$MT/parity_$name.json" --part parity --job "parity $name" \
                --label "$name" --rc "$rc" --timeout "$MT_T" --out "$MT/rows_parity_$name.jsonl"
        ) &
        pids+=($!)
    done
    for job in "${pids[@]}"; do wait "$job"; done
    cat "$MT"/rows_parity_*.jsonl >> "$MT/rows_parity.jsonl" 2>/dev/null
    rm -f "$MT"/rows_parity_*.jsonl
}

# shellcheck disable=SC2329
mt_matrix() {
    mt_needs matrix "resume matrix: 6 layouts + cp=2 x fsdp, cp=2 x tp (4 GPUs)" 4 || return 0
    local pids=() i=-1 job
    # At most MULTITIER_MATRIX_JOBS jobs at once (default 4). All eight at once ran 80 GiB
    # H100s out of memory: each rank held 9-16 GiB, most likely the NCCL communicators of a
    # new mesh per in-process run, which a process now reuses (docs/TESTING.md).
    local at_once=${MULTITIER_MATRIX_JOBS:-4}
    for job in ddp:ddp: fsdp:fsdp: hsdp:hsdp: tp:tp: fsdp_tp:fsdp_tp: hsdp_tp:hsdp_tp: \
               fsdp+cp2:fsdp:parallel.cp=2 tp+cp2:tp:parallel.cp=2; do
        i=$((i + 1))  # the checkpoint-mode rotation follows the position in this list
        if [[ ${#pids[@]} -ge $at_once ]]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
        local name=${job%%:*} rest=${job#*:}
        local layout=${rest%%:*} more=${rest#*:}
        (
            # shellcheck disable=SC2086  # more: one override or none
            rc=$(mt_job matrix "$name" "$MT/matrix_$name.log" torchrun --standalone --nproc_per_node=4 \
                -m tests.harness.matrix --layout "$layout" --name "$name" --layout-index "$i" \
                --jsonl "$MT/matrix_$name.jsonl" -- "${MATRIX_MODEL[@]}" $more)
            mt_py rows matrix "$MT/matrix_$name.jsonl" --part matrix --job "matrix $name" --rc "$rc" \
                --timeout "$MT_T" --out "$MT/rows_matrix_$name.jsonl"
        ) &
        pids+=($!)
    done
    for job in "${pids[@]}"; do wait "$job"; done
    cat "$MT"/rows_matrix_*.jsonl >> "$MT/rows_matrix.jsonl" 2>/dev/null
    rm -f "$MT"/rows_matrix_*.jsonl
}

# shellcheck disable=SC2329
mt_reshard() {
    mt_needs reshard "4 -> 2 -> 1 and 1 -> 4 per recipe (4 GPUs)" 4 || return 0
    local pids=() g=0 v
    declare -A extra=([bf16]="recipe=bf16" [fp8_delayed+q]="recipe=fp8_delayed recipe.quantized_init=true"
                      [fp8_cs+q]="recipe=fp8_cs recipe.quantized_init=true"
                      [fp8_block+q]="recipe=fp8_block recipe.quantized_init=true")
    for v in bf16 fp8_delayed+q fp8_cs+q fp8_block+q; do
        (
            # shellcheck disable=SC2086  # the recipe overrides are words
            rc=$(mt_job reshard "$v" "$MT/reshard_$v.log" "$PY" -m tests.harness.reshard \
                --root "$MT_ROOT/reshard/$v" --name "$v" --gpus 0,1,2,3 --one-gpu "$g" \
                --timeout $((MT_T / 3)) --logs "$MT" --jsonl "$MT/reshard_$v.jsonl" \
                -- "${MATRIX_MODEL[@]}" ${extra[$v]})
            mt_py rows rows "$MT/reshard_$v.jsonl" --part reshard --job "reshard $v" --rc "$rc" \
                --timeout "$MT_T" --out "$MT/rows_reshard_$v.jsonl"
        ) &
        pids+=($!)
        g=$((g + 1))  # each variant's 1-GPU runs on a GPU of its own
    done
    for v in "${pids[@]}"; do wait "$v"; done
    cat "$MT"/rows_reshard_*.jsonl >> "$MT/rows_reshard.jsonl" 2>/dev/null
    rm -f "$MT"/rows_reshard_*.jsonl
}

# shellcheck disable=SC2329
mt_kill9() {
    mt_needs kill9 "kill -9 of a rank during an async save (2 GPUs)" 2 || return 0
    local rc vis=2,3
    [[ $NGPU -ge 4 ]] || vis=0,1
    # train.deterministic: the resumed losses are compared bit for bit (it refuses document
    # masking on sm_90, docs/RUNS.md); the reference run shares the killed run's GPUs.
    rc=$(CUDA_VISIBLE_DEVICES=$vis mt_job kill9 kill9 "$MT/kill9.log" "$PY" -m tests.harness.kill_save \
        --root "$MT_ROOT/kill9" --logs "$MT" --timeout $((MT_T / 2)) --jsonl "$MT/kill9.jsonl" \
        -- "${MATRIX_MODEL[@]}" recipe=bf16 train.deterministic=true data.document_mask=false)
    mt_py rows rows "$MT/kill9.jsonl" --part kill9 --job kill9 --rc "$rc" --timeout "$MT_T" \
        --out "$MT/rows_kill9.jsonl"
}

# shellcheck disable=SC2329
mt_twonode() {  # two nodes on one host: two torchrun agents of 2 GPUs (slurm/launch.py,
                # --nnodes=2, c10d rendezvous) against one agent of 4 GPUs, bit for bit
    mt_needs twonode "2 nodes x 2 GPUs vs 1 node x 4 GPUs" 4 || return 0
    local rc worst=0 layout
    for layout in hsdp_tp fsdp_tp; do
        rc=$(mt_job twonode "$layout" "$MT/twonode_$layout.log" "$PY" -m tests.harness.two_node \
            --nproc-per-node 2 --root "$MT_ROOT/twonode_$layout" --timeout $((MT_T / 2)) \
            --case "$layout: 2 nodes x 2 GPUs vs 1 node x 4" --jsonl "$MT/twonode.jsonl" -- \
            "${MATRIX_MODEL[@]}" "parallel=$layout" parallel.tp=2 recipe=bf16 train.steps=10 train.log_every=1 \
            train.deterministic=true data.document_mask=false)
        ((rc > worst)) && worst=$rc
    done
    mt_py rows rows "$MT/twonode.jsonl" --part twonode --job twonode --rc "$worst" \
        --timeout "$MT_T" --out "$MT/rows_twonode.jsonl"
}

# shellcheck disable=SC2329
multitier() {
    stage "multitier: every multi-GPU check on $NGPU GPUs, side by side (parts: ${MULTITIER_PARTS:-${MT_PARTS[*]}})"
    MT="$OUT/multitier" MT_ROOT=/tmp/gpu-suite-multitier MT_T=${MULTITIER_TIMEOUT:-420}
    rm -rf "$MT" "$MT_ROOT"
    mkdir -p "$MT" "$MT_ROOT"
    # NVLink multicast off (NCCL NVLS, symmetric memory), as the gpu tests run.
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    local parts=() p pids=() t0=$SECONDS
    # MULTITIER_DRY=N: pretend N GPUs and only print each job's command (a check of the stage)
    [[ -z ${MULTITIER_DRY:-} ]] || NGPU=$MULTITIER_DRY
    read -r -a parts <<< "${MULTITIER_PARTS:-${MT_PARTS[*]}}"
    for p in "${parts[@]}"; do
        [[ " ${MT_PARTS[*]} " == *" $p "* ]] || { echo "multitier: no part $p (${MT_PARTS[*]})" >&2; status=1; }
    done
    # Waves: the parts of one wave run side by side, the waves one after another. All of them
    # at once (about 90 processes) ran 80 GiB H100s out of memory ("Failed to CUDA calloc"
    # inside NCCL); the resume matrix (32 processes) runs alone.
    local wave waves=()
    read -r -a waves <<< "${MULTITIER_WAVES:-tests,ac,parity,reshard,kill9 matrix twonode}"
    for wave in "${waves[@]}"; do
        pids=()
        for p in "${parts[@]}"; do
            [[ ",$wave," == *",$p,"* ]] || continue
            "mt_$p" &
            pids+=($!)
        done
        for p in "${pids[@]}"; do wait "$p"; done
        echo "multitier: wave $wave done at $((SECONDS - t0)) s"
    done
    echo "multitier: every part done in $((SECONDS - t0)) s"
    mt_py table --parts "${parts[@]}" --md "$OUT/multitier_table.md" "$MT"/rows_*.jsonl > "$MT/table.txt"
    local rc=$?
    tar czf "$OUT/multitier_logs.tgz" -C "$OUT" multitier multitier_table.md 2>/dev/null
    cat "$MT/table.txt"
    [[ $rc -eq 0 ]] || status=1
}

[[ $# -gt 0 ]] || set -- single
for what in "$@"; do
    case "$what" in
        single) tests; recipes; resume; save ;;
        tests|recipes|resume|save|step|ckpt|multi|ac|matrix|scale|switch|determinism|cp2|cpseq|levers|peer8b|peer128|cp8b|peercurve|multitier) "$what" ;;
        *) echo "usage: $0 single|multi|multitier|ac|peer8b|peer128|cp8b|peercurve|matrix|scale|tests|recipes|resume|save|step|ckpt|switch|determinism|cp2|cpseq|levers ..." >&2; exit 2 ;;
    esac
done
exit $status
