"""The one way an engine is driven, in every rollout mode and placement: continuous batching and partial rollouts
across weight updates and stops. Split rollout ranks serve it (rollout/split.py); a colocated trainer rank steps it
in-process (rollout/engines.py) between its updates.

    loop = EngineLoop(engine, n, sampling)
    loop.admit([(gid, prompt_ids, seed), ...])  # the source decides what may start (rollout/stream_source.py)
    groups = loop.step()                     # refill free slots, one engine step, the groups that finished
    loop.update(lambda: engine.receive_weights(...), min_version)   # pause (requests kept), load, resume
    kept = loop.harvest()                    # a stop: every group's samples so far, for the resumed run

Seeds: a group admitted with a seed samples what a one-call batch with that seed sampled (the seed is its request's:
the batch seed + its place in the batch x n). On a CPU engine a seeded request must be prefilled in one scheduler
step (a CPU generator cannot follow a chunked prefill: "CPU Generator does not use offset"), so `fill` starts a
seeded group only while its prompt tokens (x n) fit the step's token budget beside the sequences already decoding;
the rest wait for the next step, in order. A seeded group too big for any step alone starts unseeded.

A group is one prompt's `n` samples (one vLLM request with n children). A finished group's slot is refilled at once,
so the engine stays full while the prompt stream lasts. A weight update pauses scheduling with every in-flight
request and its KV cache kept (vLLM's sleep level 0, mode "keep"), loads the new weights and resumes: a response may
span versions, and vLLM labels each token with the version that sampled it (Rollouts.token_versions) beside its
behaviour logprob. Nothing is restarted. The only requests aborted are those the trainer could no longer train
(`min_version`: their first tokens are older than rollout.max_staleness allows), and they are counted.

A stop keeps the work: `harvest()` aborts every group and returns what each sampled so far (tokens, behaviour
logprobs, per-token versions); the resumed run hands it back with `resume([...])`, and each unfinished sample goes on
as a request of its own whose prompt is the prompt plus its tokens so far (prefilled with the resumed weights, then
sampled on). Its earlier tokens keep their logprobs and versions, and the group its admission version: the staleness
bound counts from its first token, across the stop.

With tools (rollout.tools, `tools=`), each of a group's n samples runs its own turns (rollout/multi_turn.Turns): a
turn is a streamed request, a call runs in the driver's pool while the engine steps everything else, and the sample
goes on as a new request after the call's output. Weight updates land between engine steps as for any request, so a
sample's turns may span versions; each token is stamped with the version of the step that sampled it (a tool's
output with the version current when it was appended: it is context, masked out of the loss). The group keeps its
admission version: the staleness bound counts from its first token, tool time included. A stop keeps a tool group's
turns too: `harvest` hands back every sample's tokens, masks and call counts; after `resume`, a sample whose turn
ended in a call that the stop cut short runs that call again, the others go on with their turn.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from .base import RolloutInterrupted, Rollouts, SamplingConfig
from .multi_turn import CALL_WAIT_S, Turns


@dataclass
class Group:
    """One finished prompt: its place in the trainer's prompt stream and its n samples."""

    gid: int
    rollouts: Rollouts  # n samples, prompt_index all 0, token_versions set
    admitted_version: int  # the engine's weights when the group started


@dataclass
class LoopStats:
    """What the loop did since the last `take_stats` (seconds; occupancy summed over the engine's busy steps)."""

    steps: int = 0
    busy_s: float = 0.0  # inside engine steps
    idle_s: float = 0.0  # nothing to generate: waiting for prompts (the trainer's admission) or weights
    paused_s: float = 0.0  # weight updates (engine paused, requests kept)
    occupancy_sum: float = 0.0  # running sequences / the engine's max, per step
    finished: int = 0
    dropped: int = 0  # groups aborted because the trainer could no longer train them (staleness)

    def sums(self) -> dict[str, float]:
        """The figures as sums (several engines' and several messages' add up; occupancy = its sum / steps)."""
        return {"steps": float(self.steps), "occupancy_sum": self.occupancy_sum, "busy_s": self.busy_s,
                "idle_s": self.idle_s, "paused_s": self.paused_s, "finished": float(self.finished),
                "dropped": float(self.dropped)}


@dataclass
class _Continued:
    """A group resumed from a stop: its samples so far, and the requests that continue the unfinished ones."""

    gid: int
    prompt_ids: list[int]
    samples: Rollouts  # finish reason "abort": still to continue
    admitted_version: int
    requests: dict[str, int] = dataclasses.field(default_factory=dict)  # request id -> its sample

    def extend(self, k: int, more: Rollouts) -> None:
        """Sample k's continuation (one sample) after its earlier tokens."""
        s = self.samples
        s.token_ids[k] = s.token_ids[k] + more.token_ids[0]
        s.logprobs[k] = s.logprobs[k] + more.logprobs[0]
        s.token_versions[k] = s.token_versions[k] + more.versions_of(0)
        s.finish_reasons[k] = more.finish_reasons[0]
        s.truncated[k] = s.finish_reasons[k] == "length"

    def finished(self) -> Rollouts:
        s = self.samples
        return dataclasses.replace(s, weight_version=min((v for vs in s.token_versions for v in vs),
                                                         default=self.admitted_version))


class EngineLoop:
    """Continuous batching over a `VLLMEngine` (add_request / step / pause / resume / abort)."""

    def __init__(self, engine, n: int, sampling: SamplingConfig, *, max_running_seqs: int | None = None,
                 tools=None):
        self.engine, self.n, self.sampling = engine, n, sampling
        # rollout.tools: every sample its own turns (`tools` is the multi_turn.ToolRollout driver); CPU engines
        # sample tool turns unseeded (a seeded CPU generator cannot follow a chunked prefill)
        self.turns = None if tools is None else Turns(tools, engine, sampling,
                                                      seeded=getattr(engine, "step_budget", None) is None)
        self.tool_groups: dict[int, int] = {}  # gid -> admitted version
        self.max_seqs = int(max_running_seqs or engine.max_num_seqs)
        self.capacity = max(1, self.max_seqs // n)  # groups in the engine at once
        self.waiting: deque[tuple[int, list[int], _Continued | None, SamplingConfig]] = deque()
        self.running: dict[str, tuple[int, int]] = {}  # request id -> (gid, admitted version)
        self.continued: dict[int, _Continued] = {}  # resumed groups in the engine, by gid
        self._ready: list[Group] = []  # resumed groups with nothing left to sample
        self.side: dict[str, tuple[int, int]] = {}  # a side batch's request id -> (batch, prompt)
        self.side_n: dict[str, int] = {}  # its samples
        self.side_waiting: deque[tuple[str, list[int], int, SamplingConfig]] = deque()
        self._side_batches: dict[int, dict] = {}
        self._next_bid = 0
        # (tokens, sequences) one scheduler step takes, where seeded requests must fit it (CPU engines; None on GPU)
        self.budget = getattr(engine, "step_budget", None)
        self.stats = LoopStats()
        self._steps = 0  # engine steps so far: a running group's tokens since it started, one per step
        self._started: dict[int, int] = {}  # gid -> the step it started at

    def configure(self, n: int, sampling: SamplingConfig, *, max_running_seqs: int | None = None) -> None:
        """The stream's group size, sampling and the most sequences it may hold (before any group is admitted)."""
        if self.running or self.waiting or self.continued or self.tool_groups:
            raise RuntimeError("the engine loop can be configured only while no group is in it")
        self.n, self.sampling = n, sampling
        if self.turns is not None:
            self.turns = Turns(self.turns.driver, self.engine, sampling, seeded=self.budget is None)
        self.max_seqs = int(max_running_seqs or self.engine.max_num_seqs)
        self.capacity = max(1, self.max_seqs // n)

    # -- the trainer's side of the conversation ------------------------------------------------------------------------

    def admit(self, prompts: Sequence[tuple]) -> None:
        """Prompts that may start as soon as a slot is free (in this order): (gid, prompt ids[, request seed])."""
        for gid, ids, *seed in prompts:
            sampling = self.sampling
            if seed and seed[0] is not None:
                sampling = self._unseeded_if_too_big(ids, self.n, dataclasses.replace(sampling, seed=int(seed[0])))
            self.waiting.append((int(gid), list(map(int, ids)), None, sampling))

    def resume(self, groups: Sequence[tuple[int, Sequence[int], Rollouts, int]]) -> None:
        """Groups a stop cut short, [(gid, prompt ids, their samples so far, admitted version)] as `harvest` gave
        them: queued before any new prompt; their unfinished samples go on where they stopped."""
        resumed = [(int(g), list(map(int, ids)), _Continued(int(g), list(map(int, ids)), _own(samples), int(v)),
                    self.sampling) for g, ids, samples, v in groups]
        self.waiting.extendleft(reversed(resumed))

    def harvest(self) -> list[tuple[int, Rollouts]]:
        """Stop, keeping the work: abort every group and return [(gid, its samples so far)] for those that sampled
        anything (finish reason "abort" where a sample still ran). Waiting new prompts are forgotten: the trainer
        admitted them and admits them again."""
        tool_kept = []
        if self.turns is not None:  # each tool sample's tokens so far (its requests stream them as they come)
            tool_kept = [(gid, self._tool_rollouts(gid)) for gid in self.tool_groups]
            self.turns.abort()
            self.tool_groups.clear()
        kept = self.engine.abort_keeping(self._stream_requests())
        out = [(gid, kept[rid]) for rid, (gid, _) in self.running.items() if rid in kept]
        for c in [*self.continued.values(), *(c for _, _, c, _ in self.waiting if c is not None)]:
            for rid, k in c.requests.items():  # each still running: its part so far ends in "abort"
                c.extend(k, kept[rid])
            out.append((c.gid, c.samples))
        out += tool_kept
        out = [(gid, r) for gid, r in out if any(r.token_ids)]  # nothing sampled yet: admitted anew, as fresh
        out += [(g.gid, g.rollouts) for g in self._ready]
        self.abort_side()
        self.running.clear(), self.continued.clear(), self.waiting.clear(), self._ready.clear(), self._started.clear()
        return out

    def update(self, load: Callable[[], dict], min_version: int | None = None) -> dict:
        """New weights mid-generation: pause (in-flight requests and their KV kept), `load()` them, resume, then drop
        what can no longer be trained (admitted before `min_version`). Returns load's figures, `kept` (groups that
        went on with the new weights) and `dropped` [(gid, admitted version)]."""
        t = time.perf_counter()
        self.engine.pause()
        try:
            sequences = self.engine.num_unfinished()
            figures = load()
            if self.engine.num_unfinished() != sequences:
                raise RuntimeError(f"the engine lost requests across a weight update ({sequences} in flight before, "
                                   f"{self.engine.num_unfinished()} after)")
        finally:
            self.engine.resume()
        dropped = self.drop_older_than(min_version) if min_version is not None else []
        self.stats.paused_s += time.perf_counter() - t
        return {**figures, "kept": len(self.running), "dropped": dropped}

    def drop_older_than(self, min_version: int) -> list[tuple[int, int]]:
        """Abort the in-flight groups admitted with weights older than `min_version` (counted as dropped): the
        trainer would refuse them, and their slots serve fresh prompts instead. Returns their (gid, version)."""
        old = [rid for rid, (_, v) in self.running.items() if v < min_version]
        resumed = [c for c in self.continued.values() if c.admitted_version < min_version]
        requests = old + [rid for c in resumed for rid in c.requests]
        if requests:
            self.engine.abort(requests)
        tools = [(g, v) for g, v in self.tool_groups.items() if v < min_version]
        if tools:
            self.turns.abort([(g, k) for g, _ in tools for k in range(self.n)])
            for g, _ in tools:
                del self.tool_groups[g]
        self.stats.dropped += len(old) + len(resumed) + len(tools)
        for c in resumed:
            del self.continued[c.gid]
        dropped = [self.running.pop(rid) for rid in old]
        for gid, _ in dropped:
            self._started.pop(gid, None)
        return dropped + [(c.gid, c.admitted_version) for c in resumed] + tools

    def abort_all(self) -> list[int]:
        """Stop: abort every in-flight group; the gids of those (and of the waiting prompts) that never finished."""
        gids = ([g for g, _ in self.running.values()] + [*self.continued] + [*self.tool_groups]
                + [g for g, _, _, _ in self.waiting])
        requests = self._stream_requests()
        if requests:
            self.engine.abort(requests)
        self.abort_side()
        if self.turns is not None:
            self.turns.abort()
            self.tool_groups.clear()
        self.running.clear(), self.continued.clear(), self.waiting.clear(), self._ready.clear(), self._started.clear()
        return gids

    def abort_side(self) -> None:
        """Side batches end with the stream (a stop): their requests aborted, the batches forgotten."""
        started = [rid for rid in self.side if rid not in {w[0] for w in self.side_waiting}]
        if started:
            self.engine.abort(started)
        self.side.clear(), self.side_n.clear(), self.side_waiting.clear(), self._side_batches.clear()

    # -- the loop ------------------------------------------------------------------------------------------------------

    def fill(self) -> int:
        """Start waiting side-batch prompts, then waiting groups while the engine has room (and, seeded on a CPU
        engine, while their prefill fits this step: module doc); returns how many started."""
        started, used = 0, [0, 0]  # prompt tokens and sequences this fill adds to the next step
        while self.side_waiting and self._fits(self.side_waiting[0][1], self.side_waiting[0][2], used,
                                               self.side_waiting[0][3]):
            rid, ids, n, sampling = self.side_waiting.popleft()
            self.engine.add_request(rid, ids, n, sampling)
            started += 1
        while (self.waiting and len(self.running) + len(self.continued) + len(self.tool_groups) < self.capacity
               and self._fits(self.waiting[0][1], self.n, used, self.waiting[0][3])):
            gid, ids, resumed, sampling = self.waiting.popleft()
            started += 1
            if resumed is not None:
                self._continue(resumed)
                continue
            if self.turns is not None:  # the sample's place in its group seeds each of its turns (GPU)
                self.tool_groups[gid] = self.engine.weight_version
                for k in range(self.n):
                    self.turns.add((gid, k), ids, k, f"t{gid}x{k}")
                continue
            rid = f"g{gid}"
            self.engine.add_request(rid, ids, self.n, sampling)
            self.running[rid] = (gid, self.engine.weight_version)
            self._started[gid] = self._steps
        return started

    def _fits(self, ids, n: int, used: list[int], sampling: SamplingConfig | None = None) -> bool:
        """Whether a request of `n` samples of `ids` with `sampling` may start now (module doc: seeds on a CPU
        engine); counts it into `used` when it may."""
        if self.budget is None or sampling is None or sampling.seed is None:
            return True
        max_tokens, max_seqs = self.budget
        need = len(ids) * n
        if need > max_tokens or n > max_seqs:  # never fits one step: started unseeded (_unseeded_if_too_big)
            return True
        live = self._live_sequences()
        if used[0] + need + live > max_tokens or live + used[1] + n > max_seqs:
            return False
        used[0] += need
        used[1] += n
        return True

    def _live_sequences(self) -> int:
        """Sequences the engine decodes in the next step, counted from above (a group's finished samples too)."""
        turns = len(self.turns.requests) if self.turns is not None else 0
        return (self.n * len(self.running) + sum(self.side_n.get(rid, 1) for rid in self.side)
                + sum(len(c.requests) for c in self.continued.values()) + turns)

    def _continue(self, c: _Continued) -> None:
        """A resumed group's unfinished samples, each a request of its own after its earlier tokens (unseeded, as
        a seed's CPU generator cannot follow a chunked prefill; the earlier tokens decide nothing more)."""
        if self.turns is not None and c.samples.sampled_mask is not None:  # a tool group: its turns go on
            self.tool_groups[c.gid] = c.admitted_version
            for k in range(self.n):
                self.turns.restore((c.gid, k), c.prompt_ids, c.samples, k, k, f"t{c.gid}x{k}r")
            return
        for k, reason in enumerate(c.samples.finish_reasons):
            if reason != "abort":
                continue
            left = self.sampling.max_tokens - len(c.samples.token_ids[k])
            if left <= 0:  # it had used its whole budget when the stop came
                c.samples.finish_reasons[k], c.samples.truncated[k] = "length", True
                continue
            rid = f"c{c.gid}_{k}"
            self.engine.add_request(rid, c.prompt_ids + c.samples.token_ids[k], 1,
                                    dataclasses.replace(self.sampling, max_tokens=left, seed=None))
            c.requests[rid] = k
        if c.requests:
            self.continued[c.gid] = c
        else:
            self._ready.append(Group(c.gid, c.finished(), c.admitted_version))

    def _stream_requests(self) -> list[str]:
        """The engine's requests of the stream: new groups' and resumed samples' (not side batches')."""
        return [*self.running, *(r for c in self.continued.values() for r in c.requests)]

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting or self.side or self.continued or self._ready or self.tool_groups)

    def add_batch(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig,
                  request_indices: Sequence[int] | None = None) -> int:
        """A whole batch beside the stream (held-out accuracy, validation, a colocated engine's share): started as
        soon as it fits, outside the admission; `batch_done` hands it back. `request_indices`: the prompts' places
        in the whole batch (each request's seed follows it, as `VLLMEngine.generate` seeds a batch)."""
        bid = self._next_bid
        self._next_bid += 1
        self._side_batches[bid] = {"size": len(prompts), "done": {}}
        places = range(len(prompts)) if request_indices is None else request_indices
        for i, (ids, place) in enumerate(zip(prompts, places)):
            rid = f"b{bid}_{i}"
            params = sampling if sampling.seed is None else dataclasses.replace(sampling,
                                                                                 seed=sampling.seed + place * n)
            params = self._unseeded_if_too_big(list(map(int, ids)), n, params)
            self.side_waiting.append((rid, list(map(int, ids)), n, params))
            self.side[rid] = (bid, i)
            self.side_n[rid] = n
        return bid

    def _unseeded_if_too_big(self, ids, n: int, sampling: SamplingConfig) -> SamplingConfig:
        """A seeded request whose prefill can never fit one CPU step starts unseeded (module doc)."""
        if self.budget is not None and sampling.seed is not None and (len(ids) * n > self.budget[0]
                                                                       or n > self.budget[1]):
            return dataclasses.replace(sampling, seed=None)
        return sampling

    def batch_done(self, bid: int) -> Rollouts | None:
        """Side batch `bid` in prompt order once all of it finished (then forgotten), else None."""
        got = self._side_batches[bid]
        if len(got["done"]) < got["size"]:
            return None
        del self._side_batches[bid]
        parts = [got["done"][i] for i in range(got["size"])]
        if not parts:
            return Rollouts(prompt_index=[], token_ids=[], logprobs=[], finish_reasons=[],
                            weight_version=self.engine.weight_version)
        order = [(r, k, i) for i, r in enumerate(parts) for k in range(len(r))]
        return Rollouts.in_order(order, min(r.weight_version for r in parts))

    def step(self) -> list[Group]:
        """Refill, one engine step, and the groups that finished in it."""
        self.fill()
        groups, self._ready = self._ready, []
        turns = self.turns
        if not self.running and not self.side and not self.continued and not (turns and turns.requests):
            if turns is not None:  # only tool calls run (wait a little for one), or resumed samples were done
                if turns.calls:
                    turns.wait_calls(CALL_WAIT_S)
                groups += self._tool_groups_done()
            self.stats.finished += len(groups)
            return groups
        t = time.perf_counter()
        self.stats.occupancy_sum += min(1.0, self.engine.num_unfinished() / self.max_seqs)
        if turns is None:
            out = self.engine.step()
        else:  # the tool turns' new tokens and the whole groups' (side batches) from the same engine step
            out, deltas = self.engine.step_both(turns.requests)
            turns.feed(deltas, self.engine.weight_version)
        self.stats.busy_s += time.perf_counter() - t
        self.stats.steps += 1
        self._steps += 1
        resumed = {rid: c for c in self.continued.values() for rid in c.requests}
        for rid, rollouts in out:
            if rid in self.side:
                bid, i = self.side.pop(rid)
                self.side_n.pop(rid, None)
                self._side_batches[bid]["done"][i] = rollouts
                continue
            if rid in resumed:
                c = resumed[rid]
                c.extend(c.requests.pop(rid), rollouts)
                if not c.requests:
                    del self.continued[c.gid]
                    groups.append(Group(c.gid, c.finished(), c.admitted_version))
                continue
            if rid not in self.running:  # aborted meanwhile (its last output raced the abort)
                continue
            gid, admitted = self.running.pop(rid)
            self._started.pop(gid, None)
            groups.append(Group(gid, rollouts, admitted))
        if turns is not None:
            groups += self._tool_groups_done()
        self.stats.finished += len(groups)
        return groups

    def _tool_groups_done(self) -> list[Group]:
        """Returned calls handled (outputs appended, next turns started); the tool groups whose n samples are all
        done, as Groups with per-token versions (forgotten by the turns)."""
        self.turns.poll(self.engine.weight_version)
        done = []
        for gid in dict.fromkeys(gid for gid, _ in self.turns.take_done()):
            keys = [(gid, k) for k in range(self.n)]
            if gid not in self.tool_groups or any(self.turns.samples[key].finish is None for key in keys):
                continue
            done.append(Group(gid, self._tool_rollouts(gid), self.tool_groups.pop(gid)))
            self.turns.abort(keys)  # (nothing runs for them: only forgotten)
        return done

    def _tool_rollouts(self, gid: int) -> Rollouts:
        """A tool group's samples so far, with per-token versions; its weight version the oldest token's."""
        keys = [(gid, k) for k in range(self.n)]
        versions = [v for key in keys for v in self.turns.samples[key].versions]
        return self.turns.rollouts(keys, min(versions, default=self.tool_groups[gid]), with_versions=True)

    def progress(self) -> dict[int, int]:
        """Each running group's tokens per sample so far (engine steps since it started, plus a resumed group's kept
        tokens; a tool group's longest sample): what the trainer's load-fed assignment expects the rest from."""
        out = {gid: self._steps - self._started.get(gid, self._steps) for gid, _ in self.running.values()}
        for c in self.continued.values():
            out[c.gid] = max((len(t) for t in c.samples.token_ids), default=0)
        if self.turns is not None:
            for gid in self.tool_groups:
                out[gid] = max((len(self.turns.samples[(gid, k)].tokens) for k in range(self.n)
                                if (gid, k) in self.turns.samples), default=0)
        return out

    def take_stats(self) -> LoopStats:
        stats, self.stats = self.stats, LoopStats()
        return stats


def _own(samples: Rollouts) -> Rollouts:
    """A copy whose lists the loop may extend, with every token's version spelled out."""
    n = len(samples)
    return Rollouts(prompt_index=[0] * n, token_ids=[list(t) for t in samples.token_ids],
                    logprobs=[list(x) for x in samples.logprobs], finish_reasons=list(samples.finish_reasons),
                    weight_version=samples.weight_version,
                    token_versions=[samples.versions_of(k) for k in range(n)],
                    sampled_mask=None if samples.sampled_mask is None else [samples.mask_of(k) for k in range(n)],
                    tool_stats=None if samples.tool_stats is None else [dict(x) for x in samples.tool_stats])
