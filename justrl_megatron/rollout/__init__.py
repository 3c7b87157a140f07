"""Everything that produces a trained batch: batch sources (source.py: rounds, streaming), placements (placement.py:
colocated, split.py: split), the engines (vLLM) and their loops, tools, weight sync from the trainer. The trainer
asks a source for batches and a placement for the devices; it never imports vLLM."""

from .base import (FINISH_REASONS, RolloutEngine, RolloutInterrupted, Rollouts, SamplingConfig, StaleRolloutError,
                   check_staleness, logprob_gap)

__all__ = ["FINISH_REASONS", "RolloutEngine", "RolloutInterrupted", "Rollouts", "SamplingConfig", "StaleRolloutError",
           "check_staleness", "logprob_gap", "make_engine", "VLLMEngine"]


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


def make_engine(cfg, model_dir, *, seed: int = 0, in_process: bool = True):
    """The engine a config asks for, built on every rank that hosts one (the placement says where: placement.py).

    ``in_process`` (colocated): EVERY rank must call this (vLLM's external_launcher builds its groups over all of
    torch.distributed's WORLD), then `engine.generate_all(...)` on every rank. ``in_process=False`` (split): the
    rollout ranks call it (the engine runs in a child process) and receive weights with `receive_weights`.
    Reads rollout.tensor_parallel, gpu_memory_utilization, cpu_kvcache_gib, enforce_eager, weight_sync_backend,
    weight_sync_bucket_mb, model.dtype; the context is data.max_prompt_length + rollout.max_response_length.
    """
    from ..dtypes import resolve_dtype, torch_name
    from .vllm_engine import VLLMEngine

    ro = cfg.rollout
    # the trainer's dtype, resolved the same way ("auto": bf16 on GPU, fp32 on CPU). vLLM's own "auto" would run a
    # float32 checkpoint in half precision and break trainer/rollout logprob parity.
    dtype = torch_name(resolve_dtype(cfg.model.dtype))
    return VLLMEngine(
        model_dir, dtype=dtype, tensor_parallel=ro.tensor_parallel, seed=seed,
        max_model_len=cfg.data.max_prompt_length + ro.max_response_length,
        gpu_memory_utilization=ro.gpu_memory_utilization, cpu_kvcache_gib=ro.cpu_kvcache_gib,
        enforce_eager=ro.enforce_eager, in_process=in_process,
        weight_sync_backend=ro.weight_sync_backend, bucket_bytes=int(ro.weight_sync_bucket_mb) << 20,
        return_routed_experts=cfg.algo.routing_replay == "rollout",
        prefix_caching=not ro.streaming,  # streaming: prompt blocks cached under older weights would be relabelled
    )
