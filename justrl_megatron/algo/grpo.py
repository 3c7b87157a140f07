"""GRPO: group-normalised advantages and the clipped policy-gradient loss (verl's ``compute_policy_loss`` semantics).

JustRL: advantages normalised by the group std, clip ratio [1 - 0.2, 1 + 0.28], dual-clip c = 10, token-mean over the
whole mini-batch (the denominator counts response tokens across all micro-batches and data-parallel ranks), no KL,
no entropy bonus. `aggregate` lists the other loss aggregations (docs/algorithm.md compares them with verl 0.4.0).

Per response token, with ratio r = exp(logp - old_logp) and advantage A:

    A >= 0:  loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))      (clipped once r > 1 + clip_high)
    A <  0:  loss = min(max(-A r, -A clip(r, ...)), -A c)                   (clipped once r < 1 - clip_low,
                                                                              and dual-clipped once r > c)

A clipped token contributes a constant: zero gradient. Everything is computed in float32 whatever the input dtype.
"""
from __future__ import annotations

import torch

from .loss_config import LossConfig

AGG_MODES = ("token-mean", "verl04-dynbsz", "seq-mean-token-mean", "seq-mean-token-sum")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOG_RATIO_CLAMP = 20.0  # as verl: exp() of a larger log-ratio is inf; such tokens get no gradient either way


def group_advantages(rewards: torch.Tensor, group_size: int, norm_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """(r - group mean) / (group std + eps) for consecutive groups of ``group_size`` (flat in, flat out).

    ``norm_by_std=False`` is Dr.GRPO (r - mean). The std is the unbiased one, as verl's ``torch.std``. A group whose
    rewards are all equal (including a group of one) gets exactly 0 — no signal, and no rounding noise blown up by
    a near-zero std.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be flat [num_prompts * group_size], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float() if not rewards.is_floating_point() else rewards
    groups = r.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if norm_by_std and group_size > 1:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    flat = (groups == groups[:, :1]).all(dim=1, keepdim=True)
    return torch.where(flat, torch.zeros_like(centred), centred).reshape(-1)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman's k1 / k2 / k3).

    k1 = log(p/q) (unbiased, high variance, can be negative); k2 = log(p/q)^2 / 2; k3 = q/p - 1 - log(q/p) (unbiased,
    non-negative, low variance; verl's "low_var_kl", clamped to [-10, 10] as there).
    """
    log_ratio = logprobs.float() - ref_logprobs.float()
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.clamp(torch.exp(-log_ratio) - 1 + log_ratio, min=-10.0, max=10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; known: {KL_ESTIMATORS}")


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: str, denominator=None, num_sequences=None,
              num_rows=None):
    """Reduce per-token ``values`` [B, T] (B rows = the sequences of one micro-batch) to a scalar.

    token-mean:            sum(values * mask) / denominator   (default: this batch's token count)
    verl04-dynbsz:         sum(values * mask) / (this batch's token count) * B / num_sequences   (default: B)
    seq-mean-token-mean:   sum_b mean_t(values_b) / num_sequences
    seq-mean-token-sum:    sum_b sum_t(values_b) / num_sequences   (default: rows with at least one token)

    seq-mean-token-sum is Dr. GRPO's aggregation without its constant divisor (Dr. GRPO also divides by a fixed
    generation length, which only rescales the loss).

    Pass the mini-batch's global token (or sequence) count and the losses of its micro-batches, on all ranks, add up
    to the loss of the whole mini-batch. The gradients add up too — so the caller must undo any averaging its
    framework does on top: Megatron's schedule divides each micro-batch loss by the number of micro-batches, and DDP
    averages gradients over data-parallel ranks (multiply back, or configure sum reductions).

    verl04-dynbsz is verl 0.4.0's "token-mean" with dynamic batch size: a token mean inside each micro-batch, weighted
    by the micro-batch's share of the mini-batch's sequences (all of them: ``num_sequences`` counts empty responses
    too). Unlike the others it depends on how the mini-batch was packed into micro-batches. ``num_rows``: the
    micro-batch's share counts this many sequences instead of B (rows taken out of the loss entirely, such as masked
    truncated responses, leave the share as they leave ``num_sequences``).
    """
    mask = mask.to(values.dtype)
    if agg == "token-mean":
        denom = mask.sum() if denominator is None else denominator
        return (values * mask).sum() / torch.as_tensor(denom, dtype=values.dtype).clamp(min=1)
    if agg not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {agg!r}; known: {AGG_MODES}")
    if agg == "verl04-dynbsz":
        rows = values.shape[0] if num_rows is None else num_rows
        share = rows / (rows if num_sequences is None else max(float(num_sequences), 1.0))
        return (values * mask).sum() / mask.sum().clamp(min=1) * share
    tokens = mask.sum(dim=-1)
    per_seq = (values * mask).sum(dim=-1)
    if agg == "seq-mean-token-mean":
        per_seq = per_seq / tokens.clamp(min=1)
    n = (tokens > 0).sum() if num_sequences is None else num_sequences
    return per_seq.sum() / torch.as_tensor(n, dtype=values.dtype).clamp(min=1)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                loss: LossConfig | None = None, *, denominator=None, num_sequences=None, num_rows=None,
                ref_logprobs=None, entropy=None, weights=None, agg: str | None = None, **settings):
    """Clipped GRPO/PPO loss over response tokens; returns ``(loss, metrics)``.

    Settings: ``loss`` (an algo.LossConfig; its defaults when None), with any of its fields replaced by keyword
    (``clip_low=``, ``kl_coef=``, ...; ``agg=`` is short for ``loss_agg=``).
    Shapes: logprobs, old_logprobs, mask (and ref_logprobs, entropy) [B, T]; advantages [B] or [B, T]. ``mask`` marks
    response tokens. ``denominator`` / ``num_sequences``: see :func:`aggregate`. The KL penalty (``kl_coef`` > 0 with
    ``ref_logprobs``) and the entropy bonus (``entropy_coef`` > 0 with ``entropy``) use the same aggregation.
    ``weights`` [B, T] (detached): a per-token factor on the policy-gradient term only, e.g. the rollout correction's
    importance weights (algo/rollout_correction.py); the clip statistics are those of the unweighted tokens.

    Metrics (all detached). To all-reduce with SUM: ``num_tokens``, ``clip_low_count``, ``clip_high_count``,
    ``clip_dual_count``, ``approx_kl_sum`` (sum of old_logp - logp), ``ref_kl_sum``, ``entropy_sum``; with MIN / MAX:
    ``ratio_min`` / ``ratio_max`` (+inf / -inf with no tokens). Convenience values for this call alone:
    ``clip_frac_low``, ``clip_frac_high``, ``clip_frac_dual``, ``approx_kl``, ``pg_loss``, ``kl_loss``,
    ``entropy_loss``.
    """
    cfg = (loss or LossConfig()).but(**settings, **({} if agg is None else {"loss_agg": agg}))
    agg, clip_low, clip_high, dual_clip_c = cfg.loss_agg, cfg.clip_low, cfg.clip_high, cfg.dual_clip_c
    kl_coef, entropy_coef = cfg.kl_coef, cfg.entropy_coef
    if agg not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {agg!r}; known: {AGG_MODES}")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    logprobs, old_logprobs = logprobs.float(), old_logprobs.float()
    adv = advantages.float()
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    adv = adv.expand_as(logprobs)
    mask_f = mask.to(torch.float32)
    valid = mask_f > 0

    log_ratio = torch.clamp(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(loss_unclipped, loss_clipped)  # pessimistic: the clipped branch wins once outside the range
    negative = adv < 0
    if dual_clip_c is not None:
        # For A < 0 the loss -A r grows without bound in r; dual-clip caps it at -A c (again a constant).
        pg = torch.where(negative, torch.minimum(pg, -adv * dual_clip_c), pg)
    if weights is not None:
        pg = pg * weights.detach().float()
    agg_kw = dict(agg=agg, denominator=denominator, num_sequences=num_sequences, num_rows=num_rows)
    pg_loss = aggregate(pg, mask_f, **agg_kw)
    total = pg_loss

    with torch.no_grad():
        positive = adv > 0
        clip_high_mask = valid & positive & (ratio > 1.0 + clip_high)
        clip_low_mask = valid & negative & (ratio < 1.0 - clip_low)
        dual_mask = valid & negative & (ratio > dual_clip_c) if dual_clip_c is not None else torch.zeros_like(valid)
        num_tokens = mask_f.sum()
        denom = num_tokens.clamp(min=1)
        masked_ratio = ratio.detach()
        metrics = {
            "num_tokens": num_tokens,
            "clip_low_count": clip_low_mask.sum().float(),
            "clip_high_count": clip_high_mask.sum().float(),
            "clip_dual_count": dual_mask.sum().float(),
            "approx_kl_sum": (-log_ratio.detach() * mask_f).sum(),
            "ratio_min": torch.where(valid, masked_ratio, torch.full_like(masked_ratio, float("inf"))).min(),
            "ratio_max": torch.where(valid, masked_ratio, torch.full_like(masked_ratio, float("-inf"))).max(),
            "pg_loss": pg_loss.detach(),
        }
        metrics["clip_frac_low"] = metrics["clip_low_count"] / denom
        metrics["clip_frac_high"] = metrics["clip_high_count"] / denom
        metrics["clip_frac_dual"] = metrics["clip_dual_count"] / denom
        metrics["approx_kl"] = metrics["approx_kl_sum"] / denom

    if ref_logprobs is not None and kl_coef:
        kl = kl_penalty(logprobs, ref_logprobs, cfg.kl_estimator)
        kl_loss = aggregate(kl, mask_f, **agg_kw)
        total = total + kl_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
        metrics["ref_kl_sum"] = (kl.detach() * mask_f).sum()
    if entropy is not None and entropy_coef:
        entropy_loss = aggregate(entropy.float(), mask_f, **agg_kw)
        total = total - entropy_coef * entropy_loss  # a bonus: higher entropy lowers the loss
        metrics["entropy_loss"] = entropy_loss.detach()
        metrics["entropy_sum"] = (entropy.detach().float() * mask_f).sum()
    return total, metrics
