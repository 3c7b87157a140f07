"""GRPO advantages and policy loss, checked against plain-Python references written from the rule, not the code."""
import math
import statistics

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from justrl_megatron.algo.grpo import AGG_MODES, aggregate, group_advantages, kl_penalty, policy_loss

CL, CH, C = 0.2, 0.28, 10.0
SETTINGS = settings(max_examples=60, deadline=None)


# ------------------------------------------------------------------------------------------------ references
def ref_token_loss(lp, old, a, clip_low=CL, clip_high=CH, c=C):
    """The clipped objective case by case (PPO paper + dual-clip), for one token."""
    r = math.exp(lp - old)
    if a > 0:
        return -a * min(r, 1 + clip_high)
    if a < 0:
        loss = -a * max(r, 1 - clip_low)
        return -a * c if (c is not None and r > c) else loss
    return 0.0


def ref_token_grad_is_zero(r, a, clip_low=CL, clip_high=CH, c=C):
    if a > 0:
        return r > 1 + clip_high
    if a < 0:
        return r < 1 - clip_low or (c is not None and r > c)
    return True


def ref_aggregate(per_token, mask, agg, denominator=None, num_sequences=None):
    rows = [[v for v, m in zip(vr, mr) if m] for vr, mr in zip(per_token, mask)]
    if agg == "token-mean":
        n = denominator if denominator is not None else sum(len(r) for r in rows)
        return sum(sum(r) for r in rows) / max(n, 1)
    if agg == "verl04-dynbsz":  # one micro-batch alone: its own token mean, times its share of the sequences
        share = len(rows) / (num_sequences if num_sequences is not None else len(rows))
        return sum(sum(r) for r in rows) / max(sum(len(r) for r in rows), 1) * share
    seqs = [(sum(r) / len(r) if agg == "seq-mean-token-mean" else sum(r)) for r in rows if r]
    n = num_sequences if num_sequences is not None else len(seqs)
    return sum(seqs) / max(n, 1)


@st.composite
def batches(draw, min_rows=1, max_rows=4, max_len=6, wide=False):
    b = draw(st.integers(min_rows, max_rows))
    t = draw(st.integers(1, max_len))
    floats = st.floats(-5.0, 0.0, allow_nan=False, width=32)
    deltas = st.floats(-3.0 if wide else -1.0, 3.0 if wide else 1.0, allow_nan=False, width=32)
    old = [[draw(floats) for _ in range(t)] for _ in range(b)]
    lp = [[o + draw(deltas) for o in row] for row in old]
    # no subnormal advantages: their gradients underflow to zero, which is float arithmetic, not clipping
    adv_values = st.sampled_from([-1.5, -0.7, 0.0, 0.4, 1.2]) | st.floats(-2, 2, width=32).filter(
        lambda a: a == 0 or abs(a) > 1e-3)
    adv = [draw(adv_values) for _ in range(b)]
    mask = [[draw(st.booleans()) for _ in range(t)] for _ in range(b)]
    return lp, old, adv, mask


def tensors(lp, old, adv, mask):
    lp_t = torch.tensor(lp, dtype=torch.float32, requires_grad=True)
    return lp_t, torch.tensor(old, dtype=torch.float32), torch.tensor(adv, dtype=torch.float32), \
        torch.tensor(mask, dtype=torch.bool)


# ------------------------------------------------------------------------------------------------ advantages
@SETTINGS
@given(st.integers(1, 4), st.integers(2, 6), st.data())
def test_group_advantages_match_python_statistics(num_groups, n, data):
    rewards = data.draw(st.lists(st.sampled_from([-1.0, 0.0, 0.5, 1.0]), min_size=num_groups * n,
                                 max_size=num_groups * n))
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float64), n)
    adv_nostd = group_advantages(torch.tensor(rewards, dtype=torch.float64), n, norm_by_std=False)
    for g in range(num_groups):
        group = rewards[g * n:(g + 1) * n]
        mean, std = statistics.mean(group), statistics.stdev(group)
        for i, r in enumerate(group):
            expect = 0.0 if len(set(group)) == 1 else (r - mean) / (std + 1e-6)
            assert adv[g * n + i].item() == pytest.approx(expect, abs=1e-9)
            assert adv_nostd[g * n + i].item() == pytest.approx(0.0 if len(set(group)) == 1 else r - mean, abs=1e-12)


def test_identical_groups_are_exactly_zero():
    # 0.1 * 3 / 3 is not exactly 0.1 in floating point: without the explicit check this would be ~1e-11 / eps.
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 1.0, -1.0, -1.0, -1.0], dtype=torch.float32)
    adv = group_advantages(rewards, 3)
    assert torch.equal(adv[:3], torch.zeros(3)) and torch.equal(adv[6:], torch.zeros(3))
    assert adv[3] > 0 > adv[4]
    assert torch.equal(group_advantages(torch.tensor([3.0, -2.0]), 1), torch.zeros(2))  # groups of one


def test_group_advantages_validates_shape():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="flat"):
        group_advantages(torch.zeros(2, 2), 2)
    assert group_advantages(torch.tensor([1, 0, 0, 0]), 4).dtype == torch.float32  # int rewards are promoted


# ------------------------------------------------------------------------------------------------ loss values
@SETTINGS
@given(batches(wide=True), st.sampled_from(AGG_MODES), st.sampled_from([None, 10.0, 3.0]))
def test_policy_loss_matches_reference(batch, agg, c):
    lp, old, adv, mask = batch
    loss, _ = policy_loss(*tensors(lp, old, adv, mask), agg=agg, dual_clip_c=c)
    per_token = [[ref_token_loss(lp[b][t], old[b][t], adv[b], c=c) for t in range(len(lp[0]))] for b in range(len(lp))]
    assert loss.item() == pytest.approx(ref_aggregate(per_token, mask, agg), rel=1e-4, abs=1e-5)


# ------------------------------------------------------------------------------------------------ gradients
@SETTINGS
@given(batches(wide=True), st.sampled_from(AGG_MODES))
def test_clip_regions_have_exactly_zero_gradient_and_sign_follows_advantage(batch, agg):
    lp, old, adv, mask = batch
    ratios = [[math.exp(lp[b][t] - old[b][t]) for t in range(len(lp[0]))] for b in range(len(lp))]
    for row in ratios:  # stay clear of the boundaries, where float32 vs float64 could disagree
        for r in row:
            assume(min(abs(r - (1 - CL)), abs(r - (1 + CH)), abs(r - C)) > 1e-3)
    lp_t, old_t, adv_t, mask_t = tensors(lp, old, adv, mask)
    loss, _ = policy_loss(lp_t, old_t, adv_t, mask_t, agg=agg)
    loss.backward()
    for b in range(len(lp)):
        for t in range(len(lp[0])):
            g = lp_t.grad[b, t].item()
            if not mask[b][t] or ref_token_grad_is_zero(ratios[b][t], adv[b]):
                assert g == 0.0, (b, t, ratios[b][t], adv[b])
            else:
                # minimising the loss raises the log-probability of tokens with positive advantage
                assert g != 0.0 and math.copysign(1, g) == -math.copysign(1, adv[b])


def test_unclipped_gradient_value():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -2.0]])
    loss, _ = policy_loss(lp, old, torch.tensor([2.0]), torch.ones(1, 2, dtype=torch.bool))
    loss.backward()
    # d/dlp of -A exp(lp - old) / 2 tokens
    assert lp.grad[0, 0].item() == pytest.approx(-2.0 * math.exp(0.1) / 2, rel=1e-6)
    assert lp.grad[0, 1].item() == pytest.approx(-2.0 / 2, rel=1e-6)


# ------------------------------------------------------------------------------------------------ micro-batching
@SETTINGS
@given(batches(min_rows=2, max_rows=6), st.sampled_from([m for m in AGG_MODES if m != "verl04-dynbsz"]), st.data())
def test_micro_batches_with_global_denominator_equal_one_big_batch(batch, agg, data):
    lp, old, adv, mask = batch
    lp_t, old_t, adv_t, mask_t = tensors(lp, old, adv, mask)
    full, _ = policy_loss(lp_t, old_t, adv_t, mask_t, agg=agg)
    full.backward()
    grad_full = lp_t.grad.clone()
    lp_t.grad = None

    cut = data.draw(st.integers(1, len(lp) - 1))
    tokens = mask_t.sum()
    seqs = (mask_t.sum(-1) > 0).sum()
    total = 0.0
    for sl in (slice(0, cut), slice(cut, None)):
        part, _ = policy_loss(lp_t[sl], old_t[sl], adv_t[sl], mask_t[sl], agg=agg, denominator=tokens,
                              num_sequences=seqs)
        part.backward()
        total = total + part.detach()
    assert total.item() == pytest.approx(full.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(lp_t.grad, grad_full, rtol=1e-5, atol=1e-7)


# A mini-batch of 5 responses (one empty) packed into micro-batches [[0, 1], [2, 3], [4]]: per-token losses and the
# weight each mode gives each token, written out by hand. No clipping (ratios near 1), so d loss / d logp = -A r w.
PACKING = [[0, 1], [2, 3], [4]]
LENGTHS = [3, 1, 4, 0, 2]   # response tokens; sequence 3 is empty
ADV = [1.0, -0.5, 0.8, 1.3, -1.2]


def _hand_weights(agg):
    """The weight of each token of each sequence in the mini-batch loss sum_i w_i sum_t loss_it."""
    tokens, seqs, nonempty = sum(LENGTHS), len(LENGTHS), sum(1 for n in LENGTHS if n)
    if agg == "token-mean":                        # 1 / 10
        return [1 / tokens] * seqs
    if agg == "verl04-dynbsz":                     # (sequences in mb / 5) * 1 / (tokens in mb)
        w = [0.0] * seqs
        for mb in PACKING:
            for i in mb:
                w[i] = len(mb) / seqs / sum(LENGTHS[j] for j in mb)
        return w
    if agg == "seq-mean-token-mean":               # 1 / (4 non-empty sequences x own length)
        return [1 / (nonempty * n) if n else 0.0 for n in LENGTHS]
    return [1 / nonempty] * seqs                   # seq-mean-token-sum: 1 / 4


@pytest.mark.parametrize("agg", AGG_MODES)
def test_each_mode_over_micro_batches_matches_a_hand_computation(agg):
    """Each micro-batch through policy_loss with the mini-batch denominators the step passes (tokens for token-mean,
    all sequences for verl04-dynbsz, non-empty ones for seq-mean-*): loss and gradient == the hand weights above."""
    g = torch.Generator().manual_seed(0)
    width = max(LENGTHS)
    old = torch.randn(len(LENGTHS), width, generator=g) - 1.0
    lp = (old + 0.05 * torch.randn(old.shape, generator=g)).requires_grad_()
    mask = torch.tensor([[t < n for t in range(width)] for n in LENGTHS])
    adv = torch.tensor(ADV)
    denom = {"token-mean": dict(denominator=sum(LENGTHS)), "verl04-dynbsz": dict(num_sequences=len(LENGTHS))}.get(
        agg, dict(num_sequences=sum(1 for n in LENGTHS if n)))
    total = 0.0
    for mb in PACKING:
        part, m = policy_loss(lp[mb], old[mb], adv[mb], mask[mb], agg=agg, **denom)
        assert m["clip_low_count"] + m["clip_high_count"] + m["clip_dual_count"] == 0
        part.backward()
        total += part.item()

    ratio = torch.exp(lp.detach() - old)
    w = torch.tensor(_hand_weights(agg))[:, None]
    per_token = -adv[:, None] * ratio * mask  # the unclipped GRPO loss of each token
    assert total == pytest.approx(float((w * per_token).sum()), rel=1e-6)
    torch.testing.assert_close(lp.grad, w * per_token, rtol=1e-6, atol=1e-9)


def test_verl04_dynbsz_depends_on_the_packing_and_differs_from_token_mean():
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 0.0, 0.0], [3.0, 3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)

    def verl04(packing):
        return sum(aggregate(values[mb], mask[mb], "verl04-dynbsz", num_sequences=3).item() for mb in packing)

    # [[0, 1], [2]]: 2/3 * (4 + 5) / 5 + 1/3 * 6 / 2 = 2.2;  [[0], [1, 2]]: 1/3 * 1 + 2/3 * 11 / 3 = 2.777...
    assert verl04([[0, 1], [2]]) == pytest.approx(2 / 3 * 9 / 5 + 1 / 3 * 3)
    assert verl04([[0], [1, 2]]) == pytest.approx(1 / 3 + 2 / 3 * 11 / 3)
    assert verl04([[0, 1, 2]]) == pytest.approx(aggregate(values, mask, "token-mean").item()) == 15 / 7


def test_token_mean_denominator_is_used_as_given():
    lp = torch.zeros(2, 3)
    adv = torch.tensor([1.0, 1.0])
    mask = torch.ones(2, 3)
    loss, _ = policy_loss(lp, lp, adv, mask, denominator=24)
    assert loss.item() == pytest.approx(-6 / 24)
    assert aggregate(torch.ones(2, 3), mask, "token-mean", denominator=torch.tensor(12.0)).item() == 0.5
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss(lp, lp, adv, mask, agg="token-sum")


def test_advantage_per_token_equals_per_sequence():
    torch.manual_seed(0)
    lp, old = torch.randn(3, 4), torch.randn(3, 4)
    adv = torch.tensor([0.5, -1.0, 2.0])
    mask = torch.rand(3, 4) > 0.3
    a, _ = policy_loss(lp, old, adv, mask)
    b, _ = policy_loss(lp, old, adv[:, None].expand(3, 4).clone(), mask)
    assert a.item() == b.item()


def test_bf16_inputs_give_float32_loss():
    lp = torch.randn(2, 5).to(torch.bfloat16).requires_grad_()
    loss, _ = policy_loss(lp, lp.detach() + 0.01, torch.tensor([1.0, -1.0]), torch.ones(2, 5))
    loss.backward()
    assert loss.dtype == torch.float32 and lp.grad.dtype == torch.bfloat16 and torch.isfinite(lp.grad).all()


# ------------------------------------------------------------------------------------------------ metrics
def test_metrics_count_each_clip_region():
    # ratios: 1.5 (A>0: high clip), 0.5 (A<0: low clip), 20 (A<0: dual clip), 1.0 (none), 0.5 (A>0: none), masked 3.0
    ratios = torch.tensor([[1.5, 0.5, 20.0, 1.0, 0.5, 3.0]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    old = torch.zeros(1, 6)
    lp = torch.log(ratios)
    _, m = policy_loss(lp, old, adv, mask)
    assert m["num_tokens"].item() == 5
    assert (m["clip_high_count"].item(), m["clip_low_count"].item(), m["clip_dual_count"].item()) == (1, 1, 1)
    assert m["clip_frac_high"].item() == pytest.approx(0.2)
    assert m["ratio_min"].item() == pytest.approx(0.5) and m["ratio_max"].item() == pytest.approx(20.0)
    expect_kl = -(math.log(1.5) + 2 * math.log(0.5) + math.log(20.0)) / 5
    assert m["approx_kl"].item() == pytest.approx(expect_kl, rel=1e-5)
    assert m["approx_kl_sum"].item() == pytest.approx(expect_kl * 5, rel=1e-5)
    assert all(not v.requires_grad for v in m.values())
    _, m_nodual = policy_loss(lp, old, adv, mask, dual_clip_c=None)
    assert m_nodual["clip_dual_count"].item() == 0


def test_empty_mask_is_harmless():
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, m = policy_loss(lp, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(lp.grad, torch.zeros(2, 3))
    assert m["ratio_min"].item() == math.inf and m["ratio_max"].item() == -math.inf


# ------------------------------------------------------------------------------------------------ KL and entropy
def test_kl_estimators():
    lp = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -2.0, -0.1]])
    d = (lp - ref)
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), d)
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), 0.5 * d ** 2)
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.exp(-d) - 1 + d)
    assert (kl_penalty(lp, ref, "k3") >= 0).all()
    assert torch.equal(kl_penalty(lp, lp, "k3"), torch.zeros_like(lp))
    with pytest.raises(ValueError):
        kl_penalty(lp, ref, "k4")


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_is_added_and_off_by_default(estimator):
    torch.manual_seed(1)
    lp, old, ref = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 4, dtype=torch.bool)
    base, _ = policy_loss(lp, old, adv, mask)
    off, m_off = policy_loss(lp, old, adv, mask, ref_logprobs=ref)  # kl_coef=0: JustRL
    on, m = policy_loss(lp, old, adv, mask, ref_logprobs=ref, kl_coef=0.1, kl_estimator=estimator)
    assert off.item() == base.item() and "kl_loss" not in m_off
    expect = base + 0.1 * kl_penalty(lp, ref, estimator).mean()
    assert on.item() == pytest.approx(expect.item(), rel=1e-6)
    assert m["ref_kl_sum"].item() == pytest.approx(kl_penalty(lp, ref, estimator).sum().item(), rel=1e-6)


def test_entropy_bonus_lowers_loss_and_pushes_entropy_up():
    lp = torch.zeros(1, 4)
    entropy = torch.full((1, 4), 2.0, requires_grad=True)
    base, _ = policy_loss(lp, lp, torch.ones(1), torch.ones(1, 4))
    loss, m = policy_loss(lp, lp, torch.ones(1), torch.ones(1, 4), entropy=entropy, entropy_coef=0.01)
    assert loss.item() == pytest.approx(base.item() - 0.01 * 2.0)
    loss.backward()
    assert (entropy.grad < 0).all()  # gradient descent increases entropy
    assert m["entropy_sum"].item() == 8.0
