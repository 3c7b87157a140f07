"""Training on tool samples (multi-turn rollouts: a tool's output inside the response, `sampled_mask` 0 there) through
every trainer path a tool recipe can take: the shared-prompt path (a group's samples sharing one prompt copy) against
the plain one, and LoRA, each against an independent reference: with the old log-probs equal to the current ones
(ratio 1) the policy-gradient loss is -sum(A x model tokens) / model tokens, computed here from the masks alone.
Context parallelism: tests/test_context_parallel.py (`cp2_tool_samples`, CP2 = CP1)."""

import random

import pytest
import torch

from justrl_megatron.model.hf_config import ModelShape
from justrl_megatron.model.policy import Policy
from justrl_megatron.train.batching import Sample
from justrl_megatron.train.step import compute_logprobs, grpo_update

SHAPE = ModelShape(family="qwen2", num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                   num_query_groups=2, head_dim=8, vocab_size=120, max_position_embeddings=128, rope_theta=10000.0,
                   rms_norm_eps=1e-6, qkv_bias=True, tie_word_embeddings=False, init_std=0.05)
LORA = dict(rank=4, alpha=8.0, dropout=0.0, targets=["qkv", "proj", "fc1", "fc2"])
MAX_TOKENS = 256


def tool_samples(groups=3, n=3, seed=11):
    """n samples per prompt; each response: model tokens, a tool's output (masked), model tokens again; the
    advantages are not symmetric within a group, so masked and unmasked losses differ."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(1, 120) for _ in range(rng.randint(4, 9))]
        for _ in range(n):
            a, b, c = rng.randint(1, 6), rng.randint(2, 7), rng.randint(1, 6)
            response = [rng.randrange(1, 120) for _ in range(a + b + c)]
            out.append(Sample(prompt, response, advantage=rng.uniform(-1.5, 2.0), group=g,
                              sampled_mask=[1] * a + [0] * b + [1] * c))
    return out


def build(shared, lora=None):
    return Policy.build(SHAPE, dtype="fp32", transformer_impl="local", lr=1e-3, warmup_steps=0, weight_decay=0.0,
                        grad_clip=0.0, distributed_optimizer=False, seed=1234, shared_prompt=shared, lora=lora)


def train_once(policy, samples):
    """(old logprobs, entropies, the step's metrics, the gradients of the trainable weights)."""
    grads = {}

    def capture(pol, step):
        grads.update({n: p.main_grad.detach().clone() for c in pol.chunks for n, p in c.module.named_parameters()
                      if p.requires_grad})

    old, ent = compute_logprobs(policy, samples, max_tokens_per_micro_batch=MAX_TOKENS, with_entropy=True)
    m = grpo_update(policy, samples, old, mini_batch_size=len(samples), max_tokens_per_micro_batch=MAX_TOKENS,
                    on_grads=capture)
    return old, ent, m, grads


def expected(samples, entropies):
    masks = [torch.tensor(s.sampled_mask, dtype=torch.float64) for s in samples]
    tokens = sum(float(x.sum()) for x in masks)
    return {"pg_loss": -sum(s.advantage * float(x.sum()) for s, x in zip(samples, masks)) / tokens,
            "unmasked": -sum(s.advantage * len(s.response_ids) for s in samples) / sum(len(s.response_ids)
                                                                                       for s in samples),
            "entropy": sum(float((e.double() * x).sum()) for e, x in zip(entropies, masks)) / tokens,
            "tokens": tokens}


def _maxdiff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_tool_samples_train_alike_with_and_without_a_shared_prompt(lora):
    samples = tool_samples()
    shared, plain = build("on", lora), build("off", lora)
    assert shared.shared_prompt and not plain.shared_prompt
    with torch.no_grad():  # the same weights (adapters included)
        theirs = dict(plain.chunks[0].module.named_parameters())
        for name, p in shared.chunks[0].module.named_parameters():
            p.copy_(theirs[name])
    shared.optimizer.reload_model_params()
    a_old, a_ent, a_m, a_g = train_once(shared, samples)
    b_old, b_ent, b_m, b_g = train_once(plain, samples)
    assert _maxdiff(a_old, b_old) <= 1e-6 and _maxdiff(a_ent, b_ent) <= 1e-6
    for key in ("loss", "pg_loss", "entropy", "num_response_tokens", "grad_norm"):
        assert abs(a_m[key] - b_m[key]) <= 1e-6 * (1 + abs(b_m[key])), (key, a_m[key], b_m[key])
    assert a_g.keys() == b_g.keys() and max(float((a_g[k] - b_g[k]).abs().max()) for k in a_g) <= 1e-6
    if lora:  # only the adapters train
        assert a_g and all("lora" in k for k in a_g), sorted(a_g)[:5]
    # against the masks alone: ratio 1, so the loss is the masked token mean of -A
    want = expected(samples, b_ent)
    assert a_m["num_response_tokens"] == want["tokens"] < sum(len(s.response_ids) for s in samples)
    assert abs(a_m["pg_loss"] - want["pg_loss"]) <= 1e-6 and abs(want["pg_loss"] - want["unmasked"]) > 1e-2
    assert abs(a_m["entropy"] - want["entropy"]) <= 1e-5
