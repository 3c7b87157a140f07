"""`justrl-bench --plan-check SHAPE...`: the planner scored against the real loop on this machine, shape by shape.

    justrl-bench --plan-check heldout-short heldout-deep --json docs/plan/check.json
    justrl-bench --plan-check "prompts=4,n=8,cap=640,mini_batch=2,etas=2,ranks=1+1"   # the shape a user cares about

Per shape (bench/longtail.py's SHAPES, or key=value on the command line), one after the other: the machine's speed,
the planner's inputs measured for it (bench/plan_calibrate.py), the machine's speed again (the inputs measured once
more where it moved more than DRIFT_LIMIT meanwhile), every mode of the shape
run with justrl-train (`warmup` untimed + `repeats` timed steps, on a policy that does not move: `STILL_POLICY`),
the machine's speed after, one batch of the initial
model sampled for the response lengths a plan draws from, and the score (bench/plan_score.py). The JSON (the format
is plan_score's) is rewritten after each shape, so a check cut short keeps what it finished; `--plan-rescore` scores
it again.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

from .longtail import Shape, bench_longtail
from .plan_calibrate import (UPDATE_FIT, colocated_decode_factor, fit_update_cost, machine_speed, measure_decode,
                             measure_loop, measure_update, overlap_factors, speed_drift)
from .plan_inputs import PlanInputs
from .plan_score import FORMAT, score_shape


# The modes' runs train with a learning rate too small to change an fp32 weight (Adam moves each by ~lr; the update,
# the sync and every cost stay as they are): the planner predicts throughput at the lengths it is given, the initial
# model's, and the demo's policy otherwise learns to stop rambling within a few steps (measured in
# docs/benchmarks.md, "The first held-out check"), a drift a real run makes over thousands of steps, not five.
STILL_POLICY = ("trainer.lr=1e-12",)

# The inputs are measured again (once) when the machine's one-thread speed right after measuring them is this far
# from its speed right before: a host that sped up or slowed down meanwhile (a neighbour on the VM's host) measured
# another machine than the one the runs then meet. The first measurement is kept in the JSON beside.
DRIFT_LIMIT = 0.05


def measure_plan_inputs(model: str | None, shape: Shape) -> dict:
    """Everything bench/plan.py needs from this machine for `shape`. The train phase's update points (every prompt
    computed: its tokens are computed tokens) are measured and reported beside the loop's, which alone give the
    update input."""
    import statistics

    decode = measure_decode(model, shape)
    train_points = measure_update(round(decode["prompt_len"]))
    loop = measure_loop(model, shape)
    train_slope = statistics.linear_regression([t for t, _ in train_points], [s for _, s in train_points])[0]
    update_factor, decode_factor = overlap_factors(decode["beside_update"], train_points)
    return {"decode": decode, "update_points": train_points, "loop": loop,
            **dict(zip(UPDATE_FIT, fit_update_cost(loop["update_points"]))),
            "train_phase_s_per_token": train_slope, "overlapped_update_factor": update_factor,
            "overlapped_decode_factor": decode_factor}


def refit_inputs(entry: dict) -> dict:
    """A check's shape entry's planner inputs made again from its stored calibration with this module's fits (the
    update's costs, split and colocated, from the loop runs' points): what the check would have planned with them.
    Only what was measured before the runs goes in; the runs are not read."""
    import copy

    measured = copy.deepcopy(entry["calibration"])
    loop = measured["loop"]
    measured.update(zip(UPDATE_FIT, fit_update_cost(loop["update_points"])))
    if loop.get("colocated"):
        loop["colocated"].update(zip(UPDATE_FIT, fit_update_cost(loop["colocated_update_points"])))
    shape = Shape(**{k: tuple(v) if isinstance(v, list) else v for k, v in entry["shape"].items()})
    stored = entry["inputs"]
    return plan_inputs_for(measured, shape, stored["lengths"], stored["engine_assignment"])


def plan_inputs_for(measured: dict, shape: Shape, lengths: list[int], assignment: str = "static") -> dict:
    """The planner's inputs (as JSON, checked) from the measurements, the shape's sizes, a length sample and how the
    engine path assigns groups to engines. The decode line's fit may cross zero; with the measured table it is not
    used, so it is kept at 0 at least."""
    d, loop = measured["decode"], measured["loop"]
    inputs = {"decode": {"fixed_s": max(0.0, d["fixed_s"]), "per_seq_s": max(0.0, d["per_seq_s"]),
                         "per_context_token_s": d["per_context_token_s"],
                         "prefill_s_per_token": d["prefill_s_per_token"],
                         "by_seqs": {str(b): s for b, s in d["by_seqs"].items()}},
              "update_fixed_s": measured["update_fixed_s"], "update_s_per_token": measured["update_s_per_token"],
              "update_s_per_response_token": measured["update_s_per_response_token"],
              "logprob_s_per_token": loop["logprob_s_per_token"], "optimizer_steps": shape.optimizer_steps,
              "sync_s": loop["sync_s"], "colocated_switch_s": loop.get("colocated_switch_s", 0.0),
              "colocated": loop.get("colocated"),
              "reward_s_per_group": loop["reward_s_per_group"], "overhead_s": loop["overhead_s"],
              "lengths": [min(max(1, int(x)), shape.cap) for x in lengths], "prompt_len": round(d["prompt_len"]),
              "prompts_per_step": shape.prompts, "n": shape.n, "max_response_length": shape.cap,
              "shared_prompt": loop["shared_prompt"], "engine_assignment": assignment,
              "overlapped_update_factor": measured.get("overlapped_update_factor", 1.0),
              "overlapped_decode_factor": measured.get("overlapped_decode_factor", 1.0)}
    if inputs["colocated"]:
        split_decode = PlanInputs.from_dict({**inputs, "colocated": None})
        factor = colocated_decode_factor(split_decode, loop["runs"]["colocated cap"], shape.ranks)
        inputs["colocated"] = {**inputs["colocated"], "decode_factor": factor}
    return PlanInputs.from_dict(inputs).to_dict()


def plan_check(shapes: list[Shape], *, model: str | None = None, warmup: int = 1, repeats: int = 3,
               out: str | None = None, progress: bool = True, header: dict | None = None,
               assignment: str = "static") -> dict:
    """The check of `shapes` (see the module's docstring); the report in plan_score's format. `assignment`: how the
    engine path being checked sends groups to engines (it matters with several engines per shape)."""
    report = {"format": FORMAT, **(header or {}), "load_start": list(os.getloadavg()), "shapes": {}}

    def save():
        if out:
            with open(out, "w") as f:
                f.write(json.dumps(report, indent=1, default=str) + "\n")

    for shape in shapes:
        speed = {"inputs": machine_speed()}
        measured = measure_plan_inputs(model, shape)
        plan_inputs_for(measured, shape, [shape.cap], assignment)  # refused inputs stop the check before the runs
        speed["before"] = machine_speed()
        first = None
        if abs(speed_drift(speed["inputs"], speed["before"])) > DRIFT_LIMIT:
            first = {"speed": dict(speed), "calibration": measured}
            speed["inputs"] = speed["before"]
            measured = measure_plan_inputs(model, shape)
            speed["before"] = machine_speed()
        raw = bench_longtail(model=model, warmup=warmup, repeats=repeats, shape=shape, progress=progress,
                             steps_override=STILL_POLICY)
        speed["after"] = machine_speed()
        entry = {"shape": asdict(shape), "workload": raw["workload"],
                 "inputs": plan_inputs_for(measured, shape, raw["lengths"], assignment),
                 "calibration": measured, "speed": speed, "histogram": raw["histogram"],
                 "load_end": list(os.getloadavg()), "first_inputs_drifted": first,
                 "modes": {name: {k: m[k] for k in ("plan", "warmup", "records", "process_wall_s")}
                           for name, m in raw["modes"].items()}}
        entry["scores"] = score_shape(entry)
        report["shapes"][shape.name] = entry
        save()
    return report


def drift_line(entry: dict) -> str:
    """How far the machine's speed moved from the inputs' measurement to before / after the runs."""
    s = entry["speed"]
    return (f"the machine {100 * speed_drift(s['inputs'], s['before']):+.0f}% / "
            f"{100 * speed_drift(s['inputs'], s['after']):+.0f}% slower before / after the runs than at the inputs, "
            f"{s['after']['steal_s'] - s['inputs']['steal_s']:.0f} s stolen since")
