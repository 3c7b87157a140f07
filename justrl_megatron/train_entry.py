"""The hydra entry point of justrl-train: compose -> validate (before any heavy work) -> run the GRPO loop."""

from __future__ import annotations

import os
import sys

import hydra

from .config import CONFIG_DIR, ConfigError, register, validate
from .console import quiet_console

register()


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_config(cfg):
    """Everything that can be checked without starting megatron or vLLM. Returns the model's ModelShape."""
    from transformers import AutoConfig

    from .assets import resolve_model_path
    from .model.hf_config import model_shape

    model_dir = resolve_model_path(cfg.model.path)
    shape = model_shape(AutoConfig.from_pretrained(model_dir))
    validate(cfg, world_size=_world_size(), shape=shape)
    return model_dir, shape


def apply_memory_plan(cfg, shape):
    """Resolve model.recompute (auto) and clamp trainer.max_tokens_per_micro_batch with the memory plan, so the loop
    and Policy.build see concrete values. On a GPU the plan is printed in one line (rank 0); on the CPU auto becomes
    none and the budget stays. Raises MemoryPlanError (a ValueError) when a manual setting cannot fit."""
    from .model.memory import resolve_recompute

    plan = resolve_recompute(cfg, shape, _world_size())
    if plan is not None and int(os.environ.get("RANK", "0")) == 0:
        print(f"justrl-train: {plan.describe()}", flush=True)
    return plan


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base=None)
def main(cfg) -> None:
    try:
        model_dir, shape = check_config(cfg)
        apply_memory_plan(cfg, shape)
    except (ConfigError, FileNotFoundError, ValueError) as exc:  # MemoryPlanError is a ValueError
        print(f"justrl-train: {exc}", file=sys.stderr)
        sys.exit(2)
    quiet_console(verbose=cfg.logging.verbose)  # the composed config decides (a recipe may set it)
    from .train.loop import run

    run(cfg, model_dir, shape)
