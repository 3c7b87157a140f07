"""The non-finite step guard on CUDA, for test_gpu_step_guard.py:

    python guard_device.py OUT

bench/guard.py on DeepSeek-R1-Distill-Qwen-1.5B's whole shape (28 layers), bf16, 16 samples x 1,024 tokens (the
16K-token update the mfu stage measures: the guard's cost grows with the parameters, an update's with parameters x
tokens, so a cut-down model or fewer tokens overstates its share): guard on / off / the former host-copy guard, side
by side, and the host copies of one guarded step.
Writes OUT/guard.json.
"""

import justrl_megatron.compat  # noqa: F401  (first)

import json
import os
import sys



def main(out):
    from justrl_megatron.bench.gpu_check import MODEL
    from justrl_megatron.bench.guard import bench_guard
    from justrl_megatron.bench.train import BUILTIN_SHAPES

    result = bench_guard(shape=BUILTIN_SHAPES[MODEL], dtype="bf16", samples=16, seq_len=1024, repeats=5)
    with open(os.path.join(out, "guard.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "all_s"}))


if __name__ == "__main__":
    main(sys.argv[1])
