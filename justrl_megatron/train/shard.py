"""Each trainer rank's share of a scored batch: trainer rank 0 plans, every DP replica receives only its samples.

Trainer rank 0 holds the whole scored batch (rollout/source.py). It builds the update's samples, plans every pass
over them exactly as each rank would if it held them all (`plan_pass`, train/batching.py: token-balanced over DP
replicas, packed under the token budget, shared-prompt units when `trainer.shared_prompt`):

    logprob pass    the whole batch once: old logprobs, reference logprobs (algo.kl_coef), and the samples whose
                    trainer vs rollout logprob gap this replica counts (each sample in exactly one replica)
    update passes   one per mini-batch (one for the on-policy single step), each with the whole mini-batch's loss
                    denominator and token count, which no replica could count from its own share

and sends each trainer rank the `Shard` of its DP replica (`scatter_shards`; the TP, PP and CP ranks of a replica
get the same one): the samples its passes hold (each sample goes to at most two replicas: its logprob pass's and its
mini-batch's), their plans with the samples renumbered 0.. in the shard, and every sample's response length (the
layout of the per-token logprobs, which still reach every rank: train/step.py). A caller that holds the whole batch
on every rank (tests, benchmarks) gets the same plan from `plan_shards(..., whole=True)` on each rank.

MoE routing replay with experts recorded in the old-logprob pass (algo.routing_replay=old) moves the recorded experts
between replicas by their index in the whole batch (model/moe.RoutingReplay.fetch), so there every replica keeps the
whole batch (`Layout.whole`): the plans are the same, only the bytes sent are not saved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from ..algo.grpo import AGG_MODES
from ..distributed import trainer_scatter
from .batching import Sample, plan_pass


@dataclass(frozen=True)
class Layout:
    """What a pass's plan depends on besides the samples: the same on every trainer rank."""

    dp_size: int
    max_tokens: int  # trainer.max_tokens_per_micro_batch
    shared_prompt: bool = False
    multiple_of: int = 1  # micro-batches per DP replica: a multiple of the pipeline size with virtual PP
    whole: bool = False  # every replica keeps the whole batch (routing replay of recorded experts)

    @classmethod
    def of(cls, policy, max_tokens: int) -> "Layout":
        from megatron.core import parallel_state as ps

        vpp = ps.get_virtual_pipeline_model_parallel_world_size()
        replay = getattr(policy, "routing_replay", None)
        return cls(ps.get_data_parallel_world_size(), max_tokens, bool(policy.shared_prompt),
                   ps.get_pipeline_model_parallel_world_size() if vpp else 1,
                   whole=replay is not None and replay.source == "old")


@dataclass
class PassPlan:
    """One pass of a replica: its micro-batches, each a list of units (lists of indices into `Shard.samples`)."""

    micro_batches: list[list[list[int]]]
    denominator: int = 0  # an update pass: the loss denominator of the whole mini-batch (every replica's samples)
    num_tokens: int = 0  # an update pass: prompt + response tokens of the whole mini-batch

    def sample_indices(self) -> list[int]:
        return sorted(i for mb in self.micro_batches for unit in mb for i in unit)


@dataclass
class Shard:
    """What one DP replica trains on, and the figures of the whole batch it needs."""

    samples: list[Sample]  # this replica's samples, in the batch's order
    ids: list[int]  # each one's index in the whole batch
    response_lengths: list[int]  # every sample of the whole batch's
    logprob_pass: PassPlan
    update_passes: list[PassPlan]
    mini_batch_size: int | None  # samples per mini-batch of the update passes (None: no update planned)
    loss_agg: str
    mask_truncated: bool
    max_tokens: int

    @property
    def num_samples(self) -> int:
        """Samples in the whole batch."""
        return len(self.response_lengths)

    def check(self, *, max_tokens: int, mini_batch_size: int | None = None, loss_agg: str | None = None,
              mask_truncated: bool | None = None) -> None:
        """The pass settings a step was asked for must be the ones this shard was planned with."""
        asked = {"max_tokens_per_micro_batch": (max_tokens, self.max_tokens),
                 "mini_batch_size": (mini_batch_size, self.mini_batch_size),
                 "loss aggregation": (loss_agg, self.loss_agg), "mask_truncated": (mask_truncated, self.mask_truncated)}
        wrong = [f"{k} {a} (planned with {b})" for k, (a, b) in asked.items() if a is not None and a != b]
        if wrong:
            raise ValueError(f"the shard was planned for other settings: {', '.join(wrong)}")


def loss_denominator(samples: Sequence[Sample], ids: Sequence[int], loss_agg: str, mask_truncated: bool = False
                     ) -> int:
    """The mini-batch's global denominator: response tokens (token-mean), sequences (verl04-dynbsz) or responses with
    a token (seq-mean-*). ``mask_truncated``: truncated responses are out of the loss, so out of every count too."""
    if loss_agg not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {loss_agg!r}; known: {AGG_MODES}")
    if mask_truncated:
        ids = [i for i in ids if not samples[i].truncated]
    # tool rollouts: only the tokens the model sampled count (a tool's output is context)
    if loss_agg == "token-mean":
        return sum(samples[i].num_sampled for i in ids)
    if loss_agg == "verl04-dynbsz":  # verl divides by the mini-batch size: every sequence, empty or not
        return len(ids)
    return sum(1 for i in ids if samples[i].num_sampled)


def plan_shards(samples: Sequence[Sample], layout: Layout, *, mini_batch_size: int | None = None,
                loss_agg: str = "token-mean", mask_truncated: bool = False, whole: bool = False) -> list[Shard]:
    """Every DP replica's shard of the whole batch `samples` (index: the DP rank). ``mini_batch_size``: samples per
    optimizer step of the update (None: the logprob pass only). ``whole``: each shard holds the whole batch (the
    caller has it on every rank), numbered as in it."""
    n, plan = len(samples), lambda ids: plan_pass(samples, ids, layout.max_tokens, layout.dp_size,
                                                   shared_prompt=layout.shared_prompt, multiple_of=layout.multiple_of)
    if mini_batch_size is not None and mini_batch_size < 1:
        raise ValueError(f"mini_batch_size must be >= 1, got {mini_batch_size}")
    logprob_pass = plan(range(n))
    updates = []
    for start in range(0, n if mini_batch_size else 0, mini_batch_size or 1):
        ids = range(start, min(start + mini_batch_size, n))
        updates.append((plan(ids), max(loss_denominator(samples, ids, loss_agg, mask_truncated), 1),
                        sum(samples[i].length for i in ids)))
    lengths = [len(s.response_ids) for s in samples]
    whole = whole or layout.whole
    shards = []
    for r in range(layout.dp_size):
        if whole:
            held, local = range(n), None
        else:
            passes = [logprob_pass[r], *(p[r] for p, _, _ in updates)]
            held = sorted({i for p in passes for mb in p for unit in mb for i in unit})
            local = {g: k for k, g in enumerate(held)}

        def renumber(micro_batches, local=local):
            return micro_batches if local is None else [[[local[i] for i in u] for u in mb] for mb in micro_batches]

        shards.append(Shard(samples=list(samples) if whole else [samples[g] for g in held], ids=list(held),
                            response_lengths=lengths, logprob_pass=PassPlan(renumber(logprob_pass[r])),
                            update_passes=[PassPlan(renumber(p[r]), d, t) for p, d, t in updates],
                            mini_batch_size=mini_batch_size, loss_agg=loss_agg, mask_truncated=mask_truncated,
                            max_tokens=layout.max_tokens))
    return shards


def scatter_shards(samples: Sequence[Sample] | None, layout: Layout, **plan) -> Shard:
    """This trainer rank's shard (call on every trainer rank; rank 0 passes the whole batch, the others None):
    rank 0 plans (`plan_shards(samples, layout, **plan)`) and sends each rank its replica's shard. A planning error
    (a sample over the token budget) is raised on every rank."""
    from megatron.core import parallel_state as ps

    world = dist.get_world_size() if dist.is_initialized() else 1
    replica = [None] * world  # each trainer rank's DP rank
    if world > 1:
        dist.all_gather_object(replica, ps.get_data_parallel_rank())
    else:
        replica = [0]
    per_rank, error = None, None
    if samples is not None:
        try:
            shards = plan_shards(samples, layout, **plan)
            per_rank = [shards[d] for d in replica]
        except (ValueError, RuntimeError) as exc:
            error, per_rank = exc, [f"{type(exc).__name__}: {exc}"] * world
    got = trainer_scatter(per_rank)
    if error is not None:
        raise error
    if isinstance(got, str):
        raise RuntimeError(f"trainer rank 0 could not plan the batch: {got}")
    return got


def logprob_gap(shard: Shard, trainer_logprobs: Sequence[torch.Tensor], device) -> dict[str, float]:
    """Mean and max |rollout - trainer| logprob over the sampled tokens of the whole batch (the per-step
    trainer/engine parity metric; rollout.logprob_gap's figures), the same on every trainer rank: each replica counts
    its logprob pass's samples, and the sum, count and max are reduced over the DP replicas (collective).

    The max and the count are exact. The mean is the float64 sum of |diff| over all tokens divided by the count: the
    same bits as a mean over the whole batch with one DP replica; with several, the sum is added up in another order
    (per replica, then across), which differs by at most 2 (tokens - 1) 2^-53 of the sum (float64 reassociation)."""
    from megatron.core import parallel_state as ps

    diffs = []
    for k in shard.logprob_pass.sample_indices():
        s = shard.samples[k]
        a = torch.as_tensor(s.rollout_logprobs, dtype=torch.float64)
        b = torch.as_tensor(trainer_logprobs[shard.ids[k]], dtype=torch.float64).detach().cpu().reshape(-1)
        if a.numel() != b.numel():
            raise ValueError(f"sample {shard.ids[k]}: {a.numel()} rollout logprobs but {b.numel()} trainer logprobs")
        d = (a - b).abs()
        diffs.append(d if s.sampled_mask is None else d[torch.as_tensor(s.sampled_mask, dtype=torch.bool)])
    flat = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)
    sums = torch.stack([flat.sum(), torch.tensor(float(flat.numel()), dtype=torch.float64)]).to(device)
    largest = (flat.max() if flat.numel() else torch.tensor(-math.inf, dtype=torch.float64)).reshape(1).to(device)
    if ps.get_data_parallel_world_size() > 1:  # one rank per replica in each DP group: every sample counted once
        dist.all_reduce(sums, group=ps.get_data_parallel_group())
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
    total, count = sums.tolist()
    if count == 0:
        return {"logprob_diff_mean": 0.0, "logprob_diff_max": 0.0, "logprob_diff_tokens": 0}
    return {"logprob_diff_mean": total / int(count), "logprob_diff_max": largest.item(),
            "logprob_diff_tokens": int(count)}
