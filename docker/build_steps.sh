#!/usr/bin/env bash
# The GPU image's build steps, one function per step; the Dockerfile runs them in order (`build_steps.sh STEP`).
# They live here, not inline in the Dockerfile, so that machines without docker (CI) can lint them and check the
# plan: DRY_RUN=1 prints every command instead of running it; `build_steps.sh --list` names the steps.
#
# The rule of the image: the torch that vLLM pins decides everything else. vLLM is installed first; its torch is
# then frozen in a pip constraints file that every later install must satisfy (so pip fails instead of silently
# swapping torch), and the compiled pieces (Transformer Engine's torch extension, apex) are built with
# --no-build-isolation against exactly that torch.
set -euo pipefail

VENV=${VENV:-/opt/venv}
PYTHON=${PYTHON:-$VENV/bin/python}
CONSTRAINTS=${CONSTRAINTS:-$VENV/torch-constraints.txt}
SRC=${SRC:-/workspace/justrl-megatron}
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
TE_VERSION=${TE_VERSION:-2.20.2}
MCORE_SPEC=${MCORE_SPEC:-megatron-core>=0.19,<0.20}
APEX_REF=${APEX_REF:-master}
CUDA_ARCHS=${CUDA_ARCHS:-80;90;100}
MAX_JOBS=${MAX_JOBS:-8}
DRY_RUN=${DRY_RUN:-0}

run() {  # print, then run unless DRY_RUN=1
  echo "+ $*"
  if [[ $DRY_RUN != 1 ]]; then "$@"; fi
}
torch_arch_list() {  # NVTE_CUDA_ARCHS style "80;90;100" -> TORCH_CUDA_ARCH_LIST style "8.0;9.0;10.0"
  local out=() arch archs
  IFS=';' read -r -a archs <<< "$1"
  for arch in "${archs[@]}"; do out+=("${arch%?}.${arch: -1}"); done
  (IFS=';'; echo "${out[*]}")
}
pip_install() { run "$PYTHON" -m pip install --no-cache-dir --progress-bar off "$@"; }

step_system() {  # compilers and headers for the builds; python 3.12 (megatron-core >= 0.17 needs >= 3.12)
  # bubblewrap: the code reward's sandbox (rewards/sandbox.py)
  run apt-get update
  run env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
    python3.12 python3.12-venv python3.12-dev git build-essential ninja-build cmake ca-certificates \
    libnccl2 libnccl-dev bubblewrap
  run bash -c 'rm -rf /var/lib/apt/lists/*'
}

step_venv() {
  run python3.12 -m venv "$VENV"
  # vllm asks for setuptools < 81
  pip_install --upgrade pip "setuptools>=78.1.1,<81" wheel packaging ninja pybind11
}

step_vllm() {  # first: vllm pins torch (0.33.0 -> torch 2.14.0, CUDA 13)
  pip_install "vllm==$VLLM_VERSION"
  step_pin_torch
}

step_pin_torch() {  # freeze the installed torch for every later install
  local version
  if [[ $DRY_RUN == 1 ]]; then
    version="<the torch vllm installed>"
  else
    version=$("$PYTHON" -c 'import torch; print(torch.__version__)')
  fi
  echo "+ echo torch==$version > $CONSTRAINTS"
  if [[ $DRY_RUN != 1 ]]; then echo "torch==$version" > "$CONSTRAINTS"; fi
}

step_check_torch() {  # the torch in the venv is still the one frozen after vllm
  local want have
  if [[ $DRY_RUN == 1 ]]; then echo "+ check: torch in $VENV is still $CONSTRAINTS's"; return 0; fi
  want=$(cat "$CONSTRAINTS")
  have="torch==$("$PYTHON" -c 'import torch; print(torch.__version__)')"
  if [[ $want != "$have" ]]; then
    echo "build_steps: torch changed after vllm: $CONSTRAINTS says $want, the venv has $have" >&2
    return 1
  fi
  echo "build_steps: $have (pinned by vllm)"
}

step_transformer_engine() {
  # The core library is a prebuilt wheel (transformer_engine_cu13); the torch extension (transformer_engine_torch)
  # is source-only: build it here against the image's torch, not a torch pip would fetch into an isolated build env.
  pip_install -c "$CONSTRAINTS" "nvidia-cudnn-frontend>=1.29.0"
  run env NVTE_FRAMEWORK=pytorch NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_CUDA_ARCHS="$CUDA_ARCHS" MAX_JOBS="$MAX_JOBS" \
    "$PYTHON" -m pip install --no-cache-dir --progress-bar off --no-build-isolation -c "$CONSTRAINTS" \
    "transformer-engine[pytorch,core_cu13]==$TE_VERSION"
  step_check_torch
}

step_megatron_core() {
  pip_install -c "$CONSTRAINTS" "$MCORE_SPEC"
  step_check_torch
}

step_apex() {  # NVIDIA apex from source with its C++/CUDA extensions (PyPI's `apex` is an unrelated project)
  run rm -rf /tmp/apex
  run git clone --filter=blob:none https://github.com/NVIDIA/apex /tmp/apex
  run git -C /tmp/apex checkout "$APEX_REF"
  run env APEX_CPP_EXT=1 APEX_CUDA_EXT=1 APEX_PARALLEL_BUILD="$MAX_JOBS" NVCC_APPEND_FLAGS="--threads 4" \
    TORCH_CUDA_ARCH_LIST="$(torch_arch_list "$CUDA_ARCHS")" \
    "$PYTHON" -m pip install --no-cache-dir --progress-bar off --no-build-isolation -c "$CONSTRAINTS" /tmp/apex
  run rm -rf /tmp/apex
  step_check_torch
}

step_package() {  # this package, editable: its configs/ folder is read from the source tree
  pip_install -c "$CONSTRAINTS" -e "${SRC}[gpu,test]"
  step_check_torch
}

step_check() {  # what can be checked without a GPU (docker build has none); `verify-gpu` does the rest
  step_check_torch
  run "$PYTHON" - <<'PY'
import importlib.metadata as md
import importlib.util

from packaging.version import Version

versions = {name: md.version(name) for name in
            ("vllm", "torch", "transformer_engine", "transformer_engine_torch", "megatron-core", "apex",
             "justrl-megatron")}
print(versions)
assert Version(versions["megatron-core"]) >= Version("0.19"), versions["megatron-core"]
for module in ("fused_weight_gradient_mlp_cuda", "amp_C", "transformer_engine_torch"):  # compiled extensions
    assert importlib.util.find_spec(module) is not None, f"{module} was not built"
PY
}

step_verify_gpu() {  # in a container with GPUs: docker run --gpus all IMAGE bash docker/build_steps.sh verify-gpu
  run "$PYTHON" - <<'PY'
import justrl_megatron.compat  # noqa: F401
import torch
import transformer_engine.pytorch as te
import megatron.core
import vllm
import fused_weight_gradient_mlp_cuda  # noqa: F401  (apex)

assert torch.cuda.is_available(), "no GPU visible: run with --gpus all"
layer = te.Linear(256, 256, params_dtype=torch.bfloat16).cuda()
out = layer(torch.randn(8, 256, device="cuda", dtype=torch.bfloat16))
out.float().sum().backward()
print(f"ok: torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {vllm.__version__}, "
      f"megatron-core {megatron.core.__version__}, TE Linear fwd+bwd on {torch.cuda.get_device_name()}")
PY
}

STEPS=(system venv vllm transformer-engine megatron-core apex package check)  # the Dockerfile's order
EXTRA=(pin-torch check-torch verify-gpu)

case ${1:-} in
  --list) echo "${STEPS[*]}" ;;
  all) for s in "${STEPS[@]}"; do "step_${s//-/_}"; done ;;
  *)
    step=${1:-}
    if [[ " ${STEPS[*]} ${EXTRA[*]} " != *" $step "* ]]; then
      echo "usage: $0 STEP | all | --list   (steps: ${STEPS[*]} ${EXTRA[*]})" >&2
      exit 2
    fi
    "step_${step//-/_}"
    ;;
esac
