#!/bin/bash
# Submit a long run as N dependent jobs of slurm/train.sbatch: each starts once the one
# before it has ended, for any reason (afterany), and resumes from the run directory.
#
#   slurm/chain.sh N [HYDRA_OVERRIDES...]
#   slurm/chain.sh 5 experiment=llama3_8b_fineweb
#   SBATCH_ARGS="--nodes=4 --time=24:00:00 --account=abc" slurm/chain.sh 5 experiment=...
#
# The chain's jobs do not requeue themselves (REQUEUE=0): each job is one allocation, the
# next one continues. Export REQUEUE=1 to also requeue each job after a stop signal (it
# then keeps its place in the chain: the next job waits for the requeued one to end). Jobs
# that start after the training finished exit at once. Cancel the rest with
# `scancel <ids printed below>`.

set -euo pipefail

if [[ $# -lt 1 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 N [HYDRA_OVERRIDES...]   (N >= 1 jobs; sbatch options in SBATCH_ARGS)" >&2
    exit 2
fi
count=$1
shift
read -r -a sbatch_args <<<"${SBATCH_ARGS:-}"
script="$(dirname "$0")/train.sbatch"

previous=""
ids=()
for ((i = 1; i <= count; i++)); do
    dependency=()
    if [[ -n $previous ]]; then
        dependency=(--dependency="afterany:$previous" --kill-on-invalid-dep=yes)
    fi
    out=$(sbatch --parsable "${dependency[@]}" "${sbatch_args[@]}" \
        --export="ALL,REQUEUE=${REQUEUE:-0}" "$script" "$@")
    previous=${out%%;*}  # --parsable prints "id" or "id;cluster"
    ids+=("$previous")
    echo "job $i/$count: $previous${dependency:+ (after $((i - 1)))}"
done
echo "submitted: ${ids[*]}"
