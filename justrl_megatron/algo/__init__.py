"""RL algorithms: the loss settings (`LossConfig`), advantages (`compute_advantages`) and the policy loss
(`policy_loss`: ppo, gspo, cispo).

`LossConfig` imports without torch (the config schema derives its loss keys from it); the torch names load on first use."""
from .loss_config import LossConfig

__all__ = ["ADVANTAGE_ESTIMATORS", "AGG_MODES", "KL_ESTIMATORS", "LossConfig", "POLICY_LOSSES", "aggregate",
           "compute_advantages", "group_advantages", "kl_penalty", "policy_loss"]


def __getattr__(name):
    if name in __all__ and name != "LossConfig":
        from . import grpo

        return getattr(grpo, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
