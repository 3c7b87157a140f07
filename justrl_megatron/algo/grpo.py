"""The policy-gradient family: advantages (grpo, rloo, reinforce_pp_baseline) and the policy loss (ppo, gspo, cispo),
with verl's ``compute_policy_loss`` semantics for ppo. docs/algorithm.md defines each kind with its formula.

JustRL: advantages normalised by the group std, clip ratio [1 - 0.2, 1 + 0.28], dual-clip c = 10, token-mean over the
whole mini-batch (the denominator counts response tokens across all micro-batches and data-parallel ranks), no KL,
no entropy bonus. `aggregate` lists the other loss aggregations (docs/algorithm.md compares them with verl 0.4.0).

The ppo loss per response token, with ratio r = exp(logp - old_logp) and advantage A:

    A >= 0:  loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))      (clipped once r > 1 + clip_high)
    A <  0:  loss = min(max(-A r, -A clip(r, ...)), -A c)                   (clipped once r < 1 - clip_low,
                                                                              and dual-clipped once r > c)

A clipped token contributes a constant: zero gradient. Everything is computed in float32 whatever the input dtype.
"""
from __future__ import annotations

import torch

from .loss_config import LossConfig

AGG_MODES = ("token-mean", "verl04-dynbsz", "seq-mean-token-mean", "seq-mean-token-sum")
# loss aggregations whose micro-batch losses stay partial sums when a sequence's tokens are spread over CP ranks;
# seq-mean-token-mean and verl04-dynbsz divide by a per-sequence / per-micro-batch token count no CP rank holds
CP_LOSS_AGGS = ("token-mean", "seq-mean-token-sum")
POLICY_LOSSES = ("ppo", "gspo", "cispo")
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOG_RATIO_CLAMP = 20.0  # as verl: exp() of a larger log-ratio is inf; such tokens get no gradient either way
GSPO_LOG_RATIO_MAX = 10.0  # as verl's GSPO: the sequence log-ratio clamped from above only


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


def compute_advantages(rewards: torch.Tensor, group_size: int, *, estimator: str = LossConfig.advantage,
                       norm_by_std: bool = LossConfig.norm_adv_by_std, response_lengths=None,
                       eps: float = 1e-6) -> torch.Tensor:
    """One advantage per sample from flat rewards [num_prompts * group_size] (consecutive groups).

    grpo:                   `group_advantages` ((r - mean) / (std + eps); ``norm_by_std=False``: r - mean).
    rloo:                   r minus the mean of the group's other rewards = (r - mean) * n / (n - 1).
    reinforce_pp_baseline:  r - group mean, then whitened over the batch's response tokens: every sample's value
                            counts once per response token (``response_lengths``; None: once per sample), the mean
                            is subtracted and the result divided by sqrt(unbiased variance + 1e-8).
    Every estimator gives exactly 0 to a group whose rewards are all equal (verl's whitening does not: it shifts such
    groups by the batch mean; docs/algorithm.md). Every estimator needs groups of at least 2.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; known: {ADVANTAGE_ESTIMATORS}")
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    if group_size < 2:
        raise ValueError(f"advantage estimator {estimator} needs groups of at least 2 samples (rollout.n >= 2): a "
                         f"group of one has no baseline")
    if estimator == "grpo":
        return group_advantages(rewards, group_size, norm_by_std=norm_by_std, eps=eps)
    groups = rewards.double().view(-1, group_size)
    flat = (groups == groups[:, :1]).all(dim=1, keepdim=True)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if estimator == "rloo":
        adv = centred * group_size / (group_size - 1)
    else:
        values = centred.reshape(-1)
        counts = (torch.ones_like(values) if response_lengths is None
                  else torch.as_tensor(response_lengths, dtype=torch.float64).reshape(-1))
        if counts.numel() != values.numel():
            raise ValueError(f"{counts.numel()} response lengths for {values.numel()} rewards")
        tokens = counts.sum()
        if tokens < 2:  # no spread to whiten by
            return torch.zeros_like(rewards, dtype=torch.float32)
        mean = (values * counts).sum() / tokens
        var = ((values - mean).square() * counts).sum() / (tokens - 1)
        adv = ((values - mean) * torch.rsqrt(var + 1e-8)).view_as(centred)
    return torch.where(flat, torch.zeros_like(adv), adv).reshape(-1).float()


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
        # the log ratio is clamped before exp (as verl): exp(88.7) overflows, and inf - inf makes a NaN gradient
        log_ratio = torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
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
    # as verl: what lies outside the mask is never read (a NaN or -inf there times 0 would make the sum NaN)
    values = torch.where(mask > 0, values, torch.zeros((), dtype=values.dtype, device=values.device))
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
                ref_logprobs=None, entropy=None, weights=None, kind: str | None = None, agg: str | None = None,
                **settings):
    """The policy-gradient loss over response tokens (``kind``: ppo, gspo or cispo); returns ``(loss, metrics)``.

    Settings: ``loss`` (an algo.LossConfig; its defaults when None), with any of its fields replaced by keyword
    (``clip_low=``, ``kl_coef=``, ...; ``kind=`` is short for ``policy_loss=``, ``agg=`` for ``loss_agg=``).

    ppo:    per token, ratio r = exp(logp - old): max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), for A < 0
            capped at -A c (dual_clip_c). Aggregated as ``loss_agg`` says.
    gspo:   the sequence ratio s = exp(mean over the response of (logp - old)) replaces r (its value on every token;
            its gradient per token through logp - sg(logp)), clipped the same way, no dual clip; always
            aggregated seq-mean-token-mean (LossConfig.aggregation).
    cispo:  -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp: every token keeps a gradient, its weight capped.
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
    named = {**({} if agg is None else {"loss_agg": agg}), **({} if kind is None else {"policy_loss": kind})}
    cfg = (loss or LossConfig()).but(**settings, **named)
    agg, clip_low, clip_high, dual_clip_c = cfg.aggregation, cfg.clip_low, cfg.clip_high, cfg.dual_clip_c
    kl_coef, entropy_coef = cfg.kl_coef, cfg.entropy_coef
    if cfg.policy_loss not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {cfg.policy_loss!r}; known: {POLICY_LOSSES}")
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
    negative = adv < 0

    log_ratio = torch.clamp(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if cfg.policy_loss == "cispo":
        ratio = torch.exp(log_ratio)
        pg = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high).detach() * logprobs
    else:
        if cfg.policy_loss == "gspo":  # every token carries its sequence's ratio, with its own gradient
            seq_log_ratio = torch.where(valid, logprobs - old_logprobs, 0.0).sum(-1) / mask_f.sum(-1).clamp(min=1)
            ratio = torch.exp(torch.clamp(logprobs - logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1),
                                          max=GSPO_LOG_RATIO_MAX))
        else:
            ratio = torch.exp(log_ratio)
        loss_unclipped = -adv * ratio
        loss_clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
        pg = torch.maximum(loss_unclipped, loss_clipped)  # pessimistic: the clipped branch wins outside the range
        if dual_clip_c is not None and cfg.policy_loss == "ppo":
            # For A < 0 the loss -A r grows without bound in r; dual-clip caps it at -A c (again a constant).
            pg = torch.where(negative, torch.minimum(pg, -adv * dual_clip_c), pg)
    if weights is not None:
        pg = pg * weights.detach().float()
    agg_kw = dict(agg=agg, denominator=denominator, num_sequences=num_sequences, num_rows=num_rows)
    pg_loss = aggregate(pg, mask_f, **agg_kw)
    total = pg_loss

    with torch.no_grad():
        # clipped tokens: those whose ratio is outside the range on the side where the clip acts (cispo: either
        # side, for either sign, as its weight is capped there)
        either = torch.ones_like(valid) if cfg.policy_loss == "cispo" else None
        clip_high_mask = valid & (adv > 0 if either is None else either) & (ratio > 1.0 + clip_high)
        clip_low_mask = valid & (negative if either is None else either) & (ratio < 1.0 - clip_low)
        dual_mask = (valid & negative & (ratio > dual_clip_c) if dual_clip_c is not None and cfg.policy_loss == "ppo"
                     else torch.zeros_like(valid))
        num_tokens = mask_f.sum()
        denom = num_tokens.clamp(min=1)
        masked_ratio = ratio.detach()
        metrics = {
            "num_tokens": num_tokens,
            "clip_low_count": clip_low_mask.sum().float(),
            "clip_high_count": clip_high_mask.sum().float(),
            "clip_dual_count": dual_mask.sum().float(),
            "approx_kl_sum": torch.where(valid, -log_ratio.detach(), 0.0).sum(),
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
        metrics["ref_kl_sum"] = torch.where(valid, kl.detach(), 0.0).sum()
    if entropy is not None and entropy_coef:
        entropy_loss = aggregate(entropy.float(), mask_f, **agg_kw)
        total = total - entropy_coef * entropy_loss  # a bonus: higher entropy lowers the loss
        metrics["entropy_loss"] = entropy_loss.detach()
        metrics["entropy_sum"] = torch.where(valid, entropy.detach().float(), 0.0).sum()
    return total, metrics
