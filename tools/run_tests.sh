#!/usr/bin/env bash
# README's test command (`make test`, which CI's .ci/run calls): the whole suite, every test, on 2 pytest-xdist
# workers, then the budget guard. Extra arguments go to pytest (e.g. `-m "not slow"`, `-k slurm`, `-n 0`).
#
# Why 2 workers: the suite's time is mostly process start-up (megatron imports, vLLM engines, torchrun) and
# one-threaded ranks (OMP_NUM_THREADS=1), so one test keeps about one of CI's 2 cores busy. `--dist loadscope` keeps
# every test of a module on one worker, so that its module-scoped models, engines, parity launches and clusters are
# built once. (Not `--dist loadgroup`: with pytest 9, xdist 3.8's group suffix no longer reaches the node ids, so it
# silently spread every module over both workers and each built the module's fixtures again.)
#
# The guard: the suite's wall time and its 15 slowest tests are printed at the end; the run fails, naming the budget,
# when the pytest part alone took longer than JUSTRL_TEST_BUDGET_S (default 2700 s = 45 min: CI allows 90 minutes in
# all and the project's own budget is 35, install included), so that slow creep shows before it blocks a merge.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
budget=${JUSTRL_TEST_BUDGET_S:-2700}
report=${JUSTRL_TEST_REPORT:-.pytest_cache/junit.xml}
mkdir -p "$(dirname "$report")"
workers=(-n 2 --dist loadscope --no-loadscope-reorder)
for arg in "$@"; do  # an explicit -n / --numprocesses wins
  [[ $arg == -n* || $arg == --numprocesses* ]] && workers=()
done
start=$(date +%s)
"$PY" -m pytest "${workers[@]}" --junitxml="$report" "$@"
rc=$?
wall=$(( $(date +%s) - start ))
"$PY" tools/test_report.py "$report" --wall "$wall" --budget "$budget" --slowest 15
guard=$?
if [[ $rc -ne 0 ]]; then
  exit "$rc"
fi
exit "$guard"
