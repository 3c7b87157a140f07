# syntax=docker/dockerfile:1
# hadolint global ignore=DL3059
# GPU image for justrl-megatron: vLLM (rollouts) + Megatron-Core >= 0.19 + Transformer Engine + NVIDIA apex + this
# package, for single-node runs and for launch/slurm/train.sbatch on a cluster (pyxis/enroot or apptainer).
#
# Why these versions: vLLM is the strictest dependency, so its torch decides the rest. vllm 0.33.0 pins
# torch==2.14.0, whose wheels are CUDA 13.0 builds (cuda-toolkit 13.0.3, nvidia-nccl-cu13, nvidia-cudnn-cu13).
# Hence a CUDA 13.0 *devel* base (nvcc and headers: Transformer Engine's torch extension and apex compile here,
# against exactly that torch) on Ubuntu 24.04 (Python 3.12, which megatron-core >= 0.17 requires). vllm goes in
# first; its torch is frozen in a pip constraints file that every later install must satisfy, so a dependency can
# make the build fail but never swap torch silently. transformer-engine[pytorch] is built with
# --no-build-isolation against the image's torch (core_cu13 matches its CUDA major); apex comes from source (the
# PyPI "apex" is an unrelated project). To move on: bump VLLM_VERSION, read the torch it pins and that torch's CUDA
# major, and change CUDA_IMAGE (and core_cu13 in docker/build_steps.sh) to match.
#
# The steps live in docker/build_steps.sh (linted and dry-run by tests/test_dockerfile.py: CI has no docker).
#   docker build -t justrl-megatron:gpu .
#   docker run --gpus all --rm justrl-megatron:gpu bash docker/build_steps.sh verify-gpu
#   docker run --gpus all --rm -v "$PWD/runs:/workspace/justrl-megatron/runs" justrl-megatron:gpu \
#       launch/local/train.sh recipe=justrl_deepseek_1p5b data.train=/data/dapo-math-17k.parquet
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG VLLM_VERSION=0.33.0
ARG TE_VERSION=2.20.2
ARG MCORE_SPEC="megatron-core>=0.19,<0.20"
# apex has no releases on PyPI: pin a commit here for reproducible images
ARG APEX_REF=master
# compute capabilities to compile for (A100/A800 = 80, H100/H200 = 90, B200 = 100)
ARG CUDA_ARCHS="80;90;100"
ARG MAX_JOBS=8

ENV VENV=/opt/venv \
    SRC=/workspace/justrl-megatron \
    PATH=/opt/venv/bin:${PATH} \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1 \
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1

WORKDIR /workspace/justrl-megatron
COPY docker/build_steps.sh /opt/build_steps.sh
# One layer per step, on purpose: a failed apex build does not re-download vllm.
RUN bash /opt/build_steps.sh system
RUN bash /opt/build_steps.sh venv
RUN bash /opt/build_steps.sh vllm
RUN bash /opt/build_steps.sh transformer-engine
RUN bash /opt/build_steps.sh megatron-core
RUN bash /opt/build_steps.sh apex
COPY . /workspace/justrl-megatron
RUN bash /opt/build_steps.sh package
RUN bash /opt/build_steps.sh check

CMD ["bash"]
