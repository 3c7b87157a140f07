"""Peak GPU memory of GRPO updates (forward + backward + optimizer step; two, the second in the steady state) of a
moderate model, for
test_gpu_memory.py:

    python memory_peak.py OUT RECOMPUTE TOKENS

4 layers of DeepSeek-R1-Distill-Qwen-1.5B's width (hidden 1536, ffn 8960, 12 heads, 2 KV groups, vocab 151,936),
bf16, local spec, TP1, distributed optimizer; one packed micro-batch of TOKENS tokens (1,024-token samples). The
peak counts everything allocated since the process started: weights, grads, optimizer state, activations, logprob
head. Writes OUT/peak_<recompute>.json.
"""

import justrl_megatron.compat  # noqa: F401  (first)

import json
import os
import sys

import torch

from justrl_megatron.model.hf_config import ModelShape

SHAPE = ModelShape(family="qwen2", num_layers=4, hidden_size=1536, ffn_hidden_size=8960, num_attention_heads=12,
                   num_query_groups=2, head_dim=128, vocab_size=151936, max_position_embeddings=32768,
                   rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=True, tie_word_embeddings=False, init_std=0.02)
SAMPLE_LEN, PROMPT_LEN = 1024, 64


def main(out, recompute, tokens):
    from justrl_megatron.distributed import init_distributed
    from justrl_megatron.model.policy import Policy
    from justrl_megatron.train.batching import Sample
    from justrl_megatron.train.step import grpo_update_on_policy

    init_distributed()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    policy = Policy.build(SHAPE, dtype="bf16", transformer_impl="local", recompute=recompute, lr=1e-6, seed=1234)
    after_build = torch.cuda.memory_allocated()
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(tokens // SAMPLE_LEN):
        ids = torch.randint(0, SHAPE.vocab_size, (SAMPLE_LEN,), generator=g).tolist()
        samples.append(Sample(ids[:PROMPT_LEN], ids[PROMPT_LEN:], 1.0 if i % 2 else -1.0, group=i // 8))
    # two updates: from the second on, Adam's state is alive while the backward pass holds its activations (the
    # steady state the plan predicts); the first update's backward runs before the state exists
    for _ in range(2):
        metrics, _ = grpo_update_on_policy(policy, samples, max_tokens_per_micro_batch=tokens)
    torch.cuda.synchronize()
    result = {"recompute": recompute, "tokens": tokens, "peak_bytes": torch.cuda.max_memory_allocated() - start,
              "after_build_bytes": after_build - start, "num_micro_batches": metrics["num_micro_batches"],
              "grad_norm": metrics["grad_norm"], "device": torch.cuda.get_device_name(),
              "bias_activation_fusion": bool(policy.config.bias_activation_fusion)}
    with open(os.path.join(out, f"peak_{recompute}.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
