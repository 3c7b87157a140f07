"""DAPO's dynamic sampling: train only on groups whose rewards differ, sampling more prompt batches to fill the step.

A group whose rewards are all equal (every sample right, or every sample wrong) has zero advantage everywhere
(`grpo.group_advantages`): it costs a rollout and a forward/backward for no policy gradient. With
`algo.dynamic_sampling` the loop calls `collect_groups` once per step with two callables:

    draw_batch()                          -> the next batch of prompts (data/sampler.PromptSampler.next_batch)
    generate_and_score(prompts, round)    -> a ScoredBatch: rollouts + rewards of those prompts, sampled with the
                                             seed `round_seed(trainer.seed, step, round)`

Round 0 is the ordinary step. While fewer than `num_groups` informative groups are in hand and rounds are left
(`algo.max_sampling_rounds`), another batch is drawn and scored; the informative groups are kept in the order they
came and the surplus of the last round is dropped, so the step trains on exactly `num_groups` groups. When the rounds
run out it trains on what it has (fewer groups; `batch/kept_groups` says how many) and, when not one group had any
variance, on the last round's batch as it is (its advantages are all zero: no policy gradient, but the step, its
metrics and its checkpoint happen as usual).

Exact resume: the extra batches come from the same PromptSampler, whose position is checkpointed, and each round's
seed is a pure function of (trainer.seed, step, round): a resumed run draws and samples what an uninterrupted one
would have.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

# Round 0 keeps the training seed trainer.seed * 1_000_003 + step (a run without dynamic sampling is unchanged).
# Extra rounds hash (seed, step, round) into blocks above every training seed (< 2**61 for any sane seed) and above
# validation's range [2**61, 2**61 + 2**60) (train/validation.py); a block leaves room for the per-request offsets
# the engine adds (seed + request * n + sample, vllm_engine.sampling_params), as validation's blocks do.
ROUND_SEED_BASE = 1 << 62
ROUND_SEED_BLOCK = 1 << 24


def round_seed(train_seed: int, step: int, round_index: int) -> int:
    """The rollout seed of sampling round ``round_index`` (0, 1, ...) of ``step``."""
    if round_index == 0:
        return train_seed * 1_000_003 + step
    digest = hashlib.sha256(f"dynamic-sampling:{train_seed}:{step}:{round_index}".encode()).digest()
    return ROUND_SEED_BASE + (int.from_bytes(digest[:8], "little") % (1 << 36)) * ROUND_SEED_BLOCK


def zero_variance_groups(rewards: Sequence[float], group_size: int) -> list[bool]:
    """One flag per consecutive group of ``group_size`` rewards: True when all its rewards are equal."""
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    groups = [rewards[i:i + group_size] for i in range(0, len(rewards), group_size)]
    return [all(r == g[0] for r in g) for g in groups]


@dataclass
class ScoredBatch:
    """One round: prompts (one per group) and their samples, flat and group-major (``group_size`` per prompt).

    ``rollouts`` is a rollout.base.Rollouts (any dataclass whose list fields hold one entry per sample, with
    ``prompt_index`` naming each sample's prompt); ``reward_stats`` are the scorer's counters after this round.
    """

    prompts: list
    rollouts: Any
    rewards: list[float]
    correct: list
    reward_stats: dict = field(default_factory=dict)

    def take(self, groups: Sequence[int], group_size: int) -> "ScoredBatch":
        """The batch restricted to ``groups`` (indices of prompts), in that order."""
        ids = [g * group_size + k for g in groups for k in range(group_size)]
        return ScoredBatch([self.prompts[g] for g in groups], _take_samples(self.rollouts, ids, group_size),
                           [self.rewards[i] for i in ids], [self.correct[i] for i in ids], dict(self.reward_stats))

    @staticmethod
    def concat(batches: Sequence["ScoredBatch"], group_size: int) -> "ScoredBatch":
        """Batches one after the other (the reward counters of the last one: the scorer's are cumulative)."""
        if len(batches) == 1:
            return batches[0]
        first = batches[0].rollouts
        merged = {}
        for f in dataclasses.fields(first):
            values = [getattr(b.rollouts, f.name) for b in batches]
            if all(_per_sample(b.rollouts, v) for b, v in zip(batches, values)):
                merged[f.name] = [v for part in values for v in part]
            elif any(v != values[0] for v in values):
                raise ValueError(f"rounds disagree on rollouts.{f.name}: {values}")
        if "prompt_index" in merged:
            merged["prompt_index"] = [i // group_size for i in range(len(merged["prompt_index"]))]
        return ScoredBatch([p for b in batches for p in b.prompts], dataclasses.replace(first, **merged),
                           [r for b in batches for r in b.rewards], [c for b in batches for c in b.correct],
                           dict(batches[-1].reward_stats))


def _per_sample(rollouts, value) -> bool:
    """A field with one entry per sample (token ids, logprobs, finish reasons, truncated, ...)."""
    return isinstance(value, list) and len(value) == len(rollouts.token_ids)


def _take_samples(rollouts, ids: list[int], group_size: int):
    picked = {f.name: [getattr(rollouts, f.name)[i] for i in ids] for f in dataclasses.fields(rollouts)
              if _per_sample(rollouts, getattr(rollouts, f.name))}
    if "prompt_index" in picked:
        picked["prompt_index"] = [k // group_size for k in range(len(ids))]
    return dataclasses.replace(rollouts, **picked)


@dataclass
class SamplingStats:
    kept_groups: int  # groups with reward variance in the batch trained on
    rounds: int  # prompt batches drawn and sampled this step
    zero_variance_groups: int  # over all rounds
    target: int
    max_rounds: int

    def metrics(self) -> dict[str, float]:
        return {"batch/kept_groups": float(self.kept_groups), "batch/sampling_rounds": float(self.rounds),
                "batch/zero_variance_groups": float(self.zero_variance_groups)}

    def shortfall(self) -> str | None:
        """What to tell the user when the rounds ran out before the batch was full (None when it was full)."""
        if self.kept_groups >= self.target:
            return None
        what = (f"only {self.kept_groups} of {self.target} groups" if self.kept_groups else
                f"no group of {self.target} (the batch trains with zero advantages)")
        return (f"dynamic sampling: {what} had reward variance after {self.rounds} round(s) "
                f"(algo.max_sampling_rounds={self.max_rounds}); raise it, or make the task easier or harder")


def collect_groups(draw_batch: Callable[[], list], generate_and_score: Callable[[list, int], ScoredBatch], *,
                   group_size: int, num_groups: int, max_rounds: int, enabled: bool = True
                   ) -> tuple[ScoredBatch, SamplingStats | None]:
    """Rounds of draw -> generate and score until ``num_groups`` groups have reward variance (at most ``max_rounds``
    rounds); returns exactly ``num_groups`` of them (fewer when the rounds ran out) and the round statistics.
    ``enabled=False``: one round, every group kept, no statistics (the plain GRPO step)."""
    if max_rounds < 1:
        raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
    if not enabled:
        return generate_and_score(draw_batch(), 0), None
    kept: list[ScoredBatch] = []
    have = zero = rounds = 0
    last = None
    while have < num_groups and rounds < max_rounds:
        last = generate_and_score(draw_batch(), rounds)
        rounds += 1
        flat = zero_variance_groups(last.rewards, group_size)
        zero += sum(flat)
        informative = [g for g, f in enumerate(flat) if not f][:num_groups - have]
        if informative:
            kept.append(last.take(informative, group_size))
            have += len(informative)
    batch = ScoredBatch.concat(kept, group_size) if kept else last
    batch.reward_stats = dict(last.reward_stats)
    return batch, SamplingStats(have, rounds, zero, num_groups, max_rounds)
