"""`LossConfig`: every setting of the policy loss (and of the advantages it weighs), in one frozen object.

Built once from `cfg.algo` (`LossConfig.from_algo`), it travels whole: loop -> train/step.py's update -> the
micro-batch loss -> `algo.grpo.policy_loss`. Each setting is written here and only here: config/schema.py derives
its keys from these fields (algo.<name>, and algo.distill.<name> for distill_<name>: name, type, default), and
policy_loss's keywords read the defaults from this class. Adding a loss knob: a field here (with its default and a
comment), its use in algo/grpo.py, its check in config/checks.py if it has a range, and a test.

Import-light on purpose (no torch): the config schema imports it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

DISTILL = "distill_"  # the fields whose keys are under algo.distill (without it): algo.distill.coef is distill_coef


@dataclass(frozen=True)
class LossConfig:
    # ppo: the clipped token-ratio loss (clip-higher, dual-clip) | gspo: the sequence-level ratio, clipped per
    # sequence, always aggregated seq-mean-token-mean (its clip range is ~3e-4/4e-4) | cispo: the clipped importance
    # weight, stop-gradient, times advantage times logprob (docs/algorithm.md)
    policy_loss: str = "ppo"
    # grpo: (r - group mean) / group std | rloo: leave-one-out baseline | reinforce_pp_baseline: group mean out,
    # then whitened over the batch's response tokens
    advantage: str = "grpo"
    # PPO-style clip range [1 - clip_low, 1 + clip_high]; JustRL's clip-higher keeps 0.28 above
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip_c: Optional[float] = 10.0  # A < 0: the loss is capped at -A * c (None: off)
    # token-mean: over the mini-batch's response tokens (JustRL's intent; packing-independent) | verl04-dynbsz: what
    # verl 0.4.0 computes with dynamic batch size | seq-mean-token-mean | seq-mean-token-sum (docs/algorithm.md)
    loss_agg: str = "token-mean"
    kl_coef: float = 0.0  # the KL penalty to the reference policy (JustRL: none)
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0  # an entropy bonus (JustRL: none)
    mask_truncated: bool = False  # overlong filtering: truncated responses leave the loss and its denominator
    # none | tis | mis | seq-tis | seq-mis (algo/rollout_correction.py): weights pi_trainer_old / pi_vllm on the policy
    # loss, capped (tis) or masking tokens outside [1/tis_cap, tis_cap] (mis); seq-*: one weight per response (the
    # geometric mean of its tokens' ratios). The config's default follows rollout.max_staleness (config/schema.py)
    rollout_correction: str = "none"
    tis_cap: float = 2.0  # ms-swift's threshold; slime's MIS example keeps ratios in [0.5, 2]
    norm_adv_by_std: bool = True  # grpo: advantages divided by the group's std (False: Dr. GRPO)
    # on-policy distillation (algo/distill.py; used only when a teacher scores the batch, algo.distill.teacher):
    # per-token advantage reward_coef * A_group - coef * (student logprob - teacher logprob)
    distill_coef: float = 1.0
    distill_reward_coef: float = 0.0  # 0: pure distillation, the verifier's reward stays out of the loss

    @property
    def aggregation(self) -> str:
        """The aggregation the loss really uses: GSPO's objective is a mean over sequences of token means."""
        return "seq-mean-token-mean" if self.policy_loss == "gspo" else self.loss_agg

    @classmethod
    def from_algo(cls, algo) -> "LossConfig":
        """The loss settings of a config's `algo` section (every field has a key of the same name there; the
        distill_* ones under algo.distill)."""
        def key(name):
            if name.startswith(DISTILL):
                return getattr(algo.distill, name.removeprefix(DISTILL))
            return getattr(algo, name)

        return cls(**{f.name: key(f.name) for f in dataclasses.fields(cls)})

    def but(self, **settings) -> "LossConfig":
        """This config with some fields replaced; an unknown name is a TypeError that lists the known ones."""
        unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"unknown loss setting(s) {unknown}; LossConfig has "
                            f"{', '.join(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **settings) if settings else self
