"""DAPO's overlong reward shaping (a soft length penalty) and overlong filtering (truncated responses out of the loss).

Shaping (`algo.overlong_buffer` = L_buf > 0, `algo.overlong_penalty_factor` = f): with L_max =
rollout.max_response_length, a response of length |y| gets

    0                                   |y| <= L_max - L_buf
    -f * (|y| - (L_max - L_buf)) / L_buf    L_max - L_buf < |y| <= L_max     (linear, -f at the limit)

added to its verifier reward before the group advantages (DAPO's soft overlong punishment). Dynamic sampling judges a
group by the verifier's rewards alone (as DAPO filters on accuracy): a length penalty is not a reason to keep a group.

Filtering (`algo.mask_truncated`): a response cut at L_max (finish reason "length") has no verdict of its own —
its reward says "no answer yet", not "wrong". Its tokens leave the loss and its denominator (train/step.py), so they
neither push the policy nor dilute the other responses' token mean. The group advantages still count its reward.
"""

from __future__ import annotations

from typing import Sequence


def overlong_penalties(lengths: Sequence[int], max_length: int, buffer: int, factor: float = 1.0) -> list[float]:
    """The (non-positive) penalty of each response length; all 0.0 with ``buffer`` 0."""
    if buffer <= 0:
        return [0.0] * len(lengths)
    if buffer >= max_length:
        raise ValueError(f"overlong buffer {buffer} must be shorter than the response limit {max_length}")
    start = max_length - buffer
    return [-factor * min(length - start, buffer) / buffer if length > start else 0.0 for length in lengths]


def shape_rewards(rewards: Sequence[float], lengths: Sequence[int], truncated: Sequence[bool], *, max_length: int,
                  buffer: int, factor: float, mask_truncated: bool) -> tuple[list[float], dict[str, float]]:
    """Rewards + overlong penalties, and the metrics of what was done: `reward/overlong_penalty_mean` (with a buffer)
    and `response/masked_truncated` (with masking: the fraction of responses that leave the loss). With both off the
    rewards come back unchanged and there are no metrics."""
    metrics = {}
    shaped = list(rewards)
    if buffer > 0:
        penalties = overlong_penalties(lengths, max_length, buffer, factor)
        shaped = [r + p for r, p in zip(rewards, penalties)]
        metrics["reward/overlong_penalty_mean"] = sum(penalties) / max(len(penalties), 1)
    if mask_truncated:
        metrics["response/masked_truncated"] = sum(bool(t) for t in truncated) / max(len(truncated), 1)
    return shaped, metrics
