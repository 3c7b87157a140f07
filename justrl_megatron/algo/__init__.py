"""RL algorithms: the loss settings (`LossConfig`), GRPO advantages and the clipped policy loss.

`LossConfig` imports without torch (config.py takes its defaults from it); the torch names load on first use."""
from .loss_config import LossConfig

__all__ = ["AGG_MODES", "KL_ESTIMATORS", "LossConfig", "aggregate", "group_advantages", "kl_penalty", "policy_loss"]


def __getattr__(name):
    if name in __all__:
        from . import grpo

        return getattr(grpo, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
