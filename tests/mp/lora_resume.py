"""LoRA resume is exact on real megatron-core (CPU). Run by tests/test_lora.py:

    python lora_resume.py OUT HF_DIR

A: four GRPO steps in a row (KL to the adapters-off reference, Adam, LR warmup). B: two steps, then a training
checkpoint (adapters + their optimizer state only). C: a fresh policy from the HF weights resumes B's checkpoint as
justrl-train does (base weights from HF, then the checkpoint) and takes steps 3 and 4. C's adapters and metrics must
equal A's bitwise. Verdict: OUT/resume.json (also the checkpoint's size next to the base weights').
"""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lora_common import LORA, build, samples_for

from justrl_megatron.checkpoint import load_latest_checkpoint, save_checkpoint
from justrl_megatron.model import lora
from justrl_megatron.train.reference import Reference
from justrl_megatron.train.step import compute_logprobs, grpo_update

MAX_TOKENS = 64


def step(policy, hf, k):
    samples = samples_for(hf, n=8, seed=100 + k)
    old = compute_logprobs(policy, samples, max_tokens_per_micro_batch=MAX_TOKENS)
    ref = Reference.for_policy(policy, hf).logprobs(samples, max_tokens_per_micro_batch=MAX_TOKENS)
    # two optimizer steps per RL step: the second is off-policy, so ratios and clipping take part
    return grpo_update(policy, samples, old, mini_batch_size=4, max_tokens_per_micro_batch=MAX_TOKENS, kl_coef=0.1,
                       ref_logprobs=ref)


def make(hf):
    policy = build(hf, LORA, lr=5e-3)
    policy.scheduler.lr_warmup_steps = 3  # the schedule must resume too
    policy.scheduler.step(0)
    return policy


def main(out, hf):
    a = make(hf)
    metrics_a = [step(a, hf, k) for k in (1, 2, 3, 4)]
    b = make(hf)
    for k in (1, 2):
        step(b, hf, k)
    run = Path(out) / "run"
    save_checkpoint(run, 2, b.chunks, b.optimizer, b.scheduler, {"note": "b"}, shape=b.shape, hf_source=hf)
    c = make(hf)
    resumed = load_latest_checkpoint(run, c.chunks, c.optimizer, c.scheduler)
    metrics_c = [step(c, hf, k) for k in (3, 4)]
    sa, sc = lora.global_state(a.chunks), lora.global_state(c.chunks)
    keys = ("loss", "pg_loss", "kl", "grad_norm", "lr")
    ckpt_bytes = sum(f.stat().st_size for f in (run / "checkpoints" / "step_00000002").rglob("*.distcp"))
    verdict = {
        "resumed_step": resumed["step"],
        "adapters_equal": all(torch.equal(sa[k], sc[k]) for k in sa),
        "adapter_diff": max(float((sa[k] - sc[k]).abs().max()) for k in sa),
        "metrics_equal": all(metrics_a[2 + i][k] == metrics_c[i][k] for i in (0, 1) for k in keys),
        "metrics": [[metrics_a[2 + i][k], metrics_c[i][k]] for i in (0, 1) for k in keys],
        "moved": max(float((sa[k] - lora.global_state(make(hf).chunks)[k]).abs().max()) for k in sa),
        "ckpt_bytes": ckpt_bytes,
        "base_bytes": 4 * sum(p.numel() for p in a.chunks[0].module.parameters() if not p.requires_grad),
    }
    with open(Path(out) / "resume.json", "w") as f:
        json.dump(verdict, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
