"""One GRPO update on the Megatron policy: old-logprob recomputation and the clipped policy-gradient steps.

Both go through megatron's own schedule (`get_forward_backward_func()`), so TP, SP, PP and virtual PP all work the
same way. Each data-parallel replica trains on its token-balanced share, packed into micro-batches
(train/batching.py): the samples come as a `Shard` (train/shard.py: trainer rank 0 planned the passes and sent each
replica its samples), or as the whole list on every rank, from which each rank makes the same plan itself. Per-token
logprobs (old, reference) come back for the whole batch on every rank, by sample index in the batch. The last
pipeline stage never builds logits: the policy's output layer hands back hidden states and logprobs/entropy are
computed from them in chunks (model/logprobs.py).

Loss normalisation (JustRL: token-mean over the whole mini-batch): the global denominator (response tokens of the
mini-batch over all micro-batches and DP ranks; sequences for the other modes) comes with the plan of each
mini-batch, counted where the whole batch is known, with no collective. Each micro-batch's loss is
`policy_loss(..., denominator=D)`, a partial sum that adds up to the mini-batch loss; megatron is configured not to
rescale it (model/policy.py).

Non-finite gradients (as verl 0.4.0): an optimizer step whose global grad norm is NaN or inf is skipped — gradients
zeroed, weights and optimizer state untouched — and counted (`skipped_steps`, `Policy.skipped_in_a_row`). A step that
could make a weight NaN or inf (never, with a validated config: see `step_cannot_overflow`) is taken back if it did,
and counted the same way; the normal step pays fused norms of its gradients and weights on the device, one host
sync and no host copy.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from typing import Callable, NamedTuple, Sequence

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections before megatron loads)

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from ..algo.distill import DISTILL_SUM_KEYS, distill_advantages, distill_metrics, distill_sums
from ..algo.grpo import AGG_MODES, CP_LOSS_AGGS, policy_loss
from ..algo.loss_config import LossConfig
from ..algo.rollout_correction import correction_metrics, correction_weights
from ..model.build import output_weight, returning_hidden_states, unwrap
from ..model import moe
from ..model import exact
from ..model.logprobs import logprobs_from_hidden
from ..model.optimizer_kernels import fp32_norms
from ..model.rope import rope_at_positions
from .batching import MicroBatch, Sample, gather_per_target, make_shared_micro_batch, plan_pass, sampled_targets, \
    split_for_context_parallel
from .shard import Layout, PassPlan, Shard, loss_denominator, plan_shards

__all__ = ["TeacherScores", "compute_logprobs", "grpo_update", "grpo_update_on_policy", "loss_denominator",
           "plan_micro_batches"]

# Per-micro-batch statistics summed over micro-batches, mini-batches and DP ranks (then turned into means).
SUM_KEYS = ("loss", "pg_loss", "kl_loss", "entropy_loss", "num_tokens", "clip_low_count", "clip_high_count",
            "clip_dual_count", "approx_kl_sum", "entropy_sum", "logprob_sum", "old_logprob_sum", "ref_kl_sum",
            "rc_ratio_sum", "rc_ratio_count", "rc_corrected_count", *DISTILL_SUM_KEYS)


class TeacherScores(NamedTuple):
    """A distillation teacher's view of the whole batch (train/teacher.py), by sample index: its log-prob of every
    response token and 1.0 where its top-1 token is not the sampled one."""
    logprobs: list
    top1_mismatch: list


# --- parallel layout ---------------------------------------------------------------------------------------------

def _tp_group():
    return ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None


def _is_contributor() -> bool:
    """One rank per DP replica reports results: the last pipeline stage's first TP rank."""
    return ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0


def _reduce_over_training_ranks(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Combine one value per DP replica and CP rank (a CP rank's values cover its own tokens) into the same result
    on every training rank (DP x CP group, then TP x PP group). Non-contributors must hold the identity of ``op``
    (0 for SUM, -inf for MAX, +inf for MIN)."""
    if ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
        dist.all_reduce(t, op=op, group=ps.get_data_parallel_group(with_context_parallel=True))
    if ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(t, op=op, group=ps.get_model_parallel_group())
    return t


# --- planning and running micro-batches --------------------------------------------------------------------------

def plan_micro_batches(policy, samples: Sequence[Sample], ids: Sequence[int], max_tokens_per_micro_batch: int
                       ) -> list[MicroBatch]:
    """This DP rank's packed micro-batches for the samples ``ids`` of the whole list ``samples`` (same count on every
    DP rank). With the policy's `shared_prompt`, the units (a prompt and its responses, train/batching.py) are what
    is split and packed."""
    layout = Layout.of(policy, max_tokens_per_micro_batch)
    plan = plan_pass(samples, ids, layout.max_tokens, layout.dp_size, shared_prompt=layout.shared_prompt,
                     multiple_of=layout.multiple_of)
    return _micro_batches(policy, samples, PassPlan(plan[ps.get_data_parallel_rank()]))


def _micro_batches(policy, samples: Sequence[Sample], plan: PassPlan) -> list[MicroBatch]:
    """The packed micro-batches of this rank's pass `plan` (its units index ``samples``)."""
    pad = policy.config.tensor_model_parallel_size if policy.config.sequence_parallel else 1
    cp = ps.get_context_parallel_world_size()
    if cp > 1:  # each sequence split over the CP ranks, each part padded for SP (split_for_context_parallel)
        return [split_for_context_parallel(make_shared_micro_batch(samples, units), cp,
                                           ps.get_context_parallel_rank(), multiple_of=pad)
                for units in plan.micro_batches]
    return [make_shared_micro_batch(samples, units, pad_to_multiple_of=pad) for units in plan.micro_batches]


def _as_shard(policy, samples: Sequence[Sample] | Shard, max_tokens: int, **update) -> Shard:
    """A `Shard` as it came (checked against the settings asked for), or this rank's shard of the whole list
    ``samples`` that every rank holds (each rank plans the same passes itself)."""
    if isinstance(samples, Shard):
        samples.check(max_tokens=max_tokens, **update)
        return samples
    return plan_shards(samples, Layout.of(policy, max_tokens), whole=True, **update)[ps.get_data_parallel_rank()]


def _routes(policy, routes: str | None, mb: MicroBatch, model):
    """algo.routing_replay old|rollout (model/moe.RoutingReplay): record the micro-batch's experts, or replay them."""
    replay = getattr(policy, "routing_replay", None)
    if replay is None or routes is None:
        return contextlib.nullcontext()
    return replay.recording(model, mb) if routes == "record" else replay.replaying(model, mb)


def _load_routes(policy, samples, micro_batches: list[MicroBatch]) -> str | None:
    """Before a pass over `samples` (this rank's share: `micro_batches`): algo.routing_replay=rollout replays vLLM's
    experts ("replay"); old records this pass's experts of this rank's samples for the update that follows
    ("record"); off: None."""
    replay = getattr(policy, "routing_replay", None)
    if replay is None:
        return None
    if replay.source == "rollout":
        replay.use_rollout_routes(samples)
        return "replay"
    replay.begin_recording(samples, [k for mb in micro_batches for k in mb.sample_ids])
    return "record"


def _fetch_routes(policy, routes: str | None, micro_batches: list[MicroBatch]) -> None:
    """Before replaying `micro_batches`: their samples' recorded experts onto this rank, from the DP rank whose
    old-logprob pass recorded each (collective over the DP group; model/moe.RoutingReplay.fetch)."""
    replay = getattr(policy, "routing_replay", None)
    if replay is not None and routes == "replay":
        replay.fetch([k for mb in micro_batches for k in mb.sample_ids])


def _num_targets(mb: MicroBatch, device) -> torch.Tensor:
    """The micro-batch's target count as the loss function hands it to megatron's schedule. torch.full, not
    torch.tensor: a Python scalar copied to the GPU is a host sync in every micro-batch."""
    return torch.full((), mb.num_targets, dtype=torch.int, device=device)


def _rope_positions(mb: MicroBatch, rope_once: bool):
    """The position ids RoPE rotates by, or None for megatron's segment offsets. Shared-prompt units need them
    (responses restart at the prompt's end, inside one segment); on CUDA every packed row uses them too
    (fast path `rope_once`: megatron's packed RoPE reads the boundaries on the host in every layer). The position
    ids restart at each sample, which is what the segment offsets give, so both rotate a token alike."""
    if mb.shared is not None:
        return mb.position_ids[0]
    if mb.tokens.is_cuda and ps.get_context_parallel_world_size() == 1 and rope_once:
        return mb.position_ids[0]
    return None


def _run_schedule(policy, micro_batches: list[MicroBatch], loss_fn: Callable, *, forward_only: bool,
                  routes: str | None = None) -> list:
    """Run all micro-batches through megatron's schedule; returns the loss functions' dicts (last stage only)."""
    device = policy.device
    _fetch_routes(policy, routes, micro_batches)
    mbs = [mb.to(device) for mb in micro_batches]

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        with rope_at_positions(unwrap(model), _rope_positions(mb, policy.fast_paths.rope_once)), \
                _routes(policy, routes, mb, model):
            out = model(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params(),
                        padding_mask=moe.padding_mask(model, mb))
        return out, functools.partial(loss_fn, mb, model)

    chunks = policy.chunks
    iterators = [iter(mbs) for _ in chunks] if len(chunks) > 1 else iter(mbs)
    grad_mode = torch.no_grad() if forward_only else contextlib.nullcontext()
    with returning_hidden_states(chunks), grad_mode, moe.training_pass(chunks, not forward_only):
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators, model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(mbs), micro_batch_size=1,  # the schedule divides seq_length by CP
            seq_length=max(mb.tokens.size(1) for mb in mbs) * ps.get_context_parallel_world_size(),
            forward_only=forward_only)


def _target_logprobs(policy, mb: MicroBatch, model, output: torch.Tensor, with_entropy: bool):
    hidden = output[0].index_select(0, mb.logit_positions)  # [N, h] positions that predict response tokens
    if exact.engine_pass(policy.config, hidden) and exact.piece_on("head"):
        # rollout.exact's log-prob passes and every pass under model.engine_numerics: the engine's head (model/exact.py)
        return exact.engine_logprobs(hidden, output_weight(model), mb.targets, policy.shape.vocab_size, with_entropy)
    return logprobs_from_hidden(hidden, output_weight(model), mb.targets, vocab_size=policy.shape.vocab_size,
                                with_entropy=with_entropy, group=_tp_group(),
                                compiled=hidden.is_cuda and policy.fast_paths.compiled_head)


def _target_top1_mismatch(policy, mb: MicroBatch, model, output: torch.Tensor) -> torch.Tensor:
    """Per target: 1.0 where the model's most likely token (argmax over the real vocabulary) is not the target, else
    0.0 (a tie counts as agreement). The same logits as the logprobs (hidden @ output weight), in row chunks, each
    TP rank over its vocabulary slice and one MAX all-reduce of (max logit, target logit) per chunk. Forward-only:
    the distillation teacher's `distill/top1_mismatch_frac`."""
    hidden = output[0].index_select(0, mb.logit_positions).detach()
    weight = output_weight(model).detach()
    group = _tp_group()
    vocab_local = weight.shape[0]
    start = 0 if group is None else dist.get_rank(group) * vocab_local
    real = min(max(policy.shape.vocab_size - start, 0), vocab_local)
    targets = mb.targets.to(hidden.device).reshape(-1) - start
    inside = (targets >= 0) & (targets < real)
    out = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    rows = max(1, (1 << 26) // max(vocab_local, 1))  # fp32 logits of at most 256 MB alive at once
    for a in range(0, hidden.shape[0], rows):
        b = min(a + rows, hidden.shape[0])
        z = hidden[a:b].float() @ weight[:real].float().T  # [rows, real]
        top = z.max(dim=1).values if real else torch.full((b - a,), -math.inf, device=hidden.device)
        at = z.gather(1, targets[a:b].clamp(0, max(real - 1, 0)).unsqueeze(1)).squeeze(1) if real else top
        at = torch.where(inside[a:b], at, torch.full_like(at, -math.inf))
        both = torch.stack([top, at])
        if group is not None:
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        out[a:b] = (both[1] < both[0]).float()
    return out


def _scatter_to_samples(shard: Shard, per_mb: list[tuple[MicroBatch, torch.Tensor]], device) -> list[torch.Tensor]:
    """Per-micro-batch target values -> one fp32 CPU tensor per sample of the whole batch, identical on all training
    ranks (each replica writes its shard's samples)."""
    offsets = [0, *itertools.accumulate(shard.response_lengths)]
    flat = torch.zeros(offsets[-1], dtype=torch.float32, device=device)
    if _is_contributor():
        starts = torch.tensor(offsets[:-1], dtype=torch.int64)
        for mb, values in per_mb:
            ids = torch.tensor([shard.ids[k] for k in mb.sample_ids], dtype=torch.int64)
            pos = (starts[ids[mb.row.cpu()]] + mb.col.cpu()).to(device)
            flat[pos] = values.float()
    flat = _reduce_over_training_ranks(flat).cpu()
    return [flat[a:b].clone() for a, b in zip(offsets[:-1], offsets[1:])]


# --- public API ------------------------------------------------------------------------------------------------------

def compute_logprobs(policy, samples: Sequence[Sample] | Shard, *, max_tokens_per_micro_batch: int,
                     with_entropy: bool = False, with_top1_mismatch: bool = False):
    """Response-token logprobs of the current weights, one fp32 CPU tensor per sample of the whole batch (``samples``
    the whole list, or this rank's `Shard` of it), the same on every rank.

    Forward-only through megatron's schedule, without autograd. With ``with_entropy`` returns
    ``(logprobs, entropies)``; with ``with_top1_mismatch`` ``(logprobs, mismatch)`` instead (a distillation teacher:
    `_target_top1_mismatch` per token, in the same pass).
    """
    if with_entropy and with_top1_mismatch:
        raise ValueError("compute_logprobs: with_entropy or with_top1_mismatch, not both")
    shard = _as_shard(policy, samples, max_tokens_per_micro_batch)
    if not shard.num_samples:
        return ([], []) if with_entropy or with_top1_mismatch else []
    samples = shard.samples
    micro_batches = _micro_batches(policy, samples, shard.logprob_pass)

    def loss_fn(mb, model, output):
        logp, ent = _target_logprobs(policy, mb, model, output, with_entropy)
        if with_top1_mismatch:
            ent = _target_top1_mismatch(policy, mb, model, output)
        zero = torch.zeros((), device=output.device)
        return zero, _num_targets(mb, output.device), {"logprobs": logp, "entropy": ent}

    routes = _load_routes(policy, samples, micro_batches)
    results = _run_schedule(policy, micro_batches, loss_fn, forward_only=True, routes=routes)
    if routes == "record":  # this rank's samples' experts, whole (the update fetches the ones it trains)
        policy.routing_replay.end_recording()
    logprobs = _scatter_to_samples(shard, [(mb, r["logprobs"]) for mb, r in zip(micro_batches, results)],
                                   policy.device)
    if not with_entropy and not with_top1_mismatch:
        return logprobs
    entropy = _scatter_to_samples(shard, [(mb, r["entropy"]) for mb, r in zip(micro_batches, results)],
                                  policy.device)
    return logprobs, entropy


def _padded(values: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """Per-target values [N] -> [num samples, longest response] (zeros past each response)."""
    rows, cols = len(mb.sample_ids), max(mb.response_lengths, default=0)
    out = torch.zeros(rows, cols, dtype=values.dtype, device=values.device)
    return out.index_put((mb.row, mb.col), values)


def _empty_stats(device) -> dict:
    stats = {k: torch.zeros((), device=device) for k in SUM_KEYS}
    stats["ratio_min"] = torch.full((), math.inf, device=device)
    stats["ratio_max"] = torch.full((), -math.inf, device=device)
    stats["rc_ratio_max"] = torch.full((), -math.inf, device=device)
    return stats


def grpo_update(policy, samples: Sequence[Sample] | Shard, old_logprobs: Sequence[torch.Tensor], *,
                mini_batch_size: int,
                max_tokens_per_micro_batch: int, loss: LossConfig | None = None,
                ref_logprobs: Sequence[torch.Tensor] | None = None, on_grads: Callable | None = None,
                teacher: TeacherScores | None = None, **loss_settings) -> dict[str, float]:
    """One RL step of GRPO updates: ``ceil(len(samples) / mini_batch_size)`` optimizer steps over consecutive
    mini-batches, then one LR-scheduler step. Returns metrics, the same on every rank.

    ``samples``: the whole list on every rank, or this rank's `Shard` of it (planned with the same
    ``mini_batch_size``, aggregation and mask_truncated). ``old_logprobs`` (and ``ref_logprobs``) cover the whole
    batch, by sample index. ``old_logprobs``: per-sample response-token logprobs of the policy that generated the samples (from
    `compute_logprobs` before the first step). ``loss``: the algo.LossConfig (its defaults when None), with any of
    its fields replaced by keyword (``clip_high=``, ``kl_coef=``, ...). ``ref_logprobs``: the reference policy's
    (needed only with kl_coef > 0). ``teacher``: a distillation teacher's scores of the whole batch (algo/distill.py:
    each token's advantage becomes distill_reward_coef * A - distill_coef * (old - teacher)). mask_truncated takes
    truncated samples out of the loss and its denominator; rollout_correction weighs the loss by the old logprobs
    over each sample's ``rollout_logprobs``.
    ``on_grads``: called as ``on_grads(policy, step_index)`` after each backward (gradients reduced, before the
    optimizer step); for tests and diagnostics.
    """
    loss = (loss or LossConfig()).but(**loss_settings)
    shard = _update_shard(policy, samples, max_tokens_per_micro_batch, mini_batch_size, loss)
    if len(old_logprobs) != shard.num_samples:
        raise ValueError(f"{len(old_logprobs)} old logprob sequences for {shard.num_samples} samples")
    return _update(policy, shard, old_logprobs, loss=loss, ref_logprobs=ref_logprobs, on_grads=on_grads,
                   teacher=teacher)[0]


def grpo_update_on_policy(policy, samples: Sequence[Sample] | Shard, *, max_tokens_per_micro_batch: int,
                          loss: LossConfig | None = None, ref_logprobs: Sequence[torch.Tensor] | None = None,
                          on_grads: Callable | None = None, teacher: TeacherScores | None = None,
                          **loss_settings) -> tuple[dict[str, float], list[torch.Tensor]]:
    """`grpo_update` for the common case of ONE optimizer step over samples drawn from the current weights, without
    the separate old-logprob pass: the update's own forward pass gives the old logprobs (detached, so the ratio is
    exactly 1 and the gradient is the same as with a recomputation). Saves one forward pass over the batch.

    Returns (metrics, old logprobs): the logprobs of the weights before the step, one fp32 CPU tensor per sample of
    the whole batch, as `compute_logprobs` would have returned them (for the trainer vs rollout-engine parity check).
    A `Shard` must have been planned with one mini-batch (mini_batch_size >= the batch's samples).
    """
    loss = (loss or LossConfig()).but(**loss_settings)
    whole = None if isinstance(samples, Shard) else max(len(samples), 1)
    shard = _update_shard(policy, samples, max_tokens_per_micro_batch, whole, loss)
    if len(shard.update_passes) > 1:
        raise ValueError("old logprobs can come from the update's own forward pass only with one optimizer step "
                         f"per batch (mini_batch_size {shard.mini_batch_size} < {shard.num_samples} samples)")
    return _update(policy, shard, None, loss=loss, ref_logprobs=ref_logprobs, on_grads=on_grads, teacher=teacher)


def _update_shard(policy, samples: Sequence[Sample] | Shard, max_tokens: int, mini_batch_size: int | None,
                  loss: LossConfig) -> Shard:
    return _as_shard(policy, samples, max_tokens, mini_batch_size=mini_batch_size, loss_agg=loss.aggregation,
                     mask_truncated=loss.mask_truncated)


def _update(policy, shard: Shard, old_logprobs: Sequence[torch.Tensor] | None, *, loss: LossConfig,
            ref_logprobs: Sequence[torch.Tensor] | None, on_grads: Callable | None,
            teacher: TeacherScores | None = None) -> tuple[dict[str, float], list[torch.Tensor]]:
    """Both public updates. ``old_logprobs=None``: one mini-batch, old logprobs taken from its own forward pass."""
    kl_coef, loss_agg = loss.kl_coef, loss.aggregation
    rollout_correction, mask_truncated = loss.rollout_correction, loss.mask_truncated
    samples = shard.samples
    reuse_forward = old_logprobs is None
    if kl_coef and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (reference-policy logprobs of every response)")
    if ps.get_context_parallel_world_size() > 1 and loss_agg not in CP_LOSS_AGGS:
        raise ValueError(f"loss_agg={loss_agg} does not work with context parallelism; use {CP_LOSS_AGGS}")
    if rollout_correction != "none" and any(s.rollout_logprobs is None for s in samples):
        raise ValueError(f"rollout_correction={rollout_correction} needs the rollout engine's logprobs of every "
                         "response (Sample.rollout_logprobs)")
    lr = policy.current_lr()
    totals = None
    # the update replays the old pass's experts (routing_replay=old) or vLLM's (rollout; loaded here when no
    # old-logprob pass ran); reusing the update's forward for the old logprobs with `old`: natural routing
    replay = getattr(policy, "routing_replay", None)
    from_rollout = replay is not None and replay.source == "rollout"
    if reuse_forward and from_rollout:
        replay.use_rollout_routes(samples)
    routes = None if reuse_forward and not from_rollout else "replay"
    router_load = (moe.RouterLoad(policy.chunks, policy.shape.num_layers, policy.shape.num_experts)
                   if policy.shape.num_experts else contextlib.nullcontext())
    grad_norms, steps_ok, micro_batch_counts, tokens_total, router_losses = [], [], [], 0, []

    # the whole batch's logprobs, indexed like this shard's samples
    old_logprobs = None if reuse_forward else [old_logprobs[i] for i in shard.ids]
    ref_logprobs = None if ref_logprobs is None else [ref_logprobs[i] for i in shard.ids]
    if teacher is not None:
        teacher = TeacherScores(*([values[i] for i in shard.ids] for values in teacher))
    for step, plan in enumerate(shard.update_passes):
        denom = plan.denominator
        micro_batches = _micro_batches(policy, samples, plan)
        for mb in micro_batches:
            if not reuse_forward:
                mb.extras["old"] = gather_per_target(old_logprobs, mb)
            mb.extras["adv"] = torch.tensor([samples[i].advantage for i in mb.sample_ids],
                                            dtype=torch.float32)[mb.row]
            if kl_coef:
                mb.extras["ref"] = gather_per_target(ref_logprobs, mb)
            if teacher is not None:
                mb.extras["teacher"] = gather_per_target(teacher.logprobs, mb)
                mb.extras["top1_miss"] = gather_per_target(teacher.top1_mismatch, mb)
            if mask_truncated:
                kept = [not samples[i].truncated for i in mb.sample_ids]
                mb.extras["keep"] = torch.tensor(kept, dtype=torch.float32)[mb.row]
                mb.extras["kept_rows"] = torch.tensor(sum(kept))  # verl04-dynbsz: this micro-batch's sequences
            sampled = sampled_targets(samples, mb)  # tool rollouts: a tool's output is context, never trained on
            if sampled is not None:
                mb.extras["keep"] = mb.extras["keep"] * sampled if "keep" in mb.extras else sampled
            if rollout_correction != "none":
                mb.extras["rollout"] = gather_per_target([s.rollout_logprobs for s in samples], mb)
        micro_batch_counts.append(len(micro_batches))
        tokens_total += plan.num_tokens

        loss_fn = functools.partial(_grpo_loss, policy, loss, denom)
        for chunk in policy.chunks:
            chunk.zero_grad_buffer()
        policy.optimizer.zero_grad()
        # MoE: the router losses weigh the model's coefficients per mini-batch (model/moe.py)
        with moe.loss_scale(policy.config, len(micro_batches) * ps.get_data_parallel_world_size()), router_load:
            results = _run_schedule(policy, micro_batches, loss_fn, forward_only=False,
                                    routes=routes)
        router_losses.append(moe.tracked_losses(policy.config, len(micro_batches)))
        forward_logprobs = [(mb, r.pop("target_logprobs")) for mb, r in zip(micro_batches, results)]
        if on_grads is not None:
            on_grads(policy, step)
        ok, grad_norm = optimizer_step_if_finite(policy)
        steps_ok.append(ok)
        grad_norms.append(grad_norm)
        for r in results:
            if totals is None:
                totals = {k: v.detach().clone() for k, v in r.items()}
                continue
            for k, v in r.items():
                if k == "ratio_min":
                    totals[k] = torch.minimum(totals[k], v)
                elif k in ("ratio_max", "rc_ratio_max"):
                    totals[k] = torch.maximum(totals[k], v)
                else:
                    totals[k] = totals[k] + v
    # verl 0.4.0 steps its LR scheduler once per RL step whether or not the optimizer stepped: so does this
    policy.scheduler.step(increment=1)
    if reuse_forward:  # the one mini-batch's forward pass ran on the weights before the step
        old_logprobs = _scatter_to_samples(shard, forward_logprobs, policy.device)
    else:
        old_logprobs = None
    metrics = _finalize_metrics(policy, totals, grad_norms, steps_ok, micro_batch_counts, tokens_total, lr,
                                rollout_correction, with_kl=bool(kl_coef), with_distill=teacher is not None)
    # MoE: actor/moe_aux_loss (megatron's switch loss), actor/moe_z_loss, mean over layers and micro-batches; the
    # update's router load per layer (max / mean tokens per expert)
    for name in router_losses[0]:
        metrics[name] = sum(r[name] for r in router_losses) / len(router_losses)
    if policy.shape.num_experts:
        metrics.update(router_load.imbalance())
    return metrics, old_logprobs


def optimizer_step_if_finite(policy) -> tuple[bool, float]:
    """megatron's ``optimizer.step()`` unless the global grad norm is NaN or inf (verl 0.4.0 skips such a step too).
    Returns (stepped, grad norm); a skipped step zeroes the gradients and leaves weights and optimizer state as they
    were. Every training rank decides the same way.

    megatron skips only on its fp16 loss scaler's inf check, which bf16 / fp32 never use: without this guard a NaN
    norm makes the clip factor NaN and Adam writes NaN into every weight. Decided on the device before the step, in
    one host sync: fused per-tensor norms of this rank's whole DDP gradient buffer (after the DP reduction; a NaN or
    inf anywhere in it, or a sum of squares that overflows, makes the global norm non-finite, and with the
    distributed optimizer a NaN another replica contributed lands in some rank's own shard) and of the trainable
    weights, the largest of each reduced over all training ranks at once. The largest weight norm (>= every |w|)
    decides whether the step could make a weight non-finite (`_step_keeping_finite_weights`). megatron's own step
    then runs unchanged (one grad copy, one norm, its clip).
    """
    optimizer = policy.optimizer
    params = _trainable_params(policy)
    grads = [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
    flags = _largest_norms(grads, params, policy.device)
    largest_grad, largest_weight = _reduce_over_training_ranks(flags, dist.ReduceOp.MAX).tolist()
    if not math.isfinite(largest_grad):
        optimizer.prepare_grads()  # the norm megatron would have logged (NaN / inf), for the metrics
        norm = float(optimizer.get_grad_norm())
        optimizer.zero_grad()
        for chunk in policy.chunks:
            chunk.zero_grad_buffer()
        policy.skipped_in_a_row += 1
        return False, norm
    ok, grad_norm, weights_ok = _step_keeping_finite_weights(policy, params, largest_weight)
    if grad_norm is None:  # megatron's fp32 optimizer without clipping does not compute it
        grad_norm = optimizer.get_grad_norm()
    if not ok or not weights_ok:  # megatron's own skip (fp16 scaler), or new weights taken back: a skipped step
        policy.skipped_in_a_row += 1
        return False, float(grad_norm)
    policy.skipped_in_a_row = 0
    return True, float(grad_norm)


def _trainable_params(policy) -> list[torch.Tensor]:
    return [p for chunk in policy.chunks for p in chunk.parameters() if p.requires_grad]


def _largest_norms(grads: list[torch.Tensor], params: list[torch.Tensor], device) -> torch.Tensor:
    """[largest per-tensor 2-norm of ``grads``, of ``params``] (each >= every |x| of its list; finite iff every
    element is finite and no sum of squares overflows; +inf if not finite; 0 for an empty list) as a 2-vector of fp32
    on the device, in a number of kernels that does not grow with the tensor count (`_largest_norm`)."""
    worst = torch.stack([_largest_norm(grads, device), _largest_norm(params, device)])
    return torch.where(torch.isfinite(worst), worst, torch.full_like(worst, float("inf")))


def _largest_norm(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """The largest per-tensor 2-norm in fp32 (0 for no tensors), in a number of kernels that does not grow with the
    tensor count (`fp32_norms`). (The inf-norm has no fused CPU kernel: 200x slower there.)"""
    if not tensors:
        return torch.zeros((), device=device)
    return fp32_norms(tensors).max()


@functools.lru_cache(maxsize=None)
def adam_update_bound(beta1: float, beta2: float) -> float:
    """The largest |m_hat / (sqrt(v_hat) + eps)| bias-corrected Adam can produce for ANY gradients (inf when
    beta1^2 >= beta2). By Cauchy-Schwarz, |m_t| <= (1 - b1) sqrt(S_t v_t / (1 - b2)) with S_t = sum_j<t (b1^2/b2)^j,
    so |m_hat_t| / sqrt(v_hat_t) <= (1 - b1) / (1 - b1^t) * sqrt((1 - b2^t) / (1 - b2)) * sqrt(S_t): the sup over t
    (dense up to 1e4, then log-spaced to 1e15, and the limit)."""
    gamma = beta1 ** 2 / beta2 if beta2 > 0 else math.inf
    if not 0 <= beta1 < 1 or not 0 < beta2 < 1 or gamma >= 1:
        return math.inf
    t = torch.cat([torch.arange(1, 10_001, dtype=torch.float64), torch.logspace(4, 15, 2000, dtype=torch.float64)])
    b1, b2, g = (torch.tensor(x, dtype=torch.float64) for x in (beta1, beta2, gamma))
    ratio = (1 - b1) / (1 - b1 ** t) * torch.sqrt((1 - b2 ** t) / (1 - b2)) * torch.sqrt((1 - g ** t) / (1 - g))
    limit = (1 - beta1) / math.sqrt((1 - beta2) * (1 - gamma))
    return max(float(ratio.max()), limit)


def step_cannot_overflow(policy, largest_weight: float) -> bool:
    """True when this Adam step provably leaves every trainable weight finite, from host figures only
    (``largest_weight``: a bound on every |w|, the largest weight tensor's norm over all ranks): with finite
    gradients a step moves each weight to w (1 - lr wd) - lr u with |u| <= adam_update_bound(betas) (eps > 0), and
    that stays well inside the weight dtype's range. A validated config (trainer.lr in (0, 1], adam_eps > 0) always
    passes unless a weight is already near the dtype's largest number or beta1^2 >= beta2."""
    limit = min(torch.finfo(policy.dtype).max, torch.finfo(torch.float32).max) / 4
    if not math.isfinite(largest_weight) or largest_weight > limit:
        return False
    for group in policy.optimizer.param_groups:
        if any(group.get(k) is None for k in ("lr", "eps", "betas")):  # not an Adam we know: no bound
            return False
        lr, wd, eps = float(group["lr"]), float(group.get("weight_decay") or 0.0), float(group["eps"])
        if not eps > 0 or not 0 <= lr < math.inf:
            return False
        bound = adam_update_bound(float(group["betas"][0]), float(group["betas"][1]))
        if not largest_weight * max(1.0, abs(1 - lr * wd)) + 2 * lr * bound < limit:
            return False
    return True


def _step_keeping_finite_weights(policy, params: list[torch.Tensor], largest_weight: float
                                 ) -> tuple[bool, float | None, bool]:
    """``optimizer.step()`` -> (ok, grad norm, weights finite), never leaving a NaN or inf in a trainable weight.

    The normal case costs nothing: `step_cannot_overflow` clears the step from figures already on the host (the
    largest weight came with the skip flag), and it runs as megatron's step. Only a step it cannot clear (lr = inf
    given to Policy.build directly, a weight near the dtype's range, beta1^2 >= beta2) keeps a host copy of the
    trainable weights first and is taken back if any weight on any training rank came out NaN or inf; Adam's moments
    keep that step's (finite) gradient."""
    if step_cannot_overflow(policy, largest_weight):
        ok, grad_norm, _ = policy.optimizer.step()
        return ok, grad_norm, True
    before = [p.detach().to("cpu", copy=True) for p in params]
    ok, grad_norm, _ = policy.optimizer.step()
    with torch.no_grad():  # exact here (no norm that could overflow): any element NaN or inf
        bad = (~torch.stack([torch.isfinite(p).all() for p in params])).any().float().reshape(1)
    if not _reduce_over_training_ranks(bad, dist.ReduceOp.MAX).item():
        return ok, grad_norm, True
    with torch.no_grad():
        for p, saved in zip(params, before):
            p.copy_(saved)
    policy.optimizer.reload_model_params()  # mixed precision: the fp32 main copies from the restored weights
    return ok, grad_norm, False


def skip_limit_message(skipped_in_a_row: int, limit: int) -> str | None:
    """Why training stops after ``limit`` optimizer steps in a row were skipped (``limit`` 0: never), else None."""
    if limit <= 0 or skipped_in_a_row < limit:
        return None
    return (f"stopping: the last {skipped_in_a_row} optimizer steps were skipped (non-finite gradient norm; "
            f"trainer.max_skipped_steps={limit}). The weights are the last good ones and were checkpointed. "
            "Look for the cause (actor/grad_norm, actor/entropy, the data of these steps), or resume with a higher "
            "trainer.max_skipped_steps (0: never stop)")


def _grpo_loss(policy, loss_cfg: LossConfig, denom: int, mb: MicroBatch, model, output: torch.Tensor):
    """Loss function of one micro-batch (last pipeline stage): returns (loss, tokens, stats) as megatron expects."""
    device = output.device
    if mb.num_targets == 0:  # an empty filler micro-batch: zero loss, but keep the graph for the pipeline backward
        return output.sum() * 0.0, torch.tensor(0, dtype=torch.int, device=device), \
            {**_empty_stats(device), "target_logprobs": torch.zeros(0, device=device)}
    entropy_coef = loss_cfg.entropy_coef
    logp, ent = _target_logprobs(policy, mb, model, output, with_entropy=True)
    if not entropy_coef:
        ent = ent.detach()  # metric only: no backward through the entropy
    old = mb.extras["old"] if "old" in mb.extras else logp.detach()  # on-policy single step: ratio exactly 1
    # the response tokens in the loss: all of them, or (algo.mask_truncated) those of untruncated responses, and
    # (tool rollouts) only those the model sampled
    keep = mb.extras.get("keep")
    mask = _padded(torch.ones_like(logp) if keep is None else keep, mb)
    num_rows = int(mb.extras["kept_rows"]) if "kept_rows" in mb.extras else None
    # rollout correction: weights pi_old / pi_vllm (both paths: `old` is recomputed or this forward's, detached)
    weights, rc = correction_weights(_padded(old, mb), _padded(mb.extras["rollout"], mb), mask,
                                     loss_cfg.rollout_correction, loss_cfg.tis_cap) \
        if "rollout" in mb.extras else (None, {})
    token_mean = loss_cfg.aggregation == "token-mean"
    advantages = _padded(mb.extras["adv"], mb)
    if "teacher" in mb.extras:  # on-policy distillation: per-token advantages against the teacher (algo/distill.py)
        teacher = _padded(mb.extras["teacher"], mb)
        advantages = distill_advantages(advantages, _padded(old, mb), teacher, coef=loss_cfg.distill_coef,
                                        reward_coef=loss_cfg.distill_reward_coef)
    loss, m = policy_loss(
        _padded(logp, mb), _padded(old, mb), advantages, mask, loss_cfg,
        denominator=denom if token_mean else None, num_sequences=None if token_mean else denom,
        num_rows=num_rows, ref_logprobs=_padded(mb.extras["ref"], mb) if "ref" in mb.extras else None,
        entropy=_padded(ent, mb) if entropy_coef else None, weights=weights)
    in_loss = (lambda t: t) if keep is None else (lambda t: t * keep)  # the token statistics cover the loss' tokens
    stats = _empty_stats(device)
    stats.update({
        "loss": loss.detach().clone(),  # megatron may rescale the returned loss in place
        "pg_loss": m["pg_loss"], "num_tokens": m["num_tokens"], "clip_low_count": m["clip_low_count"],
        "clip_high_count": m["clip_high_count"], "clip_dual_count": m["clip_dual_count"],
        "approx_kl_sum": m["approx_kl_sum"], "ratio_min": m["ratio_min"], "ratio_max": m["ratio_max"],
        "entropy_sum": in_loss(ent.detach()).sum(), "logprob_sum": in_loss(logp.detach()).sum(),
        "old_logprob_sum": in_loss(old).sum()})
    if rc:
        stats.update({"rc_ratio_sum": rc["ratio_sum"], "rc_ratio_count": rc["ratio_count"],
                      "rc_corrected_count": rc["corrected_count"], "rc_ratio_max": rc["ratio_max"]})
    for k in ("kl_loss", "entropy_loss", "ref_kl_sum"):
        if k in m:
            stats[k] = m[k]
    if "teacher" in mb.extras:
        stats.update(distill_sums(_padded(old, mb), teacher, _padded(mb.extras["top1_miss"], mb), mask))
    stats = {k: v.detach().float() for k, v in stats.items()}
    stats["target_logprobs"] = logp.detach()  # per target, not summed: the old logprobs when reused
    return loss, _num_targets(mb, device), stats


def _finalize_metrics(policy, totals, grad_norms, steps_ok, micro_batch_counts, tokens_total, lr,
                      rollout_correction: str = "none", with_kl: bool = False,
                      with_distill: bool = False) -> dict[str, float]:
    device = policy.device
    contributor = _is_contributor() and totals is not None
    sums = torch.stack([totals[k] if contributor else torch.zeros((), device=device) for k in SUM_KEYS])
    sums = _reduce_over_training_ranks(sums.to(device))
    rmin = _reduce_over_training_ranks(
        (totals["ratio_min"] if contributor else torch.full((), math.inf, device=device)).reshape(1).clone(),
        dist.ReduceOp.MIN)
    rmax, rc_max = _reduce_over_training_ranks(torch.stack([
        totals[k] if contributor else torch.full((), -math.inf, device=device) for k in ("ratio_max", "rc_ratio_max")
    ]).to(device), dist.ReduceOp.MAX).tolist()
    s = dict(zip(SUM_KEYS, sums.tolist()))
    n_steps = len(grad_norms)
    tokens = max(s["num_tokens"], 1.0)
    # the norms of the steps taken; a skipped step's norm is not finite (all skipped: NaN, as verl would log)
    taken = [g for g, ok in zip(grad_norms, steps_ok) if ok]
    no_step = 0.0 if not grad_norms else float("nan")
    metrics = {
        "loss": s["loss"] / max(n_steps, 1),  # mean over mini-batches of the mini-batch loss
        "pg_loss": s["pg_loss"] / max(n_steps, 1),
        "grad_norm": sum(taken) / len(taken) if taken else no_step,
        "grad_norm_max": max(taken, default=no_step),
        "clip_frac_low": s["clip_low_count"] / tokens,
        "clip_frac_high": s["clip_high_count"] / tokens,
        "clip_frac_dual": s["clip_dual_count"] / tokens,
        "approx_kl": s["approx_kl_sum"] / tokens,
        "entropy": s["entropy_sum"] / tokens,
        "logprob_mean": s["logprob_sum"] / tokens,
        "old_logprob_mean": s["old_logprob_sum"] / tokens,
        "ratio_min": rmin.item(),
        "ratio_max": rmax,
        "lr": lr,
        "num_optimizer_steps": float(n_steps),
        "skipped_steps": float(sum(not ok for ok in steps_ok)),  # optimizer steps skipped (non-finite grad norm)
        "num_micro_batches": float(sum(micro_batch_counts)),
        "num_response_tokens": s["num_tokens"],
        "num_tokens": float(tokens_total),
    }
    if with_kl:  # the KL to the reference policy (algo.kl_estimator) per response token, and its loss term
        metrics["kl"] = s["ref_kl_sum"] / tokens
        metrics["kl_loss"] = s["kl_loss"] / max(n_steps, 1)
    if s["entropy_loss"]:
        metrics["entropy_loss"] = s["entropy_loss"] / max(n_steps, 1)
    if with_distill:  # distill/reverse_kl, teacher and student log-prob means, top-1 mismatch, per token in the loss
        metrics.update(distill_metrics(s, tokens))
    # algo.rollout_correction: rollout_correction/ratio_mean, ratio_max, clipped_frac | masked_frac (logged as is)
    metrics.update(correction_metrics(rollout_correction, s["rc_ratio_sum"], s["rc_ratio_count"], rc_max,
                                      s["rc_corrected_count"]))
    return metrics
