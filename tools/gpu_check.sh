#!/usr/bin/env bash
# One command for a bare GPU box (python3 + torch + CUDA, no internet, no megatron-core/vLLM/TE): installs the
# carried wheels (.whl/, made by tools/gpu_wheels.sh on a machine with PyPI) into /tmp/justrl-site, then runs the
# stages of justrl_megatron/bench/gpu_check.py (probe, pytest -m gpu, the 16K train benchmark under the memory plan,
# the largest token budget that fits) within 9 minutes, writing gpu_check.json + gpu_check.md to $OUT (else
# ./gpu_check_out/). Exit code non-zero if any stage failed.
#
#   bash tools/gpu_check.sh             # on the GPU box, .whl/ carried with the checkout
#   bash tools/gpu_check.sh --dry-run   # anywhere (CI): checks the bundle, prints the stages and the memory plan
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
WHEELS=${JUSTRL_WHEELS_DIR:-.whl}
SITE=${JUSTRL_SITE:-/tmp/justrl-site}
OUT_DIR=${OUT:-$PWD/gpu_check_out}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # justrl_megatron runs from the checkout, never installed
export PYTHONUNBUFFERED=1

case "${1:-}" in
  --dry-run) exec "$PY" -m justrl_megatron.bench.gpu_check --dry-run --wheels "$WHEELS" ;;
  "") ;;
  *) echo "usage: bash tools/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac

if [[ -d "$WHEELS" ]]; then
  "$PY" -m justrl_megatron.bench.gpu_check --check-bundle --wheels "$WHEELS" || exit 2
  count=$(find "$WHEELS" -maxdepth 1 -name '*.whl' -type f | wc -l)
  echo "gpu_check: installing $count wheels from $WHEELS into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl || { echo "gpu_check: pip could not install $WHEELS/*.whl" >&2; exit 2; }
  export PYTHONPATH="$SITE:$PYTHONPATH"
elif ! "$PY" -c "import megatron.core, hydra, omegaconf" 2>/dev/null; then
  echo "gpu_check: megatron-core/hydra-core/omegaconf are not importable and there is no $WHEELS/ bundle:" >&2
  echo "  run 'bash tools/gpu_wheels.sh' on a machine with PyPI and carry $WHEELS/ with the checkout" >&2
  exit 2
fi

"$PY" -c "import sys, torch; print(f'gpu_check: python {sys.version.split()[0]}, torch {torch.__version__}, CUDA \
{torch.version.cuda}, device {torch.cuda.get_device_name() if torch.cuda.is_available() else None}')"
# the stages keep their own caps (9 minutes together); this is the backstop
timeout -k 10 570 "$PY" -m justrl_megatron.bench.gpu_check --out "$OUT_DIR"
