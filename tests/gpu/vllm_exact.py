"""rollout.exact on one GPU (issue 64, item 5): the engine in vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1,
model/exact.engine_env) and the policy in megatron's deterministic settings (exact_config), after a GRPO update and a
weight sync. Run by test_gpu_vllm.py where vLLM imports:

    python vllm_exact.py HF_DIR OUT

Writes OUT/exact.json: the engine's log-probs of each sample alone vs in the batch (batch invariance: what the mode
promises on GPU), the trainer's twice (determinism) and the trainer vs engine gap (what is left: the trainer's GPU
kernels are not the engine's, docs/numerics.md).
"""

import justrl_megatron.compat  # noqa: F401  (first)

import json
import os
import sys

PROMPTS = [[11, 12, 13, 14, 15], [201, 7, 42], [5, 6, 7, 8, 9, 10, 11], [300, 301]]
N, STEPS = 4, 12


def main(hf_dir, out):
    import torch

    from justrl_megatron.algo.grpo import group_advantages
    from justrl_megatron.convert.export import export_hf_stream
    from justrl_megatron.rollout import SamplingConfig, logprob_gap
    from justrl_megatron.rollout.vllm_engine import VLLMEngine
    from justrl_megatron.train.batching import Sample
    from justrl_megatron.train.step import compute_logprobs, grpo_update

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_util import hf_policy

    v = {}
    engine = VLLMEngine(hf_dir, dtype="bf16", seed=0, max_model_len=256, gpu_memory_utilization=0.3,
                        enforce_eager=True, enable_sleep=True, sleep_level=2, exact=True)
    v["batch_invariant_env"] = os.environ.get("VLLM_BATCH_INVARIANT")
    shape, policy = hf_policy(hf_dir, "bf16", lr=2e-2, grad_clip=0.0, distributed_optimizer=False, exact=True)
    v["deterministic_mode"] = bool(getattr(policy.config, "deterministic_mode", False))
    sample = SamplingConfig(max_tokens=STEPS)

    r0 = engine.generate(PROMPTS, N, sample, seed=7)
    samples = [Sample(PROMPTS[i], t, 0.0, rollout_logprobs=lp, group=i)
               for i, t, lp in zip(r0.prompt_index, r0.token_ids, r0.logprobs)]
    old = compute_logprobs(policy, samples, max_tokens_per_micro_batch=512)
    engine.sleep()
    torch.cuda.empty_cache()
    rewards = torch.tensor([1.0 if sum(t) % 3 == 0 else -1.0 for t in r0.token_ids])
    samples = [Sample(s.prompt_ids, s.response_ids, float(a), rollout_logprobs=s.rollout_logprobs, group=s.group)
               for s, a in zip(samples, group_advantages(rewards, N))]
    v["grad_norm"] = grpo_update(policy, samples, old, mini_batch_size=len(samples),
                                 max_tokens_per_micro_batch=512)["grad_norm"]
    torch.cuda.empty_cache()
    engine.update_weights(export_hf_stream(policy.chunks, shape, bucket_bytes=1 << 20, include_tied_lm_head=True),
                          version=1)
    engine.wake_up()

    batch = engine.generate(PROMPTS, N, sample, seed=8)
    # each prompt's group again, alone in the engine, seeded as at its place in the batch (the same tokens)
    alone = [engine.generate([PROMPTS[i]], N, sample, seed=8, request_indices=[i]) for i in range(len(PROMPTS))]
    by_prompt = {i: [lp for p, lp in zip(batch.prompt_index, batch.logprobs) if p == i] for i in range(len(PROMPTS))}
    same_tokens = all([t for p, t in zip(batch.prompt_index, batch.token_ids) if p == i] == a.token_ids
                      for i, a in enumerate(alone))
    v["engine_alone_vs_batch"] = {"same_tokens": same_tokens, "max_abs": max(
        (abs(x - y) for i, a in enumerate(alone) for s, t in zip(by_prompt[i], a.logprobs) for x, y in zip(s, t)),
        default=0.0)}
    trainer_samples = [Sample(PROMPTS[i], t, 0.0, group=i) for i, t in zip(batch.prompt_index, batch.token_ids)]
    first = compute_logprobs(policy, trainer_samples, max_tokens_per_micro_batch=512)
    second = compute_logprobs(policy, trainer_samples, max_tokens_per_micro_batch=512)
    v["trainer_repeat_max_abs"] = max(float((a - b).abs().max()) for a, b in zip(first, second))
    v["gap_v1"] = logprob_gap(batch.logprobs, first)
    with open(os.path.join(out, "exact.json"), "w") as f:
        json.dump(v, f, indent=1)
    engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
