"""What a composed config may not run with, checked before any heavy work, every problem at once, each saying what
to change: the values (ranges, names, finiteness) here, and every feature's refusals asked of its own package
(`rollout.problems`, `model.problems`, the reward and loss registries, data.val's `train/validation.config_problems`),
imported only when asked so that the schema stays import-light.
"""

from __future__ import annotations

import difflib
import math
from typing import Iterable

from omegaconf import OmegaConf

from ..algo.loss_config import LossConfig
from .keys import _schema_default, config_file_problems, unknown_keys
from .schema import ConfigError

def validate(cfg, *, world_size: int, shape=None, also: Iterable[str] = ()) -> None:
    """Check what the schema cannot. `shape` (a model.hf_config.ModelShape) enables the model-dependent checks;
    `also`: problems the caller found elsewhere (model, data, resume), reported in the same message."""
    problems: list[str] = [*also, *unknown_keys(cfg), *config_file_problems(), *value_problems(cfg, world_size)]
    par, ro, tr, algo = cfg.parallel, cfg.rollout, cfg.trainer, cfg.algo
    tp, pp, cp = par.tensor, par.pipeline, par.context
    from ..rollout import problems as rollout_problems  # placement, batch source, tools, sampling: each its own
    from ..rollout.placement import trainer_world_size

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
    from ..model import problems as model_problems  # each model feature's own refusals (torch-only modules)

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
    from ..algo.grpo import AGG_MODES  # torch-only module; the config stays import-light

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
    from ..train.validation import config_problems  # data.val and trainer.eval_every

    problems += config_problems(cfg)
    if problems:
        raise ConfigError.listing(problems)


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
    from ..algo.grpo import ADVANTAGE_ESTIMATORS, POLICY_LOSSES  # torch-only module; the config stays import-light

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
    from ..algo.rollout_correction import MODES  # torch-only module; the config stays import-light

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
    from ..algo.grpo import KL_ESTIMATORS
    from ..rewards import REWARD_NAMES, get_reward_fn
    from ..rewards.sandbox import SandboxUnavailable

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
    from ..data import CHAT_TEMPLATES, FORMATS, RAW_TEMPLATES

    problems = []
    for key, fmt, spec in (("data.format", data.format, data.train), ("data.eval_format", data.eval_format, data.eval)):
        if fmt is not None and fmt not in FORMATS and not str(spec or "").startswith("generated:"):
            problems.append(f"{key} must be one of {', '.join(FORMATS)}; got {fmt!r}")
    templates = sorted(CHAT_TEMPLATES) + sorted(RAW_TEMPLATES)
    if data.template not in templates and not data.template.startswith("raw:"):
        problems.append(f"data.template must be one of {', '.join(templates)} or raw:<format string>; "
                        f"got {data.template!r}")
    return problems
