"""The planner scored against real runs, and `justrl-bench --plan-rescore FILE`: a check's JSON scored again.

The score is the plan a user has before a run: response lengths drawn from the initial model's sample (whole
prompts' groups, from a resample of the sample's prompts per draw: bench/plan._Lengths), `DRAWS` draws of a run of
the measured length (a cold start, its warm-up steps untimed, its timed steps), each draw's mean step seconds. A
mode passes when the measured mean step lies inside the draws' p10-p90 and the draws' median is within
`TOLERANCE` of it. Replaying the run's own response lengths (`run_trace`) is shown beside as a diagnostic: it tells
a wrong cost model from an unlucky draw of lengths, but a user never has it.

A check's JSON (`FORMAT`; bench/plan_check.py writes it):

    {"format": "justrl-plan-check/1", "command": ..., "machine": {...},
     "shapes": {NAME: {"shape": {prompts, n, cap, mini_batch, etas, trainers, engines, ...},
                       "inputs": PlanInputs as JSON (lengths: the initial model's sample),
                       "calibration": what measured the inputs, "speed": the machine's speed around the runs,
                       "modes": {MODE: {"plan": {"mode", "eta", "trainers", "engines"}, "warmup": untimed steps,
                                        "records": the run's metrics.jsonl rows}},
                       "scores": {MODE: score_mode's row}}}}
"""

from __future__ import annotations

import statistics

from .longtail import mode_figures, run_trace
from .plan import predict_window
from .plan_inputs import PlanInputs, PlanInputsError, read_json

FORMAT = "justrl-plan-check/1"
TOLERANCE = 0.15  # the largest |median error| a passing mode may have
DRAWS = 32


def verdict(measured_mean: float, p10: float, median: float, p90: float) -> dict:
    """The rule: the measured mean inside [p10, p90] and the median prediction within TOLERANCE of it."""
    error = median / measured_mean - 1
    inside = p10 <= measured_mean <= p90
    return {"error": error, "inside": inside, "passes": inside and abs(error) <= TOLERANCE}


def score_mode(inputs: PlanInputs, entry: dict, draws: int = DRAWS) -> dict:
    """One mode's run (a check's `modes` entry) against the plan of it: drawn lengths (scored) and the run's own
    lengths replayed (the diagnostic)."""
    plan, warmup = entry["plan"], entry["warmup"]
    measured = mode_figures(entry["records"], warmup)["step_s"]
    mean = statistics.mean(measured)
    layout = dict(trainers=plan["trainers"], engines=plan["engines"], eta=plan["eta"], warmup=warmup,
                  timed=len(measured))
    drawn = predict_window(inputs, plan["mode"], draws=draws, sample_groups=True, **layout)
    replayed = predict_window(inputs, plan["mode"], draws=draws, trace=run_trace(entry["records"], inputs.n),
                              **layout)
    p10, median, p90 = drawn["step_s_p10"], drawn["step_s_median"], drawn["step_s_p90"]
    return {"measured_step_s": measured, "measured_mean_step_s": mean, "predicted_step_s": median,
            "p10": p10, "p90": p90, **verdict(mean, p10, median, p90),
            "trace_step_s": replayed["step_s"], "trace_error": replayed["step_s"] / mean - 1}


def score_shape(shape_entry: dict, draws: int = DRAWS, inputs: dict | None = None) -> dict:
    """The shape's modes scored against the plan from its stored inputs (or from `inputs`)."""
    x = PlanInputs.from_dict(inputs or shape_entry["inputs"])
    return {name: score_mode(x, entry, draws) for name, entry in shape_entry["modes"].items()}


def rescore(path: str, draws: int = DRAWS, inputs_of=None) -> dict:
    """A check's JSON scored again with this planner: {"shapes": {NAME: {MODE: row}}, "differs": [(shape, mode,
    key, stored, now)] where the stored score is not what this planner gives, "tuned": {NAME: bool}}.
    `inputs_of(shape entry)`: the inputs to plan with in place of the stored ones (plan_check.refit_inputs)."""
    check = read_json(path, "--plan-rescore")
    if not isinstance(check, dict) or check.get("format") != FORMAT:
        raise PlanInputsError(f"--plan-rescore: {path} is not a planner check (its `format` must be {FORMAT!r})")
    out = {"shapes": {}, "differs": [], "tuned": {name: e["shape"].get("tuned", False)
                                                  for name, e in check["shapes"].items()}}
    for name, entry in check["shapes"].items():
        rows = out["shapes"][name] = score_shape(entry, draws, inputs_of(entry) if inputs_of else None)
        for mode, row in rows.items():
            stored = entry.get("scores", {}).get(mode, {})
            for key in ("predicted_step_s", "p10", "p90", "measured_mean_step_s", "passes"):
                if key in stored and stored[key] != row[key]:
                    out["differs"].append((name, mode, key, stored[key], row[key]))
    return out


def score_table(shapes: dict[str, dict], tuned: dict[str, bool] | None = None) -> str:
    """Markdown: per shape and mode, the measured steps and mean, the drawn prediction's median (p10-p90), its
    error, the verdict, and the trace replay beside."""
    lines = ["| shape, mode | measured steps | mean | predicted, drawn lengths: median (p10-p90) | error | "
             "inside | passes | trace replay (diagnostic) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for shape, rows in shapes.items():
        label = f"{shape} (tuned)" if (tuned or {}).get(shape) else shape
        for mode, r in rows.items():
            lines.append(f"| {label}, {mode} | {' / '.join(f'{s:.1f}' for s in r['measured_step_s'])} | "
                         f"{r['measured_mean_step_s']:.1f} | {r['predicted_step_s']:.1f} ({r['p10']:.1f}-"
                         f"{r['p90']:.1f}) | {100 * r['error']:+.0f}% | {'yes' if r['inside'] else 'no'} | "
                         f"**{'yes' if r['passes'] else 'no'}** | {r['trace_step_s']:.1f} "
                         f"({100 * r['trace_error']:+.0f}%) |")
    passed = sum(r["passes"] for rows in shapes.values() for r in rows.values())
    total = sum(len(rows) for rows in shapes.values())
    lines.append(f"\n{passed} of {total} modes pass (measured mean inside p10-p90 and median error within "
                 f"{100 * TOLERANCE:.0f}%)")
    return "\n".join(lines)
