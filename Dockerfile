# Cluster image: NVIDIA's NGC PyTorch container (torch, CUDA, NCCL and TransformerEngine
# preinstalled) plus this project's other dependencies, read from pyproject.toml.
#
#   docker build -t te-llama:26.03 .
#   docker run --gpus all --ipc=host --rm te-llama:26.03 python train.py model=small recipe=fp8_cs
#   enroot import -o te-llama-26.03.sqsh dockerd://te-llama:26.03   # Slurm + pyxis: CONTAINER_IMAGE
#
# Base nvcr.io/nvidia/pytorch:26.03-py3: PyTorch 2.11.0a0 (NVIDIA's build of the 2.11 branch),
# CUDA 13.2, Python 3.12, TransformerEngine as shipped in that image (NVIDIA's TE install guide:
# preinstalled in NGC PyTorch containers since 22.09; its version is the image's, not
# necessarily the 2.20.2 tested here). Another release: --build-arg BASE_IMAGE=....
# This file has not been built here: the development machine has no Docker engine.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.03-py3
FROM ${BASE_IMAGE}

WORKDIR /workspace/te-llama
COPY pyproject.toml ./

# The dependencies minus torch, installed by name: `pip install .` would not keep the image's
# torch, whose version (2.11.0a0+...) pip counts as older than the `torch>=2.11` it requires,
# and the project itself installs no module (it runs from its checkout). The image's
# PIP_CONSTRAINT file stays in force, so nothing it pins (torch, numpy, ...) is replaced; the
# build fails if torch or TransformerEngine changed all the same.
RUN pip list --format=freeze | grep -iE '^(torch|transformer[-_]engine[-_a-z0-9]*)==' > /tmp/kept \
 && python -c "import re, tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; print('\n'.join(d for d in deps if re.match(r'[A-Za-z0-9_.-]+', d)[0].lower() != 'torch'))" > /tmp/requirements.txt \
 && cat /tmp/kept /tmp/requirements.txt \
 && pip install --no-cache-dir -r /tmp/requirements.txt \
 && pip list --format=freeze | grep -iE '^(torch|transformer[-_]engine[-_a-z0-9]*)==' | diff /tmp/kept - \
 && grep -qi '^transformer[-_]engine' /tmp/kept

# The code, for `docker run`; under Slurm, train.sbatch runs the mounted checkout instead.
COPY . .
