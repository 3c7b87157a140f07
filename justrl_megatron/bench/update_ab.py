"""Same-card A/B of one model setting (gpu_check's `moe` and `fp8` stages): the update's speed both ways
(bench/train.bench_train on the same batch) and the loss and grad norm of N updates on fixed data both ways, held
to a stated tolerance.

A trajectory starts both policies from the same weights (same seed) and feeds them the same samples with the same
old log-probs, so the only difference between the two runs is the setting: grouped experts must track the sequential
experts within bf16 rounding; FP8 within what its e4m3 rounding costs (TOLERANCES).
"""

from __future__ import annotations

import gc
import random

from .. import compat
from ..model.hf_config import ModelShape

# Qwen3-30B-A3B at full width, EP1: 2 of its 48 layers (128 experts, top-8, expert SwiGLU 768, hidden 2048, 32 query
# heads over 4 KV groups, q/k norms), its whole vocabulary
QWEN3_30B_A3B_SLICE = ModelShape(
    family="qwen3_moe", num_layers=2, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
    num_query_groups=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
    rms_norm_eps=1e-6, qkv_bias=False, tie_word_embeddings=False, init_std=0.02, qk_norm=True, num_experts=128,
    moe_top_k=8, moe_ffn_hidden_size=768, moe_norm_topk_prob=True, moe_aux_loss_coef=0.001)

# per update: |loss - loss_ref| <= loss_abs, |grad norm - ref| <= grad_rel x ref. GRPO losses here are O(0.1)
# (advantages +-1, ratios near 1); bf16 rounding moves them by ~1e-3, e4m3 (3 mantissa bits) by ~1e-2
TOLERANCES = {"moe_grouped_gemm": {"loss_abs": 5e-3, "grad_rel": 0.02},
              "fp8": {"loss_abs": 2e-2, "grad_rel": 0.10}}


def fixed_samples(vocab: int, *, count: int, length: int, prompt_len: int, seed: int = 0) -> list:
    from ..train.batching import Sample

    rng = random.Random(seed)
    return [Sample(prompt_ids=[rng.randrange(vocab) for _ in range(prompt_len)],
                   response_ids=[rng.randrange(vocab) for _ in range(length - prompt_len)],
                   advantage=1.0 if i % 2 else -1.0, group=i) for i in range(count)]


def trajectory(shape: ModelShape, *, updates: int = 20, count: int = 4, length: int = 2048, prompt_len: int = 256,
               lr: float = 1e-5, seed: int = 0, **build) -> list[dict]:
    """Loss and grad norm of `updates` GRPO updates of a bf16 policy (Policy.build `**build`: the setting under
    test) on fixed samples, old log-probs taken once, so every update moves further from them."""
    from ..distributed import init_distributed
    from ..model.policy import Policy
    from ..train.step import compute_logprobs, grpo_update

    init_distributed()
    policy = Policy.build(shape, dtype="bf16", transformer_impl="local", lr=lr, weight_decay=0.1, grad_clip=1.0,
                          seed=seed, max_sequence_length=max(length, shape.max_position_embeddings), **build)
    samples = fixed_samples(shape.vocab_size, count=count, length=length, prompt_len=prompt_len, seed=seed)
    budget = count * length
    old = compute_logprobs(policy, samples, max_tokens_per_micro_batch=budget)
    out = []
    for _ in range(updates):
        m = grpo_update(policy, samples, old, mini_batch_size=count, max_tokens_per_micro_batch=budget)
        out.append({"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"])})
    del policy, old
    gc.collect()
    compat.release_cached_memory()
    return out


def compare(reference: list[dict], other: list[dict], *, loss_abs: float, grad_rel: float) -> dict:
    """The largest per-update differences and whether every update is within the tolerance."""
    loss = [abs(a["loss"] - b["loss"]) for a, b in zip(reference, other)]
    grad = [abs(a["grad_norm"] - b["grad_norm"]) / max(abs(a["grad_norm"]), 1e-12) for a, b in zip(reference, other)]
    return {"updates": len(loss), "max_loss_abs_diff": max(loss), "max_grad_norm_rel_diff": max(grad),
            "loss_abs_tolerance": loss_abs, "grad_norm_rel_tolerance": grad_rel,
            "ok": len(loss) == len(reference) == len(other) and max(loss) <= loss_abs and max(grad) <= grad_rel}


def speed(setting: str, *, model, tokens: int, prompt_len: int, **bench) -> dict:
    """The update and forward-only figures of bench_train with `setting` off, then on (same card, same batch)."""
    from .train import bench_train

    out = {}
    for on in (False, True):
        raw = bench_train(model=model, tokens=tokens, seq_len=tokens, prompt_len=prompt_len, dtype="bf16", tp=1,
                          transformer_impl="local", steps=2, warmup=1, max_tokens_per_micro_batch=tokens,
                          **{setting: on}, **bench)
        out["on" if on else "off"] = {"update_s": raw["update"]["time_s"],
                                      "update_tokens_per_s": raw["update"]["tokens_per_s_per_device"],
                                      "update_mfu": raw["update"]["mfu"], "forward_only_mfu": raw["logprob"]["mfu"],
                                      "peak_allocated_gib": raw.get("gpu_peak_allocated_gib"),
                                      "loss": raw.get("loss"), "grad_norm": raw.get("grad_norm")}
        gc.collect()
        compat.release_cached_memory()
    out["speedup"] = out["off"]["update_s"] / out["on"]["update_s"]
    return out
