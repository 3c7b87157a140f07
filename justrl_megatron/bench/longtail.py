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


def sample_lengths(model: str | None, prompts: int = 16, n: int = 4, seed: int = 1) -> list[int]:
    """The workload's response lengths from one batch of the initial model (an in-process vLLM engine)."""
    from transformers import AutoTokenizer

    from .. import assets
    from ..config import compose
    from ..rollout import SamplingConfig
    from ..rollout.vllm_engine import VLLMEngine
    from ..data.sampler import load_training_rows, tokenize_prompts

    cfg = compose([w for w in WORKLOAD if not w.startswith("rollout.placement") and "num_rollout" not in w])
    model = model or str(assets.smollm2_135m_instruct())
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows, _ = tokenize_prompts(load_training_rows(cfg.data, seed=cfg.trainer.seed), tokenizer, cfg.data)
    engine = VLLMEngine(model, dtype="float32", max_model_len=cfg.data.max_prompt_length + LONGTAIL_TOKENS,
                        enforce_eager=True)
    try:
        got = engine.generate([p.ids for p in rows[:prompts]], n,
                              SamplingConfig(max_tokens=LONGTAIL_TOKENS, temperature=cfg.rollout.temperature),
                              seed=seed)
    finally:
        engine.shutdown()
    return [len(t) for t in got.token_ids]


def bench_longtail(*, model: str | None = None, warmup: int = 1, repeats: int = 3, modes=None,
                   steps_override: list[str] | tuple = (), histogram: bool = True, progress: bool = True) -> dict:
    """Each mode's `warmup + repeats` steps (justrl-train, 2 processes), then the figures side by side."""
    from .step import bench_step

    raw = {"modes": {}, "workload": list(WORKLOAD) + list(steps_override)}
    for name in modes or MODES:
        run = bench_step(model=model, warmup=0, repeats=warmup + repeats, nproc=2,
                         overrides=[*WORKLOAD, *MODES[name], *steps_override], progress=progress,
                         keep_records=True)
        raw["modes"][name] = {"figures": mode_figures(run["records"], warmup), "process_wall_s": run["process_wall_s"]}
    if histogram:
        lengths = sample_lengths(model)
        raw["lengths"] = lengths
        raw["histogram"] = length_histogram(lengths)
    med = {name: {k: statistics.median(v) for k, v in m["figures"].items()} for name, m in raw["modes"].items()}
    raw["median"] = med
    if "streaming eta=1" in med and "one-step-off" in med:
        raw["ratio_streaming1_vs_one_step_off"] = (med["streaming eta=1"]["trained_tokens_per_s"]
                                                   / med["one-step-off"]["trained_tokens_per_s"])
    return raw
