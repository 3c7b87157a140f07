"""Context parallelism (parallel.context): config checks, the batch split, and CP2 parity on real megatron-core.

The parity tests run tests/mp/cp_parity.py under torchrun twice (gloo, CPU, fp32): one 2-rank launch (the CP attention
op; CP2 vs CP1 for a GQA model and a tied-embedding model; a CP2 checkpoint's resume) and one 4-rank launch (CP2 x TP2,
CP2 x DP2, CP2 x TP2 + SP, CP2 x PP2), each case with its own verdict. `-k context_parallel` selects everything here.
"""

import random

import pytest
import torch

from helpers import rank_verdicts, run_mp
from justrl_megatron.config import ConfigError, compose, validate
from justrl_megatron.train.batching import Sample, gather_per_target, make_micro_batch, split_for_context_parallel


# --- config ----------------------------------------------------------------------------------------------------------

def _problems(overrides, world_size):
    with pytest.raises(ConfigError) as err:
        validate(compose(["recipe=justrl_deepseek_1p5b", *overrides]), world_size=world_size)
    return str(err.value)


def test_context_parallel_defaults_to_one_and_validates():
    cfg = compose(["recipe=justrl_deepseek_1p5b", "parallel.context=2", "parallel.tensor=2"])
    validate(cfg, world_size=8)
    assert compose().parallel.context == 1


def test_context_parallel_must_divide_the_world_with_tp_and_pp():
    msg = _problems(["parallel.context=2", "parallel.tensor=2"], world_size=6)
    assert "world size 6 is not divisible by parallel.tensor x parallel.pipeline x parallel.context = 2x1x2" in msg
    assert "parallel.context (0) must be >= 1" in _problems(["parallel.context=0"], world_size=2)


def test_context_parallel_refuses_shared_prompt_on_and_non_additive_loss_aggregations():
    msg = _problems(["parallel.context=2", "trainer.shared_prompt=on", "algo.loss_agg=seq-mean-token-mean"], 2)
    assert "trainer.shared_prompt=on does not work with parallel.context > 1" in msg
    assert "algo.loss_agg=seq-mean-token-mean does not work with parallel.context > 1" in msg
    # auto (the default) is simply off under CP
    from justrl_megatron.model.attention import resolve_shared_prompt
    assert resolve_shared_prompt("auto", "local", 1) and not resolve_shared_prompt("auto", "local", 2)
    with pytest.raises(ValueError, match="does not work with parallel.context > 1"):
        resolve_shared_prompt("on", "local", 2)


def test_context_parallel_with_te_in_fp32_is_refused(monkeypatch):
    """TE has no fp32 attention under CP: refused in one line where TE would run (te, or auto with TE on a GPU)."""
    from justrl_megatron.model import spec

    msg = _problems(["parallel.context=2", "model.dtype=fp32", "model.transformer_impl=te"], 2)
    assert "parallel.context > 1 with the TE spec has no fp32 attention" in msg and "model.dtype=bf16" in msg
    monkeypatch.setattr(spec, "te_available", lambda: True)
    assert "has no fp32 attention" in _problems(["parallel.context=2", "model.dtype=fp32"], 2)
    validate(compose(["recipe=justrl_deepseek_1p5b", "parallel.context=2", "model.dtype=bf16"]), world_size=2)
    validate(compose(["recipe=justrl_deepseek_1p5b", "parallel.context=2", "model.dtype=fp32",
                      "model.transformer_impl=local"]), world_size=2)
    monkeypatch.setattr(spec, "te_available", lambda: False)  # CPU: auto is the local spec, which runs fp32 CP
    validate(compose(["recipe=justrl_deepseek_1p5b", "parallel.context=2", "model.dtype=fp32"]), world_size=2)


# --- the batch split ---------------------------------------------------------------------------------------------------

def _samples(seed=0, n=7):
    rng = random.Random(seed)
    out = [Sample([5], [6], 1.0)]  # 2 tokens: shorter than 2 x CP chunks
    for _ in range(n - 1):
        out.append(Sample([rng.randrange(1, 99) for _ in range(rng.randint(1, 9))],
                          [rng.randrange(1, 99) for _ in range(rng.randint(0, 13))], rng.uniform(-1, 1)))
    return out


@pytest.mark.parametrize("cp,multiple", [(2, 1), (3, 1), (2, 2), (4, 1)])
def test_context_parallel_split_partitions_tokens_and_targets(cp, multiple):
    samples = _samples()
    whole = make_micro_batch(samples, range(len(samples)), pad_to_multiple_of=8)  # + the packer's pad segment
    parts = [split_for_context_parallel(whole, cp, r, multiple_of=multiple) for r in range(cp)]
    cu = parts[0].cu_seqlens.tolist()
    unit = 2 * cp * multiple
    assert all(torch.equal(p.cu_seqlens, parts[0].cu_seqlens) for p in parts)
    assert all((b - a) % unit == 0 and b - a >= unit for a, b in zip(cu[:-1], cu[1:]))
    assert all(p.tokens.size(1) == cu[-1] // cp for p in parts)  # every rank the same number of tokens
    # put the global row back from the chunks (rank r holds chunks r and 2cp-1-r of each sequence)
    row = [None] * cu[-1]
    pos = [None] * cu[-1]
    pad = [None] * cu[-1]
    for r, p in enumerate(parts):
        i = 0
        for a, b in zip(cu[:-1], cu[1:]):
            c = (b - a) // (2 * cp)
            for j in (r, 2 * cp - 1 - r):
                for g in range(a + j * c, a + (j + 1) * c):
                    row[g], pos[g], pad[g] = int(p.tokens[0, i]), int(p.position_ids[0, i]), bool(p.padding[0, i])
                    i += 1
    bounds = whole.cu_seqlens.tolist()
    assert bounds[-2] == whole.num_real_tokens < bounds[-1]
    for (a, b), (pa, pb) in zip(zip(bounds[:-1], bounds[1:]), zip(cu[:-1], cu[1:])):
        assert row[pa:pa + b - a] == whole.tokens[0, a:b].tolist()  # real tokens first, padding after
        assert pos[pa:pb] == list(range(pb - pa))  # true global positions (RoPE)
        # the MoE routers' padding mask: CP's padding after each sequence, and the packer's segment whole
        real = b - a if b <= whole.num_real_tokens else 0
        assert pad[pa:pb] == [False] * real + [True] * (pb - pa - real)
    # every target on exactly one rank, predicted by a local position whose next global token is the target
    seen = sorted((int(rw), int(cl)) for p in parts for rw, cl in zip(p.row, p.col))
    assert seen == sorted(zip(whole.row.tolist(), whole.col.tolist()))
    values = [torch.arange(len(s.response_ids), dtype=torch.float32) + 100 * i for i, s in enumerate(samples)]
    for p in parts:
        assert torch.equal(gather_per_target(values, p), (p.col + 100 * torch.tensor(p.sample_ids)[p.row]).float())
        assert (p.logit_positions < p.tokens.size(1)).all()


def test_context_parallel_split_of_an_empty_filler_micro_batch():
    mb = split_for_context_parallel(make_micro_batch(_samples(), []), 2, 1)
    assert mb.num_targets == 0 and mb.tokens.size(1) == 2 and mb.cu_seqlens.tolist() == [0, 4] and mb.padding.all()


# --- multi-rank parity (tests/mp/cp_parity.py) ------------------------------------------------------------------------

def _launch(tmp_path_factory, nproc):
    out = tmp_path_factory.mktemp(f"cp_parity{nproc}")
    run_mp("cp_parity.py", out, nproc=nproc)
    return rank_verdicts(out, nproc)


@pytest.fixture(scope="module")
def cp2(tmp_path_factory):
    return _launch(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def cp4(tmp_path_factory):
    return _launch(tmp_path_factory, 4)


def _case(verdicts, name):
    per_rank = [v[name] for v in verdicts]
    for v in per_rank:
        assert "error" not in v, v.get("trace", v)
    return per_rank


def _check_layout(per_rank, cp=2, tp=1, pp=1, dp=1):
    for v in per_rank:
        assert (v["cp"], v["tp"], v["pp"], v["dp"], v["dp_cp"]) == (cp, tp, pp, dp, dp * cp)
        # CP splits the tokens: a rank holds about 1 / (DP x CP) of them (plus padding to 2 x CP chunks), the CP1
        # reference's ranks 1 / (DP x CP) too, but of whole samples
        assert v["rank_tokens"] < 0.7 * v["all_tokens"] / dp and v["ref_rank_tokens"] < 0.7 * v["all_tokens"], v
        assert v["num_logprobs"] == v["ref_num_logprobs"] > 0
        assert v["logprob_diff"] <= 1e-6 and v["entropy_diff"] <= 1e-6, v
        # ratio_min/max are exp(logp - old) of two passes, each within 1e-6 of CP1's: their gap may reach 2e-6
        assert all(d <= (2e-6 if k.startswith("ratio") else 1e-6) for k, d in v["metric_diffs"].items()), \
            v["metric_diffs"]
        assert v["grad_diff"] <= 1e-6 < 1e-3 < v["grad_scale"], v
        assert v["weight_diff_plain_adam"] <= 1e-6 and v["weight_diff_distopt_adam"] <= 1e-6, v
        assert v["weight_change_distopt_adam"] > 5e-7  # the step moved the weights (lr 1e-6): not vacuous
        assert min(v["clip_fracs"]) > 0  # the loss's clip branches are all exercised


@pytest.mark.slow
def test_context_parallel_attention_op_matches_packed_attention(cp2):
    for v in _case(cp2, "attention_op"):
        assert v["local_tokens"] * 2 == v["tokens"]
        assert v["out_diff"] <= 1e-12 and max(v["grad_diffs"]) <= 1e-12 < v["grad_scale"], v


@pytest.mark.slow
@pytest.mark.parametrize("case", ["cp2_gqa", "cp2_tied"])
def test_context_parallel_cp2_matches_cp1(cp2, case):
    _check_layout(_case(cp2, case))


@pytest.mark.slow
def test_context_parallel_trains_tool_samples_as_cp1_does(cp2):
    """Tool samples (multi-turn rollouts: a tool's output inside the response, `sampled_mask` 0) at CP2: logprobs,
    loss, gradients and weights equal CP1's, and only the model's tokens are trained (the masked span crosses the
    CP chunks, so each rank masks its own part)."""
    per_rank = _case(cp2, "cp2_tool_samples")
    _check_layout(per_rank)
    for v in per_rank:
        assert v["trained_tokens"] == v["ref_trained_tokens"] == v["model_tokens"] < v["response_tokens"], v


@pytest.mark.slow
def test_context_parallel_checkpoint_resumes_at_the_same_cp(cp2):
    for v in _case(cp2, "checkpoint"):
        assert v["step"] == 1 and v["note"] == "cp2"
        assert v["diff_before_load"] > 1e-7  # the fresh policy differed: the load did something
        assert v["diff_after_load"] == 0.0 and v["diff_after_next_step"] == 0.0, v


@pytest.mark.slow
@pytest.mark.parametrize("case,layout", [("cp2_tp2", dict(tp=2)), ("cp2_dp2", dict(dp=2)),
                                         ("cp2_tp2_sp", dict(tp=2)), ("cp2_pp2", dict(pp=2))])
def test_context_parallel_with_tp_dp_pp_matches_cp1(cp4, case, layout):
    _check_layout(_case(cp4, case), **layout)


# --- the memory plan and the 32K recipe -------------------------------------------------------------------------------

DEEPSEEK_1P5B = dict(family="qwen2", num_layers=28, hidden_size=1536, ffn_hidden_size=8960, num_attention_heads=12,
                     num_query_groups=2, head_dim=128, vocab_size=151936, max_position_embeddings=131072,
                     rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=True, tie_word_embeddings=False, init_std=0.02)
H100_80GB = 81559 * 2**20


def test_context_parallel_memory_plan_counts_activations_and_head_per_cp_rank():
    from justrl_megatron.model.hf_config import ModelShape
    from justrl_megatron.model.memory import activation_bytes_per_token, estimate_peak_bytes, fixed_bytes, \
        logprob_head_bytes

    shape = ModelShape(**DEEPSEEK_1P5B)
    for mode in ("none", "full"):
        one = activation_bytes_per_token(shape, recompute=mode, impl="te")
        assert activation_bytes_per_token(shape, recompute=mode, impl="te", cp=2) == one / 2
        # the local spec keeps the all-gathered K and V (2 KV groups x 128, bf16) per layer kept for backward
        layers = 1 if mode == "full" else 28
        assert activation_bytes_per_token(shape, recompute=mode, cp=4) == pytest.approx(
            activation_bytes_per_token(shape, recompute=mode) / 4 + layers * 2 * 2 * 256)
    tokens = 33792
    peak = estimate_peak_bytes(shape, tokens=tokens, recompute="full", dp=4, cp=2, impl="te")
    assert peak == int(fixed_bytes(shape, dp=8) + tokens * activation_bytes_per_token(shape, recompute="full",
                                                                                       impl="te", cp=2)
                       + logprob_head_bytes(shape, tokens=tokens // 2))
    assert peak < estimate_peak_bytes(shape, tokens=tokens, recompute="full", dp=4, impl="te")


def test_context_parallel_recipe_validates_and_carries_its_memory_plan():
    from pathlib import Path

    from justrl_megatron.model.hf_config import ModelShape
    from justrl_megatron.model.memory import memory_plan_for, plan_memory

    shape = ModelShape(**DEEPSEEK_1P5B)
    cfg = compose(["recipe=justrl_deepseek_1p5b_32k"])
    assert (cfg.parallel.context, cfg.rollout.max_response_length, cfg.trainer.lr) == (2, 32768, 1e-6)
    validate(cfg, world_size=8, shape=shape)
    plan = plan_memory(shape, device_bytes=H100_80GB, max_tokens_per_micro_batch=cfg.trainer.max_tokens_per_micro_batch,
                       min_tokens=cfg.data.max_prompt_length + cfg.rollout.max_response_length, dp=4, cp=2,
                       impl="te")
    header = Path(__file__).parents[1].joinpath("configs/recipe/justrl_deepseek_1p5b_32k.yaml").read_text()
    assert plan.fits and plan.describe().removeprefix("memory plan: ") in header
    # the config's own plan (CPU: local spec, which keeps the gathered K/V too) fits without recompute as well
    local = memory_plan_for(cfg, shape, 8, device_bytes=H100_80GB)
    assert local.fits and local.recompute == "none" and local.max_tokens_per_micro_batch == 33792
    assert local.peak_bytes > plan.peak_bytes
    # without CP the same 32K sample needs full recompute (a third more FLOPs)
    cfg1 = compose(["recipe=justrl_deepseek_1p5b_32k", "parallel.context=1"])
    assert memory_plan_for(cfg1, shape, 8, device_bytes=H100_80GB).recompute == "full"


def test_context_parallel_resume_with_another_cp_size_is_refused(tmp_path):
    from justrl_megatron.run_config import ResumeCheck, record_launch

    record_launch(compose([f"trainer.run_dir={tmp_path}", "parallel.context=2"]), None)
    check = ResumeCheck(compose([f"trainer.run_dir={tmp_path}", "parallel.context=1"]), 5)
    assert len(check.problems) == 1
    assert check.problems[0].startswith("parallel.context changed since the last launch (2 -> 1) but the checkpoint")
    assert ResumeCheck(compose([f"trainer.run_dir={tmp_path}", "parallel.context=2"]), 5).problems == []


def test_context_parallel_bench_takes_cp_like_tp():
    from justrl_megatron.bench import cli, train

    assert cli.parse_args(["--phase", "train", "--cp", "2", "--tp", "2"]).cp == 2
    assert cli.parse_args(["--phase", "train"]).cp == 1
    assert train.parse_args(["cp=2", "--measure-activations", "true"]) == {"cp": 2, "measure_activations": True}
