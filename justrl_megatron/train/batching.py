"""GRPO samples -> packed micro-batches under a token budget, balanced over data-parallel ranks.

The plan of a pass (`plan_pass`) needs the whole batch: trainer rank 0 makes it and sends each DP replica its
samples and its micro-batches (train/shard.py); a caller that holds the whole batch on every rank makes the same
plan locally. For each pass (the old-logprob pass over the batch, each mini-batch of the update):
  1. `split_over_dp`: the samples of a mini-batch go to DP ranks, longest first, each to the rank with the fewest
     tokens so far (token-balanced, deterministic);
  2. `pack_micro_batches`: each rank's samples go into as few micro-batches as hold `max_tokens_per_micro_batch`
     tokens, again longest-first into the lightest bin; all DP ranks use the same number of micro-batches (a rank
     with fewer samples than that gets an empty one: a few padding tokens that carry no loss);
  3. `make_micro_batch`: the samples of one micro-batch are laid end to end in one row (prompt + response each) with
     `cu_seqlens` marking the boundaries: megatron's packed "thd" format. Attention and RoPE restart at each boundary,
     so a packed row computes exactly what separate padded rows would, without the padding.
The loss covers response tokens only: position p predicts token p + 1, so a sample with prompt P and response R
contributes positions P-1 .. P+R-2 of its segment.

Shared prompt (`trainer.shared_prompt`): the samples that share a prompt (a GRPO group) form *units*, one copy of the
prompt followed by each response, and the units, not the samples, are split and packed as above:

    tokens     p0 p1 p2 | a0 a1 a2 a3 | b0 b1     one unit: prompt P = 3, responses of 4 and 2 tokens
    positions   0  1  2 |  3  4  5  6 |  3  4     each response restarts at P: RoPE exactly as unshared
    attention  a response sees the prompt and its own earlier tokens, never a sibling

The last prompt token's output predicts the first token of every response of the unit; the rest as unshared. The
projections, MLP and norms (the bulk of a layer's FLOPs) run once per prompt instead of once per response; for the
attention the unit is cut back into *rows*, one per response (prompt + that response, `SharedPrompt.gather`),
attended exactly as unshared rows, and each token's output is picked back from one row (`SharedPrompt.pick`: a prompt
token from the unit's first row). Each row is an unshared sample's sequence, and the prompt's gradients sum over its
responses as they do over separate copies: the same update, with (n-1)/n of the prompt's layer work removed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass
class Sample:
    """One response of a GRPO group."""

    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float
    rollout_logprobs: list[float] | None = None
    group: int = 0
    truncated: bool = False  # cut at rollout.max_response_length; leaves the loss with algo.mask_truncated
    routed_experts: object = None  # MoE, algo.routing_replay=rollout: vLLM's experts [tokens - 1, layers, top-k]
    # tool rollouts: 1 per response token the model sampled, 0 per tool-output token (context: out of the loss and
    # of every response-token statistic); None: every token was sampled
    sampled_mask: list[int] | None = None

    @property
    def num_sampled(self) -> int:
        """Response tokens the model sampled (the ones the loss and its counts cover)."""
        return len(self.response_ids) if self.sampled_mask is None else int(sum(self.sampled_mask))

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def response_offsets(samples: Sequence[Sample]) -> list[int]:
    """Start of each sample's response tokens in the concatenation of all responses (length len(samples) + 1)."""
    offsets = [0]
    for s in samples:
        offsets.append(offsets[-1] + len(s.response_ids))
    return offsets


def _longest_first(ids: Sequence[int], lengths: Sequence[int]) -> list[int]:
    return sorted(ids, key=lambda i: (-lengths[i], i))


def split_over_dp(ids: Sequence[int], lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Token-balanced split of sample ids over DP ranks (each rank's list keeps the original order)."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    loads = [(0, 0, r) for r in range(dp_size)]  # (tokens, samples, rank)
    out: list[list[int]] = [[] for _ in range(dp_size)]
    for i in _longest_first(ids, lengths):
        tokens, count, r = min(loads)
        out[r].append(i)
        loads[r] = (tokens + lengths[i], count + 1, r)
    return [sorted(x) for x in out]


def _balanced_bins(ids: Sequence[int], lengths: Sequence[int], num_bins: int) -> list[list[int]]:
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    loads = [(0, b) for b in range(num_bins)]
    for i in _longest_first(ids, lengths):
        load, b = min(loads)
        bins[b].append(i)
        loads[b] = (load + lengths[i], b)
    return bins


def _fits(bins, lengths, max_tokens) -> bool:
    return all(sum(lengths[i] for i in b) <= max_tokens for b in bins)


def check_samples_fit(ids: Sequence[int], lengths: Sequence[int], max_tokens: int) -> None:
    for i in ids:
        if lengths[i] > max_tokens:
            raise ValueError(
                f"sample {i} has {lengths[i]} tokens (prompt + response), more than "
                f"trainer.max_tokens_per_micro_batch={max_tokens}; raise the budget to at least the longest "
                f"prompt + response")


def pack_micro_batches(per_rank: Sequence[Sequence[int]], lengths: Sequence[int], max_tokens: int, *,
                       multiple_of: int = 1) -> list[list[list[int]]]:
    """Micro-batches (lists of sample ids) for every DP rank, the same count on each, each within ``max_tokens``.

    ``multiple_of``: the count is rounded up to a multiple of it (the interleaved pipeline schedule wants a multiple
    of the pipeline size).
    """
    for ids in per_rank:
        check_samples_fit(ids, lengths, max_tokens)
    count = max(max((math.ceil(sum(lengths[i] for i in ids) / max_tokens) for ids in per_rank), default=1), 1)
    while True:
        count = math.ceil(count / multiple_of) * multiple_of
        plans = [_balanced_bins(ids, lengths, count) for ids in per_rank]
        if all(_fits(p, lengths, max_tokens) for p in plans):
            # keep the original sample order inside each micro-batch; lightest-last is irrelevant for the math
            return [[sorted(b) for b in p] for p in plans]
        count += 1


def plan_pass(samples: Sequence[Sample], ids: Sequence[int], max_tokens: int, dp_size: int, *,
              shared_prompt: bool = False, multiple_of: int = 1) -> list[list[list[list[int]]]]:
    """Every DP rank's micro-batches for one pass over the samples ``ids``: [DP rank][micro-batch] -> units (lists of
    sample ids; one sample each unless ``shared_prompt``), the same count of micro-batches on every DP rank.
    ``multiple_of``: that count is a multiple of it (the interleaved pipeline schedule)."""
    if shared_prompt:
        units = prompt_units(samples, ids, max_tokens)
    else:  # every sample a unit of its own
        check_samples_fit(ids, [s.length for s in samples], max_tokens)
        units = [[i] for i in ids]
    lengths = [unit_length(samples, u) for u in units]
    plans = pack_micro_batches(split_over_dp(range(len(units)), lengths, dp_size), lengths, max_tokens,
                               multiple_of=multiple_of)
    return [[[units[u] for u in b] for b in rank] for rank in plans]


@dataclass
class MicroBatch:
    """One packed row: what the model needs (tokens, positions, boundaries) and where each target comes from."""

    sample_ids: list[int]            # global sample indices, in packed order
    tokens: torch.Tensor             # [1, T] int64 (T includes trailing padding)
    position_ids: torch.Tensor       # [1, T] int64, restarting at each sample
    cu_seqlens: torch.Tensor         # [n + 1] int32 (the padding, if any, is one more segment)
    max_seqlen: int
    logit_positions: torch.Tensor    # [N] int64: positions whose next token is a response token
    targets: torch.Tensor            # [N] int64: those response tokens
    row: torch.Tensor                # [N] int64: index into sample_ids of each target
    col: torch.Tensor                # [N] int64: index of each target within its response
    response_lengths: list[int]
    num_real_tokens: int             # prompt + response tokens (no padding)
    extras: dict = field(default_factory=dict)  # per-target inputs added by the caller (old logprobs, advantages ...)
    shared: "SharedPrompt | None" = None  # shared-prompt units: the rows attention runs on (None: unshared)
    padding: torch.Tensor | None = None  # [1, T] bool, True at padding tokens (megatron's MoE padding_mask)

    @property
    def num_targets(self) -> int:
        return int(self.targets.numel())

    def packed_seq_params(self):
        # lazy: packing itself is pure torch (tested and benchmarked without loading megatron, ~4.6 s)
        from megatron.core.packed_seq_params import PackedSeqParams

        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                                 max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)
        if self.shared is not None:
            # model/attention.py reads it back: from the params object, or from the cu_seqlens tensor, which every
            # copy megatron might make of the params still carries
            params.justrl_shared_prompt = self.shared
            self.cu_seqlens.justrl_shared_prompt = self.shared
        return params

    def to(self, device) -> "MicroBatch":
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        moved = MicroBatch(self.sample_ids, move(self.tokens), move(self.position_ids), move(self.cu_seqlens),
                           self.max_seqlen, move(self.logit_positions), move(self.targets), move(self.row),
                           move(self.col), self.response_lengths, self.num_real_tokens,
                           {k: move(v) for k, v in self.extras.items()},
                           None if self.shared is None else self.shared.to(device),
                           None if self.padding is None else move(self.padding))
        if not self.cu_seqlens.is_cuda and moved.cu_seqlens is not self.cu_seqlens:
            # the packed boundaries on the host as well: attention that needs them (cuDNN per sequence, the exact
            # fallback) reads these instead of syncing with the device (model/attention.PackedPlan)
            moved.cu_seqlens.justrl_host_bounds = self.cu_seqlens.tolist()
        return moved


def make_micro_batch(samples: Sequence[Sample], ids: Sequence[int], *, pad_to_multiple_of: int = 1,
                     pad_token_id: int = 0) -> MicroBatch:
    """Pack ``samples[i] for i in ids`` into one row (on the CPU; `.to(device)` moves it), padded to a multiple of
    ``pad_to_multiple_of`` tokens (sequence parallelism splits the row over TP ranks): each sample a unit of its own
    (`make_shared_micro_batch`), prompt + response, one cu_seqlens segment each."""
    return make_shared_micro_batch(samples, [[i] for i in ids], pad_to_multiple_of=pad_to_multiple_of,
                                   pad_token_id=pad_token_id)


def gather_per_target(values: Sequence[torch.Tensor | Sequence[float]], mb: MicroBatch) -> torch.Tensor:
    """Per-sample sequences (one per global sample id) -> one value per target of ``mb`` (fp32, on the CPU), read
    at each target's (row, col): a context-parallel rank's micro-batch holds only some of each response's targets."""
    parts = []
    for i, n in zip(mb.sample_ids, mb.response_lengths):
        v = torch.as_tensor(values[i], dtype=torch.float32).reshape(-1).cpu()
        if v.numel() != n:
            raise ValueError(f"sample {i}: {v.numel()} values for {n} response tokens")
        parts.append(v)
    if not parts:
        return torch.zeros(0)
    starts = torch.tensor([0, *mb.response_lengths[:-1]], dtype=torch.int64).cumsum(0)
    return torch.cat(parts)[starts[mb.row.cpu()] + mb.col.cpu()]


def sampled_targets(samples: Sequence[Sample], mb: MicroBatch) -> torch.Tensor | None:
    """Per target of ``mb``: 1.0 where the model sampled the token, 0.0 where a tool wrote it (tool rollouts: context,
    out of the loss); None when no sample of ``mb`` has a tool output."""
    if all(samples[i].sampled_mask is None for i in mb.sample_ids):
        return None
    masks = {i: samples[i].sampled_mask or [1] * len(samples[i].response_ids) for i in mb.sample_ids}
    return gather_per_target(masks, mb)


# --- context parallel --------------------------------------------------------------------------------------------

def split_for_context_parallel(mb: MicroBatch, cp_size: int, cp_rank: int, *, multiple_of: int = 1,
                               pad_token_id: int = 0) -> MicroBatch:
    """This context-parallel rank's part of a packed micro-batch (megatron's and TransformerEngine's THD layout).

    Every segment (sequence) is right-padded to a multiple of 2 * cp_size * ``multiple_of`` tokens (padding: never a
    target, and after every real token, so causal attention never reads it) and cut into 2 * cp_size equal chunks;
    rank r keeps chunks r and 2 * cp_size - 1 - r (the early and the late chunk: equal causal-attention work on every
    rank), segment after segment. `cu_seqlens` / `max_seqlen` stay those of the padded GLOBAL row, as megatron's RoPE
    (true global positions per rank) and the CP attention expect. Targets are chosen by where their predicting
    position lands (labels are shifted before the split), so a logprob needs only the local hidden state; `row` /
    `col` keep saying which response token each local target is."""
    if cp_size <= 1:
        return mb
    if mb.shared is not None:
        raise ValueError("shared-prompt micro-batches cannot be split for context parallelism")
    unit = 2 * cp_size * max(multiple_of, 1)
    bounds = mb.cu_seqlens.tolist()
    tokens, positions = mb.tokens[0].tolist(), mb.position_ids[0].tolist()
    new_start = []          # per segment: its first token in the padded global row
    padded_tokens, padded_positions, padded, cu = [], [], [], [0]
    real = mb.padding[0].logical_not().tolist() if mb.padding is not None else [True] * mb.tokens.size(1)
    for a, b in zip(bounds[:-1], bounds[1:]):
        n = b - a
        size = -(-n // unit) * unit
        new_start.append(cu[-1])
        padded_tokens += tokens[a:b] + [pad_token_id] * (size - n)
        padded_positions += positions[a:b] + list(range(positions[b - 1] + 1, positions[b - 1] + 1 + size - n))
        padded += [not r for r in real[a:b]] + [True] * (size - n)
        cu.append(cu[-1] + size)
    local = []              # the padded global index of each local token, in local order
    for start, end in zip(cu[:-1], cu[1:]):
        chunk = (end - start) // (2 * cp_size)
        for j in (cp_rank, 2 * cp_size - 1 - cp_rank):
            local += range(start + j * chunk, start + (j + 1) * chunk)
    local_of = {g: i for i, g in enumerate(local)}
    seg = torch.bucketize(mb.logit_positions, torch.tensor(bounds[1:]), right=True)
    global_pos = (torch.tensor(new_start, dtype=torch.int64)[seg] + mb.logit_positions
                  - torch.tensor(bounds[:-1], dtype=torch.int64)[seg]).tolist()
    keep = [k for k, g in enumerate(global_pos) if g in local_of]
    keep_t = torch.tensor(keep, dtype=torch.int64)
    long = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return MicroBatch(
        sample_ids=mb.sample_ids, tokens=long([padded_tokens[g] for g in local]).unsqueeze(0),
        position_ids=long([padded_positions[g] for g in local]).unsqueeze(0),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32), max_seqlen=max(b - a for a, b in zip(cu[:-1], cu[1:])),
        logit_positions=long([local_of[global_pos[k]] for k in keep]), targets=mb.targets[keep_t],
        row=mb.row[keep_t], col=mb.col[keep_t], response_lengths=mb.response_lengths,
        num_real_tokens=mb.num_real_tokens, extras={k: v[keep_t] for k, v in mb.extras.items()},
        padding=torch.tensor([padded[g] for g in local], dtype=torch.bool).unsqueeze(0))


# --- shared prompt -----------------------------------------------------------------------------------------------

@dataclass
class SharedPrompt:
    """How attention sees a micro-batch of shared-prompt units (the contract model/attention.py reads).

    The rows (one per response: its prompt, then itself; the padding segment is a row of its own) are laid end to
    end: `gather[j]` is the micro-batch token at place j of that layout, `row_cu` its boundaries, `row_max` its
    longest row; `pick[t]` is the place in the rows whose attention output token t of the micro-batch takes."""

    gather: torch.Tensor   # [rows' tokens] int64
    row_cu: torch.Tensor   # [rows + 1] int32
    row_max: int
    pick: torch.Tensor     # [T] int64

    def to(self, device) -> "SharedPrompt":
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return SharedPrompt(move(self.gather), move(self.row_cu), self.row_max, move(self.pick))


def prompt_units(samples: Sequence[Sample], ids: Sequence[int], max_tokens: int) -> list[list[int]]:
    """``ids`` grouped by identical prompt (first-seen order), each group cut into units of at most ``max_tokens``
    tokens (one prompt + its responses). A unit of one sample is an unshared sample."""
    check_samples_fit(ids, [s.length for s in samples], max_tokens)
    by_prompt: dict[tuple, list[int]] = {}
    for i in ids:
        by_prompt.setdefault(tuple(samples[i].prompt_ids), []).append(i)
    units = []
    for prompt, members in by_prompt.items():
        unit, size = [], len(prompt)
        for i in members:
            n = len(samples[i].response_ids)
            if unit and size + n > max_tokens:
                units.append(unit)
                unit, size = [], len(prompt)
            unit.append(i)
            size += n
        units.append(unit)
    return units


def unit_length(samples: Sequence[Sample], unit: Sequence[int]) -> int:
    """Tokens of a unit: its prompt once plus every response."""
    return len(samples[unit[0]].prompt_ids) + sum(len(samples[i].response_ids) for i in unit)


def make_shared_micro_batch(samples: Sequence[Sample], units: Sequence[Sequence[int]], *, pad_to_multiple_of: int = 1,
                            pad_token_id: int = 0) -> MicroBatch:
    """Pack ``units`` (lists of sample ids with one prompt: its copy, then each response) into one row, a cu_seqlens
    segment per unit. Only when some unit holds several responses does attention need the rows (`SharedPrompt`);
    units of one sample are plain packed samples, and the row layout is not built."""
    sharing = any(len(u) > 1 for u in units)
    tokens: list[int] = []
    positions: list[int] = []
    cu = [0]
    logit_positions: list[int] = []
    targets: list[int] = []
    row: list[int] = []
    col: list[int] = []
    sample_ids: list[int] = []
    gather: list[int] = []   # rows end to end, as micro-batch token indices
    row_cu = [0]
    pick: list[int] = []     # per micro-batch token: its place in `gather`
    for unit in units:
        prompt = samples[unit[0]].prompt_ids
        if not prompt:
            raise ValueError(f"sample {unit[0]} has an empty prompt: its first response token would have no context")
        if any(list(samples[i].prompt_ids) != list(prompt) for i in unit):
            raise ValueError(f"samples {list(unit)} do not share one prompt")
        start, p = len(tokens), len(prompt)
        tokens.extend(prompt)
        positions.extend(range(p))
        if sharing:
            pick.extend(range(len(gather), len(gather) + p))  # the prompt's outputs come from the unit's first row
        for i in unit:
            s = samples[i]
            r, n = len(sample_ids), len(s.response_ids)
            sample_ids.append(i)
            first = len(tokens)
            tokens.extend(s.response_ids)
            positions.extend(range(p, p + n))
            if sharing:
                row_start = len(gather)
                gather.extend(range(start, start + p))
                gather.extend(range(first, first + n))
                row_cu.append(len(gather))
                pick.extend(range(row_start + p, row_start + p + n))
            # the last prompt token predicts the first response token; response token j predicts token j + 1
            if n:
                logit_positions.extend([start + p - 1, *range(first, first + n - 1)])
            targets.extend(s.response_ids)
            row.extend([r] * n)
            col.extend(range(n))
        cu.append(len(tokens))
    real = len(tokens)
    multiple = max(pad_to_multiple_of, 1)
    pad = (-real) % multiple if real else multiple
    if pad:  # one more segment (and row), attended only by itself, never a target
        if sharing:
            pick.extend(range(len(gather), len(gather) + pad))
            gather.extend(range(real, real + pad))
            row_cu.append(len(gather))
        tokens.extend([pad_token_id] * pad)
        positions.extend(range(pad))
        cu.append(len(tokens))
    seg = [b - a for a, b in zip(cu[:-1], cu[1:])]
    long = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    shared = None
    if sharing:
        shared = SharedPrompt(gather=long(gather), row_cu=torch.tensor(row_cu, dtype=torch.int32),
                              row_max=max(b - a for a, b in zip(row_cu[:-1], row_cu[1:])), pick=long(pick))
    return MicroBatch(
        sample_ids=sample_ids, tokens=long(tokens).unsqueeze(0), position_ids=long(positions).unsqueeze(0),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32), max_seqlen=max(seg), logit_positions=long(logit_positions),
        targets=long(targets), row=long(row), col=long(col),
        response_lengths=[len(samples[i].response_ids) for i in sample_ids], num_real_tokens=real, shared=shared,
        padding=(torch.arange(len(tokens)) >= real).unsqueeze(0))
