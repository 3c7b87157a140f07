"""How a plan moves with the inputs it is least sure of, and the split that holds up best across them.

    scenarios = load_scenarios("docs/plan/justrl_32xh100_scenarios.json")
    robust = robust_split(inputs_json, scenarios, "streaming", gpus=32, eta=2)
    robust["trainers"], robust["worst_ratio"], robust["rows"]   # the rows: each scenario at that split

A scenarios file names variations of the inputs: {"NAME": {"scale": {"decode": 0.73}, "set": {"lengths": ...}}}.
`scale.decode` multiplies every decode time (step, context, prefill, the measured table), `scale.update` every
update time (fixed, per token, per response token, old logprobs); `set` replaces input fields. The base inputs are
the first row whether named or not. A split's score in a scenario is its mode's trained tokens/s against colocated
sync on all the GPUs in the same scenario (the claim the docs make); the robust split has the best worst score over
the scenarios, which the point estimate's best split need not have.
"""

from __future__ import annotations

import copy

from .plan import predict
from .plan_inputs import PlanInputs, PlanInputsError, read_json

SCALES = {"decode": ("decode",), "update": ("update_fixed_s", "update_s_per_token", "update_s_per_response_token",
                                            "logprob_s_per_token")}


def load_scenarios(path: str) -> dict[str, dict]:
    scenarios = read_json(path, "plan scenarios")
    if not isinstance(scenarios, dict) or not scenarios:
        raise PlanInputsError(f"plan scenarios: {path} must be a non-empty JSON object of named scenarios")
    for name, s in scenarios.items():
        if not isinstance(s, dict) or set(s) - {"scale", "set", "why"}:
            raise PlanInputsError(f"plan scenarios: `{name}` may have only `scale`, `set` and `why`, got {s!r:.80}")
        for key, factor in s.get("scale", {}).items():
            if key not in SCALES:
                raise PlanInputsError(f"plan scenarios: `{name}.scale.{key}` is not one of {', '.join(SCALES)}")
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < float("inf"):
                raise PlanInputsError(f"plan scenarios: `{name}.scale.{key}` must be a number > 0, got {factor!r}")
    return scenarios


def scenario_inputs(base: dict, scenario: dict) -> PlanInputs:
    """The base inputs (as JSON) varied by one scenario, checked as any inputs file is."""
    d = copy.deepcopy(base)
    d.update(copy.deepcopy(scenario.get("set", {})))
    for key, factor in scenario.get("scale", {}).items():
        for name in SCALES[key]:
            if name == "decode":
                d["decode"] = {k: ({b: s * factor for b, s in v.items()} if k == "by_seqs" and v else
                                   v * factor if isinstance(v, (int, float)) else v)
                               for k, v in d["decode"].items()}
            elif name in d:
                d[name] = d[name] * factor
    return PlanInputs.from_dict(d)


def robust_split(base: dict, scenarios: dict[str, dict], mode: str, *, gpus: int, eta: int = 1,
                 trainers: range | None = None, **kw) -> dict:
    """Over the splits of `gpus` (`trainers` of them train; all with 1 to gpus - 1 trainers by default), the one
    whose worst score over the scenarios is best, and the rows at it. A split's worst score is at most its base
    score, so the scenarios are planned only for splits whose base score still beats the best worst score found
    (best base first): the same choice as planning every split in every scenario, at a fraction of the cost."""
    inputs = {name: scenario_inputs(base, s) for name, s in {"base": {}, **scenarios}.items()}
    colocated = {name: predict(x, "colocated sync", trainers=gpus, **kw) for name, x in inputs.items()}

    def plan(name: str, t: int) -> dict:
        p = predict(inputs[name], mode, trainers=t, engines=gpus - t, eta=eta, **kw)
        return {**p, "ratio": p["trained_tokens_per_s"] / colocated[name]["trained_tokens_per_s"]}

    splits = {t: {"base": plan("base", t)} for t in trainers or range(1, gpus)}
    worst: dict[int, float] = {}
    for t in sorted(splits, key=lambda t: -splits[t]["base"]["ratio"]):
        if worst and splits[t]["base"]["ratio"] <= max(worst.values()):
            break
        splits[t].update({name: plan(name, t) for name in inputs if name != "base"})
        worst[t] = min(p["ratio"] for p in splits[t].values())
    best = max(worst, key=worst.get)
    point = max(splits, key=lambda t: splits[t]["base"]["ratio"])
    why = {"base": "", **{name: s.get("why", "") for name, s in scenarios.items()}}
    rows = [{"scenario": name, "colocated_step_s": colocated[name]["step_s"], **{k: splits[best][name][k] for k in (
        "step_s", "ratio", "trainer_idle_frac", "engine_idle_frac", "dropped_groups")}, "why": why[name]}
            for name in inputs]
    return {"mode": mode, "eta": eta, "gpus": gpus, "trainers": best, "engines": gpus - best,
            "worst_ratio": worst[best], "point_estimate_trainers": point,
            "point_estimate_ratio": splits[point]["base"]["ratio"],
            "point_estimate_worst_ratio": worst[point], "rows": rows, "worst_by_trainers": worst,
            "base_by_trainers": {t: s["base"]["ratio"] for t, s in splits.items()}}


def sensitivity_table(robust: dict) -> str:
    """Markdown: each scenario at the robust split, against colocated sync in the same scenario."""
    label = f"{robust['mode']}" + (f" eta={robust['eta']}" if robust["mode"] == "streaming" else "")
    lines = [f"| scenario | colocated sync s / step | {label} at {robust['trainers']} + {robust['engines']} s / step"
             f" | ratio | trainer idle | engine idle | dropped groups |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in robust["rows"]:
        name = r["scenario"] + (f" ({r['why']})" if r["why"] else "")
        lines.append(f"| {name} | {r['colocated_step_s']:.1f} | {r['step_s']:.1f} | {r['ratio']:.2f}x | "
                     f"{r['trainer_idle_frac']:.2f} | {r['engine_idle_frac']:.2f} | {r['dropped_groups']} |")
    lines.append(f"\nchosen for the best worst case: {robust['trainers']} + {robust['engines']} (worst "
                 f"{robust['worst_ratio']:.2f}x); the point estimate's best: {robust['point_estimate_trainers']} + "
                 f"{robust['gpus'] - robust['point_estimate_trainers']} ({robust['point_estimate_ratio']:.2f}x at "
                 f"the base inputs, worst {robust['point_estimate_worst_ratio']:.2f}x)")
    return "\n".join(lines)
