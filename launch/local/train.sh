#!/usr/bin/env bash
# GRPO training on this machine: torchrun with one process per GPU (one process on a machine without GPUs).
# Arguments are hydra overrides, as for justrl-train:
#
#   launch/local/train.sh                                           # the embedded CPU demo
#   launch/local/train.sh recipe=justrl_deepseek_1p5b data.train=/data/dapo.parquet parallel=tp2
#
# Environment knobs (all optional):
#   JUSTRL_PYTHON   interpreter with justrl-megatron installed (default: the repo's .venv if present, else python3)
#   NPROC_PER_NODE  processes (default: the GPUs nvidia-smi lists, else 1)
#   JUSTRL_ENTRY    what torchrun runs (default: "-m justrl_megatron.cli train")
# Stop with a checkpoint: SIGUSR1 to the process group (`kill -USR1 -- -PID`, PID of this script): torchrun ignores it,
# the ranks finish their step, save into trainer.run_dir and exit 0. The same command again resumes from there.
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
read -r -a entry <<< "${JUSTRL_ENTRY:--m justrl_megatron.cli train}"
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # megatron's TP/SP overlap needs it
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
echo "[train.sh] $NPROC_PER_NODE process(es): ${entry[*]} $*" >&2
trap '' USR1  # inherited by torchrun (whose default action would be to die); the ranks install their own handler
# --standalone: a private rendezvous on a free port (--master-port 0 hangs).
exec "$python" -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node="$NPROC_PER_NODE" "${entry[@]}" "$@"
