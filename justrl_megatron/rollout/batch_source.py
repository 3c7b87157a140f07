"""The rounds source (rollout.source=rounds, the default): sample prompts -> rollout -> rewards, in as many
rounds as the step needs, synchronous or one-step-off.

    batch = source.next_batch(step, version, timer)   # the step's scored groups, the same on every trainer rank

Round 0 is one unit, started and collected apart. On-policy (rollout.max_staleness=0) it is started and collected at
once. One-step-off (max_staleness=1, on a placement whose rollout overlaps training: `problems` refuses it on one
that does not, where the engine shares the trainer's devices and nothing could overlap) `next_batch` starts step
k+1's unit before it returns step k's batch, and collects it in the next call: the rollout ranks generate batch k+1
with weights k-1 while the trainer updates on batch k, so a step costs about max(rollout, update) plus the copy.
Trainer rank 0 receives those rollouts and scores them in a background thread meanwhile; only the collection touches
the trainer group (one broadcast), so the thread never interleaves with the update's collectives.

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

from ..algo.dynamic_sampling import ScoredBatch, collect_groups, round_seed
from ..data.sampler import Prompt
from ..distributed import trainer_broadcast
from .base import RolloutInterrupted, Rollouts, SamplingConfig, check_staleness
from .placement import overlaps
from .scoring import generate_and_score, score
from .source import ScoredStep


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


class RoundSource:
    """A `BatchSource` (rollout/source.py): every sampling round of a step; one-step-off where the placement overlaps
    rollout and training and rollout.max_staleness >= 1."""

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
    def from_config(cls, cfg, rollout, sampler, scorer, tokenizer, *, leader: bool) -> "RoundSource":
        """rollout.n, sampling and max_staleness; algo's dynamic sampling; trainer's seed and batch size."""
        ro, tr, algo = cfg.rollout, cfg.trainer, cfg.algo
        return cls(rollout, sampler, scorer, tokenizer, n=ro.n, sampling=SamplingConfig.from_rollout_config(ro),
                   seed=tr.seed, leader=leader, max_staleness=ro.max_staleness, num_groups=tr.prompts_per_step,
                   dynamic_sampling=algo.dynamic_sampling, max_rounds=algo.max_sampling_rounds,
                   last_step=tr.total_steps)

    @staticmethod
    def problems(cfg) -> list[str]:
        """Asynchronous rounds need a placement whose rollout overlaps training; staleness beyond one step needs a
        rollout correction."""
        ro, out = cfg.rollout, []
        if ro.max_staleness >= 1 and not overlaps(ro.placement):
            out.append(f"rollout.max_staleness={ro.max_staleness} (asynchronous rollouts) needs "
                       f"rollout.placement=split with rollout.num_rollout_ranks >= 1: a colocated engine shares the "
                       f"trainer's devices, so nothing overlaps; use max_staleness=0")
        return out + correction_problems(cfg)

    def min_version(self, version: int) -> int | None:
        return None  # a batch generates with one version: the weight update waits for it

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

    def stop_state(self) -> None:
        """`state` holds the unit in flight whole (its rollouts, collected at the save): nothing more at a stop."""
        return None

    def restore(self, state: dict | None) -> None:
        """Take back the saved unit; on-policy now (a run resumed with max_staleness=0), its prompts are generated
        again with the current weights."""
        if not state:
            return
        if state.get("streaming"):  # saved by a streaming run: its untrained prompts are not this source's unit
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


def correction_problems(cfg) -> list[str]:
    """Samples more than one update old need a rollout correction (every source that trains stale samples)."""
    ro = cfg.rollout
    if ro.max_staleness > 1 and cfg.algo.rollout_correction == "none":
        return [f"rollout.max_staleness={ro.max_staleness} trains on samples up to {ro.max_staleness} updates old; "
                f"set algo.rollout_correction (tis, mis, seq-tis or seq-mis) to correct for it, or use "
                f"max_staleness=1 (one-step-off)"]
    return []
