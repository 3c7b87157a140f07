"""LoRA at TP=1 vs TP=2 on real megatron-core (CPU, gloo). Run by tests/test_lora.py:

    python lora_parity.py OUT HF_DIR tp1                                  (one process: the reference)
    python -m torch.distributed.run --standalone --nproc-per-node 2 lora_parity.py OUT HF_DIR tp2

The same global adapters (random A and B) on the same HF base weights; one GRPO step with the KL term (reference:
adapters off) and off-policy old logprobs. The reference saves loss, grad norm, reference logprobs, the adapters'
full gradients (before the optimizer step) and the adapters after it (OUT/tp1.pt); TP2 gathers its shards the same
way and rank 0 writes the largest differences to OUT/tp2.json.
"""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import json
import sys

import torch
import torch.distributed as dist

from lora_common import LORA, build, global_grads, samples_for, set_random_adapters

from justrl_megatron.model import lora
from justrl_megatron.train.reference import Reference
from justrl_megatron.train.step import compute_logprobs, grpo_update

MAX_TOKENS = 48  # several micro-batches


def one_step(hf, tp):
    policy = build(hf, LORA, tp=tp)
    set_random_adapters(policy.chunks)
    samples = samples_for(hf, n=8)
    lp = compute_logprobs(policy, samples, max_tokens_per_micro_batch=MAX_TOKENS)
    g = torch.Generator().manual_seed(5)
    old = [x + 0.3 * torch.randn(x.shape, generator=g) for x in lp]
    ref = Reference.for_policy(policy, hf).logprobs(samples, max_tokens_per_micro_batch=MAX_TOKENS)
    grads = {}
    metrics = grpo_update(policy, samples, old, mini_batch_size=len(samples), max_tokens_per_micro_batch=MAX_TOKENS,
                          kl_coef=0.2, kl_estimator="k3", ref_logprobs=ref,
                          on_grads=lambda pol, step: grads.update(global_grads(pol.chunks)))
    return {**{k: metrics[k] for k in ("loss", "pg_loss", "kl_loss", "grad_norm", "kl")}, "ref": ref, "lp": lp,
            "grads": grads, "after": lora.global_state(policy.chunks)}


def maxdiff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def main(out, hf, mode):
    result = one_step(hf, tp=1 if mode == "tp1" else 2)
    if mode == "tp1":
        torch.save(result, f"{out}/tp1.pt")
    elif dist.get_rank() == 0:
        ref = torch.load(f"{out}/tp1.pt")
        verdict = {k: abs(result[k] - ref[k]) for k in ("loss", "pg_loss", "kl_loss", "grad_norm", "kl")}
        verdict.update(loss_value=result["loss"], kl_value=result["kl"],
                       grad_keys=sorted(result["grads"]) == sorted(ref["grads"]),
                       grads=maxdiff(result["grads"], ref["grads"]), after=maxdiff(result["after"], ref["after"]),
                       grad_a_max=max(float(v.abs().max()) for k, v in ref["grads"].items() if k.endswith("lora_A")),
                       ref_logprobs=max(float((a - b).abs().max()) for a, b in zip(result["ref"], ref["ref"])),
                       logprobs=max(float((a - b).abs().max()) for a, b in zip(result["lp"], ref["lp"])))
        with open(f"{out}/tp2.json", "w") as f:
            json.dump(verdict, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
