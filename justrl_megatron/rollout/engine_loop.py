"""A rollout rank's engine loop for streaming rollouts (the streaming source, rollout/stream_source.py): continuous
batching and partial rollouts across weight updates.

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
from dataclasses import dataclass
from typing import Callable, Sequence

from .base import RolloutInterrupted, Rollouts, SamplingConfig


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

    def sums(self) -> dict[str, float]:
        """The figures as sums (several engines' and several messages' add up; occupancy = its sum / steps)."""
        return {"steps": float(self.steps), "occupancy_sum": self.occupancy_sum, "busy_s": self.busy_s,
                "idle_s": self.idle_s, "paused_s": self.paused_s, "finished": float(self.finished),
                "dropped": float(self.dropped)}


class EngineLoop:
    """Continuous batching over a `VLLMEngine` (add_request / step / pause / resume / abort)."""

    def __init__(self, engine, n: int, sampling: SamplingConfig, *, max_running_seqs: int | None = None):
        self.engine, self.n, self.sampling = engine, n, sampling
        self.max_seqs = int(max_running_seqs or engine.max_num_seqs)
        self.capacity = max(1, self.max_seqs // n)  # groups in the engine at once
        self.waiting: deque[tuple[int, list[int]]] = deque()
        self.running: dict[str, tuple[int, int]] = {}  # request id -> (gid, admitted version)
        self.side: dict[str, tuple[int, int]] = {}  # a side batch's request id -> (batch, prompt)
        self._side_batches: dict[int, dict] = {}
        self.stats = LoopStats()

    # -- the trainer's side of the conversation ------------------------------------------------------------------------

    def admit(self, prompts: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Prompts that may start as soon as a slot is free (in this order)."""
        self.waiting.extend((int(g), list(map(int, ids))) for g, ids in prompts)

    def update(self, load: Callable[[], dict], min_version: int | None = None) -> dict:
        """New weights mid-generation: pause (in-flight requests and their KV kept), `load()` them, resume, then drop
        what can no longer be trained (admitted before `min_version`). Returns load's figures, `kept` (groups that
        went on with the new weights) and `dropped` [(gid, admitted version)]."""
        t = time.perf_counter()
        self.engine.pause()
        try:
            sequences = self.engine.num_unfinished()
            figures = load()
            if self.engine.num_unfinished() != sequences:
                raise RuntimeError(f"the engine lost requests across a weight update ({sequences} in flight before, "
                                   f"{self.engine.num_unfinished()} after)")
        finally:
            self.engine.resume()
        dropped = self.drop_older_than(min_version) if min_version is not None else []
        self.stats.paused_s += time.perf_counter() - t
        return {**figures, "kept": len(self.running), "dropped": dropped}

    def drop_older_than(self, min_version: int) -> list[tuple[int, int]]:
        """Abort the in-flight groups admitted with weights older than `min_version` (counted as dropped): the
        trainer would refuse them, and their slots serve fresh prompts instead. Returns their (gid, version)."""
        old = [rid for rid, (_, v) in self.running.items() if v < min_version]
        if old:
            self.engine.abort(old)
            self.stats.dropped += len(old)
        return [self.running.pop(rid) for rid in old]

    def abort_all(self) -> list[int]:
        """Stop: abort every in-flight group; the gids of those (and of the waiting prompts) that never finished."""
        gids = [g for g, _ in self.running.values()] + [g for g, _ in self.waiting]
        if self.running or self.side:
            self.engine.abort([*self.running, *self.side])
        self.running.clear()
        self.side.clear()
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
        return bool(self.running or self.waiting or self.side)

    def add_batch(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig) -> int:
        """A whole batch beside the stream (held-out accuracy, validation): started at once, outside the admission;
        `batch_done` hands it back. Unseeded: a seed's CPU generator cannot follow a chunked prefill, and the
        stream's requests decide how prompts are chunked."""
        import dataclasses

        sampling = dataclasses.replace(sampling, seed=None)
        bid = len(self._side_batches)
        self._side_batches[bid] = {"size": len(prompts), "done": {}}
        for i, ids in enumerate(prompts):
            rid = f"b{bid}_{i}"
            self.engine.add_request(rid, ids, n, sampling)
            self.side[rid] = (bid, i)
        return bid

    def batch_done(self, bid: int) -> Rollouts | None:
        """Side batch `bid` in prompt order once all of it finished (then forgotten), else None."""
        got = self._side_batches[bid]
        if len(got["done"]) < got["size"]:
            return None
        del self._side_batches[bid]
        parts = [got["done"][i] for i in range(got["size"])]
        if not parts:
            return Rollouts(prompt_index=[], token_ids=[], logprobs=[], finish_reasons=[],
                            weight_version=self.engine.weight_version)
        order = [(r, k, i) for i, r in enumerate(parts) for k in range(len(r))]
        return Rollouts.in_order(order, min(r.weight_version for r in parts))

    def step(self) -> list[Group]:
        """Refill, one engine step, and the groups that finished in it."""
        self.fill()
        if not self.running and not self.side:
            return []
        t = time.perf_counter()
        self.stats.occupancy_sum += min(1.0, self.engine.num_unfinished() / self.max_seqs)
        out = self.engine.step()
        self.stats.busy_s += time.perf_counter() - t
        self.stats.steps += 1
        groups = []
        for rid, rollouts in out:
            if rid in self.side:
                bid, i = self.side.pop(rid)
                self._side_batches[bid]["done"][i] = rollouts
                continue
            if rid not in self.running:  # aborted meanwhile (its last output raced the abort)
                continue
            gid, admitted = self.running.pop(rid)
            groups.append(Group(gid, rollouts, admitted))
        self.stats.finished += len(groups)
        return groups

    def take_stats(self) -> LoopStats:
        stats, self.stats = self.stats, LoopStats()
        return stats
