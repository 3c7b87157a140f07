"""`justrl-bench --phase rollout` (generated tokens/s) and `--phase sync` (seconds and GB/s per weight sync).

rollout: the VLLMEngine samples `prompts x n` responses of exactly `max_tokens` tokens (EOS ignored, so every run
generates the same number of tokens) from random prompts; reports generated tokens/s (median of `repeats`).

sync: the colocated weight sync of a training step, end to end — Megatron's streaming export of a live policy
(convert/export.py: TP gather, HF names, buckets) into the engine's `update_weights` (vLLM's layerwise reload), with
the engine asleep before (GPU) as in training — for each bucket size of the sweep; also the export alone, to split
the cost. `source="hf"` streams the HF folder's tensors instead (no Megatron).

    bench_rollout(model="tiny")                               # tiny random Qwen2 on the CPU
    bench_sync(model="/models/DeepSeek-R1-Distill-Qwen-1.5B", bucket_mb=(64, 256, 512, 1024))   # GPU target: <= 0.2 s
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import torch

from .. import compat

TINY = dict(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=704, vocab_size=4096,
            max_position_embeddings=4096)


def resolve_model_dir(model: str) -> Path:
    """"tiny" (a random Qwen2 built once into a temp folder), "builtin:<name>", or an HF folder."""
    if model == "tiny":
        from ..assets import _build_once, tiny_model

        return _build_once("bench-tiny-qwen2", lambda out: tiny_model(out, "qwen2", **TINY))
    from ..assets import resolve_model_path

    return resolve_model_path(model)


def _device_name() -> str:
    return torch.cuda.get_device_name() if compat.cuda_available() else "cpu"


def _engine(model_dir, dtype, tensor_parallel, max_model_len, bucket_bytes=None):
    from ..rollout.vllm_engine import VLLMEngine

    kw = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    return VLLMEngine(model_dir, dtype=dtype, tensor_parallel=tensor_parallel, seed=0, max_model_len=max_model_len,
                      enforce_eager=not compat.cuda_available(), **kw)


def bench_rollout(*, model: str = "tiny", prompts: int | None = None, n: int = 4, prompt_len: int = 64,
                  max_tokens: int | None = None, dtype: str = "auto", tensor_parallel: int = 1, repeats: int = 3,
                  seed: int = 0) -> dict:
    """Generated tokens/s of the rollout engine (temperature 1, full vocabulary, as in training)."""
    from ..rollout import SamplingConfig

    on_gpu = compat.cuda_available()
    prompts = prompts or (256 if on_gpu else 8)
    max_tokens = max_tokens or (4096 if on_gpu else 64)
    model_dir = resolve_model_dir(model)
    engine = _engine(model_dir, dtype, tensor_parallel, prompt_len + max_tokens)
    g = torch.Generator().manual_seed(seed)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    batch = torch.randint(0, vocab, (prompts, prompt_len), generator=g).tolist()
    sampling = SamplingConfig(max_tokens=max_tokens, ignore_eos=True)
    engine.generate(batch[:2], 1, SamplingConfig(max_tokens=4))  # warm-up
    times, generated = [], 0
    for r in range(repeats):
        t0 = time.perf_counter()
        out = engine.generate_all(batch, n, sampling, seed=seed + r)
        times.append(time.perf_counter() - t0)
        generated = out.num_tokens
    seconds = statistics.median(times)
    result = {"phase": "rollout", "model": str(model), "device": _device_name(), "dtype": dtype,
              "tensor_parallel": tensor_parallel, "engines": engine.num_engines, "prompts": prompts, "n": n,
              "prompt_len": prompt_len, "max_tokens": max_tokens, "generated_tokens": generated,
              "seconds_median": seconds, "seconds_all": times, "tokens_per_s": generated / seconds}
    engine.shutdown()
    return result


def _megatron_source(model_dir, dtype: str, tp: int):
    """A live policy (random weights: the sync moves bytes, their values do not matter) and its streaming export."""
    from transformers import AutoConfig

    from ..convert.export import export_hf_stream
    from ..model.hf_config import model_shape
    from ..model.policy import Policy

    shape = model_shape(AutoConfig.from_pretrained(model_dir))
    policy = Policy.build(shape, tp=tp, dtype=dtype, distributed_optimizer=False)

    def stream(bucket_bytes):
        return export_hf_stream(policy.chunks, shape, bucket_bytes=bucket_bytes, include_tied_lm_head=True)
    return stream


def _hf_source(model_dir):
    from safetensors.torch import load_file

    device = compat.default_device()
    tensors = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update({k: v.to(device) for k, v in load_file(str(f)).items()})

    def stream(bucket_bytes):
        return iter(tensors.items())
    return stream


def bench_sync(*, model: str = "tiny", source: str = "megatron", bucket_mb=(1, 16, 64, 256), dtype: str = "auto",
               megatron_tp: int = 1, tensor_parallel: int = 1, repeats: int = 3) -> dict:
    """Seconds and GB/s of one weight sync per bucket size (median of `repeats`), with the export time alone."""
    from ..distributed import init_distributed

    if source not in ("megatron", "hf"):
        raise ValueError(f"source must be megatron (live policy export) or hf (the folder's tensors), got {source!r}")
    init_distributed()
    model_dir = resolve_model_dir(model)
    stream_for = _megatron_source(model_dir, dtype, megatron_tp) if source == "megatron" else _hf_source(model_dir)
    engine = _engine(model_dir, dtype, tensor_parallel, max_model_len=256)
    version = 0
    rows = []
    for mb in bucket_mb:
        bucket_bytes = int(mb * 2**20)
        engine.bucket_bytes = bucket_bytes
        export_s, sync_s, wake_s, nbytes, nbuckets = [], [], [], 0, 0
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in stream_for(bucket_bytes):  # the export alone (its collectives and copies)
                pass
            _sync_device()
            export_s.append(time.perf_counter() - t0)
            engine.sleep()  # as in training: the engine sleeps while Megatron works (GPU; a no-op on CPU)
            version += 1
            t0 = time.perf_counter()
            stats = engine.update_weights(stream_for(bucket_bytes), version)
            _sync_device()
            sync_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            engine.wake_up()  # the KV cache comes back after the sync
            _sync_device()
            wake_s.append(time.perf_counter() - t0)
            nbytes, nbuckets = stats["bytes"], stats["buckets"]
        med = statistics.median(sync_s)
        rows.append({"bucket_mb": mb, "buckets": nbuckets, "bytes": nbytes, "sync_s": med,
                     "sync_gb_per_s": nbytes / med / 1e9, "export_only_s": statistics.median(export_s),
                     "wake_kv_s": statistics.median(wake_s), "sync_s_all": sync_s})
    engine.shutdown()
    return {"phase": "sync", "model": str(model), "source": source, "device": _device_name(), "dtype": dtype,
            "megatron_tp": megatron_tp, "rollout_tp": tensor_parallel, "backend": engine.backend, "rows": rows}


def _sync_device():
    if compat.cuda_available():
        torch.cuda.synchronize()


def print_report(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    print(json.dumps(result))
    if result["phase"] == "rollout":
        Console().print(f"rollout: {result['model']} on {result['device']}: {result['generated_tokens']} tokens "
                        f"({result['prompts']} prompts x {result['n']} x {result['max_tokens']}) in "
                        f"{result['seconds_median']:.2f} s = {result['tokens_per_s']:,.0f} generated tokens/s")
        return
    table = Table(title=f"weight sync: {result['model']} ({result['source']} -> vLLM {result['backend']}) on "
                        f"{result['device']}, {result['dtype']}")
    for col in ("bucket MB", "buckets", "GB", "sync s", "GB/s", "export only s", "wake KV s"):
        table.add_column(col, justify="right")
    for r in result["rows"]:
        table.add_row(str(r["bucket_mb"]), str(r["buckets"]), f"{r['bytes'] / 1e9:.3f}", f"{r['sync_s']:.3f}",
                      f"{r['sync_gb_per_s']:.2f}", f"{r['export_only_s']:.3f}", f"{r['wake_kv_s']:.3f}")
    Console().print(table)
