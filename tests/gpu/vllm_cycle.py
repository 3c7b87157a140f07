"""The colocated cycle on one GPU: generate -> sleep -> GRPO update -> sync -> wake -> generate, with the real vLLM
engine (rollout/vllm_engine.py, in-process, external_launcher) next to a Megatron policy. Run by test_gpu_vllm.py:

    python vllm_cycle.py HF_DIR OUT

Writes OUT/cycle.json: versions, free GPU memory around sleep/wake, and the trainer vs vLLM logprob gaps.
"""

import justrl_megatron.compat  # noqa: F401  (first)

import json
import os
import sys

import torch

PROMPTS = [[11, 12, 13, 14, 15], [201, 7, 42], [5, 6, 7, 8, 9, 10, 11], [300, 301]]
N, STEPS = 4, 12


def free_bytes():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def generate_update_sync(engine, policy, shape, sample, v: dict) -> None:
    """generate -> sleep -> GRPO update -> sync -> wake on `engine` and `policy` (bf16), recording into `v` the
    versions, free GPU memory around sleep / wake, the gaps before and after the update and the sync's size (also
    the exact mode's cycle, tests/gpu/vllm_exact.py)."""
    from justrl_megatron.algo.grpo import group_advantages
    from justrl_megatron.convert.export import export_hf_stream
    from justrl_megatron.rollout import logprob_gap
    from justrl_megatron.train.batching import Sample
    from justrl_megatron.train.step import compute_logprobs, grpo_update

    r0 = engine.generate(PROMPTS, N, sample, seed=7)
    v["v0_version"] = r0.weight_version
    samples = [Sample(PROMPTS[i], t, 0.0, rollout_logprobs=lp, group=i)
               for i, t, lp in zip(r0.prompt_index, r0.token_ids, r0.logprobs)]
    old = compute_logprobs(policy, samples, max_tokens_per_micro_batch=512)
    v["gap_v0"] = logprob_gap(r0.logprobs, old)

    awake = free_bytes()
    engine.sleep()  # level 2: weights and KV cache released
    torch.cuda.empty_cache()
    v["freed_by_sleep_gib"] = (free_bytes() - awake) / 2**30

    rewards = torch.tensor([1.0 if sum(t) % 3 == 0 else -1.0 for t in r0.token_ids])
    adv = group_advantages(rewards, N)
    samples = [Sample(s.prompt_ids, s.response_ids, float(a), rollout_logprobs=s.rollout_logprobs, group=s.group)
               for s, a in zip(samples, adv)]
    metrics = grpo_update(policy, samples, old, mini_batch_size=len(samples), max_tokens_per_micro_batch=512)
    v["grad_norm"] = metrics["grad_norm"]
    moved = compute_logprobs(policy, samples, max_tokens_per_micro_batch=512)
    v["gap_before_sync"] = logprob_gap(r0.logprobs, moved)  # the engine is one step behind now

    torch.cuda.empty_cache()  # the trainer's cached blocks go back before vLLM takes its KV cache again
    v["sync"] = engine.update_weights(
        export_hf_stream(policy.chunks, shape, bucket_bytes=1 << 20, include_tied_lm_head=True), version=1)
    engine.wake_up()
    v["asleep_after_wake"] = sorted(engine._asleep)


def main(hf_dir, out):
    from justrl_megatron.rollout import SamplingConfig, logprob_gap
    from justrl_megatron.rollout.vllm_engine import VLLMEngine
    from justrl_megatron.train.batching import Sample
    from justrl_megatron.train.step import compute_logprobs

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_util import hf_policy

    v = {}
    # the engine first (it joins torch.distributed's WORLD as external_launcher), then the policy, as the loop does
    engine = VLLMEngine(hf_dir, dtype="bf16", seed=0, max_model_len=256, gpu_memory_utilization=0.3,
                        enforce_eager=True, enable_sleep=True, sleep_level=2)
    shape, policy = hf_policy(hf_dir, "bf16", lr=2e-2, grad_clip=0.0, distributed_optimizer=False)
    sample = SamplingConfig(max_tokens=STEPS)
    generate_update_sync(engine, policy, shape, sample, v)
    r1 = engine.generate(PROMPTS, N, sample, seed=8)
    v["v1_version"] = r1.weight_version
    trainer = compute_logprobs(policy, [Sample(PROMPTS[i], t, 0.0, group=i) for i, t in
                                        zip(r1.prompt_index, r1.token_ids)], max_tokens_per_micro_batch=512)
    v["gap_v1"] = logprob_gap(r1.logprobs, trainer)
    with open(os.path.join(out, "cycle.json"), "w") as f:
        json.dump(v, f, indent=1)
    engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
