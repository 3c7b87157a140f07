"""What the throughput planner (bench/plan.py) needs, and the JSON it reads them from, refused in one line when wrong.

    inputs = load_inputs("inputs.json")    # PlanInputsError("plan inputs: `n` must be an integer >= 1, got 0")

Every field of `PlanInputs` is checked before any simulation: a missing field, an unknown one (a misspelt optional
cost would otherwise silently count as 0), a time that is not a finite number, negative, or zero where the work
takes time (a free decode step never advances the engine's clock), a count below 1, a length distribution that is
empty or leaves [1, max_response_length]. The message names the field as the JSON spells it (`decode.fixed_s`).
"""

from __future__ import annotations

import difflib
import json
import math
import statistics
from dataclasses import MISSING, asdict, dataclass, field, fields

ASSIGNMENTS = ("static", "load")  # how groups reach engines: gid % engines, or the least outstanding work


class PlanInputsError(ValueError):
    """A planner input that cannot be simulated; the message is one line naming the field."""


@dataclass
class DecodeCost:
    """Seconds per engine step: fixed + per running sequence + per token of context held by them (KV reads), and
    the prefill of a started sequence's prompt. `by_seqs` ({running sequences: seconds}, context aside), where
    measured, replaces the first two: a step at a handful of sequences costs more than a line through large batches
    says (the per-step floor), and a long tail runs at one or two."""

    fixed_s: float
    per_seq_s: float
    per_context_token_s: float = 0.0
    prefill_s_per_token: float = 0.0
    by_seqs: dict | None = None

    def __post_init__(self):
        self._table = sorted((int(b), float(s)) for b, s in (self.by_seqs or {}).items())

    def step_s(self, seqs: int, context: float) -> float:
        return self.base_s(seqs) + self.per_context_token_s * context

    def scaled(self, factor: float) -> "DecodeCost":
        """Every cost times `factor`."""
        return DecodeCost(self.fixed_s * factor, self.per_seq_s * factor, self.per_context_token_s * factor,
                          self.prefill_s_per_token * factor,
                          {b: s * factor for b, s in self.by_seqs.items()} if self.by_seqs else None)

    def base_s(self, seqs: int) -> float:
        """The table interpolated linearly (its first value below it, its last segment's line above it); the
        line fixed + per_seq without a table."""
        table = self._table
        if not table:
            return self.fixed_s + self.per_seq_s * seqs
        if len(table) == 1 or seqs <= table[0][0]:
            return table[0][1]
        (b0, s0), (b1, s1) = next((pair for pair in zip(table, table[1:]) if seqs <= pair[1][0]), table[-2:])
        return s0 + (s1 - s0) * (seqs - b0) / (b1 - b0)


@dataclass
class ColocatedCost:
    """The colocated layout's own costs, where measured on it: its update per trainer device (each device also holds
    an engine; on the CPU the trainers share the machine's cores, which a split run's single trainer does not), its
    weight handover, in place of `sync_s` (in-process: nothing crosses a network), and its engines' decode against
    `decode` (measured on one engine: on the CPU the colocated engines decode at once on the cores). Absent: the
    split's costs."""

    update_fixed_s: float
    update_s_per_token: float
    sync_s: float
    update_s_per_response_token: float = 0.0
    logprob_s_per_token: float = 0.0
    decode_factor: float = 1.0  # each engine step's seconds are `decode`'s times this


@dataclass
class PlanInputs:
    """What a plan needs; every time is one device's (a trainer's or an engine's)."""

    decode: DecodeCost
    update_fixed_s: float  # one optimizer step's fixed cost (optimizer, launches) per mini-batch
    update_s_per_token: float  # forward + backward per computed token (see shared_prompt), one trainer device
    sync_s: float  # one weight sync: trainer and engines busy
    lengths: list[int]  # the response-length distribution (samples of it)
    prompt_len: int
    prompts_per_step: int
    n: int
    max_response_length: int
    logprob_s_per_token: float = 0.0  # the old-logprob forward (only with several optimizer steps per step)
    optimizer_steps: int = 1  # prompts_per_step / mini_batch_size
    reward_s_per_group: float = 0.0  # scoring n responses (trainer rank 0)
    overhead_s: float = 0.0  # the rest of a step on the trainer (bookkeeping, transfers, logging)
    engine_max_seqs: int = 256
    colocated_switch_s: float = 0.0  # colocated: sleep / wake of the engine around the trainer's turn
    # trainer.shared_prompt on: a group's n responses attend to one copy of its prompt, so the update computes
    # prompt_len once per group, not n times (the trained tokens counted in tokens/s stay prompt + response per sample)
    shared_prompt: bool = False
    # what a response token costs the update beyond a prompt token (the log-prob head runs on responses only; on the
    # CPU demo model about as much again as the layers)
    update_s_per_response_token: float = 0.0
    # which engine a new group goes to: "static" (group id % engines) or "load" (the engine with the least
    # outstanding work: its running samples' expected remaining tokens and its queued groups'; bench/plan.py)
    engine_assignment: str = "static"
    # where the trainer and the engines share the machine's cores (the CPU check), an update or old-logprob pass
    # that runs while an engine decodes takes this many times its seconds alone, and the engine's steps meanwhile
    # this many times theirs; 1 where each has devices of its own
    overlapped_update_factor: float = 1.0
    overlapped_decode_factor: float = 1.0
    colocated: ColocatedCost | None = None
    notes: dict = field(default_factory=dict)

    def update_s(self, groups: list[list[int]], trainers: int, colocated: bool = False) -> float:
        """One step's update of `groups` (their response lengths) on `trainers` devices. The layers run over every
        response token and each prompt n times or, with the shared prompt, once per group; the head over responses.
        `colocated`: with the colocated layout's own costs where they were measured."""
        cost = self.colocated if colocated and self.colocated else self
        response = sum(sum(g) for g in groups)
        computed = response + self.prompt_len * len(groups) * (1 if self.shared_prompt else self.n)
        per_token = cost.update_s_per_token + (cost.logprob_s_per_token if self.optimizer_steps > 1 else 0.0)
        work = per_token * computed + cost.update_s_per_response_token * response
        return self.optimizer_steps * cost.update_fixed_s + work / trainers

    def handover_s(self, colocated: bool) -> float:
        """The weight sync's seconds: the split's, or colocated's in-process handover and the engine's sleep / wake
        (the split's sync plus `colocated_switch_s` where the colocated layout was not measured)."""
        if not colocated:
            return self.sync_s
        return (self.colocated.sync_s if self.colocated else self.sync_s) + self.colocated_switch_s

    @classmethod
    def from_dict(cls, d) -> "PlanInputs":
        """From JSON, every field checked (`check_inputs`); `lengths` may be {"lognormal": {"median": M, "sigma":
        S}} (at the cap above it)."""
        check_inputs(d)
        d = dict(d)
        d["decode"] = DecodeCost(**d["decode"])
        if d.get("colocated") is not None:
            d["colocated"] = ColocatedCost(**d["colocated"])
        if isinstance(d["lengths"], dict):
            d["lengths"] = lognormal_lengths(cap=d["max_response_length"], **d["lengths"]["lognormal"])
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)


def lognormal_lengths(*, median: float, sigma: float, cap: int, points: int = 400) -> list[int]:
    """`points` evenly spaced quantiles of a log-normal length distribution, the mass above the cap at the cap: a
    stated assumption where no measured histogram exists."""
    z = statistics.NormalDist()
    return [min(cap, max(1, round(median * math.exp(sigma * z.inv_cdf((i + 0.5) / points))))) for i in range(points)]


def load_inputs(path: str) -> PlanInputs:
    """An inputs file, or PlanInputsError naming what is wrong with it (missing, not JSON, a bad field)."""
    return PlanInputs.from_dict(read_json(path, "plan inputs"))


def read_json(path: str, what: str):
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as exc:
        raise PlanInputsError(f"{what}: cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise PlanInputsError(f"{what}: {path} is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") \
            from None


# --- the checks -------------------------------------------------------------------------------------------------------

# times that are work (a zero makes the step free); the other times may be 0 (a cost the workload does not have)
_WORK_TIMES = {"update_s_per_token", "sync_s"}
_COUNTS = {"prompts_per_step", "n", "max_response_length", "optimizer_steps", "engine_max_seqs"}
_FACTORS = {"overlapped_update_factor", "overlapped_decode_factor"}


def check_inputs(d) -> None:
    """Raise PlanInputsError on the first thing wrong with a dict of plan inputs (as JSON gives it)."""
    if not isinstance(d, dict):
        raise PlanInputsError(f"plan inputs: expected a JSON object of fields, got {type(d).__name__}")
    required = {f.name for f in fields(PlanInputs) if f.default is MISSING and f.default_factory is MISSING}
    _known_and_present(d, {f.name for f in fields(PlanInputs)}, required, "")
    for f in fields(PlanInputs):
        if f.name not in d:
            continue
        value = d[f.name]
        if f.name in _COUNTS:
            check_count(f.name, value)
        elif f.name == "prompt_len":
            _check_int(f.name, value, low=0)
        elif f.name in _FACTORS:
            check_factor(f.name, value)
        elif f.type == "float":
            check_time(f.name, value, positive=f.name in _WORK_TIMES)
    if d["prompts_per_step"] % d.get("optimizer_steps", 1):
        raise PlanInputsError(f"plan inputs: `optimizer_steps` ({d['optimizer_steps']}) must divide "
                              f"`prompts_per_step` ({d['prompts_per_step']}): a step is whole mini-batches")
    if not isinstance(d.get("shared_prompt", False), bool):
        raise PlanInputsError(f"plan inputs: `shared_prompt` must be true or false, got {d['shared_prompt']!r}")
    if d.get("engine_assignment", "static") not in ASSIGNMENTS:
        raise PlanInputsError(f"plan inputs: `engine_assignment` must be one of {', '.join(ASSIGNMENTS)}, got "
                              f"{d['engine_assignment']!r}")
    if not isinstance(d.get("notes", {}), dict):
        raise PlanInputsError("plan inputs: `notes` must be a JSON object")
    _check_decode(d["decode"])
    _check_colocated(d.get("colocated"))
    _check_lengths(d["lengths"], d["max_response_length"])


def check_time(name: str, value, *, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
            or (positive and value == 0):
        need = "> 0" if positive else ">= 0"
        raise PlanInputsError(f"plan inputs: `{name}` must be a finite number of seconds {need}, got {value!r}")


def check_factor(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise PlanInputsError(f"plan inputs: `{name}` must be a finite factor > 0, got {value!r}")


def check_count(name: str, value) -> None:
    _check_int(name, value, low=1)


def _check_int(name: str, value, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise PlanInputsError(f"plan inputs: `{name}` must be an integer >= {low}, got {value!r}")


def _known_and_present(d: dict, known: set, required: set, prefix: str) -> None:
    for key in d:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f" (did you mean `{prefix}{close[0]}`?)" if close else f" (known: {', '.join(sorted(known))})"
            raise PlanInputsError(f"plan inputs: unknown field `{prefix}{key}`{hint}")
    for key in sorted(required):
        if key not in d:
            raise PlanInputsError(f"plan inputs: missing field `{prefix}{key}`")


def _check_decode(d) -> None:
    if not isinstance(d, dict):
        raise PlanInputsError(f"plan inputs: `decode` must be a JSON object, got {d!r}")
    _known_and_present(d, {f.name for f in fields(DecodeCost)}, {"fixed_s", "per_seq_s"}, "decode.")
    for name in ("fixed_s", "per_seq_s", "per_context_token_s", "prefill_s_per_token"):
        if name in d:
            check_time(f"decode.{name}", d[name])
    table = d.get("by_seqs")
    if table is not None:
        if not isinstance(table, dict) or not table:
            raise PlanInputsError(f"plan inputs: `decode.by_seqs` must be a non-empty object {{sequences: seconds}}, "
                                  f"got {table!r}")
        for seqs, seconds in table.items():
            if not str(seqs).isdigit() or int(seqs) < 1:
                raise PlanInputsError(f"plan inputs: `decode.by_seqs` keys must be running-sequence counts >= 1, "
                                      f"got {seqs!r}")
            check_time(f"decode.by_seqs[{seqs}]", seconds, positive=True)
    elif d["fixed_s"] + d["per_seq_s"] <= 0:
        raise PlanInputsError("plan inputs: `decode.fixed_s` + `decode.per_seq_s` must be > 0: a free engine step "
                              "never advances the engine's clock")


def _check_colocated(d) -> None:
    if d is None:
        return
    if not isinstance(d, dict):
        raise PlanInputsError(f"plan inputs: `colocated` must be a JSON object of costs or null, got {d!r:.60}")
    known = {f.name for f in fields(ColocatedCost)}
    _known_and_present(d, known, {"update_fixed_s", "update_s_per_token", "sync_s"}, "colocated.")
    for name in known:
        if name in d:
            check_time(f"colocated.{name}", d[name], positive=name in {*_WORK_TIMES, "decode_factor"})


def _check_lengths(lengths, cap: int) -> None:
    if isinstance(lengths, dict):
        _known_and_present(lengths, {"lognormal"}, {"lognormal"}, "lengths.")
        params = lengths["lognormal"]
        if not isinstance(params, dict):
            raise PlanInputsError(f"plan inputs: `lengths.lognormal` must be an object {{median, sigma}}, got "
                                  f"{params!r}")
        _known_and_present(params, {"median", "sigma"}, {"median", "sigma"}, "lengths.lognormal.")
        for name, value in params.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (name == "median" and not 1 <= value <= cap):
                need = f"between 1 and max_response_length ({cap})" if name == "median" else "a finite number >= 0"
                raise PlanInputsError(f"plan inputs: `lengths.lognormal.{name}` must be {need}, got {value!r}")
        return
    if not isinstance(lengths, list) or not lengths:
        raise PlanInputsError(f"plan inputs: `lengths` must be a non-empty list of response lengths or "
                              f"{{\"lognormal\": {{...}}}}, got {lengths!r:.60}")
    for i, x in enumerate(lengths):
        if isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= cap:
            raise PlanInputsError(f"plan inputs: `lengths[{i}]` must be an integer between 1 and "
                                  f"max_response_length ({cap}), got {x!r}")
