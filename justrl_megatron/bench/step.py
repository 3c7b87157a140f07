"""`justrl-bench --phase step`: end-to-end GRPO steps of the real loop, timed from its own metrics.

Runs `justrl-train` (the real loop: vLLM rollout, rewards, old logprobs, update, weight sync) as a child process in a
fresh run dir for `warmup + repeats` steps, then reads run_dir/metrics.jsonl and keeps the last `repeats` steps.
The step time quoted is the wall time between the ends of consecutive steps (everything the loop does per step,
logging included); the loop's own phase timers split it. Checkpoints and the held-out evaluation are switched off
(except the final checkpoint, which lands after the last timed step).

    bench_step()                                               # the embedded demo: SmolLM2-135M, 8 x 4 x 64 tokens
    bench_step(model="/models/DeepSeek-R1-Distill-Qwen-1.5B", prompts=64, n=8, response_len=4096, nproc=8)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Per-step phase timers the loop writes (time/<name>_s); rollout: the step's generation as the trainer saw it (its
# wait for finished groups, scoring aside), wait_rollout: the same wait, rollout_idle: the engines' seconds without
# work (waiting for prompts or weights), summed over the engines.
LOOP_PHASES = ("rollout", "reward", "old_logprob", "update", "sync", "wait_rollout", "rollout_idle")


def train_overrides(*, model: str | None = None, prompts: int | None = None, n: int | None = None,
                    response_len: int | None = None, total_steps: int, run_dir: str | os.PathLike,
                    extra: list[str] | tuple = ()) -> list[str]:
    """Hydra overrides for a benchmark run of justrl-train: sizes from the flags (recipe defaults where not given),
    one optimizer step per GRPO step, no periodic checkpoints, no held-out evaluation, no wandb."""
    out = [f"trainer.run_dir={run_dir}", f"trainer.total_steps={total_steps}", f"trainer.save_every={10**9}",
           "trainer.eval_samples=0", "logging.wandb_mode=disabled", "logging.progress=false"]
    if model is not None:
        out.append(f"model.path={model}")
    if prompts is not None:
        out += [f"trainer.prompts_per_step={prompts}", f"trainer.mini_batch_size={prompts}"]
    if n is not None:
        out.append(f"rollout.n={n}")
    if response_len is not None:
        out.append(f"rollout.max_response_length={response_len}")
    out += list(extra)  # the caller's own overrides win (hydra: the last one counts)
    if response_len is not None and not any(o.startswith("trainer.max_tokens_per_micro_batch=") for o in extra):
        from ..config.schema import compose

        cfg = compose(out)  # a micro-batch must hold one whole sample
        need = cfg.data.max_prompt_length + response_len
        if cfg.trainer.max_tokens_per_micro_batch < need:
            out.append(f"trainer.max_tokens_per_micro_batch={need}")
    return out


def _command(overrides: list[str], nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "justrl_megatron.cli", "train", *overrides]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "justrl_megatron.cli", "train", *overrides]


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run_train(cmd: list[str], env: dict, run_dir: Path, total_steps: int, timeout_s: float, progress: bool) -> None:
    """Run justrl-train, its output to run_dir/bench_step.log; a progress bar follows metrics.jsonl."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    log_path = run_dir / "bench_step.log"
    with log_path.open("w") as log, Progress(TextColumn("justrl-train"), BarColumn(), MofNCompleteColumn(),
                                             TimeElapsedColumn(), disable=not progress, transient=True) as bar:
        task = bar.add_task("steps", total=total_steps)
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout_s
        try:
            while proc.poll() is None:
                if time.time() > deadline:
                    raise TimeoutError(f"justrl-train ran past {timeout_s:.0f} s (log: {log_path})")
                bar.update(task, completed=len(read_metrics(run_dir)))
                time.sleep(1.0)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)  # its own session: the run and its vLLM / reward workers
                proc.wait()
    if proc.returncode != 0:
        tail = log_path.read_text()[-6000:]
        raise RuntimeError(f"justrl-train exited with {proc.returncode}; end of {log_path}:\n{tail}")


def summarise_steps(records: list[dict], *, warmup: int, world_size: int, samples_per_step: int) -> dict:
    """Per-step figures of the timed steps (records after the first `warmup`), each a list over steps."""
    if len(records) <= warmup:
        raise ValueError(f"metrics.jsonl has {len(records)} steps; need more than warmup={warmup}")
    per_step = {k: [] for k in ("step_s", "loop_step_s", "tokens", "generated_tokens", "tokens_per_s_per_device",
                                "generated_tokens_per_s", "trained_tokens_per_s",
                                *(f"{p}_s" for p in LOOP_PHASES))}
    for i in range(warmup, len(records)):
        r = records[i]
        loop_s = r["time/step_s"]
        # wall time between the ends of consecutive steps; the first step of a run has no predecessor
        step_s = r["time"] - records[i - 1]["time"] if i > 0 else loop_s
        tokens = r["throughput/tokens_per_s"] * loop_s  # prompt + response tokens of the batch
        generated = r["response/length_mean"] * samples_per_step
        per_step["step_s"].append(step_s)
        per_step["loop_step_s"].append(loop_s)
        per_step["tokens"].append(tokens)
        per_step["generated_tokens"].append(generated)
        per_step["tokens_per_s_per_device"].append(tokens / step_s / world_size)
        # streaming has no rollout phase of its own (the engines never stop): its generation rate is end to end
        per_step["generated_tokens_per_s"].append(generated / r.get("time/rollout_s", step_s))
        per_step["trained_tokens_per_s"].append(tokens / r["time/update_s"])
        for p in LOOP_PHASES:
            per_step[f"{p}_s"].append(r.get(f"time/{p}_s", 0.0))  # a phase the loop skipped took no time
    per_step["reward_mean"] = [r.get("reward/mean") for r in records[warmup:]]
    per_step["response_length_mean"] = [r.get("response/length_mean") for r in records[warmup:]]
    return per_step


def bench_step(*, model: str | None = None, prompts: int | None = None, n: int | None = None,
               response_len: int | None = None, warmup: int = 1, repeats: int = 3, nproc: int = 1,
               overrides: list[str] | tuple = (), threads: int | None = None, run_dir: str | None = None,
               timeout_s: float = 3600, progress: bool = True, keep_records: bool = False) -> dict:
    """Time `repeats` GRPO steps of justrl-train after `warmup` steps. ``model``: an HF folder or builtin:<name>
    (default: the recipe's); ``overrides``: more hydra overrides (e.g. ``recipe=justrl_deepseek_1p5b``)."""
    if warmup < 0 or repeats < 1 or nproc < 1:
        raise ValueError(f"need warmup >= 0, repeats >= 1, nproc >= 1 (got {warmup}, {repeats}, {nproc})")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("--phase step launches justrl-train itself: run justrl-bench without torchrun and pass "
                         "--nproc N")
    own_dir = run_dir is None
    run_path = Path(run_dir or tempfile.mkdtemp(prefix="justrl-bench-step-"))
    if not own_dir and run_path.exists() and any(run_path.iterdir()):
        raise ValueError(f"run_dir {run_path} is not empty: justrl-train would resume from it; give a new folder")
    run_path.mkdir(parents=True, exist_ok=True)
    total = warmup + repeats
    args = train_overrides(model=model, prompts=prompts, n=n, response_len=response_len, total_steps=total,
                           run_dir=run_path, extra=overrides)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    try:
        t0 = time.perf_counter()
        _run_train(_command(args, nproc), env, run_path, total, timeout_s, progress)
        wall = time.perf_counter() - t0
        from omegaconf import OmegaConf

        from ..dtypes import dtype_name

        cfg = OmegaConf.load(run_path / "hydra" / "config.yaml")
        samples = int(cfg.trainer.prompts_per_step) * int(cfg.rollout.n)
        records = read_metrics(run_path)
        per_step = summarise_steps(records, warmup=warmup, world_size=nproc, samples_per_step=samples)
    finally:
        if own_dir:
            shutil.rmtree(run_path, ignore_errors=True)
    return {"phase": "step", "model": str(cfg.model.path), "device": _device_name(), "world_size": nproc,
            "tp": int(cfg.parallel.tensor), "pp": int(cfg.parallel.pipeline), "dtype": dtype_name(str(cfg.model.dtype)),
            "prompts": int(cfg.trainer.prompts_per_step), "n": int(cfg.rollout.n),
            "max_response_length": int(cfg.rollout.max_response_length), "samples_per_step": samples,
            "optimizer_steps_per_step": int(cfg.trainer.prompts_per_step) // int(cfg.trainer.mini_batch_size),
            "warmup": warmup, "repeats": repeats, "threads": int(env.get("OMP_NUM_THREADS") or os.cpu_count()),
            "overrides": args,
            "process_wall_s": wall, "per_step": per_step, **({"records": records} if keep_records else {})}


def _device_name() -> str:
    import torch

    from .. import compat

    return torch.cuda.get_device_name() if compat.cuda_available() else "cpu"
