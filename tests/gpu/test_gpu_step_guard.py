"""The non-finite step guard on CUDA (train/step.py::optimizer_step_if_finite): no host copy of the weights in a
normal step, and at most 2% of an update (guard on vs megatron's bare step, side by side), on the 1.5B's whole shape
in bf16 at 16K tokens per update (tests/gpu/guard_device.py in a fresh subprocess)."""

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_the_step_guard_takes_no_host_copy_and_costs_under_2_percent_of_an_update(tmp_path):
    proc = subprocess.run([sys.executable, str(HERE / "guard_device.py"), str(tmp_path)], capture_output=True,
                          text=True, timeout=600, env={**os.environ})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    r = json.loads((tmp_path / "guard.json").read_text())
    assert r["device"].startswith("cuda") and r["host_copies_in_a_guarded_step"] == 0, r
    summary = {k: v for k, v in r.items() if k != "all_s"}
    assert r["guard_overhead_of_update"] <= 0.02, summary
