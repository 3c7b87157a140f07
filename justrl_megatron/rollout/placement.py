"""Where the rollout engines run relative to the trainer: one seam, chosen by `rollout.placement`.

The loop and the batch source ask a placement everything through this protocol (7 members):

    overlaps          whether the engines generate while the trainer trains (split: own ranks; colocated: no)
    problems(cfg, W)  what it cannot run with, one line each, before any model loads (config validation)
    join()            set up this rank; True on a trainer rank (a rollout-only rank serves its engine in here until
                      the trainer says stop, then returns False)
    start(export)     build or reach the engines once the policy holds weights; returns the `Engines` client
                      (rollout/engines.py) through which the batch source drives every engine: admit, take, harvest,
                      resume, a side batch
    training()        the trainer's turn on the devices (colocated: the engine sleeps)
    publish(v, min_v) the policy's weights into every engine as version v (min_v: in-flight work older than it is
                      dropped; None: nothing generates across the update, so in-flight work finishes first)
    shutdown()

Every engine is driven by one `EngineLoop` (rollout/engine_loop.py) in both placements; nothing outside this seam
asks which placement it is. A placement that overlaps has ranks of its own (`rollout.num_rollout_ranks`), one that
does not shares the trainer's (`trainer_world_size`).

Adding a placement: one class that implements `Placement`, in its own module, and one line in `PLACEMENTS` (the
registry names a class by import path, so that a placement's module may import this one), plus its tests.

Colocated (rollout.placement=colocated, the default): every rank hosts an engine on the trainer's own device. On GPU
vLLM holds `rollout.gpu_memory_utilization` of it (~47 GiB of an 80 GB H100 at 0.6), which a 16K-token update cannot
spare, so one step's cycle is

    generate -> sleep (level 2: weights and KV cache freed) -> old logprobs + update -> release the allocator's cache
             -> sync (the engine wakes its weights buffers, then loads the new weights) -> wake (KV cache) -> generate

On CPU vLLM's sleep mode does not exist and these calls are no-ops; the order is the same (tests record it).
Split (rollout.placement=split): rollout/split.py.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Protocol

from .. import compat
from ..distributed import init_distributed
from .base import RolloutEngine, WeightStream, registered_class, weight_sync_backend
from .engines import Engines, LocalEngines

# rollout.placement -> "module:Class"
PLACEMENTS = {
    "colocated": f"{__name__}:ColocatedPlacement",
    "split": "justrl_megatron.rollout.split:SplitPlacement",
}

ExportWeights = Callable[[int], WeightStream]  # bucket bytes -> the policy's full HF-named tensors (every rank)


class Placement(Protocol):
    overlaps: bool  # True: the engines generate on ranks of their own while the trainer works

    @staticmethod
    def problems(cfg, world_size: int) -> list[str]:
        """What this placement cannot run with (one line each, said before any model loads)."""

    def join(self) -> bool:
        """Set up this rank's process groups; True on a trainer rank. A rollout-only rank serves its engine here
        until the trainer says stop, then returns False."""

    def start(self, export_weights: ExportWeights) -> Engines:
        """Build (or connect to) the engines; every trainer rank, after the policy holds its first weights. Returns
        the client every batch source drives them through."""

    def training(self) -> ContextManager:
        """The trainer's turn on the devices."""

    def publish(self, version: int, min_version: int | None = None) -> dict:
        """The policy's current weights into the engine(s) as `version`; the engine is ready to generate after.
        `min_version` (the batch source's staleness bound): in-flight work admitted with older weights is dropped;
        None: nothing generates across the update (in-flight work finishes first)."""

    def shutdown(self) -> None: ...


def placement_class(name: str) -> type:
    if name not in PLACEMENTS:
        raise ValueError(f"rollout.placement must be one of {', '.join(PLACEMENTS)}, got {name!r}")
    return registered_class(PLACEMENTS[name])


def overlaps(name: str) -> bool:
    """Whether placement `name` generates while the trainer trains (an unknown name: the registry says so)."""
    return PLACEMENTS.get(name) is None or placement_class(name).overlaps


def problems(cfg, world_size: int) -> list[str]:
    """rollout.placement's name and the refusals of the placement it names (config validation)."""
    name = cfg.rollout.placement
    if name not in PLACEMENTS:
        return [f"rollout.placement must be one of {', '.join(PLACEMENTS)}, got {name!r}"]
    return placement_class(name).problems(cfg, world_size)


def make_placement(cfg, model_dir, *, engine: RolloutEngine | None = None) -> Placement:
    """The placement `cfg.rollout.placement` names. `engine`: a ready engine in place of vLLM (tests; colocated)."""
    return placement_class(cfg.rollout.placement)(cfg, model_dir, engine=engine)


def trainer_world_size(cfg, world_size: int) -> int:
    """How many of `world_size` ranks train: a placement whose engines overlap training has the last
    rollout.num_rollout_ranks ranks to itself; one that does not shares every rank."""
    if cfg.rollout.placement not in PLACEMENTS or not overlaps(cfg.rollout.placement):
        return world_size
    return world_size - cfg.rollout.num_rollout_ranks


class ColocatedPlacement:
    """A rollout engine that shares the trainer's devices and sleeps while the policy trains."""

    overlaps = False  # the engine and the trainer take turns on the same devices

    def __init__(self, cfg, model_dir, *, engine: RolloutEngine | None = None):
        self.cfg, self.model_dir, self.engine = cfg, model_dir, engine
        self._export_weights = None
        self._bucket_bytes = int(cfg.rollout.weight_sync_bucket_mb) << 20
        self.tools = None  # rollout.tools: the multi-turn driver (rollout/multi_turn.py), built in `start`

    @staticmethod
    def problems(cfg, world_size: int) -> list[str]:
        if weight_sync_backend(cfg.rollout.weight_sync_backend) in ("gloo", "nccl", "ipc"):
            return [f"rollout.weight_sync_backend={cfg.rollout.weight_sync_backend} is for rollout.placement=split; "
                    f"a colocated engine takes the weights by reference (auto or local)"]
        return []

    def join(self) -> bool:
        init_distributed()
        return True

    def start(self, export_weights: ExportWeights) -> LocalEngines:
        """Every rank builds its engine (vLLM's external_launcher spans the whole world) and steps its loop."""
        from .vllm_engine import make_engine
        from .multi_turn import ToolRollout

        self._export_weights = export_weights
        if self.engine is None:
            self.engine = make_engine(self.cfg, self.model_dir, seed=self.cfg.trainer.seed, in_process=True)
        self.tools = ToolRollout.from_config(self.cfg, self.model_dir)
        return LocalEngines(self.engine, self.cfg, self.tools)

    @contextlib.contextmanager
    def training(self):
        """The engine gives its device memory back for the duration (wake-up is `publish`'s)."""
        self.engine.sleep()
        yield

    def publish(self, version: int, min_version: int | None = None) -> dict:
        """Between two runs of the engine loop: nothing is in flight on a colocated engine."""
        compat.release_cached_memory()
        stats = self.engine.update_weights(self._export_weights(self._bucket_bytes), version)
        self.engine.wake_up()
        return stats

    def shutdown(self) -> None:
        if self.tools is not None:
            self.tools.close()
        if self.engine is not None:
            self.engine.shutdown()
