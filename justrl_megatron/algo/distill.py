"""On-policy distillation (algo.distill): a teacher's log-probs of the student's own sampled tokens as a per-token
advantage, alone or beside the task reward's group advantage.

With s_t the student's log-prob of sampled token t, q_t the teacher's, c = `algo.distill.coef` and
k = `algo.distill.reward_coef`, each response token gets the advantage

    A_t = k * A_group  -  c * (s_t - q_t)

and enters the policy loss (algo/grpo.policy_loss) unchanged: ratio, clipping, aggregation and the rollout
correction's weights are those of any other advantage. s_t - q_t is the one-sample estimate of the reverse KL
KL(student || teacher) at that position, so at ratio 1 the policy gradient -A_t * grad s_t descends the reverse KL
(the published OPD recipes: Thinking Machines' on-policy distillation, verl, slime, NeMo-RL). k = 0: pure
distillation, the verifier's reward does not enter the loss.

s_t is the trainer's OLD log-prob (the recomputed old-logprob pass, or on the on-policy fast path the update's own
forward, detached: the same weights and numerics), not the rollout engine's: it is the proximal policy the ratio is
taken against, it is computed by the same kernels as the teacher's q_t (so s_t - q_t carries no engine-vs-trainer
gap), and it is detached, so the advantage is a constant of the gradient as PPO requires. The engine's gap is the
rollout correction's business (algo.rollout_correction), as for the reward's advantage.
"""

from __future__ import annotations

import torch


def distill_advantages(group_advantages: torch.Tensor, student_logprobs: torch.Tensor,
                       teacher_logprobs: torch.Tensor, *, coef: float, reward_coef: float) -> torch.Tensor:
    """Per-token advantages [B, T] = reward_coef * group_advantages - coef * (student - teacher), detached.
    group_advantages [B] or [B, T]; the log-probs [B, T]."""
    if group_advantages.dim() == 1:
        group_advantages = group_advantages.unsqueeze(-1)
    reverse_kl = student_logprobs.detach() - teacher_logprobs.detach()
    return (reward_coef * group_advantages - coef * reverse_kl).detach()


def distill_sums(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, top1_mismatch: torch.Tensor,
                 mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over the tokens in ``mask`` (0/1, [B, T]), to be reduced with SUM and divided by the token count:
    reverse KL (student - teacher), the teacher's and the student's log-probs, tokens whose teacher top-1 is not the
    sampled token. Masked positions are never read (torch.where), so a -inf there stays out."""
    kept = mask > 0

    def total(t):
        return torch.where(kept, t.detach().float(), torch.zeros((), device=t.device)).sum()

    return {"distill_rkl_sum": total(student_logprobs - teacher_logprobs),
            "distill_teacher_sum": total(teacher_logprobs), "distill_student_sum": total(student_logprobs),
            "distill_top1_miss_sum": total(top1_mismatch)}


def distill_metrics(sums: dict[str, float], tokens: float) -> dict[str, float]:
    """distill/* per response token in the loss, from `distill_sums` reduced over micro-batches and ranks."""
    tokens = max(tokens, 1.0)
    return {"distill/reverse_kl": sums["distill_rkl_sum"] / tokens,
            "distill/teacher_logprob_mean": sums["distill_teacher_sum"] / tokens,
            "distill/student_logprob_mean": sums["distill_student_sum"] / tokens,
            "distill/top1_mismatch_frac": sums["distill_top1_miss_sum"] / tokens}


DISTILL_SUM_KEYS = ("distill_rkl_sum", "distill_teacher_sum", "distill_student_sum", "distill_top1_miss_sum")
