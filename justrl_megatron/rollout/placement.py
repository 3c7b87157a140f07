"""Where the rollout engines run relative to the trainer: one seam, chosen by `rollout.placement`.

The loop and the batch sources (rollout/source.py) ask a placement everything through this protocol: "does this rank
train?" (`join`; a rank that does not serves the engine until the trainer says stop), "build or reach the engine"
(`start`), "generate this batch" (`generate`; where rollout overlaps training, `submit` now and `receive` later),
"stream groups" (`stream_open`, `stream_admit`: where it overlaps), "the trainer needs the devices now"
(`training`), "publish weights version v, keeping in-flight work from min_version on" (`publish`) and `shutdown`.
Nothing outside this seam asks which placement it is.

Adding a placement: one class that implements `Placement`, in its own module, and one line in `PLACEMENTS` (the
registry names a class by import path, so that a placement's module may import this one), plus its tests. Its
`problems(cfg, world_size)` says what it cannot run with; config validation asks it through the registry.

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
from typing import Callable, ContextManager, Protocol, Sequence

from .. import compat
from ..distributed import init_distributed
from ..slurm import stop_requested
from .base import RolloutEngine, Rollouts, SamplingConfig, WeightStream, registered_class, weight_sync_backend

# rollout.placement -> "module:Class"
PLACEMENTS = {
    "colocated": f"{__name__}:ColocatedPlacement",
    "split": "justrl_megatron.rollout.split:SplitPlacement",
}

ExportWeights = Callable[[int], WeightStream]  # bucket bytes -> the policy's full HF-named tensors (every rank)


class Placement(Protocol):
    overlaps: bool  # True: `submit` returns at once and the batch generates while the trainer works

    @staticmethod
    def trainer_world_size(rollout_cfg, world_size: int) -> int:
        """How many of `world_size` ranks train (the rest only roll out)."""

    @staticmethod
    def problems(cfg, world_size: int) -> list[str]:
        """What this placement cannot run with (one line each, said before any model loads)."""

    def join(self) -> bool:
        """Set up this rank's process groups; True on a trainer rank. A rollout-only rank serves its engine here
        until the trainer says stop, then returns False."""

    def start(self, export_weights: ExportWeights) -> None:
        """Build (or connect to) the engine; every trainer rank, after the policy holds its first weights."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int, sampling: SamplingConfig, *,
                 seed: int | None = None) -> Rollouts:
        """`n` samples per prompt, the whole batch on every trainer rank."""

    def submit(self, prompt_ids, n: int, sampling: SamplingConfig, *, seed: int | None = None):
        """(overlaps only) start generating; returns a request for `receive`."""

    def receive(self, request) -> tuple[Rollouts, dict] | None:
        """(overlaps only) trainer rank 0: the request's rollouts and the engines' timings; None elsewhere."""

    def stream_open(self, n: int, sampling: SamplingConfig, capacity: int):
        """(overlaps only) Turn the engines into streaming loops; returns the buffer that finished groups arrive in
        (rollout/stream_source.GroupBuffer) on trainer rank 0, None elsewhere. Every trainer rank calls it."""

    def stream_admit(self, prompts: Sequence[tuple[int, Sequence[int]]]) -> None:
        """(overlaps only; trainer rank 0) Prompts the engines may start now, each with its place in the stream."""

    def stream_resume(self, groups: Sequence[tuple[int, Sequence[int], Rollouts, int]]) -> None:
        """(overlaps only; trainer rank 0) Groups a stop cut short, [(place, prompt, samples so far, admitted
        version)]: the engines continue their unfinished samples first."""

    def stream_harvest(self) -> dict[int, Rollouts]:
        """(overlaps only; trainer rank 0, at a stop) The engines abort every group and hand back what it sampled so
        far, {place: samples}; {} elsewhere."""

    def training(self) -> ContextManager:
        """The trainer's turn on the devices."""

    def publish(self, version: int, min_version: int | None = None) -> dict:
        """The policy's current weights into the engine(s) as `version`; the engine is ready to generate after.
        `min_version` (the batch source's staleness bound): in-flight work admitted with older weights is dropped;
        None: nothing generates across the update."""

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
    if cfg.rollout.placement not in PLACEMENTS:  # said by `problems`
        return world_size
    return placement_class(cfg.rollout.placement).trainer_world_size(cfg.rollout, world_size)


class ColocatedPlacement:
    """A rollout engine that shares the trainer's devices and sleeps while the policy trains."""

    overlaps = False  # the engine and the trainer take turns on the same devices

    def __init__(self, cfg, model_dir, *, engine: RolloutEngine | None = None):
        self.cfg, self.model_dir, self.engine = cfg, model_dir, engine
        self._export_weights = None
        self._bucket_bytes = int(cfg.rollout.weight_sync_bucket_mb) << 20
        self.tools = None  # rollout.tools: the multi-turn driver (rollout/multi_turn.py), built in `start`

    @staticmethod
    def trainer_world_size(rollout_cfg, world_size: int) -> int:
        return world_size

    @staticmethod
    def problems(cfg, world_size: int) -> list[str]:
        if weight_sync_backend(cfg.rollout.weight_sync_backend) in ("gloo", "nccl", "ipc"):
            return [f"rollout.weight_sync_backend={cfg.rollout.weight_sync_backend} is for rollout.placement=split; "
                    f"a colocated engine takes the weights by reference (auto or local)"]
        return []

    def join(self) -> bool:
        init_distributed()
        return True

    def start(self, export_weights: ExportWeights) -> None:
        """Every rank builds its engine (vLLM's external_launcher spans the whole world)."""
        from .vllm_engine import make_engine
        from .multi_turn import ToolRollout

        self._export_weights = export_weights
        if self.engine is None:
            self.engine = make_engine(self.cfg, self.model_dir, seed=self.cfg.trainer.seed, in_process=True)
        self.tools = ToolRollout.from_config(self.cfg, self.model_dir)

    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int, sampling: SamplingConfig, *,
                 seed: int | None = None) -> Rollouts:
        """Each engine samples its share; every rank gets the whole batch (multi-turn with rollout.tools). A stop
        signal (SIGTERM / SIGUSR1 / Ctrl-C) during it aborts the batch on every rank together: RolloutInterrupted."""
        from .multi_turn import generate_batch

        return generate_batch(self.engine, prompt_ids, n, sampling, seed=seed, tools=self.tools, stop=stop_requested)

    @contextlib.contextmanager
    def training(self):
        """The engine gives its device memory back for the duration (wake-up is `publish`'s)."""
        self.engine.sleep()
        yield

    def stream_open(self, *args):
        raise NotImplementedError("colocated engines take turns with the trainer: nothing streams beside it")

    stream_admit = stream_resume = stream_harvest = stream_open

    def publish(self, version: int, min_version: int | None = None) -> dict:
        compat.release_cached_memory()
        stats = self.engine.update_weights(self._export_weights(self._bucket_bytes), version)
        self.engine.wake_up()
        return stats

    def shutdown(self) -> None:
        if self.tools is not None:
            self.tools.close()
        if self.engine is not None:
            self.engine.shutdown()

