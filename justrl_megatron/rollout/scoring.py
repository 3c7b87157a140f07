"""Generate and score: the one way the trainer turns prompts into rewarded samples (training rounds, the held-out
accuracy, validation sets).

Every trainer rank generates (the engines' client gives each the whole batch); the rank that holds the scorer (rank
0) decodes and verifies. `generate_and_score` returns what that rank knows: elsewhere the rewards are None, and
evaluation keeps them on rank 0.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from ..algo.dynamic_sampling import ScoredBatch


def score(scorer, tokenizer, prompts: Sequence, rollouts, n: int) -> tuple[list, list, dict]:
    """(rewards, correct, the scorer's counters) of `rollouts`, `n` samples per prompt in prompt order."""
    texts = tokenizer.batch_decode(rollouts.token_ids, skip_special_tokens=True)
    answers = [prompts[i // n].answer for i in range(len(texts))]
    rewards, correct = scorer.evaluate(texts, answers)
    return rewards, correct, dict(scorer.stats)


def generate_and_score(rollout, prompts: Sequence, n: int, sampling, *, seed: int, scorer, tokenizer,
                       seconds: dict | None = None) -> ScoredBatch:
    """`n` samples of each prompt from the engines' client `rollout` (rollout/engines.py), seeded `seed`, scored
    where `scorer` is not None (rewards, correct and reward_stats None elsewhere). `seconds`: "rollout" and "reward"
    times are added to it, and each phase is a named range in a profiler trace."""
    t = time.perf_counter()
    with torch.profiler.record_function("rollout"):
        rollouts = rollout.generate([p.ids for p in prompts], n, sampling, seed=seed)
    t_reward = time.perf_counter()
    rewards = correct = stats = None
    with torch.profiler.record_function("reward"):
        if scorer is not None:
            rewards, correct, stats = score(scorer, tokenizer, prompts, rollouts, n)
    if seconds is not None:
        seconds["rollout"] = seconds.get("rollout", 0.0) + t_reward - t
        seconds["reward"] = seconds.get("reward", 0.0) + time.perf_counter() - t_reward
    return ScoredBatch(list(prompts), rollouts, rewards, correct, stats)
