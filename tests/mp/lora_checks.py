"""LoRA on real megatron-core (CPU, one process). Run by tests/test_lora.py:

    python lora_checks.py OUT HF_DIR

Builds a LoRA policy and a full one from the same tiny HF model and checks: only the adapters get gradient buffers
and optimizer state; adapters-off logits equal the base model's exactly (at init, and after updates moved the
adapters); the KL to the reference is 0 at step 0 and > 0 after an update, with both references (adapters off, frozen
copy); the frozen copy does not move. Then saves a LoRA training checkpoint (OUT/run) and the adapted model's logits
(OUT/lora_logits.pt) for the export test. Verdict: OUT/checks.json.
"""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import json
import os
import sys

import torch
import torch.distributed as dist

from lora_common import LORA, build, samples_for
from step_parity import packed_logits

from justrl_megatron.checkpoint import save_checkpoint
from justrl_megatron.model import lora
from justrl_megatron.train.reference import Reference
from justrl_megatron.train.step import compute_logprobs, grpo_update_on_policy

MAX_TOKENS = 64
KL = dict(kl_coef=0.1, kl_estimator="k3", clip_low=0.2, clip_high=0.28, dual_clip_c=10.0)


def kl_steps(policy, reference, samples):
    """Two on-policy updates with the KL term; the reference logprobs before each; the KL metric of each."""
    out = {}
    for step in (0, 1):
        ref = reference.logprobs(samples, max_tokens_per_micro_batch=MAX_TOKENS)
        now = compute_logprobs(policy, samples, max_tokens_per_micro_batch=MAX_TOKENS)
        metrics, _ = grpo_update_on_policy(policy, samples, max_tokens_per_micro_batch=MAX_TOKENS, ref_logprobs=ref,
                                           **KL)
        out[f"kl_{step}"] = metrics["kl"]
        out[f"kl_loss_{step}"] = metrics["kl_loss"]
        out[f"ref_vs_policy_{step}"] = max(float((a - b).abs().max()) for a, b in zip(ref, now))
        out[f"ref_{step}"] = ref
    return out


def main(out, hf):
    samples = samples_for(hf)
    verdict = {}

    # --- LoRA: what is trained, adapters-off == base, KL with adapters off as the reference -----------------------
    full = build(hf, None)
    base_logits = packed_logits(full, samples)
    policy = build(hf, LORA)
    chunk = policy.chunks[0]
    adapter_names = [n for n, p in chunk.module.named_parameters() if p.requires_grad]
    verdict["trainable_all_adapters"] = bool(adapter_names) and all(n.startswith(lora.MODULE) for n in adapter_names)
    verdict["adapter_numel"] = sum(p.numel() for p in chunk.module.parameters() if p.requires_grad)
    verdict["base_numel"] = sum(p.numel() for p in chunk.module.parameters() if not p.requires_grad)
    verdict["grad_buffer_numel"] = sum(b.grad_data.numel() for b in chunk.buffers)
    verdict["base_without_main_grad"] = all(not hasattr(p, "main_grad") for p in chunk.module.parameters()
                                            if not p.requires_grad)
    verdict["optimizer_numel"] = sum(p.numel() for g in policy.optimizer.param_groups for p in g["params"])
    verdict["init_equals_base"] = bool(torch.equal(packed_logits(policy, samples), base_logits))

    reference = Reference.for_policy(policy, hf)
    verdict["lora_mode"] = reference.mode
    lora_kl = kl_steps(policy, reference, samples)
    verdict.update({f"lora_{k}": v for k, v in lora_kl.items() if not k.startswith("ref_") or "vs" in k})
    verdict["b_moved"] = max(float(a.lora_B.abs().max()) for a in lora.adapters(policy.chunks).values())
    on = packed_logits(policy, samples)
    with lora.adapters_disabled(policy.chunks):
        off = packed_logits(policy, samples)
    verdict["off_equals_base"] = bool(torch.equal(off, base_logits))
    verdict["on_differs"] = float((on - base_logits).abs().max())

    # --- full fine-tuning: the frozen copy as the reference --------------------------------------------------------
    frozen_ref = Reference.for_policy(full, hf)
    verdict["frozen_mode"] = frozen_ref.mode
    verdict["frozen_requires_grad"] = any(p.requires_grad for c in frozen_ref.frozen.chunks for p in c.parameters())
    frozen_kl = kl_steps(full, frozen_ref, samples)
    verdict.update({f"frozen_{k}": v for k, v in frozen_kl.items() if not k.startswith("ref_") or "vs" in k})
    verdict["frozen_ref_unchanged"] = all(torch.equal(a, b) for a, b in zip(frozen_kl["ref_0"], frozen_kl["ref_1"]))

    # --- for the export test: a LoRA checkpoint and the adapted model's logits -------------------------------------
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # A moved too little in two steps from B = 0: give both full-size values
        state = {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in lora.global_state(policy.chunks).items()}
        lora.load_global_state(policy.chunks, state)
    save_checkpoint(f"{out}/run", 2, policy.chunks, policy.optimizer, policy.scheduler, {}, shape=policy.shape,
                    hf_source=hf)
    tokens = torch.tensor([[(i * 37 + 11) % policy.shape.vocab_size for i in range(24)]])
    with torch.no_grad():
        logits = chunk.module(tokens, torch.arange(tokens.shape[1])[None], None)[..., :policy.shape.vocab_size]
    torch.save({"tokens": tokens, "logits": logits.float()}, f"{out}/lora_logits.pt")
    with open(os.path.join(out, "checks.json"), "w") as f:
        json.dump(verdict, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
