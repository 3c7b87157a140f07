"""`justrl-bench --plan INPUTS.json`: a discrete-event model of the rollout and train pipeline, per mode.

    predict(inputs, "one-step-off", trainers=1, engines=1)   # step seconds, idle fractions, staleness, tokens/s/GPU
    best_split(inputs, "streaming", gpus=32, eta=2)           # the rollout:trainer split with the most tokens/s

It replays what the code does (rollout/admission.py, stream_source.py, engines.py, engine_loop.py, split.py,
train/loop.py):
- an engine steps all its unfinished sequences at once; one step costs `decode.step_s(B, context tokens)` (measured
  on the machine, or given for a GPU), a started group first pays its prefill. A group holds its engine slot until
  all n samples are done (EngineLoop counts groups), while only unfinished samples cost decode time.
- colocated sync: generate, then rewards + old logprobs + update on the same devices, then the weight sync.
- split sync: the same, rollout on the engines' devices, training on the trainers'; neither overlaps.
- one-step-off: batch k+1 is submitted when step k's batch is collected and generates while step k trains; the
  weight sync waits for it (a rollout rank does one thing at a time), scoring runs beside the update.
- streaming eta: (eta + 1) x prompts_per_step groups admitted and not yet taken, topped up when a step starts (after
  the previous sync); a step takes first the groups admitted eta versions ago (waiting for them), then any others in
  the order they finished; the sync pauses every engine (requests kept) and drops groups the bound no longer allows.
- where the trainer and the engines share cores (the CPU), an update that runs while engines decode (one-step-off,
  streaming) takes `overlapped_update_factor` times its seconds for as long as they decode (shared_update_s), and
  their steps meanwhile `overlapped_decode_factor` times theirs (Engine.slow_until); 1 where each has its devices.
- a started group goes to one engine (`engine_assignment`): "static", group id % engines (split.py today), or
  "load", the engine with the least outstanding work in expected tokens (_Router).
Response lengths are drawn per sample from a given distribution with a fixed seed, so a plan is deterministic, or
replayed from a run's metrics (a trace: what a check of the model against that run compares); the figures are means
over the steps after `warmup`.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
import statistics
from collections import deque

from .plan_inputs import DecodeCost, PlanInputs, load_inputs  # noqa: F401  (the planner's API: inputs, then plans)

MODES = ("colocated sync", "split sync", "one-step-off", "streaming")


class Engine:
    """One rollout engine on its own device. Samples live in a heap keyed by the engine step at which they finish;
    between two finishes the batch is constant, so time advances a chunk of steps at once."""

    def __init__(self, cost: DecodeCost, max_seqs: int, n: int):
        self.cost, self.n = cost, n
        self.slots = max(1, max_seqs // n)  # groups at once (EngineLoop.capacity)
        self.t = 0.0
        self.clock = 0  # engine steps so far
        self.heap: list[tuple[int, int, int]] = []  # (finish step, gid, context at the end)
        self.context = 0  # tokens of context held by the unfinished samples
        self.left: dict[int, int] = {}  # gid -> unfinished samples
        self.waiting: deque = deque()  # (gid, lengths, prompt_len)
        self.started: dict[int, int] = {}  # gid -> engine step at which its samples started
        self.busy_s = 0.0
        self.active_until = 0.0  # the end of its last step (or prefill)
        self.slow_end, self.slow = -math.inf, 1.0  # steps before slow_end cost `slow` times theirs
        self._next: float | None = None  # next_finish's answer until the engine changes

    def hold_until(self, t: float) -> None:
        """Nothing generates before t (a weight sync)."""
        self.t, self._next = max(self.t, t), None

    def slow_until(self, t: float, factor: float) -> None:
        """Steps and prefills before t cost `factor` times theirs (a trainer computes beside it on shared cores)."""
        self.slow_end, self.slow, self._next = t, factor, None

    def rewind_idle(self, t: float) -> None:
        """An idle engine's clock back to t at the earliest (it ran nothing after its last step)."""
        if self.idle():
            self.t, self._next = max(self.active_until, min(self.t, t)), None

    def _factor(self) -> float:
        return self.slow if self.t < self.slow_end else 1.0

    def add(self, gid: int, lengths: list[int], prompt_len: int, t: float) -> None:
        if self.idle():
            self.t = max(self.t, t)  # idle until the group arrives
        self.waiting.append((gid, lengths, prompt_len))
        self._next = None

    def _fill(self) -> None:
        while self.waiting and len(self.left) < self.slots:
            gid, lengths, p = self.waiting.popleft()
            self.left[gid] = len(lengths)
            self.started[gid] = self.clock
            for x in lengths:
                heapq.heappush(self.heap, (self.clock + max(1, x), gid, p + max(1, x)))
            self.context += p * len(lengths)
            prefill = self._factor() * self.cost.prefill_s_per_token * p * len(lengths)
            self.t += prefill
            self.busy_s += prefill
            self.active_until = self.t

    def _chunk(self, dt: float) -> tuple[int, float]:
        """Steps until the next sample finishes, or fewer that reach dt (or the end of a slow stretch); and their
        seconds."""
        b, factor = len(self.heap), self._factor()
        if factor != 1.0:
            dt = min(dt, self.slow_end - self.t)
        a, g = self._step_cost(b, self.context, factor)  # step j costs a + g j
        k = _steps_to_reach(a, g, dt, self.heap[0][0] - self.clock)
        return k, k * a + g * k * (k - 1) / 2

    def _step_cost(self, seqs: int, context: float, factor: float) -> tuple[float, float]:
        return factor * self.cost.step_s(seqs, context), factor * self.cost.per_context_token_s * seqs

    def next_finish(self) -> float:
        """When the next sample finishes if nothing else happens (inf: nothing runs)."""
        if self._next is None:
            self._fill()
            self._next = self._finish_time() if self.heap else math.inf
        return self._next

    def _finish_time(self) -> float:
        k, dt = self._chunk(math.inf)
        left = self.heap[0][0] - self.clock - k
        if left <= 0:
            return self.t + dt
        b = len(self.heap)  # a slow stretch ended first: the rest at the engine's own speed
        a, g = self._step_cost(b, self.context + k * b, 1.0)
        return self.t + dt + left * a + g * left * (left - 1) / 2

    def run_until(self, t_end: float) -> list[tuple[int, float]]:
        """Step until the first step boundary at or after t_end (or until nothing runs); finished (gid, time)."""
        done = []
        while self.t < t_end:
            self._next = None
            self._fill()
            if not self.heap:
                if t_end < math.inf:
                    self.t = t_end  # idle
                break
            k, dt = self._chunk(t_end - self.t)
            self.t += dt
            self.busy_s += dt
            self.active_until = self.t
            self.context += k * len(self.heap)
            self.clock += k
            while self.heap and self.heap[0][0] <= self.clock:
                _, gid, ctx = heapq.heappop(self.heap)
                self.context -= ctx
                self.left[gid] -= 1
                if self.left[gid] == 0:
                    del self.left[gid], self.started[gid]
                    done.append((gid, self.t))
        return done

    def drain(self) -> list[tuple[int, float]]:
        return self.run_until(math.inf)

    def abort(self, gids: set[int]) -> None:
        self._next = None
        gone = [s for s in self.heap if s[1] in gids]
        self.context -= sum(ctx - (finish - self.clock) for finish, _, ctx in gone)
        self.heap = [s for s in self.heap if s[1] not in gids]
        heapq.heapify(self.heap)
        self.waiting = deque(w for w in self.waiting if w[0] not in gids)
        for g in gids:
            self.left.pop(g, None)
            self.started.pop(g, None)

    def outstanding(self, remaining) -> float:
        """Expected tokens still to generate: `remaining(generated)` for each running sample, a whole response
        (`remaining(0)`) for each queued one."""
        running = sum(left * remaining(self.clock - self.started[gid]) for gid, left in self.left.items())
        return running + remaining(0) * sum(len(lengths) for _, lengths, _ in self.waiting)

    def idle(self) -> bool:
        return not self.heap and not self.waiting


def shared_update_s(x: PlanInputs, update: float, start: float, decoding_until: float) -> float:
    """The seconds of an update that takes `update` alone, started at `start` while engines decode on the same
    cores until `decoding_until`: it runs `x.overlapped_update_factor` times slower while they decode."""
    factor = x.overlapped_update_factor
    overlap = min(max(0.0, decoding_until - start), update * factor)
    return overlap + update - overlap / factor


def _steps_to_reach(a: float, g: float, dt: float, k_max: int) -> int:
    """The fewest steps (<= k_max) whose cost a k + g k (k - 1) / 2 reaches dt (all k_max when dt is infinite)."""
    if dt == math.inf or k_max * a + g * k_max * (k_max - 1) / 2 <= dt:
        return k_max
    if g <= 0:
        k = math.ceil(dt / a)
    else:
        k = math.ceil((-(a - g / 2) + math.sqrt((a - g / 2) ** 2 + 2 * g * dt)) / g)
    return max(1, min(k_max, k))


class _Router:
    """Which engine a started group goes to; it stays there (its n samples share the prompt's prefill).
    static: group id % engines (rollout/split.py's assignment). load: the engine with the least outstanding work in
    expected tokens (Engine.outstanding): a running sample that has generated g tokens is expected to need
    E[L - g | L > g] more, L drawn from the length distribution (what an engine knows: not the sample's own
    length); ties go to the lowest engine."""

    def __init__(self, pool: list[Engine], x: PlanInputs):
        self.pool, self.prompt_len, self.by_load = pool, x.prompt_len, x.engine_assignment == "load"
        self.sorted = sorted(min(int(v), x.max_response_length) for v in x.lengths)
        self.suffix = [0.0] * (len(self.sorted) + 1)  # suffix[i]: the sum of sorted[i:]
        for i in range(len(self.sorted) - 1, -1, -1):
            self.suffix[i] = self.suffix[i + 1] + self.sorted[i]

    def remaining(self, generated: int) -> float:
        i = bisect.bisect_right(self.sorted, generated)
        longer = len(self.sorted) - i
        return self.suffix[i] / longer - generated if longer else 0.0

    def place(self, groups: list[tuple[int, list[int]]], t: float) -> None:
        """Groups (gid, lengths) started at time t (every engine advanced to t), in order."""
        if not self.by_load:
            for gid, lengths in groups:
                self.pool[gid % len(self.pool)].add(gid, lengths, self.prompt_len, t)
            return
        loads = [(e.outstanding(self.remaining), i) for i, e in enumerate(self.pool)]
        heapq.heapify(loads)
        for gid, lengths in groups:
            load, i = heapq.heappop(loads)
            self.pool[i].add(gid, lengths, self.prompt_len, t)
            heapq.heappush(loads, (load + self.remaining(0) * len(lengths), i))


class _Lengths:
    """Each started group's response lengths: the next of `trace` (a run's own groups in the order it started them;
    None for a group its engine aborted), else n draws from the distribution.

    `sample_groups`: `lengths` is a sample of the initial model, prompt by prompt (groups of that many responses),
    and a draw should carry what such a sample leaves unknown: a group is one prompt's whole group (the responses
    to one prompt are alike: one that rambles to the cap rarely rambles alone), drawn from a resample (bootstrap)
    of the sample's groups made once per draw (16 prompts pin a long-tail mean only loosely)."""

    def __init__(self, lengths: list[int], cap: int, seed: int, trace: list | None = None,
                 sample_groups: int | None = None):
        self.lengths, self.cap, self.rng = [min(int(x), cap) for x in lengths], cap, random.Random(seed)
        self.trace, self.started = trace or [], 0
        self.groups = None
        if sample_groups and len(self.lengths) % sample_groups == 0:
            whole = [self.lengths[k:k + sample_groups] for k in range(0, len(self.lengths), sample_groups)]
            self.groups = [self.rng.choice(whole) for _ in whole]

    def group(self, n: int) -> list[int]:
        i, self.started = self.started, self.started + 1
        if i < len(self.trace) and self.trace[i] is not None:
            return [min(int(x), self.cap) for x in self.trace[i]]
        if self.groups is not None and len(self.groups[0]) == n:
            return list(self.rng.choice(self.groups))
        return [self.rng.choice(self.lengths) for _ in range(n)]


def predict(inputs: PlanInputs, mode: str, *, trainers: int = 1, engines: int = 1, eta: int = 1, steps: int = 40,
            warmup: int = 4, seed: int = 0, run_ends: bool = False, trace: list | None = None,
            sample_groups: bool = False) -> dict:
    """Simulate `steps` steps of `mode` and summarise the ones after `warmup`. colocated sync: `trainers` devices
    do both jobs (engines = trainers). `run_ends`: the run's last step is `steps` (trainer.total_steps), so nothing
    is generated beyond it, as the batch sources do: one-step-off submits no batch after the last, streaming admits
    no more groups than the remaining steps take (the engines run dry in the last steps); without it, the steady
    state of an endless run. `trace`: replay a run's own response lengths (_Lengths) instead of drawing them.
    `sample_groups`: the lengths are the initial model's sample, n per prompt, drawn as _Lengths says."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    if mode == "streaming" and eta < 1:
        raise ValueError("streaming needs eta (max_staleness) >= 1")
    if mode == "colocated sync":
        engines = trainers
    x = inputs
    draw = _Lengths(x.lengths, x.max_response_length, seed, trace, x.n if sample_groups else None)
    pool = [Engine(engine_cost(x, mode), x.engine_max_seqs, x.n) for _ in range(engines)]
    run = _stream if mode == "streaming" else _rounds
    records = run(x, mode, pool, draw, trainers, eta, steps, steps if run_ends else None)
    timed = records[warmup:]
    step_s = statistics.mean(r["step_s"] for r in timed)
    tokens = statistics.mean(r["tokens"] for r in timed)
    gpus = trainers if mode == "colocated sync" else trainers + engines
    busy = statistics.mean(r["trainer_busy_s"] for r in timed)
    span = timed[-1]["end"] - timed[0]["end"] + timed[0]["step_s"]
    engine_busy = sum(r["engine_busy_s"] for r in timed) / len(pool)
    before = records[warmup - 1]["engine_busy_each"] if warmup else [0.0] * len(pool)
    each_idle = [min(1.0, max(0.0, 1 - (b1 - b0) / span)) for b0, b1 in zip(before, timed[-1]["engine_busy_each"])]
    return {"mode": mode if mode != "streaming" else f"streaming eta={eta}", "trainers": trainers,
            "engines": engines, "gpus": gpus, "step_s": step_s, "step_s_all": [r["step_s"] for r in records],
            "tokens_per_step": tokens, "trained_tokens_per_s": tokens / step_s,
            "trained_tokens_per_s_per_gpu": tokens / step_s / gpus,
            "generated_tokens_per_s": statistics.mean(r["generated"] for r in timed) / step_s,
            "trainer_idle_frac": min(1.0, max(0.0, 1 - busy / step_s)),
            "engine_idle_frac": min(1.0, max(0.0, 1 - engine_busy / span)),
            "engine_idle_spread": max(each_idle) - min(each_idle), "assignment": x.engine_assignment,
            "staleness_max": max(r["staleness"] for r in timed),
            "dropped_groups": sum(r.get("dropped", 0) for r in timed)}


def engine_cost(x: PlanInputs, mode: str) -> DecodeCost:
    """An engine's decode cost in `mode`: colocated engines' as measured on their layout, where it was."""
    if mode == "colocated sync" and x.colocated:
        return x.decode.scaled(x.colocated.decode_factor)
    return x.decode


def batch_rollout_s(x: PlanInputs, groups: list[list[int]], engines: int) -> float:
    """The seconds `engines` engines (x.decode's cost each) take to generate one batch of `groups` (their response
    lengths), spread by the router from a cold start."""
    pool = [Engine(x.decode, x.engine_max_seqs, x.n) for _ in range(engines)]
    _Router(pool, x).place(list(enumerate(groups)), 0.0)
    return max([t for e in pool for _, t in e.drain()] + [e.t for e in pool])


def predict_window(inputs: PlanInputs, mode: str, *, warmup: int, timed: int, draws: int = 32, **kw) -> dict:
    """What a bench run measures: from a cold start, the mean over `timed` steps after `warmup` untimed ones, and
    that averaged over `draws` length draws (a run of a few steps is one draw). `predict`'s default is the steady
    state instead; the two differ where the start-up lasts longer than the warm-up: streaming eta=k reaches its
    bound only after k steps (on the CPU's rollout-bound workload those steps ran faster than the steady state)."""
    runs = [predict(inputs, mode, steps=warmup + timed, warmup=warmup, seed=seed, run_ends=True, **kw)
            for seed in range(draws)]
    out = {key: runs[0][key] for key in ("mode", "trainers", "engines", "gpus")}
    for key in ("step_s", "tokens_per_step", "trained_tokens_per_s", "trained_tokens_per_s_per_gpu",
                "generated_tokens_per_s", "trainer_idle_frac", "engine_idle_frac"):
        out[key] = statistics.mean(r[key] for r in runs)
    p10, median, p90 = interval([r["step_s"] for r in runs])  # where one run of this many steps may land
    out.update(staleness_max=max(r["staleness_max"] for r in runs),
               dropped_groups=sum(r["dropped_groups"] for r in runs), draws=draws,
               step_s_draws=[r["step_s"] for r in runs], step_s_p10=p10, step_s_median=median, step_s_p90=p90)
    return out


def interval(values: list[float]) -> tuple[float, float, float]:
    """(p10, median, p90) of `values`, the percentiles by nearest rank (of 32 draws: the 4th lowest and highest)."""
    ranked = sorted(values)
    return ranked[len(ranked) // 10], statistics.median(ranked), ranked[-1 - len(ranked) // 10]


def _tokens(x: PlanInputs, groups: list[list[int]]) -> tuple[int, int]:
    response = sum(sum(g) for g in groups)
    return response + x.prompt_len * x.n * len(groups), response


def _rounds(x: PlanInputs, mode, pool, draw, trainers, eta, steps, last_step) -> list[dict]:
    """colocated sync, split sync, one-step-off: a batch is generated with one version, spread by the router."""
    router = _Router(pool, x)

    def submit(t: float) -> list[list[int]]:
        groups = [draw.group(x.n) for _ in range(x.prompts_per_step)]
        router.place(list(enumerate(groups)), t)
        return groups

    def finish() -> float:  # the slowest engine completes the batch
        return max([t for e in pool for _, t in e.drain()] + [e.t for e in pool])

    ahead = mode == "one-step-off"
    records, t, version = [], 0.0, 0
    groups, gen_version = submit(0.0), 0
    done = finish()
    ready = done + x.reward_s_per_group * x.prompts_per_step  # scored (in a thread beside the trainer when ahead)
    for step in range(1, steps + 1):
        start, busy0 = t, sum(e.busy_s for e in pool)
        t = max(t, ready)
        staleness = version - gen_version
        tokens, response = _tokens(x, groups)
        colocated = mode == "colocated sync"
        update = x.update_s(groups, trainers, colocated)
        prefetch = ahead and (last_step is None or step < last_step)
        if prefetch:  # step k+1's batch starts now, with the current weights, and generates beside the update
            groups, gen_version = submit(t), version
            for e in pool:
                e.slow_until(t + update * x.overlapped_update_factor, x.overlapped_decode_factor)
            done = finish()
            update = shared_update_s(x, update, t, done)
        reward = x.reward_s_per_group * x.prompts_per_step
        t += update + x.overhead_s
        if prefetch:
            t = max(t, done)  # the sync waits for the batch in flight
            ready = done + reward
        t += x.handover_s(colocated)
        for e in pool:
            e.hold_until(t)  # the engines take the weights; nothing generates meanwhile
        version = step
        if not ahead:
            groups, gen_version = submit(t), version
            done = finish()
            ready = done + reward
        records.append({"step_s": t - start, "end": t, "tokens": tokens, "generated": response,
                        "trainer_busy_s": update + reward, "staleness": staleness,
                        "engine_busy_s": sum(e.busy_s for e in pool) - busy0,
                        "engine_busy_each": [e.busy_s for e in pool]})
    return records


def _stream(x: PlanInputs, mode, pool, draw, trainers, eta, steps, last_step) -> list[dict]:
    """Streaming (rollout/stream_source.py): admission bounded by eta, the take order, syncs mid-generation."""
    P = x.prompts_per_step
    capacity = (eta + 1) * P
    admitted: dict[int, tuple[int, list[int]]] = {}  # gid -> (version at admission, lengths)
    buffer: list[tuple[float, int]] = []  # finished (time, gid), in finish order
    records, t, version, next_gid = [], 0.0, 0, 0
    router = _Router(pool, x)

    def advance(until: float, every: bool = False) -> None:
        """Engines to the first step boundary at or after `until`: every one (before an admission or a sync), or
        only those with a sample finishing by then (the others would only move their clock: they get there later
        in one go, the same steps)."""
        size = len(buffer)
        for e in pool:
            if every or e.next_finish() <= until:
                buffer.extend((ft, gid) for gid, ft in e.run_until(until))
        if len(buffer) > size:
            buffer.sort()

    def ready_count() -> int:  # the finished groups at or before t lead the buffer
        return bisect.bisect_right(buffer, (t, math.inf))

    def next_event() -> float:  # a finished group not yet ready (an engine's step ran past t), or the next finish
        later = buffer[ready_count()][0] if ready_count() < len(buffer) else math.inf
        return min([later] + [e.next_finish() for e in pool])

    for step in range(1, steps + 1):
        start, busy0 = t, sum(e.busy_s for e in pool)
        advance(t, every=True)
        room = capacity - len(admitted)
        if last_step is not None:  # no more than the remaining steps take
            room = min(room, (last_step - step + 1) * P - len(admitted))
        for gid in range(next_gid, next_gid + max(room, 0)):  # _admit: top up to the bound
            admitted[gid] = (version, draw.group(x.n))
        router.place([(gid, admitted[gid][1]) for gid in range(next_gid, next_gid + max(room, 0))], t)
        next_gid += max(room, 0)
        kept: list[tuple[int, list[int]]] = []  # (version at admission, lengths)
        reward = 0.0
        expiring = {g for g, (v, _) in admitted.items() if version + 1 - v > eta}  # the step must take these
        while len(kept) < P:
            ready = buffer[:ready_count()]
            pick = next((i for i, (_, g) in enumerate(ready) if g in expiring), None)
            if pick is None and ready and P - len(kept) > len(expiring - {g for _, g in ready}):
                pick = 0
            if pick is None:  # wait for the next finished group
                t_next = next_event()
                if t_next == math.inf:
                    raise RuntimeError("streaming plan: the step waits for groups that no engine runs")
                t = max(t, t_next)
                advance(t)
                continue
            _, gid = ready[pick]
            buffer.remove(ready[pick])
            kept.append(admitted.pop(gid))
            expiring.discard(gid)
            t += x.reward_s_per_group
            reward += x.reward_s_per_group
            advance(t)
        groups = [lengths for _, lengths in kept]
        staleness = max(version - v for v, _ in kept)
        tokens, response = _tokens(x, groups)
        alone, began = x.update_s(groups, trainers), t  # the engines decode beside it while they have groups
        for e in pool:
            e.slow_until(began + alone * x.overlapped_update_factor, x.overlapped_decode_factor)
        advance(began + alone * x.overlapped_update_factor, every=True)
        update = shared_update_s(x, alone, began, max([began] + [e.active_until for e in pool]))
        for e in pool:
            e.rewind_idle(began + update)
        t = began + update + x.overhead_s
        advance(t, every=True)
        sync_start = max([t] + [e.t for e in pool])  # an engine takes the weights between its steps
        advance(sync_start, every=True)
        t = sync_start + x.sync_s
        for e in pool:
            e.hold_until(t)
        version = step
        too_old = {g for g, (v, _) in admitted.items() if v < version - eta}  # publish's min_version
        for e in pool:
            e.abort(too_old)
        buffer[:] = [(ft, g) for ft, g in buffer if g not in too_old]
        for g in too_old:
            del admitted[g]
        records.append({"step_s": t - start, "end": t, "tokens": tokens, "generated": response,
                        "trainer_busy_s": update + reward, "staleness": staleness, "dropped": len(too_old),
                        "engine_busy_s": sum(e.busy_s for e in pool) - busy0,
                        "engine_busy_each": [e.busy_s for e in pool]})
    return records


def best_split(inputs: PlanInputs, mode: str, *, gpus: int, eta: int = 1, **kw) -> dict:
    """The rollout:trainer split of `gpus` devices with the most trained tokens/s: every split with >= 1 of each
    and at most a mini-batch's samples per trainer (config.validate refuses more trainers than that)."""
    if mode == "colocated sync":
        return predict(inputs, mode, trainers=gpus, eta=eta, **kw)
    samples = inputs.prompts_per_step * inputs.n // inputs.optimizer_steps
    plans = [predict(inputs, mode, trainers=gpus - e, engines=e, eta=eta, **kw) for e in range(1, gpus)
             if gpus - e <= samples]
    return max(plans, key=lambda p: p["trained_tokens_per_s"])


def plan_all(inputs: PlanInputs, *, gpus: int | None = None, trainers: int = 1, engines: int = 1,
             etas=(1, 2), **kw) -> list[dict]:
    """Every mode: at the given layout, or at each mode's best split of `gpus` devices."""
    runs = [("colocated sync", 1), ("split sync", 0), ("one-step-off", 1)] + [("streaming", k) for k in etas]
    if gpus:
        return [best_split(inputs, m, gpus=gpus, eta=k, **kw) for m, k in runs]
    return [predict(inputs, m, trainers=trainers if m != "colocated sync" else trainers + engines - 1 or 1,
                    engines=engines, eta=k, **kw) for m, k in runs]


def table(plans: list[dict]) -> str:
    """The plans as a markdown table; each against colocated sync with the same engine assignment, where listed."""
    colocated = {p["assignment"]: p for p in plans if p["mode"] == "colocated sync"}
    lines = ["| mode | assignment | trainers + engines | s / step | trained tok/s per GPU | trainer idle | engine idle "
             "(spread) | staleness | dropped groups | vs colocated |", "| --- " * 10 + "|"]
    for p in plans:
        base = colocated.get(p["assignment"])
        ratio = f"{p['trained_tokens_per_s'] / base['trained_tokens_per_s']:.2f}x" if base else "-"
        layout = f"{p['gpus']} (both)" if p["mode"] == "colocated sync" else f"{p['trainers']} + {p['engines']}"
        lines.append(f"| {p['mode']} | {p['assignment']} | {layout} | {p['step_s']:.1f} | "
                     f"{p['trained_tokens_per_s_per_gpu']:,.0f} | {p['trainer_idle_frac']:.2f} | "
                     f"{p['engine_idle_frac']:.2f} ({p['engine_idle_spread']:.2f}) | {p['staleness_max']} | "
                     f"{p['dropped_groups']} | {ratio} |")
    return "\n".join(lines)
