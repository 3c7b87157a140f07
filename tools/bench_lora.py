"""LoRA vs full fine-tuning on CPU: GRPO update time and the trainer's memory (docs/benchmarks.md).

    python tools/bench_lora.py full|lora [--samples 32] [--prompt 64] [--response 64] [--repeats 3]

One process per mode (peak RSS is per process): SmolLM2-135M-Instruct (the demo's model), fp32, one on-policy GRPO
update (forward + backward + optimizer step) over `samples` random sequences, 1 untimed + `repeats` timed. Prints one
JSON line: seconds per update (median, min, max), the trainable parameters, the bytes of gradient buffers and of
optimizer state (counted from the live tensors), and the process's peak RSS.
"""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import argparse
import json
import random
import resource
import statistics
import time

import torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["full", "lora"])
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--response", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    from transformers import AutoConfig

    from justrl_megatron.assets import smollm2_135m_instruct
    from justrl_megatron.convert.load import load_hf_weights
    from justrl_megatron.model.hf_config import model_shape
    from justrl_megatron.model.policy import Policy
    from justrl_megatron.train.batching import Sample
    from justrl_megatron.train.step import grpo_update_on_policy

    hf = smollm2_135m_instruct()
    shape = model_shape(AutoConfig.from_pretrained(hf))
    lora = dict(rank=16, alpha=32.0, dropout=0.0, targets=["qkv", "proj", "fc1", "fc2"]) if args.mode == "lora" else None
    policy = Policy.build(shape, dtype="fp32", transformer_impl="local", lr=1e-5, warmup_steps=0, weight_decay=0.0,
                          lora=lora)
    load_hf_weights(policy.chunks, hf, progress=False)
    policy.optimizer.reload_model_params()
    rng = random.Random(0)
    samples = [Sample([rng.randrange(shape.vocab_size) for _ in range(args.prompt)],
                      [rng.randrange(shape.vocab_size) for _ in range(args.response)],
                      advantage=rng.uniform(-1, 1), group=i // 4) for i in range(args.samples)]
    times = []
    for i in range(1 + args.repeats):
        t = time.perf_counter()
        grpo_update_on_policy(policy, samples, max_tokens_per_micro_batch=2048)
        if i:
            times.append(time.perf_counter() - t)
    params = [p for c in policy.chunks for p in c.module.parameters()]
    optimizer_bytes = 0
    for sub in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]):
        for state in sub.optimizer.state.values():
            optimizer_bytes += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    print(json.dumps({
        "mode": args.mode, "update_s_median": statistics.median(times), "update_s_min": min(times),
        "update_s_max": max(times), "tokens_per_update": sum(s.length for s in samples),
        "params": sum(p.numel() for p in params), "trainable": sum(p.numel() for p in params if p.requires_grad),
        "grad_buffer_bytes": sum(b.grad_data.numel() * b.grad_data.element_size()
                                 for c in policy.chunks for b in c.buffers),
        "optimizer_state_bytes": optimizer_bytes,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    main()
