"""Streaming rollouts (rollout.streaming=true): a rollout rank's engine loop, with continuous batching and partial
rollouts across weight updates.

    loop = EngineLoop(engine, n, sampling)
    loop.admit([(gid, prompt_ids), ...])     # the trainer decides what may start (the staleness bound: admission)
    groups = loop.step()                     # refill free slots, one engine step, the groups that finished
    loop.update(lambda: engine.receive_weights(...), min_version)   # pause (requests kept), load, resume

A group is one prompt's `n` samples (one vLLM request with n children). A finished group's slot is refilled at once,
so the engine stays full while the prompt stream lasts. A weight update pauses scheduling with every in-flight
request and its KV cache kept (vLLM's sleep level 0, mode "keep"), loads the new weights and resumes: a response may
span versions, and vLLM labels each token with the version that sampled it (Rollouts.token_versions) beside its
behaviour logprob. Nothing is restarted. The only requests aborted are those the trainer could no longer train
(`min_version`: their first tokens are older than rollout.max_staleness allows), and they are counted.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .base import Rollouts, SamplingConfig


@dataclass
class Group:
    """One finished prompt: its place in the trainer's prompt stream and its n samples."""

    gid: int
    rollouts: Rollouts  # n samples, prompt_index all 0, token_versions set
    admitted_version: int  # the engine's weights when the group started


@dataclass
class LoopStats:
    """What the loop did since the last `take_stats` (seconds; occupancy summed over the engine's busy steps)."""

    steps: int = 0
    busy_s: float = 0.0  # inside engine steps
    idle_s: float = 0.0  # nothing to generate: waiting for prompts (the trainer's admission) or weights
    paused_s: float = 0.0  # weight updates (engine paused, requests kept)
    occupancy_sum: float = 0.0  # running sequences / the engine's max, per step
    finished: int = 0
    dropped: int = 0  # groups aborted because the trainer could no longer train them (staleness)
    extra: dict = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        return {"engine_occupancy": self.occupancy_sum / self.steps if self.steps else 0.0,
                "engine_busy_s": self.busy_s, "engine_idle_s": self.idle_s, "engine_paused_s": self.paused_s,
                "groups_finished": float(self.finished), "groups_dropped_in_engine": float(self.dropped)}


class EngineLoop:
    """Continuous batching over a `VLLMEngine` (add_request / step / pause / resume / abort)."""

    def __init__(self, engine, n: int, sampling: SamplingConfig, *, max_running_seqs: int | None = None):
        self.engine, self.n, self.sampling = engine, n, sampling
        self.max_seqs = int(max_running_seqs or engine.max_num_seqs)
        self.capacity = max(1, self.max_seqs // n)  # groups in the engine at once
        self.waiting: deque[tuple[int, list[int]]] = deque()
        self.running: dict[str, tuple[int, int]] = {}  # request id -> (gid, admitted version)
        self.stats = LoopStats()

    # -- the trainer's side of the conversation ------------------------------------------------------------------------

    def admit(self, prompts: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Prompts that may start as soon as a slot is free (in this order)."""
        self.waiting.extend((int(g), list(map(int, ids))) for g, ids in prompts)

    def update(self, load: Callable[[], dict], min_version: int | None = None) -> dict:
        """New weights mid-generation: pause (in-flight requests and their KV kept), `load()` them, drop what can no
        longer be trained (admitted before `min_version`), resume. Returns load's figures and `kept` / `dropped`."""
        t = time.perf_counter()
        self.engine.pause()
        try:
            before = set(self.running)
            figures = load()
        finally:
            self.engine.resume()
        dropped = self.drop_older_than(min_version) if min_version is not None else []
        kept = len(before) - len(dropped)
        if set(self.running) != before - set(dropped):
            raise RuntimeError("the engine lost requests across a weight update")
        self.stats.paused_s += time.perf_counter() - t
        return {**figures, "kept": kept, "dropped": len(dropped)}

    def drop_older_than(self, min_version: int) -> list[str]:
        """Abort the in-flight groups admitted with weights older than `min_version` (counted as dropped): the
        trainer would refuse them, and their slots serve fresh prompts instead."""
        old = [rid for rid, (_, v) in self.running.items() if v < min_version]
        if old:
            self.engine.abort(old)
            for rid in old:
                del self.running[rid]
            self.stats.dropped += len(old)
        return old

    def abort_all(self) -> list[int]:
        """Stop: abort every in-flight group; the gids of those (and of the waiting prompts) that never finished."""
        gids = [g for g, _ in self.running.values()] + [g for g, _ in self.waiting]
        if self.running:
            self.engine.abort(list(self.running))
        self.running.clear()
        self.waiting.clear()
        return gids

    # -- the loop ------------------------------------------------------------------------------------------------------

    def fill(self) -> int:
        """Start waiting prompts while the engine has room; returns how many started."""
        started = 0
        while self.waiting and len(self.running) < self.capacity:
            gid, ids = self.waiting.popleft()
            rid = f"g{gid}"
            self.engine.add_request(rid, ids, self.n, self.sampling)
            self.running[rid] = (gid, self.engine.weight_version)
            started += 1
        return started

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def step(self) -> list[Group]:
        """Refill, one engine step, and the groups that finished in it."""
        self.fill()
        if not self.running:
            return []
        t = time.perf_counter()
        self.stats.occupancy_sum += min(1.0, self.engine.num_unfinished() / self.max_seqs)
        out = self.engine.step()
        self.stats.busy_s += time.perf_counter() - t
        self.stats.steps += 1
        groups = []
        for rid, rollouts in out:
            if rid not in self.running:  # aborted meanwhile (its last output raced the abort)
                continue
            gid, admitted = self.running.pop(rid)
            groups.append(Group(gid, rollouts, admitted))
        self.stats.finished += len(groups)
        return groups

    def take_stats(self) -> LoopStats:
        stats, self.stats = self.stats, LoopStats()
        return stats
