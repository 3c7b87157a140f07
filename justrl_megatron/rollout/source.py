"""Where a training step's batch comes from: the `BatchSource` seam and its registry.

The loop asks a source for each step's scored groups and knows nothing of how they were made:

    engines = placement.start(export_weights)   # the engines' client (rollout/engines.py)
    source = make_source(cfg, engines, sampler, scorer, tokenizer, leader=rank == 0)
    source.restore(checkpointed_state, version)  # work that was in flight at the checkpoint
    scored = source.next_batch(step, version, timer)   # a ScoredStep (its batch: on trainer rank 0); None: a stop
    placement.publish(version, source.min_version(version))  # the staleness bound: the source's, computed once
    checkpoint {..., "inflight": source.state()}
    at a stop, beside that checkpoint: source.stop_state()   # what the resume continues (every group's samples)

Sources (rollout.source, or the one rollout.streaming selects), both the one group source (rollout/stream_source.py)
with an admission policy (rollout/admission.py):
  rounds     every sampling round of a step (dynamic sampling), synchronous or one-step-off
             (rollout.max_staleness=1 on a placement that overlaps training)
  streaming  engines kept full from a prompt stream, weights loaded mid-generation, admission-bounded staleness
             (rollout.max_staleness = eta)

Adding a source: a class that implements `BatchSource` in its own module and its line in `SOURCES` (by import path,
so that its module may import this one); `rollout.source=<name>` picks it. Its `problems(cfg)` says, before any
model loads, what it cannot run with; config validation asks the source in use through this registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..algo.dynamic_sampling import ScoredBatch
from .base import registered_class

# rollout.source -> "module:Class"
SOURCES = {
    "rounds": "justrl_megatron.rollout.admission:RoundSource",
    "streaming": "justrl_megatron.rollout.admission:StreamSource",
}


@dataclass
class ScoredStep:
    """What a source hands the update: the step's groups, how they were sampled, how stale they are."""

    batch: ScoredBatch | None  # read on trainer rank 0 only (a source may leave it None elsewhere)
    sampling_stats: Any  # .metrics() -> dict and .shortfall() -> str | None; None: nothing to report
    staleness: int  # updates between the weights that generated the batch and the current ones


class BatchSource(Protocol):
    @classmethod
    def from_config(cls, cfg, engines, sampler, scorer, tokenizer, *, leader: bool) -> "BatchSource":
        """Built once per trainer rank, after the placement has started its engines (`engines`: their client,
        rollout/engines.py)."""

    @staticmethod
    def problems(cfg) -> list[str]:
        """What this source cannot run with (one line each, said before any model loads)."""

    def next_batch(self, step: int, version: int, timer) -> ScoredStep | None:
        """`step`'s scored groups (`version`: updates so far; `timer`: a train/profiling.PhaseTimer for the phases'
        seconds). The loop reads the batch on trainer rank 0 only (it sends each DP replica its samples), the
        staleness and stats on every trainer rank. None: a stop cut it short; the sampler is where a resumed run
        must draw from."""

    def min_version(self, version: int) -> int | None:
        """When weights `version` are published: the oldest weights whose in-flight work the engines may keep
        (older work is dropped there); None: nothing generates across a weight update."""

    def state(self) -> dict | None:
        """The work in flight as plain data for the checkpoint (every trainer rank calls it, before the sampler's
        position is read)."""

    def stop_state(self) -> dict | None:
        """At a stop, once its checkpoint is saved or queued (the run then waits for its write): the work in flight
        that a resume should continue rather than redo (kept beside that checkpoint and handed to `restore` instead
        of `state`'s), or None: `state` said it all. The run generates nothing more after it."""

    def restore(self, state: dict | None, version: int) -> None:
        """Take back what `state` (or `stop_state`) saved; the resumed run starts with weights `version` (the
        checkpoint's step)."""


def source_name(cfg) -> str:
    """The registered source a config runs: rollout.source, else streaming or rounds by rollout.streaming."""
    return cfg.rollout.source or ("streaming" if cfg.rollout.streaming else "rounds")


def source_class(name: str) -> type:
    if name not in SOURCES:
        raise ValueError(f"rollout.source must be one of {', '.join(SOURCES)} (or null), got {name!r}")
    return registered_class(SOURCES[name])


def make_source(cfg, engines, sampler, scorer, tokenizer, *, leader: bool) -> BatchSource:
    return source_class(source_name(cfg)).from_config(cfg, engines, sampler, scorer, tokenizer, leader=leader)


def problems(cfg) -> list[str]:
    """rollout.source's name, and the refusals of the source in use (config validation)."""
    ro = cfg.rollout
    if ro.source is not None and ro.source not in SOURCES:
        return [f"rollout.source must be one of {', '.join(SOURCES)} (or null: rollout.streaming decides), "
                f"got {ro.source!r}"]
    if ro.source not in (None, "streaming") and ro.streaming:
        return [f"rollout.source={ro.source} and rollout.streaming=true name two sources; drop one of them"]
    if ro.source == "streaming" and not ro.streaming:
        return ["rollout.source=streaming: set rollout.streaming=true instead (it also configures the engines)"]
    return source_class(source_name(cfg)).problems(cfg)
