#!/usr/bin/env bash
# One command for a bare GPU box (python3 + torch + CUDA, no internet, no megatron-core/vLLM/TE): installs the
# carried wheels (.whl/, made by tools/gpu_wheels.sh on a machine with PyPI) into /tmp/justrl-site, then runs the
# stages of justrl_megatron/bench/gpu_check.py, writing gpu_check.json + gpu_check.md (rewritten after every stage)
# and pytest.log to $OUT (else ./gpu_check_out/). Each call is planned at <= 8 minutes (a device call is cut at 10);
# the stages that do not fit the first call run in a second one. Exit code non-zero if any stage failed.
#
# .whl/ is git-ignored: it must travel to the box with the checkout (a device call: carry: [".whl"]).
#
#   bash tools/gpu_check.sh                    # call 1 on the GPU box: probe, mfu, pytest
#   bash tools/gpu_check.sh --stages train     # call 2: the train phase under the memory plan
#   bash tools/gpu_check.sh --stages budget    # call 3: the token-budget search (any stage can be redone alone)
#   bash tools/gpu_check.sh --dry-run          # anywhere (CI): checks the bundle, prints the calls and the plan
set -uo pipefail

export JUSTRL_CALL_STARTED=${JUSTRL_CALL_STARTED:-$(date +%s)}  # the stages' time plan counts the install too
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
WHEELS=${JUSTRL_WHEELS_DIR:-.whl}
SITE=${JUSTRL_SITE:-/tmp/justrl-site}
OUT_DIR=${OUT:-$PWD/gpu_check_out}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # justrl_megatron runs from the checkout, never installed
export PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1  # no internet on the box: every model and tokenizer is a local folder

usage() {
  echo "usage: bash tools/gpu_check.sh [--dry-run] [--stages probe,pytest,mfu,train,budget]" >&2
  exit 2
}
DRY=0
STAGE_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --stages) [[ $# -ge 2 && -n "$2" ]] || usage; STAGE_ARGS=(--stages "$2"); shift ;;
    --stages=?*) STAGE_ARGS=(--stages "${1#--stages=}") ;;
    *) usage ;;
  esac
  shift
done
if [[ $DRY -eq 1 ]]; then
  exec "$PY" -m justrl_megatron.bench.gpu_check --dry-run --wheels "$WHEELS"
fi

missing_bundle() {
  echo "gpu_check: $1" >&2
  echo "  .whl/ is git-ignored, so it must travel to the GPU box with the checkout" >&2
  echo "  (a device call: carry: [\".whl\"])." >&2
  echo "  Make it with 'bash tools/gpu_wheels.sh' on a machine with PyPI (see docs/benchmarks.md, GPU)." >&2
  exit 2
}
if [[ -d "$WHEELS" ]]; then
  "$PY" -m justrl_megatron.bench.gpu_check --check-bundle --wheels "$WHEELS" ||
    missing_bundle "the bundle $WHEELS/ is unusable"
  count=$(find "$WHEELS" -maxdepth 1 -name '*.whl' -type f | wc -l)
  echo "gpu_check: installing $count wheels from $WHEELS into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl || { echo "gpu_check: pip could not install $WHEELS/*.whl" >&2; exit 2; }
  export PYTHONPATH="$SITE:$PYTHONPATH"
elif ! "$PY" -c "import megatron.core, hydra, omegaconf" 2>/dev/null; then
  missing_bundle "megatron-core/hydra-core/omegaconf are not importable and there is no $WHEELS/ bundle"
fi

"$PY" -c "import sys, torch; from justrl_megatron import compat; cuda = compat.cuda_available(); \
print(f'gpu_check: python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, device \
{torch.cuda.get_device_name() if cuda else None}')"
# the stages keep their own caps and the whole call's plan; this is the backstop
backstop=$("$PY" -c "from justrl_megatron.bench.gpu_check import TOTAL_CAP_S; print(TOTAL_CAP_S + 30)") || exit 2
timeout -k 10 "$backstop" "$PY" -m justrl_megatron.bench.gpu_check --out "$OUT_DIR" ${STAGE_ARGS[@]+"${STAGE_ARGS[@]}"}
