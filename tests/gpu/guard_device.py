"""The non-finite step guard on CUDA, for test_gpu_step_guard.py:

    python guard_device.py OUT

bench/guard.py on 4 layers of DeepSeek-R1-Distill-Qwen-1.5B's width (memory_peak.SHAPE), bf16, 8 samples x 1,024
tokens: guard on / off / the former host-copy guard, side by side, and the host copies of one guarded step.
Writes OUT/guard.json.
"""

import justrl_megatron.compat  # noqa: F401  (first)

import json
import os
import sys

from memory_peak import SHAPE


def main(out):
    from justrl_megatron.bench.guard import bench_guard

    result = bench_guard(shape=SHAPE, dtype="bf16", samples=8, seq_len=1024, repeats=5)
    with open(os.path.join(out, "guard.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "all_s"}))


if __name__ == "__main__":
    main(sys.argv[1])
