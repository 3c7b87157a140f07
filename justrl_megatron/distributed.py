"""Process-group set-up for one SPMD job: torchrun (or srun + torchrun) env -> torch.distributed -> megatron groups."""

from __future__ import annotations

import datetime
import os

import torch

from . import compat


def backend() -> str:
    return "nccl" if compat.cuda_available() else "gloo"


def init_distributed(timeout_minutes: int = 30) -> tuple[int, int]:
    """Initialise torch.distributed from the torchrun env (a single process without one). Returns (rank, world)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        if compat.cuda_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend(), timeout=datetime.timedelta(minutes=timeout_minutes))
    return dist.get_rank(), dist.get_world_size()


def init_model_parallel(tp: int = 1, pp: int = 1, vpp: int | None = None, seed: int = 1234) -> None:
    """(Re)build megatron's parallel groups and seed its RNG tracker (one seed per TP rank, as megatron does)."""
    # lazy: rollout-only processes (vLLM ranks, evaluation) call init_distributed and never load megatron (~4.6 s)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    import torch.distributed as dist

    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by tensor_parallel x pipeline_parallel = {tp}x{pp}")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
