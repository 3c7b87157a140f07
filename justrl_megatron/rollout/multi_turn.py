"""Multi-turn rollouts with tools (rollout.tools, rollout.tool.max_turns): generate until the model closes a tool call,
run it in a worker thread, append its output as context, generate on; up to `max_turns` calls and the response budget.

    tools = ToolRollout.from_config(cfg, model_dir)          # None when rollout.tools is empty
    loop = EngineLoop(engine, n, sampling, tools=tools)      # every placement drives tool turns in its engine loop
    rollouts = tools.generate(engine, prompt_ids, n, sampling)   # one engine, one batch (tests, benchmarks)

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
    versions: list[int] = field(default_factory=list)  # the engine's weight version when each token was added
    turn_start: int = 0  # where the model's current turn began in `tokens`
    finish: str | None = None
    stats: dict = field(default_factory=lambda: {"calls": 0, "errors": 0, "timeouts": 0, "turns": 0,
                                                 "sandbox_s": 0.0})


class Turns:
    """The turns of tool samples on one engine, for a batch (`ToolRollout.generate`) or a stream of groups
    (rollout/engine_loop.EngineLoop): each turn is a streamed request; when the model's turn ends in a call, the
    request is aborted there, the call runs in the driver's pool, its output is appended as context and the sample
    goes on as a new request. Samples are named by any hashable key (the batch's index, the stream's (gid, k)).

        turns.add(key, prompt_ids, place, name)      # starts turn 1 (request ids `{name}_{turn}`)
        turns.feed(engine.step_tokens(), version)     # the engine step's new tokens of these requests
        turns.poll()                                  # returned calls: output appended, next turn started
        turns.take_done()                             # the keys that finished since the last call
    """

    def __init__(self, driver: "ToolRollout", engine, sampling: SamplingConfig, *, seeded: bool,
                 regex: str | None = None, regex_turns: int | None = None):
        self.driver, self.engine, self.regex, self.regex_turns = driver, engine, regex, regex_turns
        self.budget = sampling.max_tokens
        self.sampling = sampling if seeded else dataclasses.replace(sampling, seed=None)
        self.samples: dict = {}
        self.places: dict = {}  # key -> (seed place, request name)
        self.requests: dict[str, object] = {}  # request id -> key
        self.calls: dict[Future, tuple[object, object]] = {}  # running tool call -> (key, tool)
        self._done: list = []

    @property
    def busy(self) -> bool:
        return bool(self.requests or self.calls)

    def add(self, key, prompt_ids, place: int, name: str) -> None:
        self.samples[key] = _Sample(list(map(int, prompt_ids)))
        self.places[key] = (int(place), name)
        self._start(key)

    def _start(self, key) -> None:
        s = self.samples[key]
        s.stats["turns"] += 1
        s.turn_start = len(s.tokens)
        place, name = self.places[key]
        rid = f"{name}_{s.stats['turns']}"
        turns = self.driver.max_turns + 1
        self.engine.add_request(rid, s.prompt + s.tokens, 1,
                                dataclasses.replace(self.sampling, max_tokens=self.budget - len(s.tokens)),
                                request_index=place * turns + s.stats["turns"] - 1, stream=True,
                                regex=self.regex if self.regex_turns is None or s.stats["turns"] <= self.regex_turns
                                else None)
        self.requests[rid] = key

    def _finish(self, key, reason: str) -> None:
        self.samples[key].finish = reason
        self._done.append(key)

    def feed(self, outputs, version: int) -> None:
        """New tokens of this engine step [(request id, tokens, logprobs, finish or None)]; others are ignored."""
        for rid, toks, lps, finish in outputs:
            key = self.requests.get(rid)
            if key is None:  # aborted at a call (its last output raced the abort), or not a turn of ours
                continue
            s = self.samples[key]
            s.tokens += toks
            s.logprobs += lps
            s.mask += [1] * len(toks)
            s.versions += [version] * len(toks)
            found = self.driver._find_call(s) if any(t in self.driver.triggers for t in toks) else None
            if found is not None:
                if finish is None:
                    self.engine.abort([rid])
                del self.requests[rid]
                if len(s.tokens) >= self.budget:  # no room left for the output: the response is cut here
                    self._finish(key, "length")
                else:
                    self.calls[self.driver.pool.submit(found[0].run, found[1])] = (key, found[0])
            elif finish is not None:
                del self.requests[rid]
                self._finish(key, finish)

    def wait_calls(self, timeout: float) -> None:
        """Only calls run: wait up to `timeout` for one (a stop is read between waits)."""
        wait(list(self.calls), timeout=timeout, return_when=FIRST_COMPLETED)

    def poll(self, version: int) -> None:
        """The calls that returned: their outputs appended (stamped `version`), the samples' next turns started."""
        for future in [f for f in self.calls if f.done()]:
            key, tool = self.calls.pop(future)
            s = self.samples[key]
            if self.driver._append_output(s, tool, future, self.budget, version):
                self._start(key)
            else:
                self._done.append(key)

    def take_done(self) -> list:
        done, self._done = self._done, []
        return done

    def abort(self, keys=None) -> None:
        """Abort the turns of `keys` (all when None): their requests, their calls (left to finish unread), and
        forget them."""
        keys = set(self.samples) if keys is None else set(keys)
        rids = [rid for rid, key in self.requests.items() if key in keys]
        if rids:
            self.engine.abort(rids)
        for rid in rids:
            del self.requests[rid]
        for future in [f for f, (key, _) in self.calls.items() if key in keys]:
            future.cancel()
            del self.calls[future]
        for key in keys:
            self.samples.pop(key, None), self.places.pop(key, None)
        self._done = [k for k in self._done if k not in keys]

    def restore(self, key, prompt_ids, so_far: Rollouts, k: int, place: int, name: str) -> None:
        """Sample k of `so_far` (a stop's `rollouts(...)`, saved with the checkpoint) goes on as `key`: a finished
        sample is done at once; an unfinished one re-runs the call its turn ended in (the stop cut the call short),
        or else continues its turn (or starts the next, after a tool's output) as a new request after its tokens."""
        s = _Sample(list(map(int, prompt_ids)), tokens=list(so_far.token_ids[k]), logprobs=list(so_far.logprobs[k]),
                    mask=so_far.mask_of(k), versions=so_far.versions_of(k),
                    stats=dict(so_far.tool_stats[k]) if so_far.tool_stats is not None else _Sample([]).stats)
        self.samples[key], self.places[key] = s, (int(place), name)
        if so_far.finish_reasons[k] != "abort":
            self._finish(key, so_far.finish_reasons[k])
            return
        zeros = [i for i, m in enumerate(s.mask) if m == 0]
        s.turn_start = zeros[-1] + 1 if zeros else 0
        if len(s.tokens) >= self.budget:
            self._finish(key, "length")
            return
        found = self.driver._find_call(s) if s.turn_start < len(s.tokens) else None
        if found is not None:
            self.calls[self.driver.pool.submit(found[0].run, found[1])] = (key, found[0])
            return
        if s.turn_start < len(s.tokens):  # the same turn goes on: counted once
            s.stats["turns"] -= 1
        self._start(key)

    def rollouts(self, keys, weight_version: int, *, with_versions: bool = False) -> Rollouts:
        """The samples of `keys` (in order) as one prompt's or one batch's Rollouts; `prompt_index` is set by the
        caller."""
        picked = [self.samples[k] for k in keys]
        return Rollouts(prompt_index=[0] * len(picked), token_ids=[s.tokens for s in picked],
                        logprobs=[s.logprobs for s in picked], finish_reasons=[s.finish or "abort" for s in picked],
                        weight_version=weight_version, sampled_mask=[s.mask for s in picked],
                        tool_stats=[s.stats for s in picked],
                        token_versions=[s.versions for s in picked] if with_versions else None)


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
        return cls(make_tools(ro), tokenizer, max_turns=ro.tool.max_turns, workers=ro.tool.workers)

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
        seed = sampling.seed if seed is None else seed
        on_cpu = getattr(engine, "step_budget", None) is not None
        turns = Turns(self, engine, dataclasses.replace(sampling, seed=seed), seeded=not on_cpu, regex=regex,
                      regex_turns=regex_turns)
        places = list(range(len(prompt_token_ids))) if request_indices is None else list(request_indices)
        check = stop if isinstance(stop, StopCheck) else StopCheck(stop)
        engine.wake_up()
        count = len(prompt_token_ids) * n
        try:
            for j in range(count):  # j: the sample; its place in the whole batch seeds it
                turns.add(j, prompt_token_ids[j // n], places[j // n] * n + j % n, f"tool{j}")
            while turns.busy:
                check.before_step()
                start = time.perf_counter()
                if turns.requests:
                    if engine.num_unfinished() == 0:
                        raise RuntimeError(f"the engine holds none of the {len(turns.requests)} requests this "
                                           f"rollout waits for")
                    turns.feed(engine.step_tokens(), engine.weight_version)
                else:
                    turns.wait_calls(CALL_WAIT_S)
                check.stepped(time.perf_counter() - start)
                turns.poll(engine.weight_version)
        except BaseException:
            turns.abort()
            raise
        check.finish()
        r = turns.rollouts(range(count), engine.weight_version)
        r.prompt_index = [j // n for j in range(count)]
        return r

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

    def _append_output(self, s: _Sample, tool, future: Future, budget: int, version: int = 0) -> bool:
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
        s.versions += [version] * len(ids)
        if len(s.tokens) >= budget:
            s.finish = "length"
            return False
        return True
