"""Everything that produces a trained batch: batch sources (source.py: rounds, streaming), placements (placement.py:
colocated, split.py: split), the engines (vLLM) and their loops, tools, weight sync from the trainer. The trainer
asks a source for batches and a placement for the devices; it never imports vLLM."""

from .base import (FINISH_REASONS, RolloutEngine, RolloutInterrupted, Rollouts, SamplingConfig, StaleRolloutError,
                   check_staleness, logprob_gap)

__all__ = ["FINISH_REASONS", "RolloutEngine", "RolloutInterrupted", "Rollouts", "SamplingConfig", "StaleRolloutError",
           "check_staleness", "logprob_gap", "problems", "VLLMEngine"]


def __getattr__(name):
    if name == "VLLMEngine":  # imported on first use: importing vLLM takes seconds
        from .vllm_engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def problems(cfg, world_size: int) -> list[str]:
    """Every rollout feature's refusals, each from its own module: the placement and the batch source the config
    names (through their registries), the tools, and what vLLM's sampling would refuse (config validation)."""
    from . import limits, placement, source, tools

    return [*placement.problems(cfg, world_size), *source.problems(cfg), *tools.problems(cfg), *limits.problems(cfg)]
