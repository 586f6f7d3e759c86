#!/bin/bash
# Submit a sweep as one Slurm job array: one array task per combination of the swept values,
# each a slurm/train.sbatch job in its own run directory (saves, requeues, resumes by itself).
#
#   slurm/sweep.sh optim.lr=1e-4,2e-4,4e-4 experiment=llama3_1b_fineweb
#   SBATCH_ARGS="--nodes=2 --time=24:00:00" SWEEP_PARALLEL=2 slurm/sweep.sh optim.lr=1e-4,2e-4 ...
#
# The overrides are those of `python train.py -m ...` (list sweeps a,b,c, choice(), range()),
# expanded as Hydra's basic sweeper does, and each job gets the run.name the local multirun
# would give it (<run.name>-<swept overrides>, sweep.py), unless run.name is on the command
# line. The plan goes to <run.root>/.sweeps/<time>/<i>.args (one override per line);
# array task i runs slurm/train.sbatch with file i (SWEEP_DIR, SLURM_ARRAY_TASK_ID).
# Submit from the repository root, as for train.sbatch. SWEEP_PARALLEL=N runs at most N tasks at a time (--array=...%N). Submitting the same sweep
# again resumes every job's run. Cancel with `scancel <array job id>`.

set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: $0 HYDRA_OVERRIDES...   (sweeps as for train.py -m; sbatch options in SBATCH_ARGS)" >&2
    exit 2
fi
here=$(dirname "$0")
PYTHON=${PYTHON:-python3}
read -r -a sbatch_args <<<"${SBATCH_ARGS:-}"

plan=$("$PYTHON" "$here/../sweep.py" "$@")  # prints "<count> <directory>"; the jobs go to stderr
read -r count sweep_dir <<<"$plan"
array="0-$((count - 1))${SWEEP_PARALLEL:+%$SWEEP_PARALLEL}"
out=$(sbatch --parsable --array="$array" "${sbatch_args[@]}" \
    --export="ALL,SWEEP_DIR=$sweep_dir" "$here/train.sbatch")
echo "submitted array job ${out%%;*} ($count tasks, --array=$array); plan in $sweep_dir"
