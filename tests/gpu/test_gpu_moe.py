"""MoE on CUDA (issue 31), for tiny random Mixtral and Qwen3-MoE: HF vs Megatron logits (megatron's MoE layer with the
alltoall dispatcher on the GPU, not the CPU redirections; in bf16 with Megatron's routes forced to the reference's,
the fraction of routes that flip on their own bounded and reported: tests/test_moe.py's `moe_parity`), routing
replay `rollout`'s replay half (the experts an engine chose, here transformers', replayed in both passes; vLLM's
half needs GPU vLLM, absent from the lent box), the router losses and load metrics of an update, and the TE spec with
fused permutation where TE is installed. The reference is transformers in fp32 on the CPU."""

import pytest
import torch

from gpu_util import hf_policy, random_samples, require
from justrl_megatron.convert.verify import random_tokens
from justrl_megatron.train.step import compute_logprobs, grpo_update
from test_moe import TINY_MOE, _hf_routes, moe_parity, tiny_moe_models

TOL = {"fp32": 1e-4, "bf16": 5e-2}  # logits max |diff| / (1 + max |logit|); bf16: as test_gpu_hf_parity's dense models
MAX_ROUTE_FLIPS = 0.1  # bf16: (token, layer) pairs whose expert set differs from the reference's (CPU: <= 0.021)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    return tiny_moe_models(tmp_path_factory.mktemp("moe_gpu"))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(TINY_MOE))
def test_moe_hf_vs_megatron_on_cuda(moe_models, name, dtype):
    """Megatron on CUDA vs transformers (fp32 arithmetic on the same weights, bf16-rounded for bf16), through
    tests/test_moe.py's `moe_parity`. The routers compute their logits in fp32 (`moe_router_dtype`), but in bf16 the
    hidden states reaching them carry bf16 rounding, so a token whose two best router logits nearly tie may pick
    another expert set than the reference (a route flip: 1-2 % of the (token, layer) pairs on the CPU). That token's
    MLP output then differs at that layer, and every later position attends to it: the natural logits differ by
    ~0.2 of 1 + max |logit| (0.886 at 3.54 on an H200), legitimately, and comparing them would test luck. So:
    - fp32: no near-tie is that close; the natural logits (own routing) agree within 1e-4, as do the forced ones.
    - bf16: Megatron runs with its routes forced to the reference's experts (its combine weights still its own
      softmax of its own fp32 router logits), so the only difference left is arithmetic, and the bound is the dense
      bf16 parity bound (test_gpu_hf_parity: 5e-2 of 1 + max |logit|; on the CPU these MoE cases measure
      0.007-0.012). The tokens with no flip at or before their position take the same bound in the natural run
      (causal: their computation is the forced one). The routing itself is checked by the flip fraction: <= 0.1,
      where an expert mapping or router that were wrong would flip most pairs (4 experts, top-2: a random set
      agrees 1 time in 6). The failure message carries every figure, the flip fraction included."""
    shape, policy = hf_policy(moe_models[name], dtype)
    assert policy.device.type == "cuda" and shape.num_experts == 4
    assert policy.config.moe_router_dtype == "fp32"
    tokens = random_tokens(shape.vocab_size, batch=2, seq_len=48, seed=3)
    got = moe_parity(policy.chunks, moe_models[name], tokens, shape.vocab_size,
                     weight_dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    assert got["ref_max"] > 0.5, got
    if dtype == "fp32":
        assert got["natural_rel"] <= TOL["fp32"] and got["forced_rel"] <= TOL["fp32"], got
    else:
        assert got["forced_rel"] <= TOL["bf16"], got
        assert got["route_flip_fraction"] <= MAX_ROUTE_FLIPS, got
        assert got["clean_rel"] is None or got["clean_rel"] <= TOL["bf16"], got


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
    got = moe_parity(policy.chunks, moe_models["qwen3_moe"], tokens, shape.vocab_size, weight_dtype=torch.bfloat16)
    # bf16: routes forced to the reference's, as in test_moe_hf_vs_megatron_on_cuda (a near-tie flip is no error)
    assert got["forced_rel"] <= TOL["bf16"] and got["route_flip_fraction"] <= MAX_ROUTE_FLIPS, got
