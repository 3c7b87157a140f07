"""Multi-turn rollouts with tools (rollout.tools, rollout.max_turns): generate until the model closes a tool call, run
it in a worker thread, append its output as context, generate on; up to `max_turns` calls and the response budget.

    tools = ToolRollout.from_config(cfg, model_dir)          # None when rollout.tools is empty
    rollouts = generate_batch(engine, prompt_ids, n, sampling, seed=..., tools=tools)   # the placement's one call

Every sample is its own engine request (its turns diverge at the first call). Requests stream their tokens
(`VLLMEngine.add_request(stream=True)` / `step_tokens`): after a token that carries a backtick, the text of the model's
current turn is decoded and asked whether it ends in a call (`Tool.find_call`); if so the request is aborted there
and the call goes to a thread pool, while the engine keeps stepping every other request (continuous batching). When
the call returns, its output is tokenised, appended, and the sample continues as a new request whose prompt is the
prompt + every response token so far, kept as token ids exactly as sampled (never re-tokenised: a re-tokenised
transcript drifts from what was sampled). Prefix caching makes the re-admission cost the new tokens only.

The result is a normal `Rollouts`: `token_ids` hold model and tool tokens in order, `sampled_mask` marks the model's
(tool tokens: 0, logprob placeholder 0.0), `tool_stats` counts calls, errors, timeouts, turns and sandbox seconds per
sample. Tool tokens count against rollout.max_response_length; a response whose budget runs out is "length".
Training treats the tool tokens as context (train/step.py masks them out of the loss and its statistics).

Seeds: on GPU each turn of each sample gets its own seed (the batch seed + its place); on CPU the requests are
unseeded, as streaming's side batches are: a seeded CPU generator cannot follow a chunked prefill, and in continuous
batching what else runs decides the chunking.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .base import Rollouts, SamplingConfig
from .stopping import StopCheck
from .tools import Observation, make_tools, trigger_token_ids

CALL_WAIT_S = 0.1  # while only tool calls run: how long one wait lasts (a stop is read between waits)


@dataclass
class _Sample:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1: sampled by the model, 0: a tool's output
    turn_start: int = 0  # where the model's current turn began in `tokens`
    finish: str | None = None
    stats: dict = field(default_factory=lambda: {"calls": 0, "errors": 0, "timeouts": 0, "turns": 0,
                                                 "sandbox_s": 0.0})


class ToolRollout:
    """The multi-turn driver over a `VLLMEngine` (add_request(stream=True) / step_tokens / abort)."""

    def __init__(self, tools: Sequence, tokenizer, *, max_turns: int, workers: int = 4):
        if not tools:
            raise ValueError("ToolRollout needs at least one tool")
        self.tools, self.tokenizer, self.max_turns = list(tools), tokenizer, int(max_turns)
        self.triggers = trigger_token_ids(tokenizer)
        self.pool = ThreadPoolExecutor(max_workers=max(1, int(workers)), thread_name_prefix="tool")

    @classmethod
    def from_config(cls, cfg, model_dir) -> "ToolRollout | None":
        ro = cfg.rollout
        if not ro.tools:
            return None
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or model_dir)
        return cls(make_tools(ro), tokenizer, max_turns=ro.max_turns, workers=ro.tool_workers)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    # -- one engine ----------------------------------------------------------------------------------------------------

    def generate(self, engine, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: SamplingConfig, *,
                 seed: int | None = None, request_indices: Sequence[int] | None = None,
                 regex: str | None = None, regex_turns: int | None = None,
                 stop: Callable[[], bool] | StopCheck | None = None) -> Rollouts:
        """`n` multi-turn samples of each prompt on this engine, grouped by prompt. `request_indices`: the prompts'
        places in a larger batch (seeds). `regex`: the first `regex_turns` (default: every) model turns held to it
        (vLLM structured output, for tests; a held token's logprob is that of the masked distribution). `stop`: as
        VLLMEngine.generate's, read between engine steps (and while only tool calls run): every request is aborted
        and RolloutInterrupted raised; calls still running finish in the pool, unread."""
        if n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
        budget = sampling.max_tokens
        seed = sampling.seed if seed is None else seed
        on_cpu = getattr(engine, "step_budget", None) is not None
        sampling = dataclasses.replace(sampling, seed=None if on_cpu else seed)
        places = list(range(len(prompt_token_ids))) if request_indices is None else list(request_indices)
        samples = [_Sample(list(map(int, p))) for p in prompt_token_ids for _ in range(n)]
        requests: dict[str, int] = {}  # request id -> sample
        calls: dict[Future, tuple[int, object]] = {}  # running tool call -> (sample, tool)
        check = stop if isinstance(stop, StopCheck) else StopCheck(stop)
        engine.wake_up()

        def start_turn(j: int) -> None:
            s = samples[j]
            s.stats["turns"] += 1
            s.turn_start = len(s.tokens)
            rid = f"tool{j}_{s.stats['turns']}"
            place = places[j // n] * n + j % n  # the sample's place in the whole batch
            engine.add_request(rid, s.prompt + s.tokens, 1,
                               dataclasses.replace(sampling, max_tokens=budget - len(s.tokens)),
                               request_index=place * (self.max_turns + 1) + s.stats["turns"] - 1, stream=True,
                               regex=regex if regex_turns is None or s.stats["turns"] <= regex_turns else None)
            requests[rid] = j

        try:
            for j in range(len(samples)):
                start_turn(j)
            while requests or calls:
                self._turns(engine, samples, requests, calls, check, start_turn, budget)
        except BaseException:
            if requests:
                engine.abort(list(requests))
            for future in calls:
                future.cancel()
            raise
        check.finish()
        return Rollouts(prompt_index=[j // n for j in range(len(samples))], token_ids=[s.tokens for s in samples],
                        logprobs=[s.logprobs for s in samples], finish_reasons=[s.finish or "abort" for s in samples],
                        weight_version=engine.weight_version, sampled_mask=[s.mask for s in samples],
                        tool_stats=[s.stats for s in samples])

    def _turns(self, engine, samples, requests: dict, calls: dict, check: StopCheck, start_turn, budget: int) -> None:
        """One engine step (or, while only tool calls run, a short wait for one), then the calls that returned."""
        check.before_step()
        start = time.perf_counter()
        if requests:
            if engine.num_unfinished() == 0:
                raise RuntimeError(f"the engine holds none of the {len(requests)} requests this rollout waits for")
            for rid, toks, lps, finish in engine.step_tokens():
                j = requests.get(rid)
                if j is None:  # aborted at a call: its last output raced the abort
                    continue
                s = samples[j]
                s.tokens += toks
                s.logprobs += lps
                s.mask += [1] * len(toks)
                found = self._find_call(s) if any(t in self.triggers for t in toks) else None
                if found is not None:
                    if finish is None:
                        engine.abort([rid])
                    del requests[rid]
                    if len(s.tokens) >= budget:  # no room left for the output: the response is cut here
                        s.finish = "length"
                    else:
                        calls[self.pool.submit(found[0].run, found[1])] = (j, found[0])
                elif finish is not None:
                    del requests[rid]
                    s.finish = finish
        else:
            wait(list(calls), timeout=CALL_WAIT_S, return_when=FIRST_COMPLETED)
        check.stepped(time.perf_counter() - start)
        for future in [f for f in calls if f.done()]:
            j, tool = calls.pop(future)
            if self._append_output(samples[j], tool, future, budget):
                start_turn(j)

    def _find_call(self, s: _Sample):
        """(tool, call) when the model's current turn ends in a call and calls are left, else None."""
        if s.stats["calls"] >= self.max_turns:
            return None
        text = self.tokenizer.decode(s.tokens[s.turn_start:], skip_special_tokens=False)
        for tool in self.tools:
            call = tool.find_call(text)
            if call is not None:
                return tool, call
        return None

    def _append_output(self, s: _Sample, tool, future: Future, budget: int) -> bool:
        """The call's output as context tokens (cut to the budget); True when the sample goes on generating."""
        try:
            obs = future.result()
        except Exception as exc:  # noqa: BLE001  (a tool must not raise; if one does, the model reads the error)
            obs = Observation(f"error: the tool failed ({type(exc).__name__}: {exc})", "error", 0.0)
        s.stats["calls"] += 1
        s.stats["errors"] += obs.status == "error"
        s.stats["timeouts"] += obs.status == "timeout"
        s.stats["sandbox_s"] += obs.seconds
        ids = self.tokenizer.encode(tool.format(obs), add_special_tokens=False)[:budget - len(s.tokens)]
        s.tokens += ids
        s.logprobs += [0.0] * len(ids)
        s.mask += [0] * len(ids)
        if len(s.tokens) >= budget:
            s.finish = "length"
            return False
        return True

    # -- SPMD: every engine its share --------------------------------------------------------------------------------

    def generate_all(self, engine, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: SamplingConfig, *,
                     seed: int | None = None, stop: Callable[[], bool] | None = None) -> Rollouts:
        """As `VLLMEngine.generate_all` (vllm_engine.generate_shares): engine e samples prompts e, e + E, ...; every
        rank gets the whole batch; a stop wanted on any rank aborts the batch on every rank."""
        from .vllm_engine import generate_shares

        return generate_shares(engine, prompt_token_ids, lambda prompts, indices, check: self.generate(
            engine, prompts, n, sampling, seed=seed, request_indices=indices, stop=check), stop)


def generate_batch(engine, prompt_ids: Sequence[Sequence[int]], n: int, sampling: SamplingConfig, *,
                   seed: int | None = None, tools: ToolRollout | None = None,
                   stop: Callable[[], bool] | None = None) -> Rollouts:
    """The placement's one call: single-turn `engine.generate_all`, or multi-turn with `tools`; `stop`: a stop
    signal's flag, read between engine steps (RolloutInterrupted)."""
    if tools is None:
        return engine.generate_all(prompt_ids, n, sampling, seed=seed, stop=stop)
    return tools.generate_all(engine, prompt_ids, n, sampling, seed=seed, stop=stop)
