"""Phases 1-3 of a GRPO step as one unit: sample prompts -> rollout -> rewards, started and collected apart.

    inflight = pipeline.start(step)        # prompts sampled; with split placement the rollout ranks start generating
    batch = pipeline.collect(inflight)     # rollouts + rewards, the same on every trainer rank

On-policy (rollout.max_staleness=0) the loop starts and collects at once. One-step-off (max_staleness=1, split
placement only: config.py refuses it colocated, where the engine shares the trainer's devices and nothing could
overlap) it starts step k+1's unit before step k's update and collects it after the weight sync: the rollout ranks
generate batch k+1 with weights k-1 while the trainer updates on batch k, so a step costs about max(rollout, update)
plus the copy. Trainer rank 0 receives the rollouts and scores them in a background thread meanwhile; only
collect() touches the trainer group (one broadcast), so the thread never interleaves with the update's collectives.

A unit in flight at a checkpoint is collected (its rollouts are already in: the weight sync waited for them) and saved
with it (`state`); a resumed run trains on exactly that batch (`restore`), as the uninterrupted run did.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field

import torch

from ..rollout import Rollouts
from .sampler import Prompt
from .split_rollout import trainer_broadcast


@dataclass
class StepBatch:
    """What phases 1-3 hand to the update: the prompts, their rollouts and rewards."""

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
    request: object = None  # SplitRollout's request
    thread: threading.Thread | None = None
    result: StepBatch | None = None  # set when collected (or restored from a checkpoint)
    leader_result: tuple | None = None  # trainer rank 0: (rollouts, rollout stats, rewards, seconds) from the thread


class RolloutPipeline:
    def __init__(self, rollout, sampler, scorer, tokenizer, *, n: int, sampling, seed: int, leader: bool,
                 max_staleness: int):
        self.rollout, self.sampler, self.scorer, self.tokenizer = rollout, sampler, scorer, tokenizer
        self.n, self.sampling, self.seed, self.leader = n, sampling, seed, leader
        self.overlaps = getattr(rollout, "overlaps", False)
        self.ahead = max_staleness >= 1 and self.overlaps  # start step k+1 before step k's update

    def step_seed(self, step: int) -> int:
        """Seeded per step, so that a resumed run samples what an uninterrupted one would have."""
        return self.seed * 1_000_003 + step

    def start(self, step: int) -> InFlight:
        return self._launch(InFlight(step, self.sampler.next_batch()))

    def _launch(self, inflight: InFlight) -> InFlight:
        if self.overlaps:
            inflight.request = self.rollout.submit([p.ids for p in inflight.prompts], self.n, self.sampling,
                                                   seed=self.step_seed(inflight.step))
            if self.leader:
                inflight.thread = threading.Thread(target=self._receive_and_score, args=(inflight,), daemon=True,
                                                   name=f"rollout-step-{inflight.step}")
                inflight.thread.start()
        return inflight

    def _receive_and_score(self, inflight: InFlight) -> None:
        try:
            rollouts, stats = self.rollout.receive(inflight.request)
            t = time.perf_counter()
            scored = self.score(inflight.prompts, rollouts)
            inflight.leader_result = (rollouts, stats, scored, time.perf_counter() - t)
        except BaseException as exc:  # noqa: BLE001  (re-raised by collect, in the loop's thread)
            inflight.leader_result = exc

    def score(self, prompts, rollouts) -> tuple:
        """(rewards, correct, reward stats) of `rollouts` (n per prompt); on the leader, which holds the scorer."""
        texts = self.tokenizer.batch_decode(rollouts.token_ids, skip_special_tokens=True)
        answers = [prompts[i // self.n].answer for i in range(len(texts))]
        rewards, correct = self.scorer.evaluate(texts, answers)
        return rewards, correct, dict(self.scorer.stats)

    def collect(self, inflight: InFlight) -> StepBatch:
        """Rollouts and rewards of `inflight`, on every trainer rank (each trainer rank calls it)."""
        if inflight.result is not None:
            return inflight.result
        prompts = inflight.prompts
        if self.overlaps:
            if inflight.request is None:
                self._launch(inflight)
            payload = None
            if self.leader:
                with torch.profiler.record_function("rollout"):  # a named range in a profiler trace, as colocated
                    inflight.thread.join()
                if isinstance(inflight.leader_result, BaseException):
                    raise inflight.leader_result
                rollouts, stats, scored, reward_s = inflight.leader_result
                payload = (rollouts, scored, {"rollout": stats.get("generate_s", 0.0), "reward": reward_s,
                                              **{f"rollout_{k.removesuffix('_s')}": v for k, v in stats.items()
                                                 if k != "generate_s"}})
            rollouts, scored, seconds = trainer_broadcast(payload)
        else:  # colocated: every rank's engine generates its share now (SPMD); rank 0 scores
            t = time.perf_counter()
            with torch.profiler.record_function("rollout"):  # named ranges in a profiler trace (train/profiling.py)
                rollouts = self.rollout.generate([p.ids for p in prompts], self.n, self.sampling,
                                                 seed=self.step_seed(inflight.step))
            t_reward = time.perf_counter()
            with torch.profiler.record_function("reward"):
                scored = trainer_broadcast(self.score(prompts, rollouts) if self.leader else None)
            seconds = {"rollout": t_reward - t, "reward": time.perf_counter() - t_reward}
        rewards, correct, reward_stats = scored
        inflight.result = StepBatch(prompts, rollouts, list(rewards), list(correct), reward_stats, seconds)
        return inflight.result

    # -- checkpoints ---------------------------------------------------------------------------------------------------

    def state(self, inflight: InFlight | None) -> dict | None:
        """The in-flight unit as plain data for the checkpoint (collected first: every trainer rank calls this)."""
        if inflight is None:
            return None
        b = self.collect(inflight)
        return {"step": inflight.step, "prompts": [dataclasses.asdict(p) for p in b.prompts],
                "rollouts": dataclasses.asdict(b.rollouts), "rewards": b.rewards, "correct": b.correct,
                "reward_stats": b.reward_stats}

    def restore(self, state: dict | None) -> InFlight | None:
        """The saved unit; on-policy now (a run resumed with max_staleness=0), its prompts are generated again with
        the current weights."""
        if not state:
            return None
        prompts = [Prompt(**p) for p in state["prompts"]]
        if not self.ahead:
            return InFlight(state["step"], prompts)  # launched by collect, after the engines got the weights
        batch = StepBatch(prompts, Rollouts(**state["rollouts"]), state["rewards"], state["correct"],
                          state["reward_stats"])
        return InFlight(state["step"], prompts, result=batch)
