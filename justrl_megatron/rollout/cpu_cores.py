"""Split placement without GPUs: the host's cores shared out between its trainer ranks and its vLLM engines.

On CPU every rank computes on the host's cores. vLLM's CPU worker binds its OpenMP threads to cores it picks alone
(VLLM_CPU_OMP_THREADS_BIND=auto: its NUMA node's cores but one, so every engine on a host gets the same ones) and a
trainer rank floats. Where the scheduler puts a trainer on the worker's core, the update runs at a third to a half of
its speed while another core holds only vLLM's busy-polling engine core; the same update beside the same engine runs
at full speed on the other core (docs/benchmarks.md): a step's time is a draw of the scheduler's. So each rank gets
cores of its own, in rank order on the host: every trainer rank its OpenMP threads' worth, the engines the rest,
evenly. Where the host has too few cores for that, the engines get distinct cores (from the last) and the trainers
float. A VLLM_CPU_OMP_THREADS_BIND set by the user wins: nothing is bound ("nobind" included).
"""

from __future__ import annotations

import os

from .. import compat


def share_cores(cores: list[int], trainers: int, engines: int, threads: int) -> tuple[list, list]:
    """(cores of each local trainer rank, or None: it floats; cores of each local engine) out of `cores`."""
    cores = sorted(cores)
    if len(cores) >= trainers * threads + engines:
        trainer_cores = [cores[i * threads:(i + 1) * threads] for i in range(trainers)]
        rest = cores[trainers * threads:]
        each, extra = divmod(len(rest), max(engines, 1))
        engine_cores, start = [], 0
        for j in range(engines):
            size = each + (j < extra)
            engine_cores.append(rest[start:start + size])
            start += size
        return trainer_cores, engine_cores
    return [None] * trainers, [[cores[-1 - j % len(cores)]] for j in range(engines)]


def local_roles(global_rank: int, train_world: int) -> tuple[int, int, int] | None:
    """(this rank's place on its host, the host's ranks, how many of them train) from torchrun's LOCAL_RANK /
    LOCAL_WORLD_SIZE (a host's ranks are consecutive); None where the launcher does not say."""
    try:
        local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    first = global_rank - local_rank
    return local_rank, local_world, max(0, min(local_world, train_world - first))


def bind_split_rank(global_rank: int, train_world: int) -> str | None:
    """Bind this rank's compute to its share of the host's cores (a trainer: this thread and the threads it starts;
    a rollout rank: the engine it will build, through VLLM_CPU_OMP_THREADS_BIND). What was bound, or None."""
    if compat.cuda_available() or "VLLM_CPU_OMP_THREADS_BIND" in os.environ or not hasattr(os, "sched_setaffinity"):
        return None
    roles = local_roles(global_rank, train_world)
    if roles is None:
        return None
    index, local_world, trainers = roles
    import torch

    threads = max(1, torch.get_num_threads())
    trainer_cores, engine_cores = share_cores(sorted(os.sched_getaffinity(0)), trainers, local_world - trainers,
                                              threads)
    if global_rank < train_world:
        cores = trainer_cores[index]
        if cores is None:
            return None
        os.sched_setaffinity(0, cores)
        return f"trainer rank {global_rank} on cores {cores}"
    cores = engine_cores[index - trainers]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    return f"rollout rank {global_rank}'s engine on cores {cores}"
