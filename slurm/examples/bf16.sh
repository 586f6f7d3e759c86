#!/bin/bash
# bf16 compute, no quantization: the reference curve for the other recipes; needs any GPU.
# Submits slurm/train.sbatch with a convergence preset (conf/experiment/) and this recipe;
# extra arguments are Hydra overrides. GB200 nodes have 4 GPUs: GPUS_PER_NODE=4.
#   slurm/examples/bf16.sh
#   CONTAINER_IMAGE=$PWD/te-llama-26.03.sqsh slurm/examples/bf16.sh   # in the container
#   EXPERIMENT=llama3_8b_fineweb NODES=4 slurm/examples/bf16.sh parallel=hsdp \
#       parallel.dp_replicate=4
set -euo pipefail
cd "$(dirname "$0")/../.."
exec sbatch --nodes="${NODES:-2}" --gpus-per-node="${GPUS_PER_NODE:-8}" \
    --time="${TIME:-24:00:00}" slurm/train.sbatch \
    experiment="${EXPERIMENT:-llama3_1b_fineweb}" recipe=bf16 "$@"
