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
"""

from __future__ import annotations

import os
import statistics

LONGTAIL_TOKENS = 384
WORKLOAD = ["recipe=cpu_demo", f"rollout.max_response_length={LONGTAIL_TOKENS}", "rollout.temperature=1.0",
            "trainer.prompts_per_step=8", "trainer.mini_batch_size=8", "rollout.n=4",
            "rollout.placement=split", "rollout.num_rollout_ranks=1"]
MODES = {
    "split sync": ["rollout.max_staleness=0"],
    "one-step-off": ["rollout.max_staleness=1"],
    "streaming eta=1": ["rollout.streaming=true", "rollout.max_staleness=1"],
    "streaming eta=2": ["rollout.streaming=true", "rollout.max_staleness=2"],
}
HISTOGRAM_EDGES = (16, 32, 64, 128, 256, LONGTAIL_TOKENS)
# A workload the planner finds rollout-bound: 2 prompts x 4 a step (an update of ~1K tokens) and room for 1,024
# tokens (a tail of a few hundred engine steps at a handful of sequences): only the rollout schedule can win here.
ROLLOUT_BOUND_TOKENS = 1024
ROLLOUT_BOUND = [w for w in WORKLOAD if not w.startswith(("rollout.max_response", "trainer.prompts_per_step",
                                                           "trainer.mini_batch_size"))]
ROLLOUT_BOUND += [f"rollout.max_response_length={ROLLOUT_BOUND_TOKENS}", "trainer.prompts_per_step=2",
                  "trainer.mini_batch_size=2"]
WORKLOADS = {  # name -> (overrides, modes, response cap)
    "longtail": (WORKLOAD, MODES, LONGTAIL_TOKENS),
    "rollout-bound": (ROLLOUT_BOUND, {k: MODES[k] for k in ("one-step-off",)}
                      | {"streaming eta=4": ["rollout.streaming=true", "rollout.max_staleness=4"],
                         "streaming eta=2": MODES["streaming eta=2"]}, ROLLOUT_BOUND_TOKENS),
}


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


def sample_lengths(model: str | None, prompts: int = 16, n: int = 4, seed: int = 1, workload=WORKLOAD,
                   cap: int = LONGTAIL_TOKENS) -> list[int]:
    """The workload's response lengths from one batch of the initial model (an in-process vLLM engine)."""
    from transformers import AutoTokenizer

    from .. import assets
    from ..rollout import SamplingConfig
    from ..rollout.vllm_engine import VLLMEngine
    from ..data.sampler import load_training_rows, tokenize_prompts

    cfg = workload_config(workload)
    model = model or str(assets.smollm2_135m_instruct())
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows, _ = tokenize_prompts(load_training_rows(cfg.data, seed=cfg.trainer.seed), tokenizer, cfg.data)
    engine = VLLMEngine(model, dtype="float32", max_model_len=cfg.data.max_prompt_length + cap,
                        enforce_eager=True)
    try:
        got = engine.generate([p.ids for p in rows[:prompts]], n,
                              SamplingConfig(max_tokens=cap, temperature=cfg.rollout.temperature),
                              seed=seed)
    finally:
        engine.shutdown()
    return [len(t) for t in got.token_ids]


def bench_longtail(*, model: str | None = None, warmup: int = 1, repeats: int = 3, modes=None,
                   steps_override: list[str] | tuple = (), histogram: bool = True, progress: bool = True,
                   workload: str = "longtail") -> dict:
    """Each mode's `warmup + repeats` steps (justrl-train, 2 processes), then the figures side by side."""
    from .step import bench_step

    overrides, all_modes, cap = WORKLOADS[workload]
    raw = {"modes": {}, "workload": list(overrides) + list(steps_override), "cap": cap}
    for name in modes or all_modes:
        run = bench_step(model=model, warmup=0, repeats=warmup + repeats, nproc=2,
                         overrides=[*overrides, *all_modes[name], *steps_override], progress=progress,
                         keep_records=True)
        raw["modes"][name] = {"figures": mode_figures(run["records"], warmup), "process_wall_s": run["process_wall_s"],
                              "records": run["records"]}
    if histogram:
        lengths = sample_lengths(model, workload=overrides, cap=cap)
        raw["lengths"] = lengths
        edges = HISTOGRAM_EDGES if cap == LONGTAIL_TOKENS else (16, 32, 64, 128, 256, 512, cap)
        raw["histogram"] = length_histogram(lengths, edges)
    med = {name: {k: statistics.median(v) for k, v in m["figures"].items()} for name, m in raw["modes"].items()}
    raw["median"] = med
    if "streaming eta=1" in med and "one-step-off" in med:
        raw["ratio_streaming1_vs_one_step_off"] = (med["streaming eta=1"]["trained_tokens_per_s"]
                                                   / med["one-step-off"]["trained_tokens_per_s"])
    return raw


# --- the planner's check (bench/plan.py): its inputs measured here, then the modes, in one run -------------------------

DECODE_BATCHES = (1, 2, 4, 16, 32, 64)  # running sequences at which an engine step is timed (a tail runs at 1-2)
TAIL_TOKENS = 513  # one sequence decoded this far against 33 tokens: what a token of context costs in the tail


def measure_decode(model: str | None, overrides=WORKLOAD, n: int = 4) -> dict:
    """Seconds per engine step against running sequences and context, and prefill per prompt token, on the engine a
    rollout rank builds (make_engine in a child process, prefix caching off as streaming runs it), real prompts.
    A step's cost is (time of 33 tokens - time of 1) / 32, at each of DECODE_BATCHES running sequences (`by_seqs`,
    the line fixed + per_seq fitted through them beside it); the context slope from one sequence at TAIL_TOKENS
    against 33 (the regime of a long tail; a slope from a large batch's short contexts came out 3-4x lower)."""
    import time

    from transformers import AutoTokenizer

    from .. import assets
    from ..data.sampler import load_training_rows, tokenize_prompts
    from ..rollout import SamplingConfig
    from ..rollout.vllm_engine import make_engine

    cfg = workload_config([*overrides, "rollout.streaming=true"])
    model = model or str(assets.smollm2_135m_instruct())
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows, _ = tokenize_prompts(load_training_rows(cfg.data, seed=cfg.trainer.seed), tokenizer, cfg.data)
    engine = make_engine(cfg, model, in_process=False)

    def shape(seqs: int) -> tuple[int, int]:  # (prompts, samples each): groups of n, or one prompt's samples
        return (seqs // n, n) if seqs >= n else (1, seqs)

    def timed(seqs: int, tokens: int) -> float:
        prompts, each = shape(seqs)
        t = time.perf_counter()
        engine.generate([p.ids for p in rows[:prompts]], each, SamplingConfig(max_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - t

    try:
        timed(n, 4)  # warm-up
        first = {b: timed(b, 1) for b in DECODE_BATCHES}
        step = {b: (timed(b, 33) - first[b]) / 32 for b in DECODE_BATCHES}
        tail = (timed(1, TAIL_TOKENS) - first[1]) / (TAIL_TOKENS - 1)
    finally:
        engine.shutdown()
    prompt_lens = {b: statistics.mean(len(p.ids) for p in rows[:shape(b)[0]]) for b in DECODE_BATCHES}
    per_context = max(0.0, (tail - step[1]) / ((TAIL_TOKENS - 33) / 2))  # the mean context grows by half the tokens
    by_seqs = {b: step[b] - per_context * b * (prompt_lens[b] + 17) for b in DECODE_BATCHES}
    xs = [b for b in DECODE_BATCHES if b >= n]
    slope, intercept = statistics.linear_regression(xs, [by_seqs[b] for b in xs])
    prefill = statistics.median(max(0.0, first[b] - step[b]) / (b * prompt_lens[b]) for b in DECODE_BATCHES)
    return {"fixed_s": intercept, "per_seq_s": slope, "per_context_token_s": per_context,
            "prefill_s_per_token": prefill, "by_seqs": by_seqs, "prompt_len": prompt_lens[max(DECODE_BATCHES)],
            "raw": {"step_s": step, "first_token_s": first, f"step_s_1_at_{TAIL_TOKENS}": tail}}


UPDATE_SIZES = ((32, 64), (32, 160))  # (samples, tokens each): the update's cost per token, two points


def measure_update(prompt_len: int = 55) -> list[tuple[int, float]]:
    """(tokens, seconds) of one GRPO update of the workload's model shape (random weights and tokens, fp32, one
    thread as each torchrun rank has), in a child process: `justrl-bench --phase train`'s code."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory(prefix="justrl-plan-") as tmp:
        out = os.path.join(tmp, "update.json")
        _one_thread_child("update", out, str(prompt_len))
        return [tuple(p) for p in json.loads(open(out).read())]


def _one_thread_child(*args: str, capture: bool = False):
    """This module run in a fresh process on one thread (as each torchrun rank runs): the measurements that an
    engine built in this process (its thread binding) or this process's threads must not touch."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "justrl_megatron.bench.longtail", *args],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True, capture_output=capture, text=True)


def _update_points(out: str, prompt_len: int) -> None:
    import json

    from .train import bench_train

    points = []
    for i, (samples, length) in enumerate(UPDATE_SIZES):
        r = bench_train(model="smollm2-135m", tokens=samples * length, seq_len=length, prompt_len=prompt_len,
                        dtype="fp32", steps=1, warmup=1 if i == 0 else 0, max_tokens_per_micro_batch=2048)
        points.append((samples * length, statistics.median(r["update"]["time_s_all"])))
    open(out, "w").write(json.dumps(points))


# the loop's calibration runs (hydra overrides on the workload's): three update sizes, the step's other costs from the
# first; the small one (2 prompts) separates the update's fixed cost (the optimizer step over every parameter) from
# its cost per token: two sizes of 8 prompts alone cannot, and a fit through the origin then charges an update of 2
# prompts ~2 s too little (docs/benchmarks.md)
LOOP_RUNS = (("rollout.max_response_length=8",), ("rollout.max_response_length=64",),
             ("rollout.max_response_length=8", "trainer.prompts_per_step=2", "trainer.mini_batch_size=2"))


def loop_update_point(record: dict, groups: int, n: int, shared_prompt: bool) -> tuple[float, float, float]:
    """(computed tokens, response tokens, seconds) of one step's update from its metrics: computed are every
    response token and the prompts n times or, with the shared prompt, once per group (the planner's units)."""
    tokens = record["throughput/tokens_per_s"] * record["time/step_s"]  # prompt + response tokens, per sample
    response = record["response/length_mean"] * groups * n
    prompts = max(0.0, tokens - response)
    return response + (prompts / n if shared_prompt else prompts), response, record["time/update_s"]


def fit_update_cost(points) -> tuple[float, float, float]:
    """(fixed seconds per update, seconds per computed token, extra seconds per response token): least squares over
    (computed, response, seconds) points. A response token costs more than a prompt token (the log-prob head), so
    a per-token rate from short responses underestimates long ones. Where the points cannot tell the three apart
    (one update size, or a negative term: noise), the fixed cost is 0 and the fit runs through the origin; where
    that still yields a negative extra cost (the response share does not vary), one rate per computed token."""
    import numpy as np

    c, r, t = (np.array([p[i] for p in points], dtype=float) for i in range(3))
    fit = _least_squares([np.ones_like(c), c, r], t)
    if fit and fit[0] >= 0 and fit[1] > 0 and fit[2] >= 0:
        return fit[0], fit[1], fit[2]
    fit = _least_squares([c, r], t)
    if fit and fit[0] > 0 and fit[1] >= 0:
        return 0.0, fit[0], fit[1]
    return 0.0, float(t.sum() / c.sum()), 0.0


def _least_squares(columns, t) -> list[float] | None:
    """The coefficients of t over the columns; None where they cannot be told apart (too few points, or
    columns nearly proportional)."""
    import numpy as np

    design = np.stack(columns, axis=1)
    if np.linalg.matrix_rank(design) < design.shape[1] or not np.linalg.cond(design / design.max(axis=0)) < 1e6:
        return None
    return [float(v) for v in np.linalg.lstsq(design, t, rcond=None)[0]]


def measure_loop(model: str | None, overrides=WORKLOAD) -> dict:
    """The loop's own per-step costs from split synchronous runs (1 + 2 steps each, LOOP_RUNS) with short
    responses: the weight sync, scoring per group and the rest of a step besides rollout, update and sync from the
    first; the update's fixed cost and cost per computed token fitted through every run's steps. The loop's update
    is the planner's input, not the train phase's: on this CPU the two differ by 1.5-5x per token (docs/benchmarks.md,
    the planner's check), so only the loop's own update predicts the loop."""
    from .step import bench_step

    cfg = workload_config(overrides)
    shared = workload_shared_prompt(cfg)
    points, first = [], None
    for extra in LOOP_RUNS:
        run = bench_step(model=model, warmup=0, repeats=3, nproc=2, progress=False, keep_records=True,
                         overrides=[*overrides, "rollout.max_staleness=0", *extra])
        records, groups = run["records"], run["prompts"]
        timed = [(records[i - 1], records[i]) for i in range(1, len(records))]  # step 1 warms up
        points += [loop_update_point(r, groups, cfg.rollout.n, shared) for _, r in timed]
        first = first or (timed, groups)
    timed, groups = first
    return {"sync_s": statistics.median(r["time/sync_s"] for _, r in timed),
            "reward_s_per_group": statistics.median(r.get("time/reward_s", 0.0) for _, r in timed) / groups,
            "overhead_s": statistics.median(max(0.0, r["time"] - p["time"] - r.get("time/wait_rollout_s", 0.0)
                                                - r["time/update_s"] - r["time/sync_s"]) for p, r in timed),
            "shared_prompt": shared, "update_points": points}


def workload_config(overrides):
    from ..config import compose

    return compose([w for w in overrides if not w.startswith("rollout.placement") and "num_rollout" not in w])


def workload_shared_prompt(cfg) -> bool:
    """Whether the workload's trainer shares each group's prompt (the CPU runs the local spec)."""
    from ..model.attention import resolve_shared_prompt

    return resolve_shared_prompt(cfg.trainer.shared_prompt, "local")


def measure_plan_inputs(model: str | None = None) -> dict:
    """Everything bench/plan.py needs from this machine, the workload's sizes aside. The train phase's update
    points (every prompt computed: its tokens are computed tokens) are measured and reported beside the loop's,
    which alone give the update input."""
    decode = measure_decode(model)
    train_points = measure_update(round(decode["prompt_len"]))
    loop = measure_loop(model)
    fixed, per_token, per_response = fit_update_cost(loop["update_points"])
    train_slope = statistics.linear_regression([t for t, _ in train_points], [s for _, s in train_points])[0]
    return {"decode": decode, "update_points": train_points, "loop": loop, "update_fixed_s": fixed,
            "update_s_per_token": per_token, "update_s_per_response_token": per_response,
            "train_phase_s_per_token": train_slope}


def plan_inputs_for(measured: dict, workload: str, lengths: list[int]):
    from .plan import DecodeCost, PlanInputs

    overrides, _, cap = WORKLOADS[workload]
    sizes = dict(w.split("=", 1) for w in overrides if "=" in w)
    d = measured["decode"]
    return PlanInputs(decode=DecodeCost(d["fixed_s"], d["per_seq_s"], d["per_context_token_s"],
                                        d["prefill_s_per_token"], d.get("by_seqs")),
                      update_fixed_s=measured["update_fixed_s"], update_s_per_token=measured["update_s_per_token"],
                      update_s_per_response_token=measured.get("update_s_per_response_token", 0.0),
                      sync_s=measured["loop"]["sync_s"], lengths=list(lengths), prompt_len=round(d["prompt_len"]),
                      prompts_per_step=int(sizes["trainer.prompts_per_step"]), n=int(sizes["rollout.n"]),
                      max_response_length=cap, reward_s_per_group=measured["loop"]["reward_s_per_group"],
                      overhead_s=measured["loop"]["overhead_s"],
                      shared_prompt=workload_shared_prompt(workload_config(overrides)))


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


def mode_plan(name: str) -> tuple[str, int]:
    if name.startswith("streaming"):
        return "streaming", int(name.split("=")[1])
    return name, 1


def check_rows(measured_inputs: dict, workload: str, raw: dict, warmup: int) -> dict:
    """Per mode: the measured figures (mean step and medians over the timed steps), and the planner's from the
    measured inputs for the window the run timed (`predict_window`: a cold start, `warmup` untimed steps, the timed
    ones), with the steady state beside it; once with lengths drawn from the initial model's sample (what a plan
    has before a run) and once replaying the run's own (`run_trace`: what the check scores, since a run of a few
    steps of a long-tail distribution lands anywhere between the draws' p10 and p90)."""
    from .plan import predict, predict_window

    inputs = plan_inputs_for(measured_inputs, workload, raw["lengths"])
    rows = {}
    for name, m in raw["modes"].items():
        mode, eta = mode_plan(name)
        measured = {k: statistics.median(v) for k, v in m["figures"].items()}
        timed = len(m["figures"]["step_s"])
        mean_step = statistics.mean(m["figures"]["step_s"])  # a predicted step_s is a mean too
        row = {"measured": measured, "measured_mean_step_s": mean_step}
        for label, trace in (("sample", None), ("trace", run_trace(m["records"], inputs.n))):
            p = predict_window(inputs, mode, eta=eta, warmup=warmup, timed=timed, trace=trace)
            row[label] = {**{k: p[k] for k in ("step_s", "step_s_p10", "step_s_p90", "trained_tokens_per_s",
                                               "trainer_idle_frac", "engine_idle_frac", "staleness_max")},
                          "step_error": p["step_s"] / mean_step - 1,
                          "steady_step_s": predict(inputs, mode, eta=eta)["step_s"]}
        rows[name] = row
    return rows


def machine_speed(repeats: int = 5) -> dict:
    """The machine's speed now: one thread's fp32 matmul rate (GFLOP/s, median of `repeats`, in a fresh process: an
    engine built in this one binds its threads) and the CPU time stolen by other guests since boot. A run on a
    machine slower or faster than when the planner's inputs were measured (a neighbour on the host, a throttled
    CPU) is no test of the planner, so the check reports this at the inputs, before and after each workload's runs."""
    out = _one_thread_child("speed", str(repeats), capture=True)
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return {"matmul_gflops": float(out.stdout.split()[-1]),
            "steal_s": int(fields[8]) / 100 if len(fields) > 8 else 0.0}


def _matmul_rate(repeats: int) -> float:
    import time

    import torch

    torch.set_num_threads(1)
    a, rates = torch.randn(512, 512), []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(100):
            a @ a
        rates.append(100 * 2 * 512 ** 3 / (time.perf_counter() - t) / 1e9)
    return statistics.median(rates)


def speed_drift(before: dict, now: dict) -> float:
    """How much slower the machine is now than when the inputs were measured (0.2: 20% slower)."""
    return before["matmul_gflops"] / now["matmul_gflops"] - 1


def plan_check(workloads=("longtail",), *, model: str | None = None, warmup: int = 1, repeats: int = 3,
               out: str | None = None, progress: bool = True) -> dict:
    """Per workload, one after the other: the planner's inputs measured, then the workload's modes run; predicted
    against measured step seconds and trained tokens/s per mode. The inputs are measured again right before each
    workload, and the machine's speed beside them and after the runs: a shared host drifts by up to 1.5x within
    the hour such a check takes (docs/benchmarks.md), which no model of the pipeline can predict."""
    import json

    report = {"load_start": list(os.getloadavg())}

    def save():
        if out:
            open(out, "w").write(json.dumps(report, indent=1, default=str) + "\n")

    for workload in workloads:
        speed = machine_speed()
        inputs = measure_plan_inputs(model)
        speed_runs = machine_speed()
        raw = bench_longtail(model=model, warmup=warmup, repeats=repeats, workload=workload, progress=progress)
        report[workload] = {"measured_inputs": inputs, "raw": raw, "rows": check_rows(inputs, workload, raw, warmup),
                            "load_end": list(os.getloadavg()), "speed_inputs": speed, "speed_before": speed_runs,
                            "speed_after": machine_speed(),
                            "inputs": plan_inputs_for(inputs, workload, raw["lengths"]).to_dict()}
        save()
    return report


if __name__ == "__main__":  # the update's cost points, in a process of their own (one thread)
    import sys

    if sys.argv[1] == "update":
        _update_points(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "speed":
        print(_matmul_rate(int(sys.argv[2])))
