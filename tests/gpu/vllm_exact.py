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

from vllm_cycle import N, PROMPTS, STEPS, generate_update_sync  # (this folder: the script's own)


def main(hf_dir, out):
    from justrl_megatron.rollout import SamplingConfig, logprob_gap
    from justrl_megatron.rollout.vllm_engine import VLLMEngine
    from justrl_megatron.train.batching import Sample
    from justrl_megatron.train.step import compute_logprobs

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_util import hf_policy

    v = {}
    engine = VLLMEngine(hf_dir, dtype="bf16", seed=0, max_model_len=256, gpu_memory_utilization=0.3,
                        enforce_eager=True, enable_sleep=True, sleep_level=2, exact=True)
    v["batch_invariant_env"] = os.environ.get("VLLM_BATCH_INVARIANT")
    shape, policy = hf_policy(hf_dir, "bf16", lr=2e-2, grad_clip=0.0, distributed_optimizer=False, exact=True)
    v["deterministic_mode"] = bool(getattr(policy.config, "deterministic_mode", False))
    sample = SamplingConfig(max_tokens=STEPS)
    generate_update_sync(engine, policy, shape, sample, v)

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
