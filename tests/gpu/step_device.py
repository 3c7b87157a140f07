"""One GRPO step of tests/mp/step_parity.py on one device, for tests/gpu/test_gpu_step.py.

    python step_device.py OUT cpu     (run with CUDA_VISIBLE_DEVICES="": the CPU reference; saves the weights)
    python step_device.py OUT cuda    (loads those weights; also a bf16 step with the GPU kernels)

Same shapes, samples, perturbed old logprobs and step options as the CPU parity tests (imported, not copied).
Writes OUT/<side>.pt: per shape the logprobs, the step's metrics and gradients (CPU tensors), plus what ran.
"""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections when CUDA is hidden)

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "mp"))
from step_parity import MAX_TOKENS, SHAPES, build, make_samples, old_from, one_step, params  # noqa: E402

from justrl_megatron.distributed import init_distributed  # noqa: E402
from justrl_megatron.model.policy import Policy  # noqa: E402
from justrl_megatron.train.step import compute_logprobs  # noqa: E402


def load_weights(policy, weights):
    with torch.no_grad():
        for k, p in params(policy).items():
            p.copy_(weights[k])
    policy.optimizer.reload_model_params()


def step(policy, samples, old):
    lp = compute_logprobs(policy, samples, max_tokens_per_micro_batch=MAX_TOKENS)
    metrics, grads = one_step(policy, samples, old)
    return {"logprobs": [x.cpu() for x in lp], "metrics": metrics,
            "grads": {k: g.float().cpu() for k, g in grads.items()},
            "device": str(policy.device), "bias_activation_fusion": bool(policy.config.bias_activation_fusion)}


def main(out, side):
    init_distributed()
    samples = make_samples()
    result = {}
    for shape in SHAPES:
        policy = build(shape)  # fp32, local spec, seed 1234
        if side == "cpu":
            weights = {k: p.detach().cpu().clone() for k, p in params(policy).items()}
            torch.save(weights, f"{out}/weights_{shape}.pt")
            old = old_from(compute_logprobs(policy, samples, max_tokens_per_micro_batch=MAX_TOKENS))
            torch.save(old, f"{out}/old_{shape}.pt")
        else:
            weights = torch.load(f"{out}/weights_{shape}.pt")
            old = torch.load(f"{out}/old_{shape}.pt")
            load_weights(policy, weights)
        result[shape] = step(policy, samples, old)
        if side == "cuda":  # the same step in bf16: varlen flash, fused rms_norm and SwiGLU, fp32 master weights
            from justrl_megatron.model import attention

            pol = Policy.build(SHAPES[shape], dtype="bf16", transformer_impl="local", lr=1e-3, seed=1234)
            load_weights(pol, {k: w.to(torch.bfloat16) for k, w in weights.items()})
            result[shape + "_bf16"] = step(pol, samples, old)
            sh = SHAPES[shape]
            result[shape + "_bf16"]["varlen"] = attention.varlen_choice(
                pol.device, torch.bfloat16, sh.num_attention_heads, sh.num_query_groups, sh.head_dim)[0]
    torch.save(result, f"{out}/{side}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
