#!/usr/bin/env bash
# GRPO training on this machine: one process per GPU (one process on a machine without GPUs), under justrl's
# launcher (`justrl-train --nproc-per-node=N`, justrl_megatron/launch.py): the run dir is locked for the whole launch
# before any rank starts, every rank dies with the launcher and with any rank that fails, and a refused, failed or
# interrupted launch ends in one line with the trainer's exit code. Arguments are hydra overrides, as for justrl-train:
#
#   launch/local/train.sh                                           # the embedded CPU demo
#   launch/local/train.sh recipe=justrl_deepseek_1p5b data.train=/data/dapo.parquet parallel=tp2
#
# Environment knobs (all optional):
#   JUSTRL_PYTHON   interpreter with justrl-megatron installed (default: the repo's .venv if present, else python3)
#   NPROC_PER_NODE  processes (default: the GPUs nvidia-smi lists, else 1)
#   JUSTRL_ENTRY    what each rank runs (default: "-m justrl_megatron.cli train")
# Stop with a checkpoint: SIGUSR1 or SIGTERM to this script's process (it becomes the launcher) or Ctrl-C: the
# launcher forwards it, the ranks finish their step, save into trainer.run_dir and exit 0. The same command again
# resumes from there.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
if [[ -n ${JUSTRL_PYTHON:-} ]]; then python=$JUSTRL_PYTHON
elif [[ -x $repo/.venv/bin/python ]]; then python=$repo/.venv/bin/python
else python=python3
fi
if [[ -z ${NPROC_PER_NODE:-} ]]; then
  NPROC_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [[ $NPROC_PER_NODE -ge 1 ]] || NPROC_PER_NODE=1
fi
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # megatron's TP/SP overlap needs it
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
echo "[train.sh] $NPROC_PER_NODE process(es): ${JUSTRL_ENTRY:--m justrl_megatron.cli train} $*" >&2
exec "$python" -m justrl_megatron.cli train --nproc-per-node="$NPROC_PER_NODE" "$@"
