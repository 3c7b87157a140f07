#!/usr/bin/env bash
# Download into .whl/ (git-ignored) exactly the wheels tools/gpu_check.sh needs on a bare GPU box: Python 3.12,
# torch/triton/transformers/pytest present, no internet, no megatron-core or hydra. The list is tools/gpu_wheels.txt.
# Run it here, on a machine with PyPI; carry .whl/ to the GPU box with the checkout (git-ignored: a device call
# needs carry: [".whl"], or the box exits 2 after its whole start-up).
#
#   bash tools/gpu_wheels.sh            # -> .whl/*.whl, prints each wheel and the total (fails over 20 MB)
set -euo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${JUSTRL_WHEELS_DIR:-.whl}
LIMIT_BYTES=$((20 * 1000 * 1000))
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)

mapfile -t SPECS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' tools/gpu_wheels.txt | grep -v '^$')
if [[ ${#SPECS[@]} -eq 0 ]]; then
  echo "gpu_wheels: tools/gpu_wheels.txt lists no wheels" >&2
  exit 1
fi

mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # only earlier wheels: DEST may be a folder that holds other things
platform_args=()
for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done

for spec in "${SPECS[@]}"; do
  # a binary wheel for CPython 3.12 on x86-64 Linux where PyPI has one (pure-python wheels match too) ...
  if ! "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${platform_args[@]}" -d "$DEST" "$spec" 2>/dev/null; then
    # ... else PyPI ships only an sdist (antlr4-python3-runtime): build a pure-python wheel from it here
    echo "gpu_wheels: no 3.12 wheel of $spec on PyPI; building one from its sdist"
    "$PY" -m pip wheel -q --no-deps --no-binary=:all: -w "$DEST" "$spec"
  fi
done

total=0
count=0
for whl in "$DEST"/*.whl; do
  size=$(stat -c %s "$whl")
  total=$((total + size))
  count=$((count + 1))
  printf '%10d  %s\n' "$size" "$(basename "$whl")"
done
printf '%10d  total (%d wheels, limit %d)\n' "$total" "$count" "$LIMIT_BYTES"
if [[ $total -gt $LIMIT_BYTES ]]; then
  echo "gpu_wheels: the bundle is $total bytes, over the $LIMIT_BYTES-byte limit; trim tools/gpu_wheels.txt" >&2
  exit 1
fi
echo "gpu_wheels: ready in $DEST/ (git-ignored): carry it to the GPU box with the checkout (a device call:"
echo "  carry: [\".whl\"]) and run there: bash tools/gpu_check.sh; then bash tools/gpu_check.sh --stages budget"
