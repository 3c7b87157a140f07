"""`justrl-bench --phase train`: throughput of the policy's update step (and of old-logprob recomputation).

Random weights, random tokens, the real code path: `Policy.build` -> `compute_logprobs` (forward only) ->
`grpo_update` (one optimizer step over all samples). Reports tokens/s, achieved TFLOP/s per device, MFU and peak
memory, as JSON and as a table.

Model FLOPs (per device, what MFU divides by the peak): forward = 2 x (matmul parameters of the decoder) per token
+ causal attention 4 x heads x head_dim x L(L+1)/2 per sequence + the output projection 2 x hidden x vocab per
position whose logprob is computed; an update is 3 x forward (recomputation, if on, is not counted: it is hardware
FLOPs, not model FLOPs).

    justrl-bench --phase train model=deepseek-r1-distill-qwen-1.5b tokens=16384        # one 16K sequence, GPU
    justrl-bench --phase train                                                          # tiny model on the CPU
    torchrun --nproc-per-node 2 -m justrl_megatron.bench.train tp=2 sp=true
    torchrun --nproc-per-node 2 -m justrl_megatron.bench.train cp=2 tokens=16384 seq_len=16384  # context parallel
"""

from __future__ import annotations

import inspect
import json
import os
import random
import resource
import statistics
import sys
import time

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import torch
import torch.distributed as dist

from .. import compat
from ..model.hf_config import ModelShape, model_shape, num_parameters, padded_vocab_size
from .flops import PEAK_BF16_TFLOPS, device_peak_tflops, forward_flops, throughput  # noqa: F401  (re-exported)

BUILTIN_SHAPES = {
    "tiny": ModelShape(family="qwen2", num_layers=4, hidden_size=256, ffn_hidden_size=704, num_attention_heads=4,
                       num_query_groups=2, head_dim=64, vocab_size=4096, max_position_embeddings=4096,
                       rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=True, tie_word_embeddings=False,
                       init_std=0.02),
    "deepseek-r1-distill-qwen-1.5b": ModelShape(
        family="qwen2", num_layers=28, hidden_size=1536, ffn_hidden_size=8960, num_attention_heads=12,
        num_query_groups=2, head_dim=128, vocab_size=151936, max_position_embeddings=131072, rope_theta=10000.0,
        rms_norm_eps=1e-6, qkv_bias=True, tie_word_embeddings=False, init_std=0.02),
    "smollm2-135m": ModelShape(
        family="llama", num_layers=30, hidden_size=576, ffn_hidden_size=1536, num_attention_heads=9,
        num_query_groups=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
        rms_norm_eps=1e-5, qkv_bias=False, tie_word_embeddings=True, init_std=0.041666666666666664),
    # the published configs of these models map to exactly these shapes (tests/test_model_families.py)
    "qwen2.5-math-1.5b": ModelShape(
        family="qwen2", num_layers=28, hidden_size=1536, ffn_hidden_size=8960, num_attention_heads=12,
        num_query_groups=2, head_dim=128, vocab_size=151936, max_position_embeddings=4096, rope_theta=10000.0,
        rms_norm_eps=1e-6, qkv_bias=True, tie_word_embeddings=True, init_std=0.02),
    "qwen3-1.7b": ModelShape(
        family="qwen3", num_layers=28, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=16,
        num_query_groups=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
        rms_norm_eps=1e-6, qkv_bias=False, tie_word_embeddings=True, init_std=0.02, qk_norm=True),
    "llama-3.2-1b-instruct": ModelShape(
        family="llama", num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
        num_query_groups=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        rms_norm_eps=1e-5, qkv_bias=False, tie_word_embeddings=True, init_std=0.02, rope_type="llama3",
        rope_factor=32.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_positions=8192),
}


def resolve_shape(model) -> ModelShape:
    if isinstance(model, ModelShape):  # a shape made by the caller (gpu_check's MoE slice)
        return model
    if model in BUILTIN_SHAPES:
        return BUILTIN_SHAPES[model]
    from transformers import AutoConfig

    from ..assets import resolve_model_path

    try:
        return model_shape(AutoConfig.from_pretrained(str(resolve_model_path(model))))
    except OSError as err:
        raise ValueError(f"model={model!r} is neither a built-in shape {sorted(BUILTIN_SHAPES)} nor an HF folder "
                         f"with a config.json ({err})") from err


def peak_tflops(dtype: torch.dtype) -> float | None:
    if not compat.cuda_available() or dtype != torch.bfloat16:
        return None
    return device_peak_tflops(torch.cuda.get_device_name(), "bfloat16")


def _sync():
    if compat.cuda_available():
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()


def _peak_memory_gib() -> tuple[str, float]:
    if compat.cuda_available():
        local = torch.cuda.max_memory_allocated() / 2**30
        kind = "gpu_peak_allocated_gib"
    else:
        local = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
        kind = "cpu_peak_rss_gib"
    t = torch.tensor([local], dtype=torch.float64, device=compat.default_device())
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return kind, float(t.item())


def _time_optimizer_steps(policy) -> list[float]:
    """Times every `policy.optimizer.step()` from now on (synchronized before and after: the update's own time is
    then the sum of its forward+backward and this); returns the list it appends to."""
    times, step = [], policy.optimizer.step

    def timed_step(*args, **kwargs):
        _sync()
        t0 = time.perf_counter()
        out = step(*args, **kwargs)
        _sync()
        times.append(time.perf_counter() - t0)
        return out

    policy.optimizer.step = timed_step
    policy.optimizer.justrl_untimed_step = step  # sync_counts counts without the timer's own synchronizations
    return times


SYNC_MESSAGE = "synchronizing CUDA operation"  # what torch's sync debug mode warns at each device-to-host sync


def count_syncs(fn, *args, **kwargs):
    """Runs `fn(*args, **kwargs)` under `torch.cuda.set_sync_debug_mode("warn")`: (its result, the number of
    device-to-host syncs it made, where each came from as 'file:line'). Work queued before is drained first, so that
    none of it is charged to `fn` (not inside another count, which would be charged the drain)."""
    import warnings

    before = torch.cuda.get_sync_debug_mode()
    if not before:
        torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the default filter would show each call site once
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(before)
    where = [f"{w.filename}:{w.lineno}" for w in caught if SYNC_MESSAGE in str(w.message)]
    return result, len(where), where


def sync_counts(policy, fn) -> dict:
    """{"update": device-to-host syncs while fn() runs, "optimizer_step": those inside policy.optimizer.step(),
    "where": the most frequent call sites}."""
    timed = policy.optimizer.step
    step = getattr(policy.optimizer, "justrl_untimed_step", timed)  # without the timer's own synchronizations
    inside: list[str] = []

    def counted_step(*args, **kwargs):
        out, _, where = count_syncs(step, *args, **kwargs)  # (a count of its own: the outer one does not see them)
        inside.extend(where)
        return out

    policy.optimizer.step = counted_step
    try:
        _, _, outside = count_syncs(fn)
    finally:
        policy.optimizer.step = timed
    where = {}
    for site in outside + inside:
        key = os.path.basename(site)
        where[key] = where.get(key, 0) + 1
    return {"update": len(outside) + len(inside), "optimizer_step": len(inside),
            "where": dict(sorted(where.items(), key=lambda kv: -kv[1])[:12])}


def saved_activation_bytes(policy, fn):
    """(fn(), bytes autograd saved for backward during it): distinct storages other than the parameters, saved by
    forward passes, i.e. the activations of the micro-batch (summed over micro-batches when there are several).
    What a backward pass saves while it recomputes (full recompute, the CP attention's blocks) is transient and not
    counted."""
    params = {p.untyped_storage().data_ptr() for c in policy.chunks for p in c.parameters()}
    storages = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and torch._C._current_graph_task_id() == -1:  # -1: not inside a backward
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(storages.values())


def bench_train(*, model: str = "tiny", tokens: int | None = None, seq_len: int | None = None,
                prompt_len: int | None = None, tp: int = 1, pp: int = 1, vpp: int | None = None, sp: bool = False,
                dtype: str = "auto", transformer_impl: str = "auto", recompute: str = "none", steps: int = 3,
                warmup: int = 1, max_tokens_per_micro_batch: int | None = None, distributed_optimizer: bool = True,
                peak: float | None = None, seed: int = 0, cp: int = 1, measure_activations: bool = False,
                attention_backend: str = "auto", count_syncs: bool = False, samples: list | None = None,
                shared_prompt: str = "off", fast_paths: dict | None = None, moe_grouped_gemm: bool = False,
                fp8: bool = False) -> dict:
    """Benchmark one policy update. ``tokens``: tokens per model replica per step (default 16384 on GPU, 2048 on
    CPU), as sequences of ``seq_len`` (default: one sequence of all of them on GPU, 512 on CPU) whose first
    ``prompt_len`` tokens are the prompt. ``peak``: the device's peak TFLOP/s, when not in the built-in table.
    ``cp``: context parallelism (each sequence split over ``cp`` ranks; a replica is TP x PP x CP ranks).
    ``measure_activations``: the last timed update runs under `saved_activation_bytes` (a Python call per saved
    tensor: negligible); reported per rank, the max over ranks. ``count_syncs`` (CUDA): one more update, untimed,
    counting device-to-host syncs (`sync_counts`) in the whole update and in its optimizer step. ``samples``: this
    batch instead of the random one (bench/packed_shape.py's JustRL shape; ``tokens`` and ``seq_len`` are then
    ignored), with ``shared_prompt`` (trainer.shared_prompt) its FLOPs count each prompt once. ``fast_paths``,
    ``moe_grouped_gemm``, ``fp8``: the model settings of those names (Policy.build)."""
    from megatron.core import parallel_state as ps

    from ..distributed import init_distributed
    from ..model.policy import Policy
    from ..train.batching import Sample
    from ..train.step import compute_logprobs, grpo_update

    on_gpu = compat.cuda_available()
    tokens = tokens or (16384 if on_gpu else 2048)
    seq_len = seq_len or (tokens if on_gpu else min(512, tokens))
    if tokens % seq_len:
        raise ValueError(f"tokens={tokens} must be a multiple of seq_len={seq_len}")
    prompt_len = prompt_len or max(1, min(1024, seq_len // 16))
    if not 0 < prompt_len < seq_len:
        raise ValueError(f"prompt_len={prompt_len} must be in [1, seq_len={seq_len})")
    shape = resolve_shape(model)
    init_distributed()
    policy = Policy.build(shape, tp=tp, pp=pp, vpp=vpp, sequence_parallel=sp, dtype=dtype,
                          transformer_impl=transformer_impl, recompute=recompute, lr=1e-6, warmup_steps=0,
                          weight_decay=0.1, grad_clip=1.0, distributed_optimizer=distributed_optimizer, seed=seed,
                          max_sequence_length=max(seq_len, shape.max_position_embeddings,
                                                  *(x.length for x in samples or ())), cp=cp,
                          attention_backend=attention_backend, shared_prompt=shared_prompt, fast_paths=fast_paths,
                          moe_grouped_gemm=moe_grouped_gemm, fp8=fp8)
    t_optimizer = _time_optimizer_steps(policy)
    dp = ps.get_data_parallel_world_size()
    world = dist.get_world_size()
    _, rss_after_build = _peak_memory_gib()
    rng = random.Random(seed)
    samples = samples or [Sample(prompt_ids=[rng.randrange(shape.vocab_size) for _ in range(prompt_len)],
                                 response_ids=[rng.randrange(shape.vocab_size) for _ in range(seq_len - prompt_len)],
                                 advantage=rng.choice([-1.0, 1.0]), group=i)
                          for i in range(dp * tokens // seq_len)]
    budget = max_tokens_per_micro_batch or tokens
    kw = dict(max_tokens_per_micro_batch=budget)

    def logprob_pass():
        return compute_logprobs(policy, samples, **kw)

    def update_pass(old):
        return grpo_update(policy, samples, old, mini_batch_size=len(samples), **kw)

    old = logprob_pass()
    for _ in range(warmup):
        logprob_pass()
        update_pass(old)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    _sync()
    t_logprob, t_update, metrics = [], [], {}
    for _ in range(steps):  # each step timed on its own: the bench CLI reports median, min and max
        t0 = time.perf_counter()
        logprob_pass()
        _sync()
        t_logprob.append(time.perf_counter() - t0)
    saved = 0
    t_optimizer.clear()
    for i in range(steps):
        t0 = time.perf_counter()
        if measure_activations and i == steps - 1:
            metrics, saved = saved_activation_bytes(policy, lambda: update_pass(old))
        else:
            metrics = update_pass(old)
        _sync()
        t_update.append(time.perf_counter() - t0)
    mem_kind, mem = _peak_memory_gib()
    extra = {f"{mem_kind.replace('_gib', '')}_after_build_gib": rss_after_build}
    if count_syncs and on_gpu:
        extra["syncs"] = sync_counts(policy, lambda: update_pass(old))
    if measure_activations:
        t = torch.tensor([saved / 2**30], dtype=torch.float64, device=compat.default_device())
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        extra["saved_activations_gib"] = float(t.item())

    vocab = padded_vocab_size(shape.vocab_size, tp, 128)
    if policy.shared_prompt:  # each group's prompt runs once
        from .packed_shape import shared_prompt_forward_flops

        fwd = shared_prompt_forward_flops(shape, samples, vocab)
    else:
        fwd = forward_flops(shape, [s.length for s in samples], sum(len(s.response_ids) for s in samples), vocab)
    total_tokens = sum(s.length for s in samples) - (
        sum(len(s.prompt_ids) for s in samples) - sum(len(p) for p in {tuple(s.prompt_ids) for s in samples})
        if policy.shared_prompt else 0)  # the tokens the model runs
    peak_tf = peak or peak_tflops(policy.dtype)

    def phase(times, flops):  # figures at the median step time; every step's time kept
        return {**throughput(flops=flops, tokens=total_tokens, seconds=statistics.median(times), devices=world,
                             peak=peak_tf), "time_s_all": times}

    # the update without its optimizer step: at one sequence per step the step's share is far larger than at
    # JustRL's ~100K tokens per GPU per step with the optimizer sharded over 32 ranks
    t_fwd_bwd = [u - o for u, o in zip(t_update, t_optimizer)] if len(t_optimizer) == len(t_update) else []

    return {
        "phase": "train", "model": model if isinstance(model, str) else shape.family,
        "parameters": num_parameters(shape),
        "device": torch.cuda.get_device_name() if on_gpu else "cpu", "world_size": world,
        "tp": tp, "pp": pp, "vpp": vpp, "cp": cp, "dp": dp, "sequence_parallel": bool(policy.config.sequence_parallel),
        "dtype": str(policy.dtype).replace("torch.", ""), "transformer_impl": policy.transformer_impl,
        "recompute": recompute, "distributed_optimizer": distributed_optimizer,
        "tokens_per_step": total_tokens, "seq_len": seq_len, "prompt_len": prompt_len, "num_sequences": len(samples),
        "max_tokens_per_micro_batch": budget, "micro_batches": metrics.get("num_micro_batches"),
        "peak_tflops": peak_tf, "update": phase(t_update, 3 * fwd), "logprob": phase(t_logprob, fwd),
        "fwd_bwd": phase(t_fwd_bwd, 3 * fwd) if t_fwd_bwd else None,
        "optimizer_s": statistics.median(t_optimizer) if t_optimizer else None, "optimizer_s_all": t_optimizer,
        "attention_backend": policy.fast_paths.attention_backend, "shared_prompt": policy.shared_prompt,
        "moe_grouped_gemm": moe_grouped_gemm, "fp8": fp8,
        mem_kind: mem, **extra, "grad_norm": metrics.get("grad_norm"), "loss": metrics.get("loss"),
    }


def _coerce(value: str, default):
    if isinstance(default, bool):
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"expected true/false, got {value!r}")
        return value.lower() in ("true", "1", "yes")
    if value.lower() in ("none", "null"):
        return None
    if isinstance(default, int) or default is None and value.lstrip("-").isdigit():
        return int(value)
    if isinstance(default, float) or default is None and value.replace(".", "", 1).isdigit():
        return float(value)
    return value


def parse_args(argv: list[str]) -> dict:
    """``key=value`` (also ``--key=value`` / ``--key value``) pairs -> bench_train keyword arguments."""
    params = inspect.signature(bench_train).parameters
    out, i = {}, 0
    while i < len(argv):
        arg = argv[i].lstrip("-")
        if "=" in arg:
            key, value = arg.split("=", 1)
        elif i + 1 < len(argv):
            key, value = arg, argv[i + 1]
            i += 1
        else:
            raise ValueError(f"argument {argv[i]!r} has no value")
        key = key.replace("-", "_")
        if key not in params:
            raise ValueError(f"unknown option {key!r}; known: {sorted(params)}")
        out[key] = _coerce(value, params[key].default)
        i += 1
    return out


def print_report(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    print(json.dumps(result))
    table = Table(title=f"train step: {result['model']} on {result['device']} ({result['dtype']}, "
                        f"{result['transformer_impl']}, TP{result['tp']} PP{result['pp']} CP{result.get('cp', 1)} "
                        f"DP{result['dp']})")
    for col in ("phase", "time (s)", "tokens/s", "TFLOP/s/device", "MFU"):
        table.add_column(col, justify="right")
    for name in ("logprob", "update", "fwd_bwd"):
        p = result.get(name)
        if p is None:
            continue
        table.add_row(name, f"{p['time_s']:.3f}", f"{p['tokens_per_s']:,.0f}", f"{p['tflops_per_device']:.3f}",
                      "n/a" if p["mfu"] is None else f"{100 * p['mfu']:.1f}%")
    Console().print(table)
    mem = next(k for k in result if k.endswith("_gib"))
    Console().print(f"{result['tokens_per_step']} tokens/step ({result['num_sequences']} x {result['seq_len']}), "
                    f"{result['micro_batches']} micro-batches; {mem} = {result[mem]:.2f}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print("options:", ", ".join(f"{k}={p.default!r}" for k, p in inspect.signature(bench_train).parameters.items()))
        return 0
    result = bench_train(**parse_args(argv))
    if not dist.is_initialized() or dist.get_rank() == 0:
        print_report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
