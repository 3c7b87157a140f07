"""`justrl-bench --phase step --workload longtail`: streaming rollouts against the batch modes on a long-tail workload.

The demo model (SmolLM2-135M-Instruct) on the demo's sums at temperature 1 with room for LONGTAIL_TOKENS tokens: most
answers end within a few dozen tokens, a minority rambles to the cap (the length histogram is part of the report).
A batch mode's rollout lasts as long as its longest response while the engine's batch empties; streaming refills
every freed slot at once and never waits for the tail.

On 1 trainer + 1 rollout rank (torchrun, 2 processes), one after the other in one run, the same steps of justrl-train:

    split sync        rollout.max_staleness=0                    generate, then train (nothing overlaps)
    one-step-off      rollout.max_staleness=1                    batch k+1 generates while step k trains
    streaming eta=1   rollout.streaming=true max_staleness=1     the engine stays full; weights load mid-generation
    streaming eta=2   rollout.streaming=true max_staleness=2

Per mode, medians over the timed steps: trained tokens/s end to end (prompt + response tokens of the trained batch
over the wall time between step ends), generated tokens/s (its response tokens over the same time), engine occupancy
(streaming: running sequences / the most the admission lets the engine hold), trainer idle fraction (the
step's wall time minus the trainer's own work: update, old and reference logprobs, rewards; the rest it waited, for
rollouts or in the weight sync for a rollout rank still generating).

A workload is a `Shape` (prompts, responses per prompt, cap, mini-batch, streaming bounds, ranks) and the modes run
on it; `SHAPES` holds this one and the ones the planner's check runs (bench/plan_check.py), `parse_shape` reads one
from the command line.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

LONGTAIL_TOKENS = 384
HISTOGRAM_EDGES = (16, 32, 64, 128, 256, LONGTAIL_TOKENS)


@dataclass(frozen=True)
class Shape:
    """A workload of the demo model (SmolLM2-135M-Instruct on the demo's sums, temperature 1) and the modes run on
    it, each as justrl-train runs it: `trainers` + `engines` ranks split (colocated: as many ranks, each doing
    both jobs). `tuned`: the planner's model was revised on checks of this shape (docs/benchmarks.md)."""

    name: str
    prompts: int
    n: int
    cap: int  # rollout.max_response_length
    mini_batch: int  # prompts per optimizer step
    etas: tuple[int, ...] = (1, 2)  # streaming bounds run
    trainers: int = 1
    engines: int = 1
    colocated: bool = True  # run colocated sync too
    batch_modes: tuple[str, ...] = ("split sync", "one-step-off")
    tuned: bool = False

    def overrides(self) -> list[str]:
        return ["recipe=cpu_demo", f"rollout.max_response_length={self.cap}", "rollout.temperature=1.0",
                f"trainer.prompts_per_step={self.prompts}", f"trainer.mini_batch_size={self.mini_batch}",
                f"rollout.n={self.n}"]

    @property
    def optimizer_steps(self) -> int:
        return self.prompts // self.mini_batch

    @property
    def ranks(self) -> int:
        return self.trainers + self.engines

    def modes(self) -> dict[str, dict]:
        """name -> {"overrides": the mode's hydra overrides, "plan": its planner layout (mode, eta, trainers,
        engines)}, in the order they run."""
        split = ["rollout.placement=split", f"rollout.num_rollout_ranks={self.engines}"]
        layout = {"trainers": self.trainers, "engines": self.engines}
        out = {}
        if self.colocated:
            out["colocated sync"] = {"overrides": ["rollout.placement=colocated", "rollout.max_staleness=0"],
                                     "plan": {"mode": "colocated sync", "eta": 1, "trainers": self.ranks,
                                              "engines": self.ranks}}
        staleness = {"split sync": 0, "one-step-off": 1}
        for name in self.batch_modes:
            out[name] = {"overrides": [*split, f"rollout.max_staleness={staleness[name]}"],
                         "plan": {"mode": name, "eta": 1, **layout}}
        for eta in self.etas:
            out[f"streaming eta={eta}"] = {"overrides": [*split, "rollout.streaming=true",
                                                         f"rollout.max_staleness={eta}"],
                                           "plan": {"mode": "streaming", "eta": eta, **layout}}
        return out


SHAPE_KEYS = {"prompts": "prompts", "n": "n", "cap": "cap", "mini_batch": "mini_batch", "etas": "etas",
              "ranks": "trainers+engines"}


def parse_shape(spec: str) -> Shape:
    """A shape from the command line: "prompts=4,n=8,cap=640,mini_batch=2,etas=1+2,ranks=1+1" (every mode; a
    missing key takes the long-tail shape's value), or the name of a built-in one (SHAPES)."""
    if "=" not in spec:
        if spec not in SHAPES:
            raise ValueError(f"--plan-check: unknown shape {spec!r}; give one of {', '.join(SHAPES)} or "
                             f"key=value,... with keys {', '.join(SHAPE_KEYS)}")
        return SHAPES[spec]
    base = SHAPES["longtail"]
    fields = {"prompts": base.prompts, "n": base.n, "cap": base.cap, "mini_batch": base.mini_batch,
              "etas": base.etas, "trainers": base.trainers, "engines": base.engines}
    for item in spec.split(","):
        key, _, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if key not in SHAPE_KEYS:
            raise ValueError(f"--plan-check: unknown shape key {key!r} in {spec!r}; keys: {', '.join(SHAPE_KEYS)}")
        try:
            numbers = [int(v) for v in value.split("+")]
        except ValueError:
            raise ValueError(f"--plan-check: {key}={value!r} is not a count (ranks: T+E, etas: 1+2)") from None
        expected = {"ranks": 2, "etas": len(numbers)}.get(key, 1)
        if any(v < 1 for v in numbers) or len(numbers) != expected:
            raise ValueError(f"--plan-check: {key}={value!r} must be {SHAPE_KEYS[key]}, counts >= 1")
        if key == "ranks":
            fields["trainers"], fields["engines"] = numbers
        elif key == "etas":
            fields["etas"] = tuple(numbers)
        else:
            fields[key] = numbers[0]
    if fields["prompts"] % fields["mini_batch"]:
        raise ValueError(f"--plan-check: mini_batch={fields['mini_batch']} must divide prompts={fields['prompts']}")
    return Shape(name=spec, **fields)


SHAPES = {s.name: s for s in (
    # the shapes the planner was revised on (docs/benchmarks.md, "The throughput planner"): 8 prompts x 4 with room
    # for 384 tokens, and a rollout-bound one (2 x 4, 1,024 tokens: a tail of a few hundred engine steps at a
    # handful of sequences, an update of ~1K tokens)
    Shape("longtail", prompts=8, n=4, cap=LONGTAIL_TOKENS, mini_batch=8, colocated=False, tuned=True),
    Shape("rollout-bound", prompts=2, n=4, cap=1024, mini_batch=2, etas=(4, 2), colocated=False,
          batch_modes=("one-step-off",), tuned=True),
    # held out until their first check (docs/plan/check_heldout.json), which revised how the check draws lengths and
    # holds the policy still (bench/plan_score.py, plan_check.STILL_POLICY)
    Shape("heldout-wide", prompts=4, n=8, cap=640, mini_batch=4, etas=(2,), tuned=True),
    Shape("heldout-minibatch", prompts=6, n=4, cap=512, mini_batch=2, etas=(1, 3), tuned=True),
    # held out until its third check (docs/plan/check_heldout3_narrow.json), whose overlapped modes led to the
    # update's cost beside a decoding engine (plan_inputs.PlanInputs.overlapped_update_factor)
    Shape("heldout-narrow", prompts=8, n=2, cap=384, mini_batch=4, etas=(2,), tuned=True),
    # held out until its first check (docs/plan/check_heldout4.json), whose update fit dropped the fixed cost of its
    # 3 optimizer steps (plan_calibrate.fit_update_cost)
    Shape("heldout-steps", prompts=6, n=3, cap=448, mini_batch=2, etas=(2,), tuned=True),
    # held out: never used to revise the planner. Every mode, colocated sync included; the first with a longer cap
    # than any shape before (checked in docs/plan/check_heldout2.json and check_heldout4.json: no revision drew on
    # it), the second with 2 optimizer steps per step (an old-logprob pass) and never run before its check
    Shape("heldout-deep", prompts=3, n=6, cap=768, mini_batch=3, etas=(1,)),
    Shape("heldout-short", prompts=4, n=4, cap=320, mini_batch=2, etas=(1,)),
)}
CHECKED_SHAPES = ("heldout-short", "heldout-deep")  # what `--plan-check` runs by default


def mode_figures(records: list[dict], warmup: int) -> dict[str, list[float]]:
    """Per timed step: step seconds, trained and generated tokens/s end to end, occupancy, trainer idle fraction."""
    out = {k: [] for k in ("step_s", "trained_tokens_per_s", "generated_tokens_per_s", "engine_occupancy",
                           "trainer_idle_frac", "staleness_max", "response_length_mean")}
    for i in range(warmup, len(records)):
        r = records[i]
        step_s = r["time"] - records[i - 1]["time"] if i > 0 else r["time/step_s"]
        tokens = r["throughput/tokens_per_s"] * r["time/step_s"]  # prompt + response tokens of the trained batch
        out["step_s"].append(step_s)
        out["trained_tokens_per_s"].append(tokens / step_s)
        out["generated_tokens_per_s"].append(r["rollout/logprob_diff_tokens"] / step_s)  # the response tokens
        out["engine_occupancy"].append(r.get("rollout/engine_occupancy", float("nan")))
        # the trainer's own work: the rest of the step it waited (for groups, or in the weight sync for a rollout
        # rank still generating: one-step-off's wait shows there, not in time/wait_rollout_s)
        busy = sum(r.get(f"time/{k}_s", 0.0) for k in ("update", "old_logprob", "ref_logprob", "reward"))
        out["trainer_idle_frac"].append(max(0.0, 1.0 - busy / step_s))
        out["staleness_max"].append(r.get("rollout/staleness_max", r.get("rollout/staleness", 0.0)))
        out["response_length_mean"].append(r["response/length_mean"])
    return out


def length_histogram(lengths: list[int], edges=HISTOGRAM_EDGES) -> list[tuple[str, int]]:
    """Counts of response lengths per bin (lower, upper]; the last bin is the cap itself."""
    bins, low = [], 0
    for high in edges[:-1]:
        bins.append((f"{low + 1}-{high}", sum(low < x <= high for x in lengths)))
        low = high
    bins.append((f"{low + 1}-{edges[-1] - 1}", sum(low < x < edges[-1] for x in lengths)))
    bins.append((f"{edges[-1]} (cap)", sum(x >= edges[-1] for x in lengths)))
    return bins


def workload_config(overrides):
    """The run's config from a shape's (and a mode's) overrides, placement aside (measurements build their own)."""
    from ..config.schema import compose

    return compose([w for w in overrides if not w.startswith("rollout.placement") and "num_rollout" not in w])


def sample_lengths(model: str | None, shape: Shape, prompts: int = 16, seed: int = 1) -> list[int]:
    """The shape's response lengths from one batch of the initial model (an in-process vLLM engine)."""
    from transformers import AutoTokenizer

    from .. import assets
    from ..rollout import SamplingConfig
    from ..rollout.vllm_engine import VLLMEngine
    from ..data.sampler import load_training_rows, tokenize_prompts

    cfg = workload_config(shape.overrides())
    model = model or str(assets.smollm2_135m_instruct())
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows, _ = tokenize_prompts(load_training_rows(cfg.data, seed=cfg.trainer.seed), tokenizer, cfg.data)
    engine = VLLMEngine(model, dtype="float32", max_model_len=cfg.data.max_prompt_length + shape.cap,
                        enforce_eager=True)
    try:
        got = engine.generate([p.ids for p in rows[:prompts]], shape.n,
                              SamplingConfig(max_tokens=shape.cap, temperature=cfg.rollout.temperature),
                              seed=seed)
    finally:
        engine.shutdown()
    return [len(t) for t in got.token_ids]


def bench_longtail(*, model: str | None = None, warmup: int = 1, repeats: int = 3, modes=None,
                   steps_override: list[str] | tuple = (), histogram: bool = True, progress: bool = True,
                   shape: Shape = SHAPES["longtail"]) -> dict:
    """Each of the shape's modes (or `modes` of them): `warmup + repeats` steps of justrl-train, then the figures
    side by side."""
    from .step import bench_step

    all_modes = shape.modes()
    raw = {"modes": {}, "workload": shape.overrides() + list(steps_override), "cap": shape.cap}
    for name in modes or all_modes:
        run = bench_step(model=model, warmup=0, repeats=warmup + repeats, nproc=shape.ranks,
                         overrides=[*shape.overrides(), *all_modes[name]["overrides"], *steps_override],
                         progress=progress, keep_records=True)
        raw["modes"][name] = {"figures": mode_figures(run["records"], warmup), "process_wall_s": run["process_wall_s"],
                              "records": run["records"], "plan": all_modes[name]["plan"], "warmup": warmup}
    if histogram:
        lengths = sample_lengths(model, shape)
        raw["lengths"] = lengths
        edges = tuple(e for e in HISTOGRAM_EDGES[:-1] + (512,) if e < shape.cap) + (shape.cap,)
        raw["histogram"] = length_histogram(lengths, edges)
    med = {name: {k: statistics.median(v) for k, v in m["figures"].items()} for name, m in raw["modes"].items()}
    raw["median"] = med
    if "streaming eta=1" in med and "one-step-off" in med:
        raw["ratio_streaming1_vs_one_step_off"] = (med["streaming eta=1"]["trained_tokens_per_s"]
                                                   / med["one-step-off"]["trained_tokens_per_s"])
    return raw


def run_trace(records: list[dict], n: int) -> list[list[int] | None]:
    """Every group a run generated, each its n response lengths, in the order the run started them: a batch mode's
    step by step (response/lengths), streaming's by admission number (rollout/group_admission; the finished groups
    a step dropped, too old or without reward variance, from rollout/untrained_*: they took engine time too). A
    group its engine aborted is None: the planner draws it."""
    def groups_of(lengths):
        return [lengths[i:i + n] for i in range(0, len(lengths), n)]

    groups, started = {}, 0
    for r in records:
        trained = groups_of(r["response/lengths"])
        groups.update(zip(r.get("rollout/group_admission") or range(started, started + len(trained)), trained))
        groups.update(zip(r.get("rollout/untrained_admission", []), groups_of(r.get("rollout/untrained_lengths", []))))
        started += len(trained)
    return [groups.get(i) for i in range(max(groups) + 1)] if groups else []
