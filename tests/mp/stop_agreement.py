"""Two gloo ranks agree on stopping a rollout (rollout/stopping.StopCheck), with simulated engine steps (no vLLM).

Run by tests/test_run_safety.py: torchrun --nproc-per-node=2 stop_agreement.py OUT (writes OUT/rank{r}.json).

Each case runs StopCheck's protocol as VLLMEngine.generate does (before_step / step / stepped, finish at the end):
  lockstep       one TP engine: every step is a collective of both ranks (an all_reduce on the default group), the
                 ranks' steps take different times; rank 0 wants to stop 0.3 s in. A round placed inside a step on
                 one rank and between steps on the other would deadlock (the launch's timeout).
  one_done       rank 0's share is done at once (it waits in the rounds), rank 1 generates and wants to stop 0.3 s
                 in: rank 0, done, raises too (no rank leaves for the gather while another aborts).
  no_stop        different shares, no stop: both return, after the same number of rounds.
  stopped_before a stop already wanted before the first step: both raise at the first round, nothing stepped.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from justrl_megatron.rollout import RolloutInterrupted
from justrl_megatron.rollout.stopping import StopCheck

OUT = sys.argv[1]


def generate(steps: int, step_s: float, stop_after: float | None, lockstep: bool) -> dict:
    start = time.monotonic()

    def stop():
        return stop_after is not None and time.monotonic() - start >= stop_after

    check, done = StopCheck(stop, distributed=True), 0
    try:
        for _ in range(steps):
            check.before_step()
            t = time.perf_counter()
            time.sleep(step_s)
            if lockstep:  # the model's TP collective inside the step
                dist.all_reduce(torch.ones(1))
            check.stepped(time.perf_counter() - t)
            done += 1
        check.finish()
        raised = False
    except RolloutInterrupted:
        raised = True
    end = time.monotonic()
    return {"raised": raised, "steps": done, "rounds": check.rounds, "seconds": end - start,
            "after_stop_s": None if stop_after is None else end - (start + stop_after)}


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    verdict = {
        "lockstep": generate(400, 0.005 if rank == 0 else 0.02, 0.3 if rank == 0 else None, lockstep=True),
        "one_done": generate(0 if rank == 0 else 400, 0.01, 0.3 if rank == 1 else None, lockstep=False),
        "no_stop": generate(20 if rank == 0 else 60, 0.01, None, lockstep=False),
        "stopped_before": generate(50, 0.01, 0.0 if rank == 1 else None, lockstep=False),
    }
    with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
        json.dump(verdict, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
