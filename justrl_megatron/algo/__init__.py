"""RL algorithms: GRPO advantages and the clipped policy loss."""
from .grpo import AGG_MODES, KL_ESTIMATORS, aggregate, group_advantages, kl_penalty, policy_loss

__all__ = ["AGG_MODES", "KL_ESTIMATORS", "aggregate", "group_advantages", "kl_penalty", "policy_loss"]
