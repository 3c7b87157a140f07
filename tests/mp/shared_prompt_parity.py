"""Shared-prompt updates against unshared ones on real megatron-core (CPU, gloo). Run under torchrun by
tests/test_shared_prompt.py.

    python -m torch.distributed.run --standalone --nproc-per-node N shared_prompt_parity.py OUT MODE

MODE one (1 process): TP1. MODE two (2 processes): TP2 + SP, PP2, DP2. MODE one_bf16: TP1 in bf16 (tests/gpu). In each layout two policies start from the
same seed, one packing samples (trainer.shared_prompt=off), one packing shared-prompt units (on), and both run the
same GRPO step: logprobs before the step, the loss and metrics, the gradients (after their reduction, before the
optimizer step) and the weights after it must agree to fp32 rounding. The samples come in groups of 4 that share a
prompt, with uneven response lengths (one empty), and the token budget cuts groups into several units spread over
micro-batches. Verdicts: OUT/<mode>_rank<r>.json.
"""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import json
import random
import sys

import torch
import torch.distributed as dist

from justrl_megatron.distributed import init_distributed
from justrl_megatron.model.policy import Policy
from justrl_megatron.train.batching import Sample
from justrl_megatron.train.step import compute_logprobs, grpo_update, plan_micro_batches

from step_parity import SHAPES, STEP_KW, maxdiff, old_from, params

MAX_TOKENS = 40  # a group (prompt + 4 responses) needs up to 12 + 4 x 16 tokens: cut into units


def grouped_samples(groups=4, n=4, seed=11):
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(250) for _ in range(rng.randint(3, 12))]
        for i in range(n):
            length = 0 if (g, i) == (1, 2) else rng.randint(1, 16)
            out.append(Sample(prompt, [rng.randrange(250) for _ in range(length)],
                              advantage=rng.uniform(-1.5, 1.5), group=g))
    return out


# lr 1e-4: Adam's first step is ~lr * g / |g| per weight, which turns gradient rounding (~1e-8 here) on weights with a
# near-zero gradient into weight differences ~lr x 1e-3; at 1e-4 those stay below the 1e-6 the weights are held to
def build(shape, shared, tp=1, pp=1, sp=False, distopt=True, dtype="fp32"):
    return Policy.build(SHAPES[shape], tp=tp, pp=pp, sequence_parallel=sp, dtype=dtype, transformer_impl="local",
                        lr=1e-4, warmup_steps=0, weight_decay=0.0, grad_clip=1.0, distributed_optimizer=distopt,
                        seed=1234, shared_prompt="on" if shared else "off")


def one_step(policy, samples, old):
    grads = {}

    def capture(pol, step):
        grads.update({k: p.main_grad.detach().clone() for k, p in params(pol).items()})

    metrics = grpo_update(policy, samples, old, mini_batch_size=len(samples), max_tokens_per_micro_batch=MAX_TOKENS,
                          on_grads=capture, **STEP_KW)
    return metrics, grads


def compare(shape, **layout):
    samples = grouped_samples()
    plain, shared = build(shape, False, **layout), build(shape, True, **layout)
    a, b = params(plain), params(shared)
    start_diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    before = {k: v.detach().clone() for k, v in a.items()}
    mbs = plan_micro_batches(shared, samples, range(len(samples)), MAX_TOKENS)
    lp_plain = compute_logprobs(plain, samples, max_tokens_per_micro_batch=MAX_TOKENS)
    lp_shared = compute_logprobs(shared, samples, max_tokens_per_micro_batch=MAX_TOKENS)
    old = old_from(lp_plain)
    m_plain, g_plain = one_step(plain, samples, old)
    m_shared, g_shared = one_step(shared, samples, old)
    return {
        "start_diff": start_diff,
        "logprob_diff": maxdiff(lp_plain, lp_shared),
        "num_logprobs": [int(x.numel()) for x in lp_shared],
        "metrics_diff": max(abs(m_plain[k] - m_shared[k]) for k in
                            ("loss", "pg_loss", "grad_norm", "entropy", "logprob_mean", "num_response_tokens")
                            if k in m_plain),
        "grad_norm": m_plain["grad_norm"],
        "grad_diff": max(float((g_plain[k] - g_shared[k]).abs().max()) for k in g_plain),
        "weight_diff": max(float((a[k] - b[k]).abs().max()) for k in a),
        "weight_moved": max(float((a[k] - before[k]).abs().max()) for k in a),
        # how the shared plan packed this DP rank's share: micro-batches, units cut from groups, tokens saved
        "micro_batches": len(mbs),
        "shared_micro_batches": sum(mb.shared is not None for mb in mbs),
        "tokens_shared": sum(mb.num_real_tokens for mb in mbs),
        "tokens_plain": sum(mb.num_real_tokens for mb in plan_micro_batches(plain, samples, range(len(samples)),
                                                                             MAX_TOKENS)),
    }


LAYOUTS = {"one": {"tp1": {}},
           "two": {"tp2_sp": dict(tp=2, sp=True), "pp2": dict(pp=2), "dp2": dict(distopt=False)},
           "one_bf16": {"tp1_bf16": dict(dtype="bf16")}}  # tests/gpu: CUDA's varlen flash over the gathered rows


def main():
    out, mode = sys.argv[1], sys.argv[2]
    init_distributed()
    verdict = {name: {shape: compare(shape, **layout) for shape in SHAPES} for name, layout in LAYOUTS[mode].items()}
    with open(f"{out}/{mode}_rank{dist.get_rank()}.json", "w") as f:
        json.dump(verdict, f, indent=1)
    dist.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
