#!/bin/bash
# FP8 with delayed scaling (per-tensor scales from an amax history); needs Hopper or newer.
# Submits slurm/train.sbatch with a convergence preset (conf/experiment/) and this recipe;
# extra arguments are Hydra overrides. GB200 nodes have 4 GPUs: GPUS_PER_NODE=4.
#   slurm/examples/fp8_delayed.sh
#   CONTAINER_IMAGE=$PWD/te-llama-26.03.sqsh slurm/examples/fp8_delayed.sh   # in the container
#   EXPERIMENT=llama3_8b_fineweb NODES=4 slurm/examples/fp8_delayed.sh parallel=hsdp \
#       parallel.dp_replicate=4
# Compare with the bf16 run of the same preset and layout:
#   python tools/compare_runs.py runs/llama3_1b-fineweb-bf16-fsdp \
#       runs/llama3_1b-fineweb-fp8_delayed-fsdp --metrics loss,grad_norm --rtol 0.02
set -euo pipefail
cd "$(dirname "$0")/../.."
exec sbatch --nodes="${NODES:-2}" --gpus-per-node="${GPUS_PER_NODE:-8}" \
    --time="${TIME:-24:00:00}" slurm/train.sbatch \
    experiment="${EXPERIMENT:-llama3_1b_fineweb}" recipe=fp8_delayed "$@"
