"""The trainable policy: GPTModel chunks wrapped in megatron DDP, megatron's (distributed) Adam, and the LR schedule.

`Policy.build` is the one place that turns a `ModelShape` plus parallel and optimizer knobs into the live training
objects. Everything is megatron-core's own machinery:
  * model chunks from `build.build_model_chunks` (TE spec on GPU, local spec otherwise), moved to the policy's device;
  * `DistributedDataParallel` with fp32 gradient buffers (grad reduction in fp32);
  * `get_megatron_optimizer`: Adam with decoupled weight decay (AdamW), the distributed optimizer by default, global
    grad-norm clipping; bf16 params keep fp32 master weights;
  * `OptimizerParamScheduler`: linear warmup from 0 to `lr` over `warmup_steps`, then constant (JustRL). The step
    code advances it once per RL step (as verl does), so every mini-batch of an RL step uses the same LR. A resumed
    run keeps only the saved step count: the schedule's values are the config's (a changed lr applies at once).
Loss scaling: the config sets `calculate_per_token_loss=True`, which turns off every implicit division in megatron
(by the number of micro-batches in the schedule, by the DP size in DDP). The GRPO loss of each micro-batch is
already divided by the GLOBAL token count of its mini-batch (train/step.py), so summing the micro-batch gradients
over micro-batches and DP ranks gives exactly the mini-batch gradient; `finalize_model_grads` is told not to
rescale by its own token count.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections before megatron loads)

import torch
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from .. import compat
from ..distributed import init_distributed, init_model_parallel
from ..dtypes import resolve_dtype
from . import fast_paths as fast_paths_mod
from .attention import attention_backend as decide_attention_backend, resolve_shared_prompt
from .build import build_model_chunks
from .exact import exact_config
from .exact import install as install_exact
from .exact import resolve_engine_numerics
from .lora import apply_lora
from .hf_config import ModelShape, padded_vocab_size, require_parallel_layout, transformer_config
from .memory import resolve_recompute
from .moe import RoutingReplay, install_route_slots, prepare_routers
from .optimizer_kernels import install_optimizer_kernels
from .spec import gpu_fusions, resolve_impl

def finalize_grads_without_token_scaling(model, num_tokens=None, **kwargs):
    """megatron's finalize_model_grads (DP reduce, SP norm reduce, tied-embedding reduce) without the 1/num_tokens
    rescale: the GRPO loss is already normalised by the global denominator (see the module docstring)."""
    return finalize_model_grads(model, None, **kwargs)


def _pipeline_options(pp: int, vpp: int | None) -> dict:
    # The interleaved schedule with batched p2p matches the forward activation and the backward gradient that two
    # neighbouring stages exchange in the same call in the wrong order when the previous and the next stage are the
    # same rank (PP=2): megatron-LM requires PP > 2 there unless p2p overlap (unbatched, per-direction ops) is on.
    if vpp:
        return dict(overlap_p2p_comm=True, batch_p2p_comm=False)
    return {}


logger = logging.getLogger(__name__)


def _moe_options(shape: ModelShape, impl: str, z_loss_coef: float | None, permute_fusion: bool | None) -> dict:
    """MoE TransformerConfig fields beyond the HF config's: the router z-loss (model/moe.py scales it like the aux
    loss) and TE's fused token permutation (null: on with the TE spec; on without TE is refused by validation,
    spec.transformer_engine_problems)."""
    if not shape.num_experts:
        return {}
    fuse = impl == "te" if permute_fusion is None else bool(permute_fusion)
    return dict(moe_z_loss_coeff=float(z_loss_coef) if z_loss_coef else None, moe_permute_fusion=fuse)


def moe_needs_sequence_parallel(shape: ModelShape, tp: int) -> bool:
    """megatron's MoE layer trains at TP > 1 only with sequence parallelism (moe_layer.py raises otherwise): the
    policy turns it on for an MoE model at parallel.tensor > 1 (config validation says so, model/moe.problems)."""
    return bool(shape.num_experts) and tp > 1


def _context_parallel_options(cp: int, impl: str) -> dict:
    """TransformerConfig fields for context parallelism. The TE spec runs megatron's own CP attention (TE's
    ring of K/V chunks, "p2p", over the same 2 x CP partition); the local spec's SDPAttention all-gathers K/V
    itself (model/attention.py) and needs no comm type."""
    if cp <= 1:
        return {}
    return dict(context_parallel_size=cp, **({"cp_comm_type": "p2p"} if impl == "te" else {}))


def _aux_loss(shape: ModelShape, coef: float | None) -> dict:
    """An MoE model's load-balancing loss weight other than its HF config's (0 turns the loss off)."""
    if coef is None or not shape.num_experts:
        return {}
    return dict(moe_aux_loss_coeff=float(coef), moe_router_load_balancing_type="aux_loss" if coef else "none")


class ConfigScheduler(OptimizerParamScheduler):
    """megatron's OptimizerParamScheduler where a resumed run keeps only the saved step count: lr, warmup and weight
    decay are this launch's config, so a changed trainer.lr takes effect at once (megatron's override flag). The
    optimizer's param groups carry their own max_lr / min_lr, which the optimizer checkpoint (loaded first) brings
    back from the earlier launch; they are set back to this launch's before the schedule is replayed."""

    def __init__(self, optimizer, **schedule):
        super().__init__(optimizer, use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True,
                         **schedule)
        self._group_lrs = [(g.get("max_lr"), g.get("min_lr")) for g in optimizer.param_groups]

    def load_state_dict(self, state_dict: dict) -> None:
        for group, (max_lr, min_lr) in zip(self.optimizer.param_groups, self._group_lrs):
            if max_lr is not None:
                group["max_lr"], group["min_lr"] = max_lr, min_lr
        super().load_state_dict(state_dict)


@dataclass
class Policy:
    chunks: list            # DDP-wrapped GPTModel chunks of this rank (one per virtual pipeline stage)
    optimizer: object       # megatron MegatronOptimizer (ChainedOptimizer / DistributedOptimizer / ...)
    scheduler: object       # megatron OptimizerParamScheduler
    config: object          # megatron TransformerConfig
    shape: ModelShape
    transformer_impl: str   # resolved: "te" | "local"
    dtype: torch.dtype
    padded_vocab_size: int
    hyper: dict = field(default_factory=dict)
    lora: dict | None = None  # rank, alpha, dropout, targets of the LoRA adapters (None: full fine-tuning)
    # a GRPO group's responses attend to one copy of their prompt (train/batching.py); resolved from "auto"
    shared_prompt: bool = False
    skipped_in_a_row: int = 0  # optimizer steps skipped in a row for a non-finite grad norm (train/step.py)
    routing_replay: object = None  # MoE, algo.routing_replay old|rollout: model/moe.RoutingReplay (train/step.py)
    # the fast paths and attention kernel every rank runs with, decided once (model/fast_paths.resolve)
    fast_paths: fast_paths_mod.FastPaths = field(default_factory=fast_paths_mod.FastPaths)

    @classmethod
    def build(cls, shape: ModelShape, *, tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1,
              sequence_parallel: bool = False, dtype="auto", transformer_impl: str = "auto", recompute: str = "none",
              lr: float = 1e-6, warmup_steps: int = 0, weight_decay: float = 0.0, grad_clip: float = 1.0,
              adam_beta1: float = 0.9, adam_beta2: float = 0.999, adam_eps: float = 1e-8,
              distributed_optimizer: bool = True, make_vocab_size_divisible_by: int = 128, seed: int = 1234,
              max_sequence_length: int | None = None, lora: dict | None = None, shared_prompt="off",
              cp: int = 1, moe_aux_loss_coef: float | None = None, moe_z_loss_coef: float | None = None,
              moe_permute_fusion: bool | None = None, routing_replay: str = "off",
              attention_backend: str = "auto", fast_paths=None, moe_grouped_gemm: bool = False,
              fp8: bool = False, exact: bool = False, engine_numerics: bool = False) -> "Policy":
        """`lora` (rank, alpha, dropout, targets): adapters on the base weights, which are frozen before DDP and the
        optimizer are built, so they get neither gradient buffers nor optimizer state (model/lora.py).
        `shared_prompt` auto | on | off (`resolve_shared_prompt`). `cp`: context-parallel size (the batch split is
        train/batching.split_for_context_parallel; megatron's DDP and distributed optimizer reduce over DP x CP).
        `moe_aux_loss_coef`: MoE models' load-balancing loss weight (None: the HF config's; 0: off; model/moe.py);
        `moe_z_loss_coef`: their router z-loss weight (None or 0: off); `moe_permute_fusion` (`_moe_options`).
        `routing_replay` off | old | rollout (model/moe.py). `attention_backend` auto | flash | cudnn: packed
        attention on CUDA (model/attention.attention_backend), `auto` measured on rank 0 and broadcast;
        `fast_paths`: the model.fast_paths section (None: all on), JUSTRL_FAST_PATHS_OFF applied on top
        (model/fast_paths.py). `moe_grouped_gemm`: MoE experts as grouped GEMMs (model/grouped_experts.py); `fp8`:
        the decoder's linears in FP8 (model/fp8.py, Hopper only). `exact` (rollout.exact): the log-prob passes compute
        what the vLLM engine computes (model/exact.py); `engine_numerics` (model.engine_numerics, resolved): every
        pass does, with the trainer's own backward."""
        replay = routing_replay != "off" and bool(shape.num_experts)
        if lora and transformer_impl == "auto":
            transformer_impl = "local"  # LoRA wraps megatron's local linears (TE fuses the norm into them)
        impl = resolve_impl(transformer_impl)
        # rollout.exact: one row per sequence, as the engine attends (shared-prompt RoPE rows are not mirrored)
        shared = resolve_shared_prompt("off" if exact else shared_prompt, impl, cp, replay)
        if moe_needs_sequence_parallel(shape, tp) and not sequence_parallel:
            logger.warning("MoE model at parallel.tensor=%d: sequence parallelism turned on (megatron's MoE layer "
                           "trains at TP > 1 only with it)", tp)
            sequence_parallel = True
        torch_dtype = resolve_dtype(dtype)
        if recompute not in (None, "none", "selective", "full"):
            raise ValueError(f"model.recompute must be none, selective or full, got {recompute!r}")
        require_parallel_layout(shape, tp, pp, vpp, ep)
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")

        init_distributed()
        if (not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() != tp
                or ps.get_pipeline_model_parallel_world_size() != pp
                or ps.get_virtual_pipeline_model_parallel_world_size() != vpp
                or ps.get_context_parallel_world_size() != cp
                or ps.get_expert_model_parallel_world_size() != ep):
            init_model_parallel(tp=tp, pp=pp, vpp=vpp, seed=seed, cp=cp, ep=ep)
        else:
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
        torch.manual_seed(seed)
        device = compat.default_device()
        heads = (shape.num_attention_heads // tp, shape.num_query_groups // tp, shape.head_dim)
        fast = fast_paths_mod.resolve(  # (TransformerEngine's spec attends with its own kernels: nothing to time)
            fast_paths, attention_backend=attention_backend,
            decide_attention=None if impl == "te" else
            lambda choice: decide_attention_backend(choice, device, torch_dtype, *heads))

        config = transformer_config(
            shape, tp=tp, pp=pp, vpp=vpp, ep=ep, sequence_parallel=sequence_parallel, dtype=torch_dtype,
            recompute=None if recompute == "none" else recompute, calculate_per_token_loss=True,
            **_pipeline_options(pp, vpp), **gpu_fusions(impl), **_context_parallel_options(cp, impl),
            **_aux_loss(shape, moe_aux_loss_coef), **_moe_options(shape, impl, moe_z_loss_coef, moe_permute_fusion))
        config.finalize_model_grads_func = finalize_grads_without_token_scaling
        config.justrl_exact = exact  # read by model/exact.engine_pass
        config.justrl_engine_numerics = engine_numerics
        if exact:
            exact_config(config)
        modules = build_model_chunks(shape, config, transformer_impl=impl, max_sequence_length=max_sequence_length,
                                     make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                                     moe_grouped_gemm=moe_grouped_gemm, fp8=fp8,
                                     attention_backend=fast.attention_backend)
        modules = [m.to(device) for m in modules]
        if exact or engine_numerics:
            install_exact(modules)
        prepare_routers(modules)
        install_route_slots(modules)  # a recomputed MoE layer routes as its forward did (model/moe.RouteSlot)
        if lora:
            apply_lora(modules, seed=seed, **lora)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer)
        chunks = [DistributedDataParallel(config, ddp_config, m, disable_bucketing=i > 0)
                  for i, m in enumerate(modules)]
        for c in chunks:
            c.broadcast_params()  # every DP replica starts from the same weights

        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=lr, min_lr=0.0, weight_decay=weight_decay, adam_beta1=adam_beta1,
                            adam_beta2=adam_beta2, adam_eps=adam_eps, clip_grad=grad_clip,
                            bf16=torch_dtype == torch.bfloat16, fp16=False, params_dtype=torch_dtype,
                            use_distributed_optimizer=distributed_optimizer),
            chunks)
        install_optimizer_kernels(optimizer, device, fast)  # foreach grad norm, fused AdamW: CUDA without apex/TE only
        scheduler = ConfigScheduler(
            optimizer, init_lr=0.0 if warmup_steps else lr, max_lr=lr, min_lr=0.0, lr_warmup_steps=warmup_steps,
            lr_decay_steps=warmup_steps + 1, lr_decay_style="constant", start_wd=weight_decay, end_wd=weight_decay,
            wd_incr_steps=1, wd_incr_style="constant")
        hyper = dict(lr=lr, warmup_steps=warmup_steps, weight_decay=weight_decay, grad_clip=grad_clip, tp=tp, pp=pp,
                     vpp=vpp, cp=cp, ep=ep, sequence_parallel=config.sequence_parallel, recompute=recompute,
                     distributed_optimizer=distributed_optimizer, seed=seed,
                     make_vocab_size_divisible_by=make_vocab_size_divisible_by, max_sequence_length=max_sequence_length)
        return cls(chunks=chunks, optimizer=optimizer, scheduler=scheduler, config=config, shape=shape,
                   transformer_impl=impl, dtype=torch_dtype,
                   padded_vocab_size=padded_vocab_size(shape.vocab_size, tp, make_vocab_size_divisible_by),
                   hyper=hyper, lora=dict(lora) if lora else None, shared_prompt=shared,
                   routing_replay=RoutingReplay(modules, source=routing_replay) if replay else None,
                   fast_paths=fast)

    @classmethod
    def from_config(cls, cfg, shape: ModelShape) -> "Policy":
        """`build` with the knobs of a composed config: cfg.model, cfg.parallel and cfg.trainer (the optimizer).
        `model.recompute=auto` is resolved by the memory plan first, as justrl-train does (it may also clamp
        `trainer.max_tokens_per_micro_batch` in cfg). The fast paths it resolves are recorded beside the launch's
        config_history entry (rank 0; a resume that resolves otherwise says so, or stops under
        model.fast_paths.strict_resume)."""
        if cfg.model.recompute == "auto":
            resolve_recompute(cfg, shape, int(os.environ.get("WORLD_SIZE", "1")))
        model, par, tr = cfg.model, cfg.parallel, cfg.trainer
        lo = model.lora
        lora = dict(rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout, targets=list(lo.targets)) if lo.enabled else None
        policy = cls.build(
            shape, tp=par.tensor, pp=par.pipeline, vpp=par.virtual_pipeline, ep=par.expert,
            sequence_parallel=par.sequence_parallel,
            dtype=model.dtype, transformer_impl=model.transformer_impl, recompute=model.recompute, lr=tr.lr,
            warmup_steps=tr.warmup_steps, weight_decay=tr.weight_decay, grad_clip=tr.grad_clip,
            adam_beta1=tr.adam_beta1, adam_beta2=tr.adam_beta2, adam_eps=tr.adam_eps,
            distributed_optimizer=par.distributed_optimizer,
            make_vocab_size_divisible_by=model.make_vocab_size_divisible_by, seed=tr.seed, lora=lora,
            shared_prompt=tr.shared_prompt, cp=par.context, moe_aux_loss_coef=model.moe_aux_loss_coef,
            moe_z_loss_coef=model.moe_z_loss_coef, moe_permute_fusion=model.moe_permute_fusion,
            routing_replay=cfg.algo.routing_replay, attention_backend=model.attention_backend,
            fast_paths=model.fast_paths, moe_grouped_gemm=model.moe_grouped_gemm, fp8=model.fp8,
            exact=cfg.rollout.exact, engine_numerics=resolve_engine_numerics(cfg, shape))
        if int(os.environ.get("RANK", "0")) == 0:  # rank 0 decides, as for the launch's other checks
            from ..run_history import record_resolved

            note = record_resolved(cfg.trainer.run_dir, policy.fast_paths.record(),
                                   strict=bool(model.fast_paths.strict_resume))
            if note:
                print(f"justrl-train: warning: {note}", file=sys.stderr, flush=True)
        return policy

    # --- small helpers the step code and tools use ---------------------------------------------------------------
    def config_for(self, shape: ModelShape):
        """The TransformerConfig of a model of `shape` at this policy's layout, precision and kernels, for a frozen
        forward-only copy (train/reference.py): this policy's own config for its own shape, else one made as
        `build` makes it (a distillation teacher of another size)."""
        if shape == self.shape:
            return self.config
        h, impl = self.hyper, self.transformer_impl
        return transformer_config(
            shape, tp=h["tp"], pp=h["pp"], vpp=h["vpp"], ep=h["ep"], sequence_parallel=h["sequence_parallel"],
            dtype=self.dtype, calculate_per_token_loss=True, **_pipeline_options(h["pp"], h["vpp"]),
            **gpu_fusions(impl), **_context_parallel_options(h["cp"], impl))

    @property
    def modules(self) -> list:
        """The GPTModel of each chunk (DDP unwrapped)."""
        return [c.module for c in self.chunks]

    @property
    def device(self) -> torch.device:
        return next(self.chunks[0].parameters()).device

    def current_lr(self) -> float:
        for group in self.optimizer.param_groups:
            return float(group["lr"])
        return 0.0
