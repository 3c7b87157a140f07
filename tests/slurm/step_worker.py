"""A multi-rank program that honours the trainer's stop/resume contract, to test the Slurm launcher on its own.

Run by launch/slurm/train.sbatch (JUSTRL_ENTRY="tests/slurm/step_worker.py") or launch/local/train.sh under torchrun.
It is not a trainer: each "step" is a gloo all-reduce plus a short sleep, but the control flow is the trainer's:
resume from the run dir's checkpoint, stop after the step in which any rank got SIGUSR1/SIGTERM (agreed by an
all-reduce), save, print the requeue line, exit 0. Every finished step is appended to steps-rank<R>.jsonl so the
test can check that no step was lost or repeated across a requeue.

Arguments are hydra-style overrides: trainer.run_dir=DIR trainer.total_steps=N step_seconds=S, and
self_signal=RANK:STEP (that rank alone sends itself SIGUSR1 during that step: the others must stop with it).
Plain torch.distributed, no megatron (so no justrl_megatron.compat import): the launcher tests skip its 5 s import.
"""

import datetime
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from justrl_megatron.ports import job_store
from justrl_megatron.slurm import StopSignal, current_job, describe, requeue_message


def main() -> None:
    stop = StopSignal().install()
    args = dict(a.split("=", 1) for a in sys.argv[1:])
    run_dir = Path(args["trainer.run_dir"])
    total = int(args.get("trainer.total_steps", 8))
    step_seconds = float(args.get("step_seconds", 1.0))
    signal_rank, signal_step = (int(v) for v in args.get("self_signal", "-1:-1").split(":"))
    store, rank, world = job_store(datetime.timedelta(minutes=30))  # the launcher's env (justrl's or torchrun's)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    job = current_job()
    ckpt = run_dir / "checkpoint.json"
    start = json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0
    print(f"rank {rank}/{world} on {socket.gethostname()}: {describe(job)}; resuming after step {start}", flush=True)

    def save(step: int) -> None:
        dist.barrier()
        if rank == 0:
            tmp = ckpt.with_suffix(".tmp")
            tmp.write_text(json.dumps({"step": step, "world": world}))
            os.replace(tmp, ckpt)
        dist.barrier()

    for step in range(start + 1, total + 1):
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x)
        assert x.item() == world * (world + 1) / 2, x
        time.sleep(step_seconds)
        if (rank, step) == (signal_rank, signal_step):
            os.kill(os.getpid(), signal.SIGUSR1)
        record = {
            "step": step,
            "rank": rank,
            "world": world,
            "host": socket.gethostname(),
            "node_id": job.node_id,
            "restart": job.restart_count,
            "signal": stop.signal_name,
        }
        with open(run_dir / f"steps-rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"step {step}/{total} done", flush=True)
        if step < total and stop.agreed():
            save(step)
            print(requeue_message(step), flush=True)
            return
    save(total)
    print(f"finished {total} steps", flush=True)


if __name__ == "__main__":
    from justrl_megatron.lifeline import await_the_launcher_if_a_peer_died

    try:
        main()
    except Exception as exc:  # a collective that lost its peer: the launcher's line, not this rank's traceback
        await_the_launcher_if_a_peer_died(exc)
        raise
    dist.destroy_process_group()
