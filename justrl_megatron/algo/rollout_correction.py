"""Rollout correction: importance weights for the gap between the rollout engine (vLLM) and the trainer.

The samples come from vLLM's numerics, the gradient from the trainer's: even with the same weights the two give a
token slightly different probabilities (kernels, precision), and the PPO ratio pi_theta / pi_old never sees that gap.
With rho = pi_old / pi_vllm per response token (pi_old: the trainer's logprobs of the weights that sampled, from the
old-logprob pass or, on the on-policy fast path, the update's own detached forward; pi_vllm: the logprobs vLLM
returned with the sample), `algo.rollout_correction` multiplies each token's policy loss by a detached weight w:

    tis      w = min(rho, C)                              truncated importance sampling (large ratios capped)
    mis      w = 1 if 1/C <= rho <= C else 0              masked importance sampling (outlier tokens dropped)
    seq-tis  w = min(rho_seq, C)        for every token of the response
    seq-mis  w = 1 if 1/C <= rho_seq <= C else 0

with C = `algo.tis_cap` and rho_seq the GEOMETRIC MEAN of the response's token ratios, exp(mean_t log rho_t). The
product of the token ratios (the exact sequence likelihood ratio) drifts with length: a small per-token gap compounds
over thousands of tokens, so almost every long response would be capped or masked whatever its quality; the geometric
mean measures the typical per-token gap and is comparable across lengths.

A masked token (mis) keeps its place in the loss denominator: the denominator is fixed before the forward pass that,
on the fast path, produces pi_old, so it cannot depend on rho. The loss of such a step is scaled down by the masked
fraction (logged as `rollout_correction/masked_frac`, small when the engines agree).

Statistics (SUM over micro-batches and ranks unless said): ratio_sum and ratio_count (tokens, or responses for the
seq-* modes), ratio_max (MAX), corrected_count (capped for tis, masked for mis).
"""

from __future__ import annotations

import torch

MODES = ("none", "tis", "mis", "seq-tis", "seq-mis")
LOG_RATIO_CLAMP = 20.0  # exp() of a larger log-ratio overflows; such a token is far outside any cap anyway


def correction_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, mode: str,
                       cap: float) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Per-token weights [B, T] (detached, 0 outside ``mask``) and statistics; ``(None, {})`` for mode none.

    Shapes: old_logprobs, rollout_logprobs, mask [B, T] (mask: the response tokens that count)."""
    if mode not in MODES:
        raise ValueError(f"unknown rollout correction {mode!r}; known: {MODES}")
    if mode == "none":
        return None, {}
    if cap <= 1.0:
        raise ValueError(f"the rollout correction cap must be > 1, got {cap}")
    with torch.no_grad():
        valid = mask > 0
        log_rho = torch.clamp(old_logprobs.float() - rollout_logprobs.float(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        log_rho = torch.where(valid, log_rho, torch.zeros_like(log_rho))
        if mode.startswith("seq-"):
            tokens = valid.sum(dim=-1)
            rho = torch.exp(log_rho.sum(dim=-1) / tokens.clamp(min=1))  # [B]: geometric mean per response
            counted = tokens > 0
        else:
            rho, counted = torch.exp(log_rho), valid
        if mode.endswith("tis"):
            w = torch.clamp(rho, max=cap)
            corrected = counted & (rho > cap)
        else:
            inside = (rho >= 1.0 / cap) & (rho <= cap)
            w = inside.float()
            corrected = counted & ~inside
        if mode.startswith("seq-"):
            w = w.unsqueeze(-1).expand_as(log_rho)
        w = torch.where(valid, w, torch.zeros_like(w))
        stats = {
            "ratio_sum": torch.where(counted, rho, torch.zeros_like(rho)).sum(),
            "ratio_count": counted.sum().float(),
            "ratio_max": torch.where(counted, rho, torch.full_like(rho, float("-inf"))).max(),
            "corrected_count": corrected.sum().float(),
        }
    return w, stats


def correction_metrics(mode: str, ratio_sum: float, ratio_count: float, ratio_max: float,
                       corrected_count: float) -> dict[str, float]:
    """The logged figures from the summed statistics: rollout_correction/ratio_mean, ratio_max and clipped_frac
    (tis modes) or masked_frac (mis modes); empty for mode none."""
    if mode == "none":
        return {}
    count = max(ratio_count, 1.0)
    frac = "clipped_frac" if mode.endswith("tis") else "masked_frac"
    return {"rollout_correction/ratio_mean": ratio_sum / count, "rollout_correction/ratio_max": ratio_max,
            f"rollout_correction/{frac}": corrected_count / count}
