"""MoE on CUDA (issue 31), for tiny random Mixtral and Qwen3-MoE: HF vs Megatron logits (megatron's MoE layer with the
alltoall dispatcher on the GPU, not the CPU redirections), routing replay `rollout`'s replay half (the experts an
engine chose, here transformers', replayed in both passes; vLLM's half needs GPU vLLM, absent from the lent box),
the router losses and load metrics of an update, and the TE spec with fused permutation where TE is installed.
The reference is transformers in fp32 on the CPU."""

import pytest
import torch

from gpu_util import hf_policy, random_samples, require
from justrl_megatron.convert.verify import hf_logits, megatron_logits, random_tokens
from justrl_megatron.train.step import compute_logprobs, grpo_update
from test_moe import TINY_MOE, _hf_routes, tiny_moe_models

TOL = {"fp32": 1e-4, "bf16": 5e-2}  # logits max |diff| / (1 + max |logit|)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    return tiny_moe_models(tmp_path_factory.mktemp("moe_gpu"))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(TINY_MOE))
def test_moe_hf_vs_megatron_on_cuda(moe_models, name, dtype):
    shape, policy = hf_policy(moe_models[name], dtype)
    assert policy.device.type == "cuda" and shape.num_experts == 4
    tokens = random_tokens(shape.vocab_size, batch=2, seq_len=48, seed=3)
    ref = hf_logits(moe_models[name], tokens, weight_dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    got = megatron_logits(policy.chunks, tokens, shape.vocab_size)
    assert float((got - ref).abs().max()) / (1 + float(ref.abs().max())) <= TOL[dtype]


def test_routing_replay_rollout_and_router_metrics_on_cuda(moe_models):
    """Routes in vLLM's layout ([tokens - 1, layers, k]) from transformers on the same weights: replaying them leaves
    the fp32 logprobs as they were; an update with them runs and logs the aux loss, z-loss and load imbalance."""
    model = moe_models["mixtral"]
    shape, policy = hf_policy(model, "fp32", shared_prompt="off", routing_replay="rollout", moe_z_loss_coef=1e-3)
    samples = random_samples(shape.vocab_size)
    for i, (s, routes) in enumerate(zip(samples, _hf_routes(model, samples))):
        s.routed_experts, s.advantage = routes, (-1.0) ** i
    replay, policy.routing_replay = policy.routing_replay, None
    natural = compute_logprobs(policy, samples, max_tokens_per_micro_batch=256)
    policy.routing_replay = replay
    replayed = compute_logprobs(policy, samples, max_tokens_per_micro_batch=256)
    assert max(float((a - b).abs().max()) for a, b in zip(natural, replayed)) <= 1e-4
    metrics = grpo_update(policy, samples, replayed, mini_batch_size=len(samples), max_tokens_per_micro_batch=256)
    assert metrics["num_optimizer_steps"] == 1
    assert 0.5 < metrics["moe_aux_loss"] < 5 and metrics["moe_z_loss"] > 0
    assert 1.0 <= metrics["moe_load_imbalance"] <= shape.num_experts / shape.moe_top_k


def test_te_spec_with_fused_permutation(moe_models):
    require("transformer_engine", "needs transformer-engine")
    shape, policy = hf_policy(moe_models["qwen3_moe"], "bf16", impl="te", moe_permute_fusion=True)
    assert policy.transformer_impl == "te" and policy.config.moe_permute_fusion
    tokens = random_tokens(shape.vocab_size, batch=2, seq_len=48, seed=3)
    ref = hf_logits(moe_models["qwen3_moe"], tokens, weight_dtype=torch.bfloat16)
    got = megatron_logits(policy.chunks, tokens, shape.vocab_size)
    assert float((got - ref).abs().max()) / (1 + float(ref.abs().max())) <= TOL["bf16"]
