"""A JustRL-shaped update batch for benchmarks: GRPO groups of 8 responses sharing one prompt, response lengths drawn
log-normal as a JustRL run's are, and its model FLOPs with each group's prompt counted once.

JustRL (DeepSeek-R1-Distill-Qwen-1.5B, 15,360-token response cap) samples responses whose lengths are roughly
log-normal around a median of ~5,000 tokens, ~8% of them cut at the cap; prompts are ~300 tokens. With
trainer.shared_prompt on (the recipe's setting on the local spec) a group's 8 responses attend to one copy of its
prompt (train/batching.py), and the batcher packs the units into micro-batches up to the token budget the memory
plan allows: many sequences per micro-batch, unlike the one-sequence figure of gpu_check's `train` stage.

Model FLOPs (bench/flops.py's count): the decoder's matmuls over the tokens the model runs (each prompt once), causal
attention per sequence (every response attends to its prompt and to itself: P x R + R(R+1)/2, the prompt's own
triangle once per group), the output projection for each response token.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict

GROUP = 8  # rollout.n
PROMPT = 300
MEDIAN = 5000
SIGMA = 0.8
CAP = 15360


def response_lengths(groups: int, *, seed: int = 0, group_size: int = GROUP, median: float = MEDIAN,
                     sigma: float = SIGMA, cap: int = CAP) -> list[list[int]]:
    """`groups` lists of `group_size` response lengths: log-normal (median, sigma), at least 1, cut at `cap`."""
    rng = random.Random(seed)
    mu = math.log(median)
    return [[max(1, min(cap, round(rng.lognormvariate(mu, sigma)))) for _ in range(group_size)]
            for _ in range(groups)]


def justrl_samples(groups: int, vocab: int, *, seed: int = 0, prompt_len: int = PROMPT, **lengths) -> list:
    """train.batching.Sample per response: `groups` groups with one shared random prompt each, random tokens, and
    advantages of both signs (a group all right or all wrong would train nothing)."""
    from ..train.batching import Sample

    rng = random.Random(seed + 1)
    samples = []
    for g, group in enumerate(response_lengths(groups, seed=seed, **lengths)):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        for i, n in enumerate(group):
            samples.append(Sample(prompt_ids=prompt, response_ids=[rng.randrange(vocab) for _ in range(n)],
                                  advantage=1.0 if i % 2 else -1.0, group=g))
    return samples


def shared_prompt_forward_flops(shape, samples, vocab: int | None = None) -> float:
    """Model FLOPs of one forward pass over `samples` with every group's prompt run once (trainer.shared_prompt):
    bench/flops.forward_flops of the unshared sequences, less the prompt's matmuls and causal triangle for every
    response of a group but one."""
    from .flops import forward_flops

    by_prompt = defaultdict(int)
    for s in samples:
        by_prompt[tuple(s.prompt_ids)] += 1
    unshared = forward_flops(shape, [s.length for s in samples], sum(len(s.response_ids) for s in samples), vocab)
    repeated = sum((n - 1) * forward_flops(shape, [len(p)], 0, vocab) for p, n in by_prompt.items())
    return unshared - repeated
