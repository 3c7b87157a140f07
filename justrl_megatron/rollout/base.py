"""The rollout seam: what the trainer asks of a rollout engine, and what comes back.

The trainer never imports vLLM. Its engine loop (rollout/engine_loop.py, the one way an engine is driven) calls

    engine.add_request(request_id, prompt_ids, n, sampling)   # a group: n samples of one prompt
    for request_id, rollouts in engine.step(): ...             # the groups that finished in one engine step
    engine.abort_keeping(request_ids)                          # a stop: each group's samples so far
    engine.pause(); engine.receive_weights(...) / update_weights(stream, version); engine.resume()
    engine.sleep(); ...train...; engine.update_weights(stream, version); engine.wake_up()   # colocated

and the source checks `rollouts.weight_version` against the policy's version with `check_staleness` before it
trains on them.
Logprobs are those of the sampled tokens under the engine's weights (raw, before any temperature/top-p
processing), which is what the trainer recomputes: `logprob_gap` measures how far the two are apart.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence, Union, runtime_checkable

import torch

# A weight stream: (hf_name, full tensor) pairs, or buckets (lists) of them, as convert/export.py yields.
NamedTensor = tuple[str, torch.Tensor]
WeightStream = Iterable[Union[NamedTensor, list[NamedTensor]]]

FINISH_REASONS = ("stop", "length", "abort")
NO_TOOL_STATS = {"calls": 0, "errors": 0, "timeouts": 0, "turns": 1, "sandbox_s": 0.0}


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample. The defaults are the JustRL training setting (temperature 1, full top-p / top-k): only
    then do the rollout logprobs equal the trainer's."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: the whole vocabulary
    seed: int | None = None  # a per-batch seed makes a batch reproducible; None: the engine's own stream
    stop_token_ids: tuple[int, ...] = ()  # on top of the model's EOS tokens
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"SamplingConfig.max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingConfig.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingConfig.top_k must be -1 (off) or >= 1, got {self.top_k}")

    @property
    def exact_logprobs(self) -> bool:
        """True when the sampled tokens' logprobs are comparable with the trainer's (full distribution)."""
        return self.temperature == 1.0 and self.top_p == 1.0 and self.top_k == -1

    @classmethod
    def from_rollout_config(cls, rollout, seed: int | None = None) -> "SamplingConfig":
        """From config.RolloutConfig (rollout.max_response_length, temperature, top_p, top_k)."""
        return cls(max_tokens=rollout.max_response_length, temperature=rollout.temperature, top_p=rollout.top_p,
                   top_k=rollout.top_k, seed=seed)


def weight_sync_backend(name: str) -> str:
    """rollout.weight_sync_backend with its alias resolved ("cpu" is local)."""
    return {"cpu": "local"}.get(name, name)


def registered_class(path: str) -> type:
    """The class a registry names by import path ("module:Class"): a registered module may import its registry."""
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


@dataclass
class Rollouts:
    """One batch of samples, flat: sample i continues prompt `prompt_index[i]` (samples of a prompt are
    consecutive, `n` of them, in prompt order — the GRPO group layout)."""

    prompt_index: list[int]
    token_ids: list[list[int]]
    logprobs: list[list[float]]  # logprob of each sampled token under the weights of `weight_version`
    finish_reasons: list[str]  # "stop" (EOS / stop token) | "length" (hit max_tokens) | "abort"
    weight_version: int
    truncated: list[bool] = field(default_factory=list)  # finish_reason == "length"
    # MoE with algo.routing_replay=rollout: per sample, vLLM's experts of every forwarded token (prompt + response
    # but the last), an int array [tokens, MoE layers, top-k] (vLLM's enable_return_routed_experts); else None
    routed_experts: list | None = None
    # streaming (rollout.streaming): per sample, the weight version that sampled each response token (a response may
    # span versions: the engine takes new weights mid-generation); None: every token is of `weight_version`
    token_versions: list[list[int]] | None = None
    # tool rollouts (rollout.tools, rollout/multi_turn.py): per sample, 1 for each response token the model sampled and
    # 0 for a tool's output (context: its logprob is a 0.0 placeholder, and it is never trained on); None: all sampled
    sampled_mask: list[list[int]] | None = None
    # tool rollouts: per sample, {"calls", "errors", "timeouts", "turns", "sandbox_s"}
    tool_stats: list[dict] | None = None

    def __post_init__(self):
        n = len(self.token_ids)
        if not (len(self.prompt_index) == len(self.logprobs) == len(self.finish_reasons) == n):
            raise ValueError(
                f"Rollouts fields disagree in length: prompt_index {len(self.prompt_index)}, token_ids {n}, "
                f"logprobs {len(self.logprobs)}, finish_reasons {len(self.finish_reasons)}")
        for i, (toks, lps) in enumerate(zip(self.token_ids, self.logprobs)):
            if len(toks) != len(lps):
                raise ValueError(f"sample {i}: {len(toks)} tokens but {len(lps)} logprobs")
        if not self.truncated:
            self.truncated = [r == "length" for r in self.finish_reasons]
        if self.routed_experts is not None and len(self.routed_experts) != n:
            raise ValueError(f"Rollouts: {len(self.routed_experts)} routed_experts for {n} samples")
        if self.token_versions is not None:
            if len(self.token_versions) != n:
                raise ValueError(f"Rollouts: {len(self.token_versions)} token_versions for {n} samples")
            for i, (toks, vs) in enumerate(zip(self.token_ids, self.token_versions)):
                if len(toks) != len(vs):
                    raise ValueError(f"sample {i}: {len(toks)} tokens but {len(vs)} token versions")
        if self.sampled_mask is not None:
            if len(self.sampled_mask) != n:
                raise ValueError(f"Rollouts: {len(self.sampled_mask)} sampled masks for {n} samples")
            for i, (toks, m) in enumerate(zip(self.token_ids, self.sampled_mask)):
                if len(toks) != len(m) or any(x not in (0, 1) for x in m):
                    raise ValueError(f"sample {i}: {len(toks)} tokens but a sampled mask of {len(m)} entries "
                                     f"(each 0 or 1)")
        if self.tool_stats is not None and len(self.tool_stats) != n:
            raise ValueError(f"Rollouts: {len(self.tool_stats)} tool stats for {n} samples")

    def __len__(self) -> int:
        return len(self.token_ids)

    @classmethod
    def in_order(cls, order: Sequence[tuple["Rollouts", int, int]], weight_version: int) -> "Rollouts":
        """Samples picked from several parts, [(part, its sample k, global prompt index g)], as one batch."""
        routed = [r.routed_experts[k] if r.routed_experts is not None else None for r, k, _ in order]
        versions = [r.versions_of(k) for r, k, _ in order]
        mixed = any(r.token_versions is not None for r, _, _ in order)
        tools = any(r.sampled_mask is not None for r, _, _ in order)
        return cls(prompt_index=[g for _, _, g in order], token_ids=[r.token_ids[k] for r, k, _ in order],
                   logprobs=[r.logprobs[k] for r, k, _ in order],
                   finish_reasons=[r.finish_reasons[k] for r, k, _ in order], weight_version=weight_version,
                   routed_experts=routed if routed and all(x is not None for x in routed) else None,
                   token_versions=versions if mixed else None,
                   sampled_mask=[r.mask_of(k) for r, k, _ in order] if tools else None,
                   tool_stats=[r.tool_stats[k] if r.tool_stats is not None else dict(NO_TOOL_STATS)
                               for r, k, _ in order] if tools else None)

    def mask_of(self, i: int) -> list[int]:
        """Which of sample i's response tokens the model sampled (1) and which a tool wrote (0)."""
        if self.sampled_mask is not None:
            return list(self.sampled_mask[i])
        return [1] * len(self.token_ids[i])

    def sampled_lengths(self) -> list[int]:
        """Tokens the model sampled per sample (tool outputs not counted)."""
        return [sum(self.mask_of(i)) for i in range(len(self))]

    def versions_of(self, i: int) -> list[int]:
        """The weight version of each of sample i's response tokens."""
        if self.token_versions is not None:
            return list(self.token_versions[i])
        return [self.weight_version] * len(self.token_ids[i])

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the engine loop needs from a rollout engine (rollout/vllm_engine.py implements it)."""

    max_num_seqs: int  # sequences one scheduler step holds at most
    step_budget: tuple[int, int] | None  # (tokens, sequences) of a step that seeded prefills must fit (CPU), or None

    @property
    def weight_version(self) -> int: ...

    def add_request(self, request_id: str, prompt_ids: Sequence[int], n: int, sampling: SamplingConfig) -> None: ...

    def step(self) -> list[tuple[str, "Rollouts"]]: ...

    def abort_keeping(self, request_ids: Sequence[str]) -> dict[str, "Rollouts"]: ...

    def abort(self, request_ids: Sequence[str]) -> None: ...

    def num_unfinished(self) -> int: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def update_weights(self, stream: WeightStream, version: int) -> dict: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def shutdown(self) -> None: ...


class RolloutInterrupted(Exception):
    """A stop (SIGTERM / SIGUSR1 / Ctrl-C, slurm.stop_requested) cut a rollout short: its requests were aborted and
    nothing of it is returned. Every rank of the job raises it together (rollout/stopping.py agrees on it), so the
    trainer can checkpoint the last completed step and exit as a stop does."""


class StaleRolloutError(RuntimeError):
    """A rollout batch was sampled with weights older than rollout.max_staleness allows."""


def check_staleness(batch_version: int, current_version: int, max_staleness: int = 0) -> int:
    """Refuse a batch sampled with weights more than `max_staleness` versions behind the policy; return the lag.

    max_staleness = 0 is on-policy (the batch must come from the current weights); 1 is one-step-off async.
    """
    if max_staleness < 0:
        raise ValueError(f"rollout.max_staleness must be >= 0, got {max_staleness}")
    lag = current_version - batch_version
    if lag < 0:
        raise StaleRolloutError(
            f"rollout batch has weight version {batch_version}, newer than the policy's {current_version}: "
            f"the engine was synced with weights the trainer does not have (a version counter is off)")
    if lag > max_staleness:
        raise StaleRolloutError(
            f"rollout batch was sampled with weight version {batch_version} but the policy is at {current_version} "
            f"({lag} step(s) stale) and rollout.max_staleness={max_staleness}; sync the engine "
            f"(engine.update_weights) before generating, or raise rollout.max_staleness for off-policy training")
    return lag


def logprob_gap(rollout_logprobs: Sequence[Sequence[float]], trainer_logprobs: Sequence,
                mask: Sequence[Sequence[int]] | None = None) -> dict[str, float]:
    """Mean and max |rollout - trainer| logprob over all sampled tokens (the per-step trainer/engine parity metric).

    `trainer_logprobs[i]` holds the trainer's logprobs of sample i's response tokens (a list or 1-D tensor).
    `mask` (Rollouts.sampled_mask): only the tokens marked 1 count (a tool's output has no rollout logprob).
    """
    if len(rollout_logprobs) != len(trainer_logprobs):
        raise ValueError(f"{len(rollout_logprobs)} rollout samples but {len(trainer_logprobs)} trainer samples")
    diffs = []
    for i, (a, b) in enumerate(zip(rollout_logprobs, trainer_logprobs)):
        a = torch.as_tensor(a, dtype=torch.float64)
        b = torch.as_tensor(b, dtype=torch.float64).detach().cpu().reshape(-1)
        if a.numel() != b.numel():
            raise ValueError(f"sample {i}: {a.numel()} rollout logprobs but {b.numel()} trainer logprobs")
        d = (a - b).abs()
        diffs.append(d if mask is None else d[torch.as_tensor(mask[i], dtype=torch.bool)])
    flat = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)
    if flat.numel() == 0:
        return {"logprob_diff_mean": 0.0, "logprob_diff_max": 0.0, "logprob_diff_tokens": 0}
    return {"logprob_diff_mean": flat.mean().item(), "logprob_diff_max": flat.max().item(),
            "logprob_diff_tokens": int(flat.numel())}
