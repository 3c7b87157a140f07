"""The policy-loss family (ppo, gspo, cispo) and the advantage estimators (grpo, rloo, reinforce_pp_baseline) against
values and gradients computed by hand on small tensors; their composition with TIS, KL and entropy; the k3 and
rollout.n fixes. The same kinds through the real Megatron step (TP1 vs TP2 x PP2): tests/test_step.py."""

import math

import pytest
import torch

from justrl_megatron.algo import LossConfig, compute_advantages, kl_penalty, policy_loss

# two responses: 3 tokens and 2 tokens (the third position of row 1 is padding)
LP = [[-1.0, -0.5, -2.0], [-0.3, -1.2, 0.0]]
OLD = [[-1.1, -0.4, -2.05], [-0.2, -1.0, 0.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
ADV = [1.5, -0.5]


def tensors():
    lp = torch.tensor(LP, requires_grad=True)
    return lp, torch.tensor(OLD), torch.tensor(ADV), torch.tensor(MASK)


# --- gspo ------------------------------------------------------------------------------------------------------------

def test_gspo_value_and_gradient_by_hand():
    lp, old, adv, mask = tensors()
    loss, m = policy_loss(lp, old, adv, mask, kind="gspo", clip_low=0.5, clip_high=0.5)
    # sequence ratios: exp of the mean token log-ratio over each response
    s0 = math.exp(((-1.0 + 1.1) + (-0.5 + 0.4) + (-2.0 + 2.05)) / 3)
    s1 = math.exp(((-0.3 + 0.2) + (-1.2 + 1.0)) / 2)
    # nothing clipped with the wide range: per sequence -A s, averaged over its tokens (equal), then over sequences
    assert loss.item() == pytest.approx((-1.5 * s0 + 0.5 * s1) / 2, rel=1e-6)
    loss.backward()
    # d/dlogp_t of (1/2) * mean_t(-A s) = -A s / (2 |y|) on every token of the response; padding gets nothing
    expected = [[-1.5 * s0 / 6] * 3, [0.5 * s1 / 4] * 2 + [0.0]]
    assert torch.allclose(lp.grad, torch.tensor(expected), atol=1e-7)
    assert m["ratio_min"].item() == pytest.approx(min(s0, s1), rel=1e-6)
    assert m["clip_low_count"].item() == m["clip_high_count"].item() == m["clip_dual_count"].item() == 0


def test_gspo_clips_whole_sequences_with_its_own_range():
    lp, old, adv, mask = tensors()
    loss, m = policy_loss(lp, old, adv, mask, kind="gspo", clip_low=3e-4, clip_high=4e-4)
    s0 = math.exp(0.05 / 3)  # > 1 + 4e-4 with A > 0: clipped, no gradient, every token of the sequence counted
    s1 = math.exp(-0.3 / 2)  # < 1 - 3e-4 with A < 0: clipped
    assert loss.item() == pytest.approx((-1.5 * (1 + 4e-4) + 0.5 * (1 - 3e-4)) / 2, rel=1e-6)
    loss.backward()
    assert torch.count_nonzero(lp.grad) == 0
    assert (m["clip_high_count"].item(), m["clip_low_count"].item()) == (3, 2)
    assert s0 > 1 + 4e-4 and s1 < 1 - 3e-4


def test_gspo_ignores_loss_agg_and_empty_rows():
    lp, old, adv, mask = tensors()
    a, _ = policy_loss(lp, old, adv, mask, kind="gspo", agg="token-mean")
    b, _ = policy_loss(lp, old, adv, mask, kind="gspo", agg="seq-mean-token-sum")
    assert a.item() == b.item()  # GSPO's objective is seq-mean-token-mean whatever loss_agg says
    assert LossConfig(policy_loss="gspo", loss_agg="token-mean").aggregation == "seq-mean-token-mean"
    empty = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    loss, m = policy_loss(lp, old, adv, empty, kind="gspo", clip_low=0.5, clip_high=0.5)
    s0 = math.exp(0.05 / 3)
    assert loss.item() == pytest.approx(-1.5 * s0, rel=1e-6) and m["num_tokens"].item() == 3


# --- cispo -----------------------------------------------------------------------------------------------------------

def test_cispo_value_and_gradient_by_hand():
    lp, old, adv, mask = tensors()
    loss, m = policy_loss(lp, old, adv, mask, kind="cispo", clip_low=0.05, clip_high=0.1)
    ratios = torch.exp(torch.tensor(LP) - torch.tensor(OLD))
    w = ratios.clamp(0.95, 1.1)
    a = torch.tensor(ADV)[:, None]
    m_ = torch.tensor(MASK)
    # token-mean (the default loss_agg) over the 5 response tokens of -sg(w) * A * logp
    assert loss.item() == pytest.approx(float((-(w * a) * torch.tensor(LP) * m_).sum() / 5), rel=1e-6)
    loss.backward()
    # every token keeps a gradient, -w A / 5, even where its weight is capped
    assert torch.allclose(lp.grad, -(w * a) * m_ / 5, atol=1e-7)
    assert torch.count_nonzero(lp.grad) == 5
    # ratios: row 0 exp(0.1)=1.105 (capped), exp(-0.1)=0.905 (capped), exp(0.05); row 1 exp(-0.1), exp(-0.2)
    assert (m["clip_high_count"].item(), m["clip_low_count"].item()) == (1, 3)


def test_cispo_follows_loss_agg():
    lp, old, adv, mask = tensors()
    tm, _ = policy_loss(lp, old, adv, mask, kind="cispo")
    sm, _ = policy_loss(lp, old, adv, mask, kind="cispo", agg="seq-mean-token-mean")
    assert tm.item() != pytest.approx(sm.item())


# --- every kind composes with TIS weights, KL and entropy ------------------------------------------------------------

@pytest.mark.parametrize("kind", ["ppo", "gspo", "cispo"])
def test_each_kind_composes_with_tis_kl_and_entropy(kind):
    lp, old, adv, mask = tensors()
    ref = torch.tensor(LP) - 0.2
    ent = torch.tensor([[0.5, 0.4, 0.3], [0.2, 0.1, 0.0]])
    w = torch.tensor([[1.0, 2.0, 0.5], [1.5, 1.0, 1.0]])
    base, _ = policy_loss(lp, old, adv, mask, kind=kind)
    weighted, _ = policy_loss(lp, old, adv, mask, kind=kind, weights=w)
    full, m = policy_loss(lp, old, adv, mask, kind=kind, weights=w, ref_logprobs=ref, kl_coef=0.1,
                          entropy=ent, entropy_coef=0.01)
    assert weighted.item() != pytest.approx(base.item())  # the weights act on the policy-gradient term
    agg = LossConfig(policy_loss=kind).aggregation
    kl_ref, _ = policy_loss(lp, lp, torch.zeros(2), mask, kind="ppo", agg=agg, ref_logprobs=ref, kl_coef=1.0)
    ent_ref, _ = policy_loss(lp, lp, torch.zeros(2), mask, kind="ppo", agg=agg, entropy=ent, entropy_coef=1.0)
    assert full.item() == pytest.approx(weighted.item() + 0.1 * kl_ref.item() + 0.01 * ent_ref.item(), rel=1e-5)
    assert m["kl_loss"].item() == pytest.approx(kl_ref.item(), rel=1e-6)
    full.backward()
    assert torch.isfinite(lp.grad).all()


def test_unknown_kind_is_refused():
    lp, old, adv, mask = tensors()
    with pytest.raises(ValueError, match="unknown policy loss 'grpo'"):
        policy_loss(lp, old, adv, mask, kind="grpo")
    with pytest.raises(TypeError, match="unknown loss setting"):
        policy_loss(lp, old, adv, mask, clip_hihg=0.3)


# --- advantage estimators --------------------------------------------------------------------------------------------

def test_rloo_is_the_leave_one_out_baseline():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5])
    adv = compute_advantages(r, 4, estimator="rloo")
    # group 0: 1 - mean(0, 0, 1) = 2/3, 0 - mean(1, 0, 1) = -2/3; group 1: 1 - mean(1, 0, .5) = 0.5, ...
    expected = [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.5, 0.5, -5 / 6, -1 / 6]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-6)
    assert adv.dtype == torch.float32


def test_reinforce_pp_baseline_whitens_over_response_tokens():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    lengths = [2, 1, 3, 0]  # the empty response counts for nothing
    adv = compute_advantages(r, 2, estimator="reinforce_pp_baseline", response_lengths=lengths)
    # centred: [0.5, -0.5, 0, 0]; group 1 is all-equal -> exactly 0 after whitening too
    values = torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64)
    counts = torch.tensor(lengths, dtype=torch.float64)
    mean = (values * counts).sum() / counts.sum()  # (1 - 0.5) / 6
    var = ((values - mean) ** 2 * counts).sum() / (counts.sum() - 1)
    expected = (values - mean) / torch.sqrt(var + 1e-8)
    expected[2:] = 0.0
    assert torch.allclose(adv.double(), expected, atol=1e-6)
    # per sample (no lengths): each response counts once
    per_sample = compute_advantages(r, 2, estimator="reinforce_pp_baseline")
    v = torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64)
    exp2 = (v - v.mean()) / torch.sqrt(v.var() + 1e-8)
    exp2[2:] = 0.0
    assert torch.allclose(per_sample.double(), exp2, atol=1e-6)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_all_equal_groups_get_exactly_zero(estimator):
    r = torch.tensor([0.3, 0.3, 0.3, 1.0, 0.0, 1.0, 0.7, 0.7, 0.7])
    adv = compute_advantages(r, 3, estimator=estimator, response_lengths=[5, 1, 2, 3, 3, 3, 1, 1, 9])
    assert adv[:3].eq(0).all() and adv[6:].eq(0).all() and adv[3:6].ne(0).all()


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_a_group_of_one_is_refused(estimator):
    with pytest.raises(ValueError, match="groups of at least 2"):
        compute_advantages(torch.tensor([1.0, 0.0]), 1, estimator=estimator)


def test_grpo_estimator_is_group_advantages():
    from justrl_megatron.algo import group_advantages

    r = torch.rand(12, generator=torch.Generator().manual_seed(0))
    assert torch.equal(compute_advantages(r, 4), group_advantages(r, 4))
    assert torch.equal(compute_advantages(r, 4, norm_by_std=False), group_advantages(r, 4, norm_by_std=False))


# --- the two fixes ---------------------------------------------------------------------------------------------------

def test_k3_gradient_is_finite_far_from_the_reference():
    lp = torch.tensor([-89.0, -30.0, -1.0], requires_grad=True)
    kl = kl_penalty(lp, torch.tensor([0.0, 0.0, -1.2]), "k3")
    kl.sum().backward()
    assert torch.isfinite(lp.grad).all()
    assert kl[0].item() == kl[1].item() == 10.0  # clamped as before
    assert kl[2].item() == pytest.approx(math.exp(-0.2) - 1 + 0.2, rel=1e-5)  # unchanged inside the range


def test_config_refuses_groups_of_one_and_unknown_kinds():
    from justrl_megatron.config import ConfigError, compose, validate

    for overrides, message in ((["rollout.n=1"], "a group of one always gets advantage 0"),
                               (["algo.policy_loss=grpo"], "algo.policy_loss must be one of ppo, gspo, cispo"),
                               (["algo.advantage=ppo"], "algo.advantage must be one of grpo, rloo")):
        with pytest.raises(ConfigError, match=message):
            validate(compose(["recipe=cpu_demo", *overrides]), world_size=1)


def test_gspo_with_ppo_clip_range_warns_once():
    from justrl_megatron.config import compose, config_warnings

    assert config_warnings(compose(["recipe=cpu_demo"])) == []
    warned = config_warnings(compose(["recipe=cpu_demo", "algo.policy_loss=gspo"]))
    assert len(warned) == 1 and "clips nothing" in warned[0] and "3e-4" in warned[0]
    assert config_warnings(compose(["recipe=cpu_demo", "algo.policy_loss=gspo", "algo.clip_low=3e-4",
                                    "algo.clip_high=4e-4"])) == []


# --- verl core_algos (b178a3cd) details --------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "verl04-dynbsz"])
def test_nan_and_minus_inf_in_masked_positions_leave_loss_and_metrics_finite(kind, agg):
    """As verl's masked aggregation: whatever lies outside the mask (a NaN, -inf logprobs) is never read; the loss,
    its gradient and the token metrics equal those of the same batch with zeros there."""
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(2, 5, generator=g)).requires_grad_()
    old = -torch.rand(2, 5, generator=g)
    adv, mask = torch.tensor([1.0, -0.5]), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    bad_old = old.masked_fill(mask == 0, float("nan"))
    bad_lp = lp.masked_fill(mask == 0, float("-inf"))
    kw = dict(kind=kind, agg=agg, clip_low=0.2, clip_high=0.28)
    loss, m = policy_loss(bad_lp, bad_old, adv, mask, **kw)
    ref, m_ref = policy_loss(lp.masked_fill(mask == 0, 0.0), old.masked_fill(mask == 0, 0.0), adv, mask, **kw)
    assert torch.isfinite(loss) and abs(float(loss) - float(ref)) <= 1e-6
    assert all(torch.isfinite(m[k]) and abs(float(m[k]) - float(m_ref[k])) <= 1e-6
               for k in ("pg_loss", "approx_kl_sum", "approx_kl"))


def test_gspo_clamps_the_sequence_log_ratio_at_10_from_above_only_as_verl():
    """verl's GSPO: exp(clamp(log_ratio_seq, max=10)); below, no clamp (a ratio of exp(-30) stays exp(-30))."""
    lp = torch.zeros(2, 3)
    old = torch.tensor([[-12.0, -12.0, -12.0], [30.0, 30.0, 30.0]])
    adv, mask = torch.tensor([1.0, 1.0]), torch.ones(2, 3)
    _, m = policy_loss(lp, old, adv, mask, kind="gspo", clip_low=0.2, clip_high=0.28)
    assert abs(float(m["ratio_max"]) - math.exp(10.0)) <= 1e-3 * math.exp(10.0)
    assert abs(float(m["ratio_min"]) - math.exp(-30.0)) <= 1e-3 * math.exp(-30.0)
