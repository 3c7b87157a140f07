"""Process-group set-up for one SPMD job: torchrun (or srun + torchrun) env -> torch.distributed -> megatron groups.

Split placement (rollout.placement=split, `init_split`): the first `world - num_rollout_ranks` ranks train, the rest
host vLLM engines. Megatron's `initialize_model_parallel` (0.16.1) builds its TP/PP/DP groups over the whole default
group and has no rank-subset option (its `order` / sizes all multiply up to `get_world_size()`), and so do our own
collectives (checkpoint barriers, the loop's broadcasts). So the job rendezvouses ONCE through its env:// store
(`job_store`; the same under the Slurm scripts) and builds three groups on prefixes of that store:

    default group  the trainer ranks only (on a trainer) / the rollout ranks only (on a rollout rank)
    control        a gloo `ObjectChannel`: trainer rank 0 (channel rank 0) + every rollout rank (1 ..), for prompts,
                   rollouts, weight-sync metadata and stop; the other trainer ranks are not in it and never wait on it

Everything that calls `init_distributed()` afterwards (the policy, checkpoints, metrics) sees its own side only.
"""

from __future__ import annotations

import datetime
import os
import pickle
from dataclasses import dataclass

import torch

from . import compat
from .ports import STORE_FD_ENV, held_port, job_store


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
        if "MASTER_PORT" not in os.environ:  # one process on its own: it holds a port for its store as a launcher does
            held = held_port()
            os.environ["MASTER_PORT"] = str(held.getsockname()[1])
            os.environ[STORE_FD_ENV] = str(held.detach())
        if compat.cuda_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        timeout = datetime.timedelta(minutes=timeout_minutes)
        store, rank, world = job_store(timeout)
        dist.init_process_group(backend(), store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world,
                                timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


@dataclass
class SplitRoles:
    """Where this process stands in a split job (global ranks: 0 .. train_world - 1 train, the rest roll out)."""

    global_rank: int
    world: int
    train_world: int
    control: "ObjectChannel | None"  # None on trainer ranks other than 0
    store: object = None  # the job's rendezvous store (more channels: rollout/split.py's streaming results)
    timeout: datetime.timedelta | None = None

    @property
    def is_trainer(self) -> bool:
        return self.global_rank < self.train_world

    @property
    def num_rollout_ranks(self) -> int:
        return self.world - self.train_world

    @property
    def engine_index(self) -> int:
        """This rollout rank's engine (0 .. num_rollout_ranks - 1); its control-channel rank is engine_index + 1."""
        return self.global_rank - self.train_world


def init_split(num_rollout_ranks: int, timeout_minutes: int = 30) -> SplitRoles:
    """Split placement's groups (see the module doc). Call before anything else touches torch.distributed."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("init_split must run before torch.distributed is initialised (it builds the default group)")
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store, rank, world = job_store(timeout)
    if not 1 <= num_rollout_ranks < world:
        raise ValueError(f"rollout.placement=split needs 1 <= rollout.num_rollout_ranks < world size {world}, "
                         f"got {num_rollout_ranks}")
    train_world = world - num_rollout_ranks
    trainer = rank < train_world
    if compat.cuda_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    side = "trainer" if trainer else "rollout"
    dist.init_process_group(backend() if trainer else "gloo", store=dist.PrefixStore(f"justrl-{side}", store),
                            rank=rank if trainer else rank - train_world,
                            world_size=train_world if trainer else num_rollout_ranks, timeout=timeout)
    control = None
    if rank == 0 or not trainer:
        control = ObjectChannel(dist.PrefixStore("justrl-control", store), 0 if trainer else rank - train_world + 1,
                                num_rollout_ranks + 1, timeout)
    return SplitRoles(rank, world, train_world, control, store, timeout)


# how long a group's members wait for each other to join (an engine or a policy takes minutes to start)
JOIN_TIMEOUT = datetime.timedelta(minutes=30)


def listening_store():
    """A TCPStore server on a port the kernel picks as it binds (`.port`): the port is the store's from the moment
    its number is known, so it can be announced to other processes with nothing able to take it first."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, None, True, JOIN_TIMEOUT, wait_for_workers=False)


def store_client(prefix: str, timeout: datetime.timedelta):
    """A connection of its own to the job's rendezvous store (MASTER_ADDR:MASTER_PORT), under `prefix`: for a thread
    whose store operations must neither wait behind the main thread's nor hold them up."""
    import torch.distributed as dist

    store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]), None, False,
                          timeout, wait_for_workers=False)
    return dist.PrefixStore(prefix, store)


def transfer_group(master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float = 600.0, *,
                   store=None):
    """A gloo group of its own on a TCPStore rendezvous (rank 0 hosts it: `store`, from `listening_store`, whose
    port the others were given), independent of torch.distributed's WORLD, so that processes outside the job's groups
    (vLLM's workers) can join it. Joining waits for every member up to JOIN_TIMEOUT; then `timeout_s` bounds each
    operation (a member that stops answering ends the operation with an error instead of a hang)."""
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    if store is None:
        store = TCPStore(master_address, master_port, world_size, is_master=False, timeout=JOIN_TIMEOUT)
    group = ProcessGroupGloo(PrefixStore("justrl-weight-sync", store), rank, world_size, JOIN_TIMEOUT)
    group.set_timeout(datetime.timedelta(seconds=timeout_s))
    return group


class ObjectChannel:
    """Python objects over a gloo group of its own (outside the default group): broadcast, send, receive."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta):
        from torch.distributed import ProcessGroupGloo

        self.rank, self.size = rank, size
        self.group = ProcessGroupGloo(store, rank, size, timeout)

    def broadcast_object(self, obj, src: int = 0):
        """`src`'s object on every member (the others pass anything)."""
        from torch.distributed import BroadcastOptions

        data = _to_bytes(obj) if self.rank == src else None
        length = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64)
        opts = BroadcastOptions()
        opts.rootRank = src
        self.group.broadcast([length], opts).wait()
        if data is None:
            data = torch.empty(int(length), dtype=torch.uint8)
        self.group.broadcast([data], opts).wait()
        return obj if self.rank == src else pickle.loads(data.numpy().tobytes())

    def send_object(self, obj, dst: int) -> None:
        data = _to_bytes(obj)
        self.group.send([torch.tensor([data.numel()], dtype=torch.int64)], dst, 0).wait()
        self.group.send([data], dst, 1).wait()

    def recv_object(self, src: int):
        length = torch.zeros(1, dtype=torch.int64)
        self.group.recv([length], src, 0).wait()
        data = torch.empty(int(length), dtype=torch.uint8)
        self.group.recv([data], src, 1).wait()
        return pickle.loads(data.numpy().tobytes())


def _to_bytes(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


def init_model_parallel(tp: int = 1, pp: int = 1, vpp: int | None = None, seed: int = 1234, cp: int = 1,
                        ep: int = 1) -> None:
    """(Re)build megatron's parallel groups and seed its RNG tracker (one seed per TP rank, as megatron does).
    `cp`: context-parallel size; megatron then builds the DP x CP groups its DDP and distributed optimizer use.
    `ep`: expert parallelism of MoE models, with expert TP 1 (whole experts per rank)."""
    # lazy: rollout-only processes (vLLM ranks, evaluation) call init_distributed and never load megatron (~4.6 s)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    import torch.distributed as dist

    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ValueError(f"world size {world} is not divisible by tensor_parallel x pipeline_parallel x "
                         f"context_parallel = {tp}x{pp}x{cp}")
    if world % (ep * pp):
        raise ValueError(f"world size {world} is not divisible by expert_parallel x pipeline_parallel = {ep}x{pp}")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
        _destroy(_GROUPS_OF_THE_LAST_LAYOUT)
    before = set(_live_groups())
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
    )
    _GROUPS_OF_THE_LAST_LAYOUT[:] = [g for g in _live_groups() if g not in before]
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


# The process groups megatron built for the current layout. `destroy_model_parallel` only forgets them: torch.distributed
# keeps every group alive, and on gloo each holds threads that poll, so a process that rebuilds its layout (a parity
# test, a converter, a policy built at another layout) would pile them up and burn cores idle (docs/testing.md). A
# rebuild destroys the previous layout's groups.
_GROUPS_OF_THE_LAST_LAYOUT: list = []


def _live_groups() -> list:
    """Every process group torch.distributed holds (its registry is private: none seen, none destroyed)."""
    import torch.distributed as dist

    world = getattr(dist.distributed_c10d, "_world", None)
    return list(getattr(world, "pg_map", {}) or {})


def _destroy(groups: list) -> None:
    import torch.distributed as dist

    live = set(_live_groups())  # (megatron destroys some of its own)
    for group in groups:
        if group in live and group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)
    groups.clear()


def trainer_broadcast(obj):
    """Trainer rank 0's object on every trainer rank (the default group: all ranks colocated, the trainers' in a
    split job)."""
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def trainer_scatter(per_rank):
    """Trainer rank 0's `per_rank[r]` on trainer rank r (the default group, as `trainer_broadcast`); the other ranks
    pass None. Each rank receives its own object only (pickled; the messages are padded to the largest)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return per_rank[0]
    box = [None]
    dist.scatter_object_list(box, per_rank if dist.get_rank() == 0 else None, src=0)
    return box[0]
