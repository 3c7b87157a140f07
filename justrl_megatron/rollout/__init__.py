"""Rollout engines (vLLM) and weight sync from the trainer. The trainer imports only `base` names from here."""

from .base import (FINISH_REASONS, RolloutEngine, Rollouts, SamplingConfig, StaleRolloutError, check_staleness,
                   logprob_gap)

__all__ = ["FINISH_REASONS", "RolloutEngine", "Rollouts", "SamplingConfig", "StaleRolloutError", "check_staleness",
           "logprob_gap", "make_engine", "VLLMEngine"]


def __getattr__(name):
    if name == "VLLMEngine":  # imported on first use: importing vLLM takes seconds
        from .vllm_engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_engine(cfg, model_dir, *, seed: int = 0, dtype: str = "auto", in_process: bool = True):
    """The engine a config asks for (cfg.rollout: tensor_parallel, gpu_memory_utilization, cpu_kvcache_gib,
    enforce_eager, weight_sync_backend, weight_sync_bucket_mb; the context length from data + rollout lengths)."""
    from .vllm_engine import VLLMEngine

    ro = cfg.rollout
    return VLLMEngine(
        model_dir, dtype=dtype, tensor_parallel=ro.tensor_parallel, seed=seed,
        max_model_len=cfg.data.max_prompt_length + ro.max_response_length,
        gpu_memory_utilization=ro.gpu_memory_utilization, cpu_kvcache_gib=ro.cpu_kvcache_gib,
        enforce_eager=ro.enforce_eager, in_process=in_process, weight_sync_backend=ro.weight_sync_backend,
        bucket_bytes=ro.weight_sync_bucket_mb * 2**20,
    )
