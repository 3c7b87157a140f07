"""How a batch source talks to the engines, wherever they run: the `Engines` client a placement's `start` returns.

Every rollout mode speaks to engines the same way (rollout/stream_source.py): admit groups, take finished ones from a
`GroupBuffer`, hand a stop's unfinished groups back (`harvest`) and continue them after a resume (`resume`). Each
engine is an `EngineLoop` (rollout/engine_loop.py): split rollout ranks serve theirs (rollout/split.py,
`RemoteEngines`); a colocated trainer rank steps its own in-process between updates (`LocalEngines`, here).

    buffer = engines.open(n, sampling, capacity)   # trainer rank 0: where finished groups arrive
    engines.admit([(gid, prompt ids, seed), ...])   # each group to the engine with the least outstanding work
    gid, rollouts, version = buffer.take(pick, stop)
    engines.harvest()                               # a stop: {gid: samples so far}
    engines.generate(prompts, n, sampling, seed)    # a whole batch beside the stream (held-out accuracy, validation)

Groups are fed by load (`EngineLoads`): a group goes to the engine whose admitted, unfinished groups hold the fewest
expected tokens still to sample (each running group's E[L - g | L > g] per sample after its g tokens so far, L over
the lengths seen; bench/plan.py plans the same rule), not to `gid % engines`; a group stays on one engine, so its
prompt is prefilled once for its n samples.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from typing import Callable, Protocol, Sequence

from ..distributed import trainer_broadcast
from ..slurm import stop_requested
from .base import RolloutInterrupted, Rollouts, SamplingConfig


class Engines(Protocol):
    overlaps: bool  # the engines generate while the trainer trains (their own ranks)

    def open(self, n: int, sampling: SamplingConfig, capacity: int) -> "GroupBuffer | None":
        """(trainer rank 0) The buffer that finished groups of `n` samples arrive in (at most `capacity`
        outstanding)."""

    def admit(self, groups: Sequence[tuple[int, Sequence[int], int | None]]) -> None:
        """(trainer rank 0) Groups that may start now: (gid, prompt ids, request seed or None)."""

    def resume(self, groups: Sequence[tuple[int, Sequence[int], Rollouts, int]]) -> None:
        """(trainer rank 0) Groups a stop cut short, (gid, prompt ids, samples so far, admitted version): the
        engines continue their unfinished samples first."""

    def harvest(self) -> dict[int, Rollouts]:
        """(trainer rank 0, at a stop) Every group aborted, what it sampled so far: {gid: samples}."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int, sampling: SamplingConfig, *,
                 seed: int | None = None) -> Rollouts:
        """`n` samples per prompt beside the stream, the whole batch on every trainer rank (every trainer rank
        calls it); a stop raises RolloutInterrupted on every trainer rank."""

    def follow(self) -> None:
        """(trainer ranks but 0) Take part in the engines' work until trainer rank 0 `release`s them."""

    def release(self) -> None:
        """(trainer rank 0) The step's engine work is done: the other trainer ranks leave `follow`."""


class EngineLoads:
    """Which engine a new group goes to: the one with the least outstanding work, in expected tokens. A group that has
    sampled g tokens per sample is expected to need n x E[L - g | L > g] more, L over the response lengths seen so far
    (the last `window` samples; before any: `expected_length`), g as its engine last reported (`progress`).
    Thread-safe: receiver threads report finished groups and progress."""

    def __init__(self, engines: int, n: int, expected_length: float, window: int = 1024):
        self.n, self.window, self._lock = n, window, threading.Lock()
        self._engines = engines
        self._where: dict[int, list] = {}  # gid -> [engine, tokens per sample so far]
        self._prior = float(expected_length)
        self._recent: deque[int] = deque(maxlen=window)  # finished samples' lengths, newest last
        self._sorted: list[int] = []
        self._suffix: list[float] = [0.0]  # _suffix[i]: sum of _sorted[i:]
        self._dirty = False

    def _residual(self, generated: int) -> float:
        """E[L - g | L > g] over the lengths seen (the prior mean less g, at least one token, before any)."""
        if self._dirty:
            self._sorted = sorted(self._recent)
            self._suffix = [0.0] * (len(self._sorted) + 1)
            for i in range(len(self._sorted) - 1, -1, -1):
                self._suffix[i] = self._suffix[i + 1] + self._sorted[i]
            self._dirty = False
        if not self._sorted:
            return max(self._prior - generated, 1.0)
        i = bisect.bisect_right(self._sorted, generated)
        longer = len(self._sorted) - i
        return self._suffix[i] / longer - generated if longer else 1.0

    def work(self) -> list[float]:
        """Each engine's expected outstanding tokens."""
        with self._lock:
            out = [0.0] * self._engines
            for e, generated in self._where.values():
                out[e] += self.n * self._residual(generated)
            return out

    def assign(self, gid: int) -> int:
        return self.assign_all([gid])[0]

    def assign_all(self, gids) -> list[int]:
        """Engines for several new groups at once (each added to its engine's work before the next is placed)."""
        work = self.work()
        out = []
        with self._lock:
            for gid in gids:
                e = min(range(self._engines), key=lambda i: (work[i], i))
                work[e] += self.n * self._residual(0)
                self._where[int(gid)] = [e, 0]
                out.append(e)
        return out

    def progress(self, generated: dict[int, int]) -> None:
        """An engine's report: its running groups' tokens per sample so far."""
        with self._lock:
            for gid, g in generated.items():
                if int(gid) in self._where:
                    self._where[int(gid)][1] = int(g)

    def finished(self, gid: int, lengths: Sequence[int] = ()) -> None:
        """Group `gid` came back (finished, dropped or harvested); `lengths` its samples' (what is expected learns)."""
        with self._lock:
            self._where.pop(int(gid), None)
            if lengths:
                self._recent.extend(int(x) for x in lengths)
                self._dirty = True

    @property
    def outstanding(self) -> int:
        with self._lock:
            return len(self._where)

    def forget(self) -> None:
        with self._lock:
            self._where.clear()


def engine_figures(per_engine: dict[int, dict[str, float]]) -> dict[str, float]:
    """Each engine's busy fraction since the last step and the spread between the busiest and the idlest."""
    busy = {}
    for e, s in sorted(per_engine.items()):
        total = s.get("busy_s", 0.0) + s.get("idle_s", 0.0) + s.get("paused_s", 0.0)
        busy[e] = s.get("busy_s", 0.0) / total if total > 0 else 0.0
    out = {f"rollout/engine{e}_busy_frac": v for e, v in busy.items()}
    if busy:
        out["rollout/engine_busy_spread"] = max(busy.values()) - min(busy.values())
    return out


def merge_parts(parts, num_prompts: int) -> Rollouts:
    """The engines' parts [(prompt indices, Rollouts)] as one batch in prompt order."""
    samples: dict[int, list[tuple[Rollouts, int]]] = {}
    for indices, r in parts:
        for k, local in enumerate(r.prompt_index):
            samples.setdefault(indices[local], []).append((r, k))
    order = [(r, k, g) for g in range(num_prompts) for r, k in samples.get(g, [])]
    return Rollouts.in_order(order, min((r.weight_version for _, r in parts), default=0))  # the oldest weights count


class BufferError(RuntimeError):
    """The finished-group buffer was filled past its bound, or its producer failed."""


class GroupBuffer:
    """Finished groups waiting for the trainer (trainer rank 0), filled by the engines' side, bounded.

    The bound is the admission's: at most `capacity` groups are admitted and not yet taken, so more finished ones than
    that means the accounting is off; `put` refuses them rather than grow. `take` blocks until a group is in."""

    def __init__(self, capacity: int, producers: int = 1):
        self.capacity = capacity
        self._items: deque = deque()
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._open = producers
        self.max_depth = 0
        self.stats: dict[str, float] = {}
        self.engine_stats: dict[int, dict[str, float]] = {}
        self.ends: list = []
        # answers beside the groups, by kind: "batch" (a side batch's part), "harvest" (an engine's samples so far,
        # at a stop)
        self._answers: dict[str, deque] = {"batch": deque(), "harvest": deque()}

    def put_batch(self, part, kind: str = "batch") -> None:
        with self._cond:
            self._answers[kind].append(part)
            self._cond.notify_all()

    def take_batch(self, kind: str = "batch", *, timeout: float | None = None):
        """The next answer of `kind`; blocks until one is in. Raises what a producer raised, BufferError when every
        producer has stopped, TimeoutError after `timeout` seconds (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._answers[kind]:
                if self._error is not None:
                    raise self._error
                if self._open <= 0:
                    raise BufferError(f"every rollout rank stopped streaming while the trainer waits for its {kind}")
                left = 1.0 if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {kind} answer from the rollout ranks in {timeout:.0f} s")
                self._cond.wait(timeout=min(1.0, left))
            return self._answers[kind].popleft()

    def put(self, items, stats: dict | None = None, engine: int = 0) -> None:
        with self._cond:
            self._items.extend(items)
            if len(self._items) > self.capacity:
                self._error = BufferError(f"{len(self._items)} finished groups buffered, more than the {self.capacity} "
                                          f"the admission allows: the trainer's and the engines' counts disagree")
            self.max_depth = max(self.max_depth, len(self._items))
            mine = self.engine_stats.setdefault(engine, {})
            for k, v in (stats or {}).items():
                self.stats[k] = self.stats.get(k, 0.0) + v
                mine[k] = mine.get(k, 0.0) + v
            self._cond.notify_all()

    def wait_change(self, timeout: float = 1.0) -> None:
        """Until something arrives (or `timeout`); raises what a producer raised."""
        with self._cond:
            if self._error is not None:
                raise self._error
            if self._open <= 0:
                raise BufferError("every rollout rank stopped while the trainer waits for its groups")
            self._cond.wait(timeout=timeout)

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def end(self, payload) -> None:
        """A producer has stopped (its engine aborted what was left: `payload` says what)."""
        with self._cond:
            self._open -= 1
            self.ends.append(payload)
            self._cond.notify_all()

    def take(self, pick: Callable[[list], int | None] | None = None, stop: Callable[[], bool] | None = None):
        """A finished group; blocks until one is in. `pick(items)` chooses among the finished ones (an index, or None:
        wait for more); default the oldest. Raises what a producer raised, or when none is left; RolloutInterrupted
        when `stop()` holds when it would wait (read at least once a second while it waits)."""
        with self._cond:
            while True:
                if self._error is not None:
                    raise self._error
                if self._items:
                    i = pick(list(self._items)) if pick is not None else 0
                    if i is not None:
                        item = self._items[i]
                        del self._items[i]
                        return item
                if self._open <= 0:
                    raise BufferError("every rollout rank stopped streaming while the trainer waits for groups")
                if stop is not None and stop():  # only instead of waiting: groups already in are taken
                    raise RolloutInterrupted("a stop was requested while the step waited for finished groups")
                self._cond.wait(timeout=1.0)

    def take_stats(self) -> tuple[dict[str, float], int, int, dict[int, dict[str, float]]]:
        """(the engines' summed loop figures since the last call, the depth now, the largest depth since, each
        engine's own figures)."""
        with self._cond:
            stats, self.stats = self.stats, {}
            per_engine, self.engine_stats = self.engine_stats, {}
            depth, peak = len(self._items), self.max_depth
            self.max_depth = depth
            return stats, depth, peak, per_engine

    def peek(self) -> dict:
        """The finished groups in the buffer, {gid: samples}, left in it (drop notices left out)."""
        with self._cond:
            return {gid: r for gid, r, _ in self._items if r is not None}

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)


class LocalEngines:
    """Colocated engines: each trainer rank steps its own engine's loop in-process, between updates (nothing
    overlaps: the engine sleeps while its rank trains). Trainer rank 0 decides (admission, which engine); the others
    `follow`: each "run" that rank 0 sends has every rank admit its share and step its loop until its share is done,
    or until a stop that every rank agrees on (rollout/stopping.py: the ranks of a TP engine step in lockstep), and
    the finished groups are gathered into rank 0's buffer. A stop keeps every rank's samples so far for `harvest`."""

    overlaps = False

    def __init__(self, engine, cfg, tools=None):
        from .engine_loop import EngineLoop

        ro = cfg.rollout
        self.engine, self.tools = engine, tools
        self.index, self.count = getattr(engine, "engine_index", 0), getattr(engine, "num_engines", 1)
        self.loop = EngineLoop(engine, ro.n, SamplingConfig.from_rollout_config(ro), tools=tools)
        self.loads = EngineLoads(self.count, ro.n, ro.max_response_length / 2)
        self.buffer: GroupBuffer | None = None
        self._pending: tuple[list, list] = ([], [])  # admitted, resumed: sent with the next run
        self._harvested: dict[int, Rollouts] = {}

    # -- trainer rank 0 ------------------------------------------------------------------------------------------------

    def open(self, n: int, sampling: SamplingConfig, capacity: int) -> GroupBuffer | None:
        self.loop.configure(n, sampling)
        if _rank() != 0:
            return None
        engines = self

        class RunningBuffer(GroupBuffer):
            def take(self, pick=None, stop=None):  # nothing to take yet: the engines run what was admitted
                with self._cond:
                    ready = bool(self._items) and (pick is None or pick(list(self._items)) is not None)
                if not ready and any(engines._pending):
                    engines._send(("run", engines._pending))
                return super().take(pick, stop)

        self.buffer = RunningBuffer(capacity, producers=1)
        return self.buffer

    def admit(self, groups) -> None:
        engines = self.loads.assign_all([g for g, *_ in groups])
        self._pending[0].extend((int(g), list(map(int, ids)), seed, e) for (g, ids, seed), e in zip(groups, engines))

    def resume(self, groups) -> None:
        engines = self.loads.assign_all([g for g, *_ in groups])
        self._pending[1].extend((int(g), list(map(int, ids)), r, int(v), e)
                                for (g, ids, r, v), e in zip(groups, engines))

    def harvest(self) -> dict[int, Rollouts]:
        """A stop's samples so far (kept when the stop cut a run short; between runs nothing is in flight), and the
        admitted groups that never ran (nothing sampled: admitted anew)."""
        kept, self._harvested = self._harvested, {}
        for g, _, samples, _, _ in self._pending[1]:
            kept[g] = samples
        self._pending = ([], [])
        self.loads.forget()
        return kept

    def release(self) -> None:
        if _followers():
            trainer_broadcast(("release", None))

    def _send(self, command) -> None:
        """Rank 0: a command for every trainer rank, then this rank's part of it."""
        if _followers():
            trainer_broadcast(command)
        self._pending = ([], [])
        self._do(command)

    # -- every trainer rank ----------------------------------------------------------------------------------------

    def follow(self) -> None:
        while True:
            command = trainer_broadcast(None)
            if command[0] == "release":
                return
            self._do(command)

    def _do(self, command) -> None:
        kind, (admitted, resumed) = command
        self.loop.resume([(g, ids, r, v) for g, ids, r, v, e in resumed if e == self.index])
        self.loop.admit([(g, ids, seed) for g, ids, seed, e in admitted if e == self.index])
        finished, interrupted = self._step_until_done(lambda: self.loop.busy, self.loop.step)
        kept = self.loop.harvest() if interrupted else {}
        parts = _gather((self.index, [(g.gid, g.rollouts, g.admitted_version) for g in finished], kept,
                         self.loop.take_stats().sums()))
        if self.buffer is None:  # not rank 0: rank 0 keeps the groups (and ends the step at a stop)
            return
        seen = set()
        for e, groups, harvested, stats in parts:
            if e in seen:  # the ranks of one engine hold the same groups: keep one copy
                continue
            seen.add(e)
            for gid, r, _ in groups:
                self.loads.finished(gid, r.sampled_lengths())
            self.buffer.put(groups, stats, engine=e)
            self._harvested.update(dict(harvested))
        if interrupted:
            self.loads.forget()
            raise RolloutInterrupted("a stop was requested during the rollout (agreed by every rank)")

    def _step_until_done(self, busy: Callable[[], bool], step: Callable[[], list]) -> tuple[list, bool]:
        """Step this rank's loop while `busy()`, reading the stop between steps (agreed with the other ranks);
        returns (what the steps returned, whether a stop cut it short)."""
        from .stopping import StopCheck, agreement_group

        many = _followers()
        check = StopCheck(stop_requested, group=agreement_group() if many else None, distributed=many)
        out = []
        try:
            while busy():
                check.before_step()
                t = time.perf_counter()
                out += step()
                check.stepped(time.perf_counter() - t)
            check.finish()
        except RolloutInterrupted:
            return out, True
        return out, False

    def generate(self, prompt_ids, n: int, sampling: SamplingConfig, *, seed: int | None = None) -> Rollouts:
        """Every rank: its engine's share (prompts index, index + engines, ...) as a side batch of its loop; the
        whole batch gathered on every rank in prompt order (a prompt's samples do not depend on the engine count:
        its seed follows its place in the whole batch)."""
        if seed is not None:
            sampling = _with_seed(sampling, seed)
        mine = list(range(self.index, len(prompt_ids), self.count))
        bid = self.loop.add_batch([prompt_ids[i] for i in mine], n, sampling, request_indices=mine)
        done: list = []

        def step():
            self.loop.step()
            part = self.loop.batch_done(bid)
            if part is not None:
                done.append(part)
            return []

        _, interrupted = self._step_until_done(lambda: not done, step)
        if interrupted:
            self.loop.abort_side()
            raise RolloutInterrupted("a stop was requested during the rollout")
        parts = _gather((self.index, mine, done[0]))
        unique = {e: (indices, r) for e, indices, r in parts}
        return merge_parts(list(unique.values()), len(prompt_ids))


def _with_seed(sampling: SamplingConfig, seed: int) -> SamplingConfig:
    import dataclasses

    return dataclasses.replace(sampling, seed=seed)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _followers() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_world_size() > 1


def _gather(obj) -> list:
    """Every trainer rank's `obj` (colocated: the default group), in rank order."""
    import torch.distributed as dist

    if not _followers():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
