"""The streaming source (rollout.streaming=true): the trainer's side of streaming rollouts, on trainer rank 0.

The rollout ranks keep their engines full from the prompts this source admits (rollout/split.py serves them with
rollout/engine_loop.EngineLoop) and hand finished groups back into a `GroupBuffer`; `next_batch` takes the first
trainer.prompts_per_step groups that may be trained and returns at once when the buffer holds them.

Staleness bound eta = rollout.max_staleness, by admission: at most (eta + 1) * prompts_per_step groups are admitted
and not yet taken. A step takes the groups that could not wait another step first (waiting for them if they still
run), then any others in the order they finished (`_pick`): a prompt admitted while the policy was at version w is
trained by the step that trains version w + eta, however long its responses. Only when more such groups are
outstanding than a step takes (after dynamic sampling's rejections) are the rest too old: the engines abort them at
the weight update that makes them so (`min_version`, handed to the placement's publish), the trainer drops any that
finished meanwhile, both counted (rollout/dropped_*), and fresh prompts take their places. No trained token is ever
more than eta versions behind the policy.

Checkpoints: a checkpoint saves the prompts not trained yet (`state`); a resumed run admits them first. A stop
(SIGTERM, SIGUSR1, Ctrl-C) keeps the samples too: `stop_state`, read after the stop's checkpoint, has the engines
abort every group and hand back what it sampled so far (tokens, behaviour logprobs, per-token versions), beside the
finished groups not trained yet; the resumed run continues them where they stopped (rollout/continued_at_resume),
each under its first admission's version, so the bound still counts from its first token. After a crash only the
prompts are there: they are generated anew (rollout/discarded_at_resume counts the groups whose work was lost).
Nothing is trained twice and no prompt is skipped.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from ..algo.dynamic_sampling import ScoredBatch
from ..data.sampler import Prompt
from ..distributed import trainer_broadcast
from ..slurm import stop_requested
from .base import RolloutInterrupted, Rollouts, SamplingConfig, check_staleness
from .batch_source import correction_problems
from .placement import overlaps
from .scoring import score
from .source import ScoredStep


@dataclass
class StreamStats:
    """A streaming step's figures, where the loop reads dynamic sampling's (`metrics`, `shortfall`)."""

    figures: dict

    def metrics(self) -> dict[str, float]:
        return self.figures

    def shortfall(self) -> str | None:
        return None


class StreamSource:
    """A `BatchSource` (rollout/source.py): admission (the staleness bound) and the step's groups (module doc)."""

    def __init__(self, rollout, sampler, scorer, tokenizer, *, n: int, sampling, leader: bool, max_staleness: int,
                 num_groups: int, dynamic_sampling: bool = False, max_rounds: int = 1, last_step: int | None = None):
        self.rollout, self.sampler, self.scorer, self.tokenizer = rollout, sampler, scorer, tokenizer
        self.n, self.sampling, self.leader, self.eta = n, sampling, leader, max_staleness
        self.num_groups, self.dynamic_sampling, self.max_rounds = num_groups, dynamic_sampling, max_rounds
        self.last_step = last_step
        self.capacity = (max_staleness + 1) * num_groups  # groups admitted and not yet taken
        self._queue: deque[Prompt] = deque()  # drawn from the sampler (or restored), not admitted yet
        self._admitted: dict[int, tuple[Prompt, int]] = {}  # gid -> (prompt, the version it was admitted at)
        self._next_gid = 0
        self._buffer: GroupBuffer | None = None  # trainer rank 0: finished groups (the placement fills it)
        self._finished: dict[int, Rollouts] = {}  # groups a stopped step had taken, not trained
        self._resumed: deque[tuple[Prompt, int, Rollouts]] = deque()  # a stop's groups: (prompt, version, so far)
        self._counts = {"dropped_stale": 0, "dropped_in_engine": 0, "discarded_at_resume": 0,
                        "continued_at_resume": 0}

    @classmethod
    def from_config(cls, cfg, rollout, sampler, scorer, tokenizer, *, leader: bool) -> "StreamSource":
        """rollout.n, sampling and max_staleness (eta); algo's dynamic sampling; trainer's batch size."""
        ro, tr, algo = cfg.rollout, cfg.trainer, cfg.algo
        return cls(rollout, sampler, scorer, tokenizer, n=ro.n, sampling=SamplingConfig.from_rollout_config(ro),
                   leader=leader, max_staleness=ro.max_staleness, num_groups=tr.prompts_per_step,
                   dynamic_sampling=algo.dynamic_sampling, max_rounds=algo.max_sampling_rounds,
                   last_step=tr.total_steps)

    @staticmethod
    def problems(cfg) -> list[str]:
        """Streaming needs a placement whose engines run beside the trainer, and eta >= 1."""
        ro, out = cfg.rollout, []
        if not overlaps(ro.placement):
            out.append("rollout.streaming=true needs rollout.placement=split: a colocated engine shares the trainer's "
                       "devices, so generation and training cannot overlap; drop rollout.streaming or use split")
        elif ro.max_staleness < 1:
            out.append(f"rollout.streaming=true needs rollout.max_staleness >= 1 (a response may span weight versions "
                       f"and waits in the buffer while the trainer updates), got {ro.max_staleness}")
        if cfg.algo.routing_replay == "rollout":
            out.append("algo.routing_replay=rollout does not work with rollout.streaming=true (the engine loop returns "
                       "no routed experts, and a response may span weight versions); use algo.routing_replay=old")
        return out + correction_problems(cfg)

    def min_version(self, version: int) -> int | None:
        """Groups started before version - eta could not be trained any more: the engines drop them."""
        return version - self.eta

    def next_batch(self, step: int, version: int, timer) -> ScoredStep | None:
        """The step's groups. None: a stop (SIGTERM / SIGUSR1 / Ctrl-C) came while the step waited for them: every
        trainer rank returns None, and the groups it had taken go back among the admitted ones, whose prompts the
        checkpoint saves (a long tail never holds a requeue up)."""
        payload = None
        if self.leader:
            try:
                payload = self._take(step, version)
            except RolloutInterrupted:
                payload = "interrupted"
        payload = trainer_broadcast(payload)
        if payload == "interrupted":
            return None
        prompts, rollouts, rewards, correct, reward_stats, figures, seconds, sampler_state = payload
        self.sampler.load_state_dict(sampler_state)  # only trainer rank 0 draws: every rank keeps its position
        timer.seconds |= seconds
        staleness = int(figures["rollout/staleness_max"])
        check_staleness(version - staleness, version, self.eta)  # the bound, once more, on every trainer rank
        return ScoredStep(ScoredBatch(prompts, rollouts, rewards, correct, reward_stats), StreamStats(figures),
                          staleness)

    # -- trainer rank 0 ------------------------------------------------------------------------------------------------

    def _admit(self, step: int, version: int) -> None:
        """Top the outstanding groups up to the bound (no more than the remaining steps can take): the groups a stop
        cut short first (under their own admission's version, unless a smaller bound now makes them too old), then
        fresh prompts."""
        room = self.capacity - len(self._admitted)
        if self.last_step is not None:
            room = min(room, (self.last_step - step + 1) * self.num_groups - len(self._admitted))
        resumed, batch = [], []
        for _ in range(max(room, 0)):
            gid = self._next_gid
            self._next_gid += 1
            if self._resumed:
                prompt, admitted, samples = self._resumed.popleft()
                if admitted >= version - self.eta:
                    self._admitted[gid] = (prompt, admitted)
                    resumed.append((gid, prompt.ids, samples, admitted))
                    continue
                self._counts["discarded_at_resume"] += 1
            else:
                if not self._queue:
                    self._queue.extend(self.sampler.next_batch())
                prompt = self._queue.popleft()
            self._admitted[gid] = (prompt, version)
            batch.append((gid, prompt.ids))
        self.rollout.stream_resume(resumed)
        self.rollout.stream_admit(batch)

    def _pick(self, version: int, needed):
        """Which finished group the step takes next (GroupBuffer.take's `pick`): an engine's drop notice first (it
        frees admission room), then the groups that cannot wait another step (admitted eta or more versions ago:
        trained now or never), then any, in the order they finished. While an expiring group still runs and the step
        has no other room for it, the step waits for it: a long response is trained, not thrown away for a shorter
        one that overtook it (which would bias training against long answers and waste its tokens)."""
        def expiring(gid: int) -> bool:
            return version + 1 - self._admitted[gid][1] > self.eta

        def pick(items: list) -> int | None:
            for i, (gid, rollouts, _) in enumerate(items):
                if rollouts is None or expiring(gid):
                    return i
            running = sum(expiring(gid) for gid in self._admitted)  # none is in the buffer (the loop above)
            return 0 if needed() > running else None

        return pick

    def _take(self, step: int, version: int):
        if self._buffer is None:
            self._buffer = self.rollout.stream_open(self.n, self.sampling, self.capacity)
        self._admit(step, version)
        buffer, counts = self._buffer, dict.fromkeys(self._counts, 0)
        kept, kept_gids, zero_variance, taken = [], [], 0, 0
        untrained: dict[int, list[int]] = {}  # groups the engines finished that the step drops: their lengths
        wait = reward = 0.0
        pick = self._pick(version, lambda: self.num_groups - len(kept))
        taken_back: dict[int, tuple[Prompt, int]] = {}  # what a stop puts back: the groups this step took to train
        taken_samples: dict[int, Rollouts] = {}
        while len(kept) < self.num_groups:
            t = time.perf_counter()
            try:
                gid, rollouts, _ = buffer.take(pick, stop=stop_requested)
            except RolloutInterrupted:
                self._admitted.update(taken_back)
                self._finished.update(taken_samples)
                raise
            wait += time.perf_counter() - t
            prompt, admitted = self._admitted.pop(gid)
            if rollouts is None:  # aborted by its engine: too old to train
                counts["dropped_in_engine"] += 1
                self._admit(step, version)
                continue
            if version - rollouts.weight_version > self.eta:  # finished, but too old by now
                counts["dropped_stale"] += 1
                untrained[gid] = rollouts.sampled_lengths()
                self._admit(step, version)
                continue
            t = time.perf_counter()
            rewards, correct, reward_stats = score(self.scorer, self.tokenizer, [prompt], rollouts, self.n)
            reward += time.perf_counter() - t
            taken += 1
            taken_back[gid], taken_samples[gid] = (prompt, admitted), rollouts
            # dynamic sampling: a group without reward variance teaches nothing; after max_rounds batches' worth of
            # groups the step takes what comes (as the synchronous rounds do when they run out)
            if (self.dynamic_sampling and len(set(rewards)) == 1
                    and taken < self.max_rounds * self.num_groups):
                zero_variance += 1
                untrained[gid] = rollouts.sampled_lengths()
                self._admit(step, version)
                continue
            kept.append((prompt, rollouts, rewards, correct, reward_stats))
            kept_gids.append(gid)
        for k, v in counts.items():
            self._counts[k] += v
        for k in ("discarded_at_resume", "continued_at_resume"):  # counted once, by the first step after a resume
            counts[k], self._counts[k] = self._counts[k], 0
        order = [(r, k, g) for g, (_, r, *_) in enumerate(kept) for k in range(len(r))]
        versions = [r.versions_of(k) for r, k, _ in order]
        oldest = [min(v, default=version) for v in versions]
        rollouts = Rollouts.in_order(order, min(oldest))
        rollouts.token_versions = versions
        lags = [version - o for o in oldest]
        engine, depth, peak = buffer.take_stats()
        engine_s = engine.get("busy_s", 0.0) + engine.get("idle_s", 0.0) + engine.get("paused_s", 0.0)
        figures = {
            "rollout/staleness_mean": sum(lags) / len(lags), "rollout/staleness_max": float(max(lags)),
            "rollout/multi_version_frac": sum(len(set(v)) > 1 for v in versions) / len(versions),
            "rollout/engine_occupancy": engine["occupancy_sum"] / engine["steps"] if engine.get("steps") else 0.0,
            "rollout/engine_idle_frac": engine.get("idle_s", 0.0) / engine_s if engine_s else 0.0,
            "rollout/buffer_depth": float(depth), "rollout/buffer_peak": float(peak),
            "rollout/admitted_outstanding": float(len(self._admitted)),
            # each trained group's admission number since this process started (beside response/lengths), and
            # those of the finished groups the step dropped with their lengths: the trace bench/plan.py replays
            "rollout/group_admission": kept_gids,
            "rollout/untrained_admission": list(untrained),
            "rollout/untrained_lengths": [x for lengths in untrained.values() for x in lengths],
            **{f"rollout/{k}": float(v) for k, v in counts.items()},
        }
        if self.dynamic_sampling:
            figures |= {"batch/kept_groups": float(len(kept)), "batch/zero_variance_groups": float(zero_variance)}
        seconds = {"wait_rollout": wait, "reward": reward, "rollout_idle": engine.get("idle_s", 0.0),
                   "rollout_paused": engine.get("paused_s", 0.0), "rollout_busy": engine.get("busy_s", 0.0)}
        return ([p for p, *_ in kept], rollouts, [x for *_, rw, _, _ in kept for x in rw],
                [x for *_, c, _ in kept for x in c], kept[-1][4], figures, seconds, self.sampler.state_dict())

    # -- checkpoints ---------------------------------------------------------------------------------------------------

    def state(self) -> dict:
        """The prompts not trained yet (admitted ones in admission order, then the drawn ones), on every trainer
        rank. Their samples, buffered or in flight, are not saved: a resumed run generates them anew."""
        prompts = None
        if self.leader:
            prompts = [dataclasses.asdict(p) for _, (p, _) in sorted(self._admitted.items())]
            prompts += [dataclasses.asdict(p) for p in self._queue]
        return {"streaming": True, "prompts": trainer_broadcast(prompts),
                "outstanding": trainer_broadcast(len(self._admitted) if self.leader else None)}

    def stop_state(self) -> dict | None:
        """At a stop, after its checkpoint (trainer rank 0; None elsewhere): every admitted group with what it
        sampled so far (the engines abort them and hand it back; finished ones come from the buffer), then the
        drawn prompts. The engines generate nothing more in this run."""
        if not self.leader:
            return None
        samples = dict(self._finished)
        if self._buffer is not None:
            try:
                samples.update(self.rollout.stream_harvest())  # each engine's finished groups arrive before its answer
            except Exception as exc:  # noqa: BLE001 - an engine gone: the checkpoint's prompts still resume the run
                print(f"justrl-train: warning: the rollout ranks did not hand back their groups at the stop ({exc}); "
                      f"the resumed run generates them anew", flush=True)
                return None
            while len(self._buffer):
                gid, rollouts, _ = self._buffer.take()
                if rollouts is not None:  # (a drop notice: that group is admitted anew)
                    samples[gid] = rollouts
        groups = [{"prompt": dataclasses.asdict(p), "version": v,
                   "samples": dataclasses.asdict(samples[gid]) if gid in samples else None}
                  for gid, (p, v) in sorted(self._admitted.items())]
        return {"streaming": True, "groups": groups, "prompts": [dataclasses.asdict(p) for p in self._queue]}

    def restore(self, state: dict | None) -> None:
        if not state:
            return
        fresh = [Prompt(**g["prompt"]) for g in state.get("groups", []) if g["samples"] is None]
        for g in state.get("groups", []):  # saved at a stop: these go on where they stopped
            if g["samples"] is not None:
                self._resumed.append((Prompt(**g["prompt"]), int(g["version"]), Rollouts(**g["samples"])))
        self._queue.extendleft(reversed(fresh + [Prompt(**p) for p in state["prompts"]]))
        self._counts["continued_at_resume"] = len(self._resumed)
        self._counts["discarded_at_resume"] = int(state.get("outstanding", 0))


class BufferError(RuntimeError):
    """The finished-group buffer was filled past its bound, or its producer failed."""


class GroupBuffer:
    """Finished groups waiting for the trainer (trainer rank 0), filled by receiver threads, bounded.

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
        self.ends: list = []
        # answers beside the groups, by kind: "batch" (a side batch's part: the split placement's generate while
        # streaming), "harvest" (an engine's samples so far, at a stop)
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

    def put(self, items, stats: dict | None = None) -> None:
        with self._cond:
            self._items.extend(items)
            if len(self._items) > self.capacity:
                self._error = BufferError(f"{len(self._items)} finished groups buffered, more than the {self.capacity} "
                                          f"the admission allows: the trainer's and the engines' counts disagree")
            self.max_depth = max(self.max_depth, len(self._items))
            for k, v in (stats or {}).items():
                self.stats[k] = self.stats.get(k, 0.0) + v
            self._cond.notify_all()

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

    def take_stats(self) -> tuple[dict[str, float], int, int]:
        """(the engines' summed loop figures since the last call, the depth now, the largest depth since)."""
        with self._cond:
            stats, self.stats = self.stats, {}
            depth, peak = len(self._items), self.max_depth
            self.max_depth = depth
            return stats, depth, peak

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)
