"""Phases 1-3 of a GRPO step: sample prompts -> rollout -> rewards, in as many rounds as the step needs.

    batch = pipeline.next_batch(step, version, timer)   # the step's scored groups, the same on every trainer rank

Round 0 is one unit, started and collected apart. On-policy (rollout.max_staleness=0) it is started and collected at
once. One-step-off (max_staleness=1, on a placement whose rollout overlaps training: config.py refuses it colocated,
where the engine shares the trainer's devices and nothing could overlap) `next_batch` starts step k+1's unit before
it returns step k's batch, and collects it in the next call: the rollout ranks generate batch k+1 with weights k-1
while the trainer updates on batch k, so a step costs about max(rollout, update) plus the copy. Trainer rank 0
receives those rollouts and scores them in a background thread meanwhile; only the collection touches the trainer
group (one broadcast), so the thread never interleaves with the update's collectives.

With algo.dynamic_sampling, groups whose rewards are all equal are dropped and more rounds are drawn and generated
now (seeded per step and round: algo/dynamic_sampling.round_seed) until trainer.prompts_per_step groups are left.

A unit in flight at a checkpoint is collected (its rollouts are already in: the weight sync waited for them) and saved
with it (`state`); a resumed run trains on exactly that batch (`restore`), as the uninterrupted run did.

A stop (SIGTERM / SIGUSR1 / Ctrl-C) during a rollout aborts it on every rank (rollout.RolloutInterrupted): the step's
prompts go back into the sampler (its position before the step's draw), so that the checkpoint of the last completed
step, and the run resumed from it, draw them again; `next_batch` then returns None. A unit restored from a checkpoint
was drawn before that checkpoint: it stays the unit (prompts only, generated anew at the resume).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field

import torch

from ..algo.dynamic_sampling import SamplingStats, ScoredBatch, collect_groups, round_seed
from ..distributed import trainer_broadcast
from ..rollout import RolloutInterrupted, Rollouts, check_staleness
from ..slurm import stop_requested
from .sampler import Prompt
from .scoring import generate_and_score, score


@dataclass
class StepBatch:
    """Round 0 of a step, the unit that may be in flight: the prompts, their rollouts and rewards."""

    prompts: list[Prompt]
    rollouts: Rollouts
    rewards: list[float]
    correct: list[bool]
    reward_stats: dict
    seconds: dict = field(default_factory=dict)  # rollout / reward phase seconds, and the rollout ranks' waits


@dataclass
class InFlight:
    step: int
    prompts: list[Prompt]
    request: object = None  # the placement's request (`submit`), where rollout overlaps training
    thread: threading.Thread | None = None
    result: StepBatch | None = None  # set when collected (or restored from a checkpoint)
    leader_result: tuple | None = None  # trainer rank 0: (rollouts, rollout stats, rewards, seconds) from the thread
    sampler_before: dict | None = None  # the sampler's position before this unit's draw (None: restored)
    sampler_after: dict | None = None  # ... and after it (a restored unit: the checkpoint's position)


@dataclass
class ScoredStep:
    """What phases 1-3 hand to the update: the step's groups, how they were sampled, how stale they are."""

    batch: ScoredBatch
    sampling_stats: SamplingStats | None  # None without dynamic sampling
    staleness: int  # updates between the weights that generated the batch and the current ones


class RolloutPipeline:
    def __init__(self, rollout, sampler, scorer, tokenizer, *, n: int, sampling, seed: int, leader: bool,
                 max_staleness: int, num_groups: int, dynamic_sampling: bool = False, max_rounds: int = 1,
                 last_step: int | None = None):
        self.rollout, self.sampler, self.scorer, self.tokenizer = rollout, sampler, scorer, tokenizer
        self.n, self.sampling, self.seed, self.leader = n, sampling, seed, leader
        self.max_staleness, self.num_groups = max_staleness, num_groups
        self.dynamic_sampling, self.max_rounds, self.last_step = dynamic_sampling, max_rounds, last_step
        self.ahead = max_staleness >= 1 and rollout.overlaps  # start step k+1 before step k's update
        self._inflight: InFlight | None = None

    @classmethod
    def for_config(cls, cfg, rollout, sampler, scorer, tokenizer, *, leader: bool):
        """The pipeline a config asks for (rollout.n, sampling, staleness and streaming; algo's dynamic sampling)."""
        from ..rollout import SamplingConfig

        ro, tr, algo = cfg.rollout, cfg.trainer, cfg.algo
        if ro.streaming:
            return StreamingPipeline(rollout, sampler, scorer, tokenizer, n=ro.n,
                                     sampling=SamplingConfig.from_rollout_config(ro), leader=leader,
                                     max_staleness=ro.max_staleness, num_groups=tr.prompts_per_step,
                                     dynamic_sampling=algo.dynamic_sampling, max_rounds=algo.max_sampling_rounds,
                                     last_step=tr.total_steps)
        return cls(rollout, sampler, scorer, tokenizer, n=ro.n, sampling=SamplingConfig.from_rollout_config(ro),
                   seed=tr.seed, leader=leader, max_staleness=ro.max_staleness, num_groups=tr.prompts_per_step,
                   dynamic_sampling=algo.dynamic_sampling, max_rounds=algo.max_sampling_rounds,
                   last_step=tr.total_steps)

    def next_batch(self, step: int, version: int, timer) -> ScoredStep | None:
        """Every sampling round of `step` (`version`: updates so far); `timer` (profiling.PhaseTimer) gets the
        phases' seconds: wait_rollout, rollout, reward and the rollout ranks' waits. None: a stop cut the rollout
        short (every trainer rank returns None; the sampler is back where it was before the step's draw)."""
        inflight = self._inflight or self._start(step)
        try:
            return self._next_batch(inflight, step, version, timer)
        except RolloutInterrupted:
            self._put_back(inflight)
            return None

    def _put_back(self, inflight: InFlight) -> None:
        """A stop cut `inflight`'s rollout (or a later round of its step) short: its draw is undone. It stays the
        unit instead where it cannot be drawn again exactly (restored from a checkpoint), or where its rollouts are
        in and could not be made again (one-step-off: sampled by older weights than the checkpoint's)."""
        keep = inflight.result if self.ahead else None
        if inflight.sampler_before is not None and keep is None:
            self.sampler.load_state_dict(inflight.sampler_before)
            self._inflight = None
        else:
            self.sampler.load_state_dict(inflight.sampler_after)
            self._inflight = InFlight(inflight.step, inflight.prompts, result=keep,
                                      sampler_after=inflight.sampler_after)

    def _next_batch(self, inflight: InFlight, step: int, version: int, timer) -> ScoredStep:
        with timer("wait_rollout"):
            first = self._collect(inflight)
        timer.seconds |= first.seconds
        staleness = check_staleness(first.rollouts.weight_version, version, self.max_staleness)
        first_round = [first.prompts]

        def draw_batch():
            return first_round.pop() if first_round else self.sampler.next_batch()

        def rollout_round(prompts, round_index):
            if round_index == 0:
                return ScoredBatch(first.prompts, first.rollouts, first.rewards, first.correct, first.reward_stats)
            return self._extra_round(prompts, round_seed(self.seed, step, round_index), version, timer)

        scored, stats = collect_groups(draw_batch, rollout_round, group_size=self.n, num_groups=self.num_groups,
                                       max_rounds=self.max_rounds, enabled=self.dynamic_sampling)
        # one-step-off: the next step's round 0 starts now, generating with the current weights while this one updates
        ahead = self.ahead and (self.last_step is None or step < self.last_step)
        self._inflight = self._start(step + 1) if ahead else None
        return ScoredStep(scored, stats, staleness)

    def _extra_round(self, prompts, seed: int, version: int, timer) -> ScoredBatch:
        """A dynamic-sampling round: generated now, scored on the leader, the scores broadcast."""
        got = generate_and_score(self.rollout, prompts, self.n, self.sampling, seed=seed, scorer=self.scorer,
                                 tokenizer=self.tokenizer, seconds=timer.seconds)
        check_staleness(got.rollouts.weight_version, version, self.max_staleness)
        rewards, correct, stats = trainer_broadcast((got.rewards, got.correct, got.reward_stats)
                                                    if self.leader else None)
        return ScoredBatch(got.prompts, got.rollouts, list(rewards), list(correct), stats)

    def _start(self, step: int) -> InFlight:
        before = self.sampler.state_dict()
        prompts = self.sampler.next_batch()
        return self._launch(InFlight(step, prompts, sampler_before=before, sampler_after=self.sampler.state_dict()))

    def _launch(self, inflight: InFlight) -> InFlight:
        if self.rollout.overlaps:
            inflight.request = self.rollout.submit([p.ids for p in inflight.prompts], self.n, self.sampling,
                                                   seed=round_seed(self.seed, inflight.step, 0))
            if self.leader:
                inflight.thread = threading.Thread(target=self._receive_and_score, args=(inflight,), daemon=True,
                                                   name=f"rollout-step-{inflight.step}")
                inflight.thread.start()
        return inflight

    def _receive_and_score(self, inflight: InFlight) -> None:
        try:
            rollouts, stats = self.rollout.receive(inflight.request)
            t = time.perf_counter()
            scored = score(self.scorer, self.tokenizer, inflight.prompts, rollouts, self.n)
            inflight.leader_result = (rollouts, stats, scored, time.perf_counter() - t)
        except BaseException as exc:  # noqa: BLE001  (re-raised by _collect, in the loop's thread)
            inflight.leader_result = exc

    def _collect(self, inflight: InFlight) -> StepBatch:
        """Rollouts and rewards of `inflight`, on every trainer rank (each trainer rank calls it)."""
        if inflight.result is not None:
            return inflight.result
        prompts = inflight.prompts
        if self.rollout.overlaps:
            if inflight.request is None:
                self._launch(inflight)
            payload = None
            if self.leader:
                with torch.profiler.record_function("rollout"):  # a named range in a profiler trace, as colocated
                    inflight.thread.join()
                if isinstance(inflight.leader_result, RolloutInterrupted):
                    payload = "interrupted"  # the rollout ranks aborted it: every trainer rank raises
                elif isinstance(inflight.leader_result, BaseException):
                    raise inflight.leader_result
                else:
                    rollouts, stats, scored, reward_s = inflight.leader_result
                    payload = (rollouts, scored, {"rollout": stats.get("generate_s", 0.0), "reward": reward_s,
                                                  **{f"rollout_{k.removesuffix('_s')}": v for k, v in stats.items()
                                                     if k != "generate_s"}})
            payload = trainer_broadcast(payload)
            if isinstance(payload, str):  # "interrupted"
                raise RolloutInterrupted("the rollout ranks aborted the batch (a stop signal)")
            rollouts, scored, seconds = payload
        else:  # every rank's engine generates its share now (SPMD); rank 0 scores
            seconds = {}
            got = generate_and_score(self.rollout, prompts, self.n, self.sampling,
                                     seed=round_seed(self.seed, inflight.step, 0), scorer=self.scorer,
                                     tokenizer=self.tokenizer, seconds=seconds)
            rollouts = got.rollouts
            scored = trainer_broadcast((got.rewards, got.correct, got.reward_stats) if self.leader else None)
        rewards, correct, reward_stats = scored
        inflight.result = StepBatch(prompts, rollouts, list(rewards), list(correct), reward_stats, seconds)
        return inflight.result

    # -- checkpoints ---------------------------------------------------------------------------------------------------

    def state(self) -> dict | None:
        """The in-flight unit as plain data for the checkpoint (collected first: every trainer rank calls this).
        Call it before reading the sampler's position: a unit whose rollout a stop cut short is put back (prompts
        only, or back into the sampler)."""
        inflight = self._inflight
        if inflight is None:
            return None
        if inflight.result is None and inflight.request is None:  # put back by a stop: generated anew at the resume
            return {"step": inflight.step, "prompts": [dataclasses.asdict(p) for p in inflight.prompts]}
        try:
            b = self._collect(inflight)
        except RolloutInterrupted:
            self._put_back(inflight)
            return self.state()
        return {"step": inflight.step, "prompts": [dataclasses.asdict(p) for p in b.prompts],
                "rollouts": dataclasses.asdict(b.rollouts), "rewards": b.rewards, "correct": b.correct,
                "reward_stats": b.reward_stats}

    def restore(self, state: dict | None) -> None:
        """Take back the saved unit; on-policy now (a run resumed with max_staleness=0), its prompts are generated
        again with the current weights."""
        if not state:
            return
        if state.get("streaming"):  # saved by a streaming run: its untrained prompts are not this pipeline's unit
            print(f"justrl-train: warning: {len(state['prompts'])} prompts admitted or drawn by the streaming run "
                  f"are skipped (rollout.streaming is off now)", flush=True)
            return
        prompts = [Prompt(**p) for p in state["prompts"]]
        after = self.sampler.state_dict()  # after the unit's draw: the checkpoint's position
        if not self.ahead or "rollouts" not in state:  # generated by _collect, after the engines got weights
            self._inflight = InFlight(state["step"], prompts, sampler_after=after)
            return
        batch = StepBatch(prompts, Rollouts(**state["rollouts"]), state["rewards"], state["correct"],
                          state["reward_stats"])
        self._inflight = InFlight(state["step"], prompts, result=batch, sampler_after=after)


# --- streaming (rollout.streaming=true) --------------------------------------------------------------------------------

@dataclass
class StreamStats:
    """A streaming step's figures, where the loop reads dynamic sampling's (`metrics`, `shortfall`)."""

    figures: dict

    def metrics(self) -> dict[str, float]:
        return self.figures

    def shortfall(self) -> str | None:
        return None


class StreamingPipeline:
    """The trainer's side of streaming rollouts: admission (the staleness bound) and the step's groups.

    The rollout ranks keep their engines full from the prompts trainer rank 0 admits (train/split_rollout.py,
    rollout/streaming.py) and hand finished groups back into a buffer; `next_batch` takes the first
    trainer.prompts_per_step groups that may be trained and returns at once when the buffer holds them.

    Staleness bound eta = rollout.max_staleness, by admission: at most (eta + 1) * prompts_per_step groups are admitted
    and not yet taken. A step takes the groups that could not wait another step first (waiting for them if they still
    run), then any others in the order they finished (`_pick`): a prompt admitted while the policy was at version w
    is trained by the step that trains version w + eta, however long its responses. Only when more such groups are
    outstanding than a step takes (after dynamic sampling's rejections) are the rest too old: the engines abort them
    at the weight update that makes them so, the trainer drops any that finished meanwhile, both counted
    (rollout/dropped_*), and fresh prompts take their places. No trained token is ever more than eta versions behind
    the policy.

    Checkpoints: the groups buffered or in flight are not saved; their prompts are (`state`), and a resumed run admits
    them first and generates them anew with the resumed weights (rollout/discarded_at_resume counts the discarded
    work). Nothing is trained twice and no prompt is skipped.
    """

    def __init__(self, rollout, sampler, scorer, tokenizer, *, n: int, sampling, leader: bool, max_staleness: int,
                 num_groups: int, dynamic_sampling: bool = False, max_rounds: int = 1, last_step: int | None = None):
        from collections import deque

        self.rollout, self.sampler, self.scorer, self.tokenizer = rollout, sampler, scorer, tokenizer
        self.n, self.sampling, self.leader, self.eta = n, sampling, leader, max_staleness
        self.num_groups, self.dynamic_sampling, self.max_rounds = num_groups, dynamic_sampling, max_rounds
        self.last_step = last_step
        self.capacity = (max_staleness + 1) * num_groups  # groups admitted and not yet taken
        self._queue: deque[Prompt] = deque()  # drawn from the sampler (or restored), not admitted yet
        self._admitted: dict[int, tuple[Prompt, int]] = {}  # gid -> (prompt, the version it was admitted at)
        self._next_gid = 0
        self._open = False
        self._counts = {"dropped_stale": 0, "dropped_in_engine": 0, "discarded_at_resume": 0}

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
        """Top the outstanding groups up to the bound (no more than the remaining steps can take)."""
        room = self.capacity - len(self._admitted)
        if self.last_step is not None:
            room = min(room, (self.last_step - step + 1) * self.num_groups - len(self._admitted))
        batch = []
        for _ in range(max(room, 0)):
            if not self._queue:
                self._queue.extend(self.sampler.next_batch())
            prompt, gid = self._queue.popleft(), self._next_gid
            self._next_gid += 1
            self._admitted[gid] = (prompt, version)
            batch.append((gid, prompt.ids))
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
        if not self._open:
            self.rollout.stream_open(self.n, self.sampling, self.capacity)
            self._open = True
        self._admit(step, version)
        buffer, counts = self.rollout.buffer, dict.fromkeys(self._counts, 0)
        kept, zero_variance, taken = [], 0, 0
        wait = reward = 0.0
        pick = self._pick(version, lambda: self.num_groups - len(kept))
        taken_back: dict[int, tuple[Prompt, int]] = {}  # what a stop puts back: the groups this step took to train
        while len(kept) < self.num_groups:
            t = time.perf_counter()
            try:
                gid, rollouts, _ = buffer.take(pick, stop=stop_requested)
            except RolloutInterrupted:
                self._admitted.update(taken_back)
                raise
            wait += time.perf_counter() - t
            prompt, admitted = self._admitted.pop(gid)
            if rollouts is None:  # aborted by its engine: too old to train
                counts["dropped_in_engine"] += 1
                self._admit(step, version)
                continue
            if version - rollouts.weight_version > self.eta:  # finished, but too old by now
                counts["dropped_stale"] += 1
                self._admit(step, version)
                continue
            t = time.perf_counter()
            rewards, correct, reward_stats = score(self.scorer, self.tokenizer, [prompt], rollouts, self.n)
            reward += time.perf_counter() - t
            taken += 1
            taken_back[gid] = (prompt, admitted)
            # dynamic sampling: a group without reward variance teaches nothing; after max_rounds batches' worth of
            # groups the step takes what comes (as the synchronous rounds do when they run out)
            if (self.dynamic_sampling and len(set(rewards)) == 1
                    and taken < self.max_rounds * self.num_groups):
                zero_variance += 1
                self._admit(step, version)
                continue
            kept.append((prompt, rollouts, rewards, correct, reward_stats))
        for k, v in counts.items():
            self._counts[k] += v
        counts["discarded_at_resume"], self._counts["discarded_at_resume"] = self._counts["discarded_at_resume"], 0
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

    def restore(self, state: dict | None) -> None:
        if not state:
            return
        self._queue.extendleft(reversed([Prompt(**p) for p in state["prompts"]]))
        self._counts["discarded_at_resume"] = int(state.get("outstanding", len(state["prompts"])))
