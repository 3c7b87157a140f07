"""The throughput planner's inputs measured on this machine, for a shape of bench/longtail.py: what
`justrl-bench --plan-check` calibrates before it runs the shape's modes (bench/plan_check.py).

    measure_decode(model, shape)      # an engine step against running sequences and context, prefill per token
    measure_loop(model, shape)        # the loop's own update, old-logprob pass, sync, scoring, rest, colocated switch
    machine_speed()                   # one thread's matmul rate now: how far the machine drifted since the inputs

The calibration covers the lengths a plan of the shape extrapolates to: the decode tail runs to the shape's cap, and
one of the loop's runs trains responses of the shape's own cap.
"""

from __future__ import annotations

import os
import statistics

from .longtail import Shape, workload_config

DECODE_BATCHES = (1, 2, 4, 16, 32, 64)  # running sequences at which an engine step is timed (a tail runs at 1-2)
TAIL_TOKENS = 513  # at least this far one sequence is decoded against 33 tokens: what context costs in the tail


def measure_decode(model: str | None, shape: Shape) -> dict:
    """Seconds per engine step against running sequences and context, and prefill per prompt token, on the engine a
    rollout rank builds (make_engine in a child process, prefix caching off as streaming runs it), real prompts.
    A step's cost is (time of 33 tokens - time of 1) / 32, at each of DECODE_BATCHES running sequences (`by_seqs`,
    the line fixed + per_seq fitted through them beside it); the context slope from one sequence at the shape's cap
    (TAIL_TOKENS at least) against 33 (the regime of a long tail; a slope from a large batch's short contexts came
    out 3-4x lower)."""
    import time

    from transformers import AutoTokenizer

    from .. import assets
    from ..data.sampler import load_training_rows, tokenize_prompts
    from ..rollout import SamplingConfig
    from ..rollout.vllm_engine import make_engine

    cfg = workload_config([*shape.overrides(), "rollout.streaming=true"])
    n, tail_tokens = shape.n, max(TAIL_TOKENS, shape.cap)
    model = model or str(assets.smollm2_135m_instruct())
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows, _ = tokenize_prompts(load_training_rows(cfg.data, seed=cfg.trainer.seed), tokenizer, cfg.data)
    engine = make_engine(cfg, model, in_process=False)

    def layout(seqs: int) -> tuple[int, int]:  # (prompts, samples each): groups of n, or one prompt's samples
        return (seqs // n, n) if seqs >= n else (1, seqs)

    def timed(seqs: int, tokens: int) -> float:
        prompts, each = layout(seqs)
        t = time.perf_counter()
        engine.generate([p.ids for p in rows[:prompts]], each, SamplingConfig(max_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - t

    prompt_lens = {b: statistics.mean(len(p.ids) for p in rows[:layout(b)[0]]) for b in DECODE_BATCHES}
    try:
        timed(n, 4)  # warm-up
        first = {b: timed(b, 1) for b in DECODE_BATCHES}
        step = {b: (timed(b, 33) - first[b]) / 32 for b in DECODE_BATCHES}
        tail = (timed(1, tail_tokens) - first[1]) / (tail_tokens - 1)
        overlap = _decode_beside_update(lambda: timed(_overlap_seqs(shape), 33),
                                        round(prompt_lens[max(DECODE_BATCHES)]))
    finally:
        engine.shutdown()
    per_context = max(0.0, (tail - step[1]) / ((tail_tokens - 33) / 2))  # the mean context grows by half the tokens
    by_seqs = {b: step[b] - per_context * b * (prompt_lens[b] + 17) for b in DECODE_BATCHES}
    xs = [b for b in DECODE_BATCHES if b >= n]
    slope, intercept = statistics.linear_regression(xs, [by_seqs[b] for b in xs])
    prefill = statistics.median(max(0.0, first[b] - step[b]) / (b * prompt_lens[b]) for b in DECODE_BATCHES)
    return {"fixed_s": intercept, "per_seq_s": slope, "per_context_token_s": per_context,
            "prefill_s_per_token": prefill, "by_seqs": by_seqs, "prompt_len": prompt_lens[max(DECODE_BATCHES)],
            "raw": {"step_s": step, "first_token_s": first, f"step_s_1_at_{tail_tokens}": tail},
            "beside_update": overlap}


def _overlap_seqs(shape: Shape) -> int:
    """The running sequences of the decode timed beside an update: one step's batch (an engine in one-step-off
    generates the next one while the trainer updates), whole groups, at most the largest measured batch."""
    return max(shape.n, min(shape.prompts * shape.n, max(DECODE_BATCHES)) // shape.n * shape.n)


def _decode_beside_update(decode, prompt_len: int, alone_repeats: int = 3) -> dict:
    """On a machine whose cores the trainer and the engine share (this CPU), an update that runs while an engine
    decodes takes longer than alone, and so does the decode. Measured here: `decode()` (a call of a fixed size)
    timed alone, then called over and over while the update's cost points (`measure_update`'s child, one thread)
    run beside it; the points come back to be set against the same points measured alone."""
    import json
    import subprocess
    import tempfile

    alone = [decode() for _ in range(alone_repeats)]
    beside = []
    with tempfile.TemporaryDirectory(prefix="justrl-plan-") as tmp:
        out = os.path.join(tmp, "update.json")
        argv, env = _one_thread_command("update", out, str(prompt_len))
        child = subprocess.Popen(argv, env=env)
        try:
            while child.poll() is None:
                seconds = decode()
                if child.poll() is None:  # the call ran beside the update throughout
                    beside.append(seconds)
        finally:
            if child.poll() is None:
                child.kill()
            child.wait()
        if child.returncode:
            raise RuntimeError(f"the update beside the decoding engine failed (exit {child.returncode})")
        points = [tuple(p) for p in json.loads(open(out).read())]
    if not beside:
        raise RuntimeError("the update beside the decoding engine ended before one decode call did: nothing measured")
    return {"decode_alone_s": alone, "decode_beside_s": beside, "update_points": points}


def overlap_factors(beside: dict, alone_points) -> tuple[float, float]:
    """(update, decode): how much longer each takes beside the other than alone (`_decode_beside_update`'s
    measurement; `alone_points`: the same update points measured alone)."""
    update = sum(s for _, s in beside["update_points"]) / sum(s for _, s in alone_points)
    return update, statistics.median(beside["decode_beside_s"]) / statistics.median(beside["decode_alone_s"])


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

    argv, env = _one_thread_command(*args)
    return subprocess.run(argv, env=env, check=True, capture_output=capture, text=True)


def _one_thread_command(*args: str) -> tuple[list[str], dict]:
    import sys

    return [sys.executable, "-m", "justrl_megatron.bench.plan_calibrate", *args], {**os.environ, "OMP_NUM_THREADS": "1"}


def _update_points(out: str, prompt_len: int) -> None:
    import json

    from .train import bench_train

    points = []
    for i, (samples, length) in enumerate(UPDATE_SIZES):
        r = bench_train(model="smollm2-135m", tokens=samples * length, seq_len=length, prompt_len=prompt_len,
                        dtype="fp32", steps=1, warmup=1 if i == 0 else 0, max_tokens_per_micro_batch=2048)
        points.append((samples * length, statistics.median(r["update"]["time_s_all"])))
    open(out, "w").write(json.dumps(points))


def loop_runs(shape: Shape) -> list[tuple[str, list[str], int]]:
    """The calibration's runs of the loop (label, hydra overrides on the shape's, ranks), 1 + 2 steps each, split
    synchronous on the shape's ranks unless said: responses capped at 8 tokens (the sync, scoring and the rest of a
    step from it), at the shape's own cap (the update at the lengths its plan extrapolates to), and 2 prompts at 8
    tokens (the update's fixed cost against its cost per token: sizes of one prompt count alone cannot separate
    them, and a fit through the origin then charges a small update ~2 s too little, docs/benchmarks.md). With the
    shape's mini-batch below its prompts the runs take several optimizer steps, so the old-logprob pass is
    measured too. A colocated shape adds colocated runs at 8 tokens and at the cap: the colocated layout's own update
    and handover (`colocated`, the sleep / wake beyond it: `colocated_switch_s`)."""
    split = ["rollout.placement=split", f"rollout.num_rollout_ranks={shape.engines}", "rollout.max_staleness=0"]
    runs = [("short", [*split, "rollout.max_response_length=8"], shape.ranks),
            ("cap", [*split, f"rollout.max_response_length={shape.cap}"], shape.ranks),
            ("two prompts", [*split, "rollout.max_response_length=8", "trainer.prompts_per_step=2",
                             "trainer.mini_batch_size=2"], shape.ranks)]
    if shape.colocated:
        colocated = ["rollout.placement=colocated", "rollout.max_staleness=0"]
        runs += [("colocated short", [*colocated, "rollout.max_response_length=8"], shape.ranks),
                 ("colocated cap", [*colocated, f"rollout.max_response_length={shape.cap}"], shape.ranks)]
    return runs


def loop_update_point(record: dict, groups: int, n: int, shared_prompt: bool) -> tuple[float, float, float]:
    """(computed tokens, response tokens, seconds) of one step's update from its metrics: computed are every
    response token and the prompts n times or, with the shared prompt, once per group (the planner's units)."""
    tokens = record["throughput/tokens_per_s"] * record["time/step_s"]  # prompt + response tokens, per sample
    response = record["response/length_mean"] * groups * n
    prompts = max(0.0, tokens - response)
    return response + (prompts / n if shared_prompt else prompts), response, record["time/update_s"]


UPDATE_FIT = ("update_fixed_s", "update_s_per_token", "update_s_per_response_token")  # fit_update_cost's, as stored


def fit_update_cost(points) -> tuple[float, float, float]:
    """(fixed seconds per optimizer step, seconds per computed token, extra seconds per response token): least
    squares over (computed, response, seconds[, optimizer steps: 1 if not given]) points. A response token costs
    more than a prompt token (the log-prob head), so a per-token rate from short responses underestimates long ones.
    Where the points cannot tell the three apart (one update size, or a term comes out negative: noise), the closer
    of the two fits that leave one out (no extra per response token, or no fixed cost) among those with no negative
    term; where neither has, one rate per computed token. Several optimizer steps make the fixed cost a large part
    of a short update: a fit that drops it charges its seconds to every token, long updates too."""
    import numpy as np

    c, r, t = (np.array([p[i] for p in points], dtype=float) for i in range(3))
    k = np.array([p[3] if len(p) > 3 else 1 for p in points], dtype=float)
    fit = _least_squares([k, c, r], t)
    if fit and fit[0] >= 0 and fit[1] > 0 and fit[2] >= 0:
        return fit[0], fit[1], fit[2]
    fits = []
    for columns, full in (([k, c], lambda f: (f[0], f[1], 0.0)), ([c, r], lambda f: (0.0, f[0], f[1]))):
        fit = _least_squares(columns, t)
        if fit and min(fit) >= 0 and full(fit)[1] > 0:
            residual = float(np.sum((t - np.stack(columns, axis=1) @ np.array(fit)) ** 2))
            fits.append((residual, full(fit)))
    if fits:
        return min(fits)[1]
    return 0.0, float(t.sum() / c.sum()), 0.0


def _least_squares(columns, t) -> list[float] | None:
    """The coefficients of t over the columns; None where they cannot be told apart (too few points, or
    columns nearly proportional)."""
    import numpy as np

    design = np.stack(columns, axis=1)
    if np.linalg.matrix_rank(design) < design.shape[1] or not np.linalg.cond(design / design.max(axis=0)) < 1e6:
        return None
    return [float(v) for v in np.linalg.lstsq(design, t, rcond=None)[0]]


def measure_loop(model: str | None, shape: Shape) -> dict:
    """The loop's own per-step costs from `loop_runs` (step 1 of each warms up): the weight sync, scoring per group
    and the rest of a step besides rollout, old logprobs, update and sync from the short run; the update's fixed
    cost per optimizer step and its costs per token fitted through every split run's steps, per trainer device;
    the old-logprob pass per computed token where the shape takes several optimizer steps; the colocated layout's
    own update (fitted the same way, per device, every rank a trainer), handover and switch.
    The loop's update is the planner's input, not the train phase's: on this CPU the two differ by 1.5-5x per token
    (docs/benchmarks.md, the planner's check), so only the loop's own update predicts the loop."""
    from .step import bench_step

    shared = workload_shared_prompt(shape)
    out = {"shared_prompt": shared, "update_points": [], "colocated_update_points": [], "runs": {}}
    logprob = {False: [], True: []}  # colocated or not: (computed tokens per trainer, seconds)
    handover, switch = [], []
    for label, extra, nproc in loop_runs(shape):
        run = bench_step(model=model, warmup=0, repeats=3, nproc=nproc, progress=False, keep_records=True,
                         overrides=[*shape.overrides(), *extra])
        records, groups = run["records"], run["prompts"]
        out["runs"][label] = records
        timed = [(records[i - 1], records[i]) for i in range(1, len(records))]
        colocated = label.startswith("colocated")
        trainers = shape.ranks if colocated else shape.trainers  # colocated: every rank trains
        steps = run["prompts"] // int(dict(o.split("=", 1) for o in [*shape.overrides(), *extra]
                                           )["trainer.mini_batch_size"])
        for _, r in timed:
            computed, response, seconds = loop_update_point(r, groups, shape.n, shared)
            out["colocated_update_points" if colocated else "update_points"].append(
                (computed / trainers, response / trainers, seconds, steps))
            if steps > 1:
                logprob[colocated].append((computed / trainers, r.get("time/old_logprob_s", 0.0)))
        if colocated:
            handover += [r["time/sync_s"] for _, r in timed]
        if label == "short":
            out.update(
                sync_s=statistics.median(r["time/sync_s"] for _, r in timed),
                reward_s_per_group=statistics.median(r.get("time/reward_s", 0.0) for _, r in timed) / groups,
                overhead_s=statistics.median(max(0.0, _unaccounted(p, r, ("sync",))) for p, r in timed))
        if label == "colocated short":
            switch = [_unaccounted(p, r, ("sync",)) for p, r in timed]
    rate = {k: sum(s for _, s in v) / sum(c for c, _ in v) if v else 0.0 for k, v in logprob.items()}
    out["logprob_s_per_token"] = rate[False]
    if handover:
        out["colocated"] = {**dict(zip(UPDATE_FIT, fit_update_cost(out["colocated_update_points"]))),
                            "logprob_s_per_token": rate[True], "sync_s": statistics.median(handover)}
        # the rest of a colocated step beyond the split's (the engine's sleep / wake; 0 at least: the planner adds
        # it), the raw difference kept
        out["colocated_beyond_split_s"] = statistics.median(switch) - out["overhead_s"]
        out["colocated_switch_s"] = max(0.0, out["colocated_beyond_split_s"])
    return out


def colocated_decode_factor(inputs, records: list[dict], engines: int) -> float:
    """How much slower the colocated layout's engines generate than `inputs.decode` (measured on one engine) says:
    the median, over the colocated run's timed steps (`records`, step 1 warms up), of the rollout waited for
    against the planner's rollout of the same batch on `engines` engines."""
    from .plan import batch_rollout_s

    n = inputs.n
    ratios = [r["time/wait_rollout_s"] / batch_rollout_s(inputs, [r["response/lengths"][i:i + n] for i in range(
        0, len(r["response/lengths"]), n)], engines) for r in records[1:]]
    return statistics.median(ratios)


def _unaccounted(previous: dict, record: dict, also: tuple[str, ...]) -> float:
    """A step's wall time (between step ends) less its timed phases: waiting for the batch (rollout and scoring),
    reference and old logprobs, the update, and `also`."""
    phases = ("wait_rollout", "old_logprob", "ref_logprob", "update", *also)
    return record["time"] - previous["time"] - sum(record.get(f"time/{k}_s", 0.0) for k in phases)


def workload_shared_prompt(shape: Shape) -> bool:
    """Whether the shape's trainer shares each group's prompt (the CPU runs the local spec)."""
    from ..model.attention import resolve_shared_prompt

    return resolve_shared_prompt(workload_config(shape.overrides()).trainer.shared_prompt, "local")


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


if __name__ == "__main__":  # the update's cost points, in a process of their own (one thread)
    import sys

    if sys.argv[1] == "update":
        _update_points(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "speed":
        print(_matmul_rate(int(sys.argv[2])))
