"""train/batching.py (packing plans, packed rows) and train/step.py (one GRPO step) on real megatron-core.

The parity tests run tests/mp/step_parity.py under torchrun (gloo, CPU): a 1-process TP1 reference, then 2- and
4-process jobs with TP2, TP2+SP, PP2, DP2, TP2 x PP2 and PP2 x VPP2 that load the reference weights through megatron's
dist_checkpointing and must reproduce its logits, logprobs, loss, gradients and grad norm for one GRPO step.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import rank_verdicts, run_mp
from justrl_megatron.train.batching import (
    Sample,
    gather_per_target,
    make_micro_batch,
    pack_micro_batches,
    response_offsets,
    split_over_dp,
)
from justrl_megatron.train.step import loss_denominator



# --- batching ------------------------------------------------------------------------------------------------------

def _samples(lengths):
    return [Sample(prompt_ids=[1, 2], response_ids=list(range(3, 3 + n - 2)), advantage=0.5) for n in lengths]


def test_split_over_dp_balances_tokens_and_keeps_every_sample():
    lengths = [30, 5, 22, 8, 17, 13, 9, 40, 3, 11]
    parts = split_over_dp(range(len(lengths)), lengths, 3)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(lengths)  # greedy longest-first: within one sample of balanced
    assert max(loads) <= sum(lengths) / 3 + 40 / 3 + 1
    assert parts == split_over_dp(range(len(lengths)), lengths, 3)  # every rank computes the same plan
    assert all(p == sorted(p) for p in parts)


def test_pack_respects_budget_and_gives_every_rank_the_same_count():
    lengths = [30, 5, 22, 8, 17, 13, 9, 40, 3, 11, 2, 2]
    per_rank = split_over_dp(range(len(lengths)), lengths, 2)
    plans = pack_micro_batches(per_rank, lengths, 48)
    assert len({len(p) for p in plans}) == 1
    for ids, plan in zip(per_rank, plans):
        assert sorted(i for mb in plan for i in mb) == sorted(ids)
        assert all(sum(lengths[i] for i in mb) <= 48 for mb in plan)
    # the interleaved pipeline schedule wants a multiple of the pipeline size
    assert len(pack_micro_batches(per_rank, lengths, 48, multiple_of=4)[0]) % 4 == 0


def test_pack_rejects_a_sample_longer_than_the_budget():
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=16"):
        pack_micro_batches([[0, 1]], [10, 17], 16)


def test_a_rank_without_samples_gets_an_empty_micro_batch():
    plans = pack_micro_batches([[0, 1, 2], []], [10, 10, 10], 15)  # one sample per micro-batch fits
    assert sorted(plans[0]) == [[0], [1], [2]]
    assert plans[1] == [[], [], []]
    mb = make_micro_batch(_samples([10]), [], pad_to_multiple_of=2)
    assert mb.num_targets == 0 and mb.tokens.shape == (1, 2) and mb.cu_seqlens.tolist() == [0, 2]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(2, 40), min_size=1, max_size=40), st.integers(1, 4), st.integers(40, 120))
def test_packing_plan_properties(lengths, dp, budget):
    per_rank = split_over_dp(range(len(lengths)), lengths, dp)
    plans = pack_micro_batches(per_rank, lengths, budget)
    assert len(plans) == dp and len({len(p) for p in plans}) == 1
    seen = sorted(i for plan in plans for mb in plan for i in mb)
    assert seen == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in mb) <= budget for plan in plans for mb in plan)


def test_packed_row_layout():
    samples = [Sample([5, 6, 7], [8, 9], 1.0), Sample([1], [2, 3, 4], -1.0), Sample([11, 12], [13], 0.0)]
    mb = make_micro_batch(samples, [0, 2, 1], pad_to_multiple_of=4)
    assert mb.tokens.tolist() == [[5, 6, 7, 8, 9, 11, 12, 13, 1, 2, 3, 4]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]]
    assert mb.cu_seqlens.tolist() == [0, 5, 8, 12] and mb.cu_seqlens.dtype == torch.int32
    assert mb.max_seqlen == 5 and mb.num_real_tokens == 12
    # position p predicts token p + 1: only response tokens are targets
    assert mb.logit_positions.tolist() == [2, 3, 6, 8, 9, 10]
    assert mb.targets.tolist() == [8, 9, 13, 2, 3, 4]
    assert mb.targets.tolist() == mb.tokens[0, mb.logit_positions + 1].tolist()
    assert mb.row.tolist() == [0, 0, 1, 2, 2, 2] and mb.col.tolist() == [0, 1, 0, 0, 1, 2]
    padded = make_micro_batch(samples, [0, 2], pad_to_multiple_of=4)  # 8 real tokens: no padding needed
    assert padded.tokens.shape == (1, 8)
    padded = make_micro_batch(samples, [0], pad_to_multiple_of=4)  # 5 -> 8: padding is its own segment
    assert padded.cu_seqlens.tolist() == [0, 5, 8] and padded.num_targets == 2
    psp = mb.packed_seq_params()
    assert psp.qkv_format == "thd" and psp.max_seqlen_q == 5 and torch.equal(psp.cu_seqlens_kv, mb.cu_seqlens)


def test_per_target_values_and_offsets():
    samples = [Sample([5, 6, 7], [8, 9], 1.0), Sample([1], [2, 3, 4], -1.0)]
    mb = make_micro_batch(samples, [1, 0])
    values = [torch.tensor([0.1, 0.2]), [1.0, 2.0, 3.0]]
    assert gather_per_target(values, mb).tolist() == pytest.approx([1.0, 2.0, 3.0, 0.1, 0.2])
    assert response_offsets(samples) == [0, 2, 5]
    with pytest.raises(ValueError, match="sample 0"):
        gather_per_target([[0.1], [1.0, 2.0, 3.0]], mb)
    with pytest.raises(ValueError, match="empty prompt"):
        make_micro_batch([Sample([], [1], 0.0)], [0])


def test_loss_denominator_is_global_over_the_mini_batch():
    samples = [Sample([1], [2, 3], 1.0), Sample([1], [], 1.0), Sample([1], [4, 5, 6], 1.0)]
    assert loss_denominator(samples, [0, 1, 2], "token-mean") == 5
    assert loss_denominator(samples, [0, 1, 2], "seq-mean-token-mean") == 2
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        loss_denominator(samples, [0], "token-sum")


# --- multi-rank parity ------------------------------------------------------------------------------------------

def _torchrun(out, mode, nproc):
    run_mp("step_parity.py", out, mode, nproc=nproc)
    return rank_verdicts(out, nproc, prefix=f"{mode}_rank")


@pytest.fixture(scope="module")
def parity_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("step_parity")


@pytest.fixture(scope="module")
def ref(parity_dir):
    return _torchrun(parity_dir, "ref", 1)[0]


@pytest.fixture(scope="module")
def layouts2(parity_dir, ref):
    return _torchrun(parity_dir, "layouts2", 2)


@pytest.fixture(scope="module")
def layouts4(parity_dir, ref):
    return _torchrun(parity_dir, "layouts4", 4)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["qwen", "llama"])
def test_reference_step(ref, shape):
    v = ref[shape]
    assert v["packed_vs_padded"] <= 1e-5  # THD rows through several micro-batches == plain padded rows
    assert v["entropy_vs_naive"] <= 1e-5
    assert v["num_micro_batches"] > 1
    m = v["metrics"]
    assert m["num_optimizer_steps"] == 1 and m["num_response_tokens"] > 0
    # the perturbed behaviour logprobs push tokens out of the clip range on both sides, and past the dual clip
    assert m["clip_frac_low"] > 0 and m["clip_frac_high"] > 0 and m["clip_frac_dual"] > 0
    assert m["ratio_min"] < 0.8 < 1.28 < m["ratio_max"]
    assert v["grad_scale"] > 1e-3 and m["grad_norm"] > 0
    assert v["uneven_steps"] == 2  # mini-batches of 11 and 1 samples: two optimizer steps
    _check_reuse_forward(v["reuse_forward"])
    stale = v["reuse_forward_stale"]  # behaviour logprobs of other weights, TIS: still one proximal policy
    _check_reuse_forward(stale)
    assert "rollout_correction/ratio_mean" in stale["compared"], stale


def _check_reuse_forward(r):
    """One on-policy step with the old logprobs from the update's own forward pass == with a separate pass."""
    assert r["num_samples"] == 12
    assert r["old_diff"] <= 1e-6 and r["metrics_diff"] <= 1e-6 and r["weight_diff"] <= 1e-7, r
    assert r["ratio"] == [1.0, 1.0] and r["clip_fracs"] == [0.0, 0.0, 0.0], r
    assert r["grad_norm"] > 0


@pytest.mark.slow
def test_lr_warms_up_linearly_per_rl_step_then_stays(ref):
    assert ref["warmup_lrs"] == pytest.approx([0.0, 5e-4, 1e-3, 1e-3])


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["qwen", "llama"])
def test_recompute_changes_memory_not_numbers(ref, shape):
    for rc in ("full", "selective"):
        assert ref[shape][f"recompute_{rc}_grad_diff"] <= 1e-7
        assert ref[shape][f"recompute_{rc}_loss_diff"] <= 1e-7


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["qwen", "llama"])
def test_zero_advantages_leave_weights_unchanged(ref, shape):
    v = ref[shape]
    assert v["zero_adv_grad_norm"] == 0.0
    assert v["zero_adv_max_change"] == 0.0
    assert v["real_adv_max_change"] > 1e-4  # the same step with real advantages does move the weights


@pytest.mark.slow
def test_kl_penalty_and_entropy_bonus_enter_the_loss(ref):
    v = ref["kl_entropy"]
    # k3 estimator of a constant log-ratio 0.1: exp(-0.1) - 1 + 0.1 per token, token-mean over the mini-batch
    assert v["kl_loss"] == pytest.approx(math.exp(-0.1) - 1 + 0.1, rel=1e-4)
    assert v["entropy_loss"] == pytest.approx(v["entropy"], rel=1e-5)
    assert v["loss"] == pytest.approx(v["pg_loss"] + 0.5 * v["kl_loss"] - 0.01 * v["entropy_loss"], rel=1e-5)


@pytest.mark.slow
def test_cpu_spec_and_bf16(ref):
    assert ref["spec"] == {"impl": "local", "core_attention": True, "norms": True}
    b = ref["bf16"]
    assert b["param_dtype"] == "torch.bfloat16"
    assert b["logprob_diff"] < 0.05
    assert b["loss"] == pytest.approx(b["ref_loss"], abs=1e-3)
    assert b["grad_norm"] == pytest.approx(b["ref_grad_norm"], rel=0.02)


def _check_layout(verdicts, name, *, tp, pp, dp, sp=False, chunks=1, grads=True):
    last_stage_seen = False
    for rank_verdict in verdicts:
        v = rank_verdict[name]
        assert (v["tp"], v["pp"], v["dp"], v["chunks"], v["sequence_parallel"]) == (tp, pp, dp, chunks, sp)
        assert v["logprob_diff"] <= 1e-5, v
        assert v["loss"] == pytest.approx(v["ref_loss"], abs=1e-6), v
        assert v["grad_norm"] == pytest.approx(v["ref_grad_norm"], rel=1e-5), v
        assert v["metrics_diff"] <= 1e-5, v
        _check_reuse_forward(v["reuse_forward"])
        if grads:
            assert v["grad_diff"] <= 1e-6, v
            assert v["grad_scale"] > 1e-3
        if "logit_diff" in v:  # logits live on the last pipeline stage
            last_stage_seen = True
            assert v["logit_diff"] <= 1e-5, v
    assert last_stage_seen


@pytest.mark.slow
@pytest.mark.parametrize("name,layout", [
    ("tp2", dict(tp=2, pp=1, dp=1)),
    ("tp2_sp", dict(tp=2, pp=1, dp=1, sp=True)),
    ("pp2", dict(tp=1, pp=2, dp=1)),
    ("dp2", dict(tp=1, pp=1, dp=2)),
    ("dp2_distopt", dict(tp=1, pp=1, dp=2, grads=False)),  # grads are sharded: loss + grad norm only
    ("tp2_sp_tied", dict(tp=2, pp=1, dp=1, sp=True)),
])
def test_two_rank_layouts_match_tp1(layouts2, name, layout):
    _check_layout(layouts2, name, **layout)


@pytest.mark.slow
@pytest.mark.parametrize("name,layout", [
    ("tp2pp2", dict(tp=2, pp=2, dp=1)),
    ("pp2vpp2_tied", dict(tp=1, pp=2, dp=2, chunks=2)),
])
def test_four_rank_layouts_match_tp1(layouts4, name, layout):
    _check_layout(layouts4, name, **layout)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gspo", "cispo"])
def test_each_policy_loss_matches_tp1_at_tp2_pp2(ref, layouts4, kind):
    """algo.policy_loss=gspo / cispo: one update through the real Megatron step at TP2 x PP2 gives TP1's loss, grad
    norm and gradients (ppo: every layout test above); and it is a different update from ppo's."""
    t1 = ref["kinds"][kind]
    assert t1["loss"] != pytest.approx(ref["qwen"]["metrics"]["loss"], rel=1e-3)
    for rank_verdict in layouts4:
        v = rank_verdict["kinds"][kind]
        assert v["ref_loss"] == t1["loss"]
        assert v["loss"] == pytest.approx(v["ref_loss"], abs=1e-6), v
        assert v["grad_norm"] == pytest.approx(v["ref_grad_norm"], rel=1e-5), v
        assert v["grad_diff"] <= 1e-6 and v["grad_scale"] > 1e-3, v


@pytest.mark.slow
def test_uneven_mini_batches_with_an_empty_dp_rank(layouts2):
    """Mini-batches of 11 and 1 samples at DP2 (the second leaves one rank a filler micro-batch) == TP1."""
    for rank_verdict in layouts2:
        u = rank_verdict["dp2_distopt"]["uneven"]
        assert u["num_optimizer_steps"] == [2, 2]
        assert u["num_response_tokens"][0] == u["num_response_tokens"][1]
        for key in ("loss", "grad_norm", "grad_norm_max", "entropy"):
            ours, ref = u[key]
            assert ours == pytest.approx(ref, rel=1e-4, abs=1e-6), (key, u)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp2", "dp2_distopt", "tp2_sp"])
def test_sharded_step_matches_the_whole_batch_step_bitwise(layouts2, name):
    """train/shard.py: each DP replica trains on the shard rank 0 scattered (only its samples) exactly as on the whole
    list every rank holds (which the layouts above hold to TP1): metrics, old logprobs and gradients bitwise, for
    several mini-batches after an old-logprob pass and for the on-policy single step."""
    for v in layouts2:
        for case in ("mini_batches", "on_policy"):
            got = v[name]["sharded"][case]
            assert got["metrics_equal"], (name, case, got["differing"])
            assert got["old_equal"] and got["grads_equal"], (name, case)
            whole, shard = got["gap_whole"], got["gap_shard"]
            assert shard["logprob_diff_max"] == whole["logprob_diff_max"] > 0
            assert shard["logprob_diff_tokens"] == whole["logprob_diff_tokens"]
            # one replica: the same sum in the same order; two: float64 reassociation only
            tol = 0 if name == "tp2_sp" else 2 * whole["logprob_diff_tokens"] * 2.0 ** -53 * whole["logprob_diff_mean"]
            assert abs(shard["logprob_diff_mean"] - whole["logprob_diff_mean"]) <= tol
        assert v[name]["sharded"]["mini_batches"]["optimizer_steps"] == 3
        if name != "tp2_sp":  # at DP2 a replica holds part of the batch
            assert v[name]["sharded"]["on_policy"]["held"] < v[name]["sharded"]["on_policy"]["batch"]


def test_vocab_parallel_chunked_logprobs_match_naive(layouts2):
    for rank_verdict in layouts2:
        v = rank_verdict["vocab_parallel"]
        for key in ("logprob_diff", "entropy_diff", "grad_hidden_diff", "grad_weight_diff",
                    "logits_path_logprob_diff", "logits_path_grad_diff"):
            assert v[key] <= 1e-10, (key, v)
        assert v["grad_scale"] > 1e-2


# --- non-finite gradients and loss aggregation on a real policy (in this process: TP1, one rank) -------------------

TINY = dict(family="qwen2", num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
            head_dim=8, vocab_size=120, max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
            qkv_bias=True, tie_word_embeddings=False, init_std=0.02)
STEP_KW = dict(max_tokens_per_micro_batch=32, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)


def _policy(dtype="fp32", distopt=True, lr=1e-2):
    from justrl_megatron.model.hf_config import ModelShape
    from justrl_megatron.model.policy import Policy

    return Policy.build(ModelShape(**TINY), dtype=dtype, transformer_impl="local", lr=lr, warmup_steps=0,
                        weight_decay=0.1, grad_clip=1.0, distributed_optimizer=distopt, seed=7)


def _batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Sample(prompt_ids=torch.randint(1, 120, (3,), generator=g).tolist(),
                   response_ids=torch.randint(1, 120, (n,), generator=g).tolist(),
                   advantage=float(torch.randn((), generator=g))) for n in lengths]


def _snapshot(policy):
    """Model weights, and every tensor of megatron's inner optimizers: their (fp32 master) params and Adam state."""
    out = {f"w{i}.{n}": p.detach().clone() for i, c in enumerate(policy.chunks) for n, p in c.module.named_parameters()}
    for k, opt in enumerate(getattr(policy.optimizer, "chained_optimizers", [policy.optimizer])):
        for g, group in enumerate(opt.optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                out[f"o{k}.{g}.{j}"] = p.detach().clone()
                for name, v in opt.optimizer.state.get(p, {}).items():
                    out[f"o{k}.{g}.{j}.{name}"] = v.detach().clone() if torch.is_tensor(v) else torch.tensor(v)
    return out


def _poison(value):
    def on_grads(policy, step):
        p = next(policy.chunks[0].module.parameters())
        p.main_grad.view(-1)[0] = value
    return on_grads


@pytest.mark.parametrize("dtype,distopt,inject", [("fp32", True, "grad"), ("fp32", True, "advantage"),
                                                  ("bf16", False, "grad")])
def test_non_finite_gradient_skips_the_step(dtype, distopt, inject):
    """A NaN (or inf) in the gradients: no change to any weight or optimizer tensor, gradients zeroed, the skip
    counted; the LR schedule still advances (as verl's); the next good step resets the count and moves the weights."""
    from justrl_megatron.train.step import compute_logprobs, grpo_update

    policy = _policy(dtype, distopt)
    samples = _batch([5, 3, 7, 2])
    def step(**kw):
        old = compute_logprobs(policy, samples, max_tokens_per_micro_batch=32)
        return grpo_update(policy, samples, old, mini_batch_size=4, **STEP_KW, **kw)

    assert step()["skipped_steps"] == 0  # a good step first: Adam has state to protect
    before, lr_steps = _snapshot(policy), policy.scheduler.num_steps
    assert any(k.endswith("exp_avg") for k in before)

    if inject == "grad":
        bad = step(on_grads=_poison(float("nan")))
    else:
        good = samples
        samples = [Sample(s.prompt_ids, s.response_ids, float("nan") if i == 1 else s.advantage)
                   for i, s in enumerate(good)]
        bad = step()
        samples = good
    assert bad["skipped_steps"] == 1 and math.isnan(bad["grad_norm"]) and bad["num_optimizer_steps"] == 1
    after = _snapshot(policy)
    assert after.keys() == before.keys()
    assert [k for k in before if not torch.equal(after[k], before[k])] == []
    assert all(not c.module.parameters().__next__().main_grad.any() for c in policy.chunks)  # zeroed
    assert policy.skipped_in_a_row == 1 and policy.scheduler.num_steps == lr_steps + 1

    assert step(on_grads=_poison(float("inf")))["skipped_steps"] == 1 and policy.skipped_in_a_row == 2
    good = step()
    assert good["skipped_steps"] == 0 and math.isfinite(good["grad_norm"]) and policy.skipped_in_a_row == 0
    moved = _snapshot(policy)
    assert all(torch.isfinite(v).all() for v in moved.values())
    assert any(not torch.equal(moved[k], before[k]) for k in before if k.startswith("w"))


def test_the_guards_norm_pass_is_a_fixed_number_of_ops_over_single_dtype_lists():
    """The guard's device pass over a bf16 policy's fp32 gradients and bf16 weights (plus an fp32 one): the same
    largest norms as per-tensor `torch.linalg.vector_norm`, inf for a NaN; one `_foreach_norm` per dtype, each on a
    list of ONE dtype (CUDA's fused kernel takes nothing else: a mixed list runs a kernel per tensor, which made the
    guard cost 2.2% of an H200 update instead of <1%), and no op per tensor (no per-tensor casts)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from justrl_megatron.train.step import _largest_norms, _trainable_params

    policy = _policy("bf16", distopt=False)
    params = _trainable_params(policy) + [torch.full((3,), 7.0)]
    grads = [torch.randn(p.shape) for p in params]

    def ops(grads, params):
        seen = []

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                norm = func is torch.ops.aten._foreach_norm.Scalar
                seen.append((func, {t.dtype for t in args[0]} if norm else None))
                return func(*args, **(kwargs or {}))

        with Ops():
            return _largest_norms(grads, params, torch.device("cpu")), seen

    got, seen = ops(grads, params)
    want = [max(float(torch.linalg.vector_norm(t.float())) for t in ts) for ts in (grads, params)]
    assert got.dtype == torch.float32 and got.tolist() == pytest.approx(want, rel=1e-6)
    assert {p.dtype for p in params} == {torch.bfloat16, torch.float32} and len(params) > 16
    norms = [dtypes for func, dtypes in seen if dtypes is not None]
    assert len(norms) == 3 and all(len(d) == 1 for d in norms), norms  # fp32 grads; bf16 and fp32 weights
    assert len(ops(grads * 3, params * 3)[1]) == len(seen)  # three times the tensors: not one op more
    grads[5].view(-1)[0] = float("nan")
    assert _largest_norms(grads, params, torch.device("cpu")).tolist() == [math.inf, pytest.approx(want[1])]


@pytest.mark.parametrize("dtype,distopt", [("fp32", True), ("bf16", False)])
def test_a_step_that_makes_the_weights_non_finite_is_taken_back(dtype, distopt):
    """lr=inf (issue 32): a finite gradient, but every new weight NaN / inf. The step is taken back (weights and
    master weights as before, all finite) and counted as skipped, like a non-finite gradient."""
    from justrl_megatron.model.build import nonfinite_parameters
    from justrl_megatron.train.step import compute_logprobs, grpo_update

    policy = _policy(dtype, distopt, lr=float("inf"))
    samples = _batch([5, 3, 7, 2])
    before = {k: v for k, v in _snapshot(policy).items() if k.count(".") <= 2 or k.startswith("w")}  # no Adam state
    old = compute_logprobs(policy, samples, max_tokens_per_micro_batch=32)
    bad = grpo_update(policy, samples, old, mini_batch_size=4, **STEP_KW)
    assert bad["skipped_steps"] == 1 and math.isnan(bad["grad_norm"])  # as a skipped step logs it
    assert policy.skipped_in_a_row == 1 and nonfinite_parameters(policy.chunks) == []
    after = _snapshot(policy)
    assert [k for k in before if not torch.equal(after[k], before[k])] == []


def test_adam_update_bound_holds_for_torchs_adamw():
    """The bound the guard relies on, against torch's own AdamW (what megatron runs on CPU; TE's and apex's FusedAdam
    compute the same update) on gradient sequences built to push |m_hat| / sqrt(v_hat) up: long runs of tiny
    gradients then a large one, growing geometric spikes, constant gradients, and g_k ~ (b2 / b1)^k, which makes
    the bound's Cauchy-Schwarz step an equality. One element per sequence (shorter ones end in zero gradients)."""
    from torch.nn.utils.rnn import pad_sequence

    from justrl_megatron.train.step import adam_update_bound

    g = torch.Generator().manual_seed(0)
    for betas in [(0.9, 0.999), (0.0, 0.999), (0.9, 0.95), (0.5, 0.3)]:
        bound = adam_update_bound(*betas)
        seqs = [torch.cat([torch.full((k,), 1e-12), torch.tensor([1.0])]) for k in (0, 1, 3, 10, 100, 1000)]
        seqs += [torch.tensor([2.0 ** i for i in range(60)]), torch.ones(500), torch.randn(300, generator=g) ** 5]
        if betas[0] > 0:
            seqs.append((betas[1] / betas[0]) ** torch.arange(1200, dtype=torch.float64))
        grads = pad_sequence([x.double() for x in seqs], batch_first=True).T  # [steps, sequences]
        w = torch.nn.Parameter(torch.zeros(grads.shape[1], dtype=torch.float64))
        opt = torch.optim.AdamW([w], lr=1.0, betas=betas, eps=1e-30, weight_decay=0.0)
        worst = 0.0
        for row in grads:
            before = w.detach().clone()
            w.grad = row.clone()
            opt.step()
            worst = max(worst, float((w.detach() - before).abs().max()))
        assert worst <= bound * (1 + 1e-9), (betas, worst, bound)
        assert worst >= 0.5 * bound, (betas, worst, bound)  # nearly reached: not loose by orders of magnitude
    assert adam_update_bound(0.99, 0.9) == math.inf  # beta1^2 >= beta2: unbounded, the guard copies instead


def test_a_normal_step_takes_no_host_copy_and_a_risky_one_does():
    """The guard's cost: no copy of the weights for a step `step_cannot_overflow` clears (lr 1e-2, small weights);
    a weight near fp32's largest number keeps the copy-and-check path (and the step is still taken)."""
    from justrl_megatron.train.step import compute_logprobs, grpo_update, step_cannot_overflow

    copies = []

    class CountCopies(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.to and kwargs.get("copy"):
                copies.append(args[0].numel())
            return func(*args, **kwargs)

    policy = _policy("fp32", True)
    samples = _batch([5, 3, 7, 2])
    old = compute_logprobs(policy, samples, max_tokens_per_micro_batch=32)
    assert step_cannot_overflow(policy, 1.0) and not step_cannot_overflow(policy, 1e38)
    with CountCopies():
        assert grpo_update(policy, samples, old, mini_batch_size=4, **STEP_KW)["skipped_steps"] == 0
    assert copies == []
    with torch.no_grad():
        next(policy.chunks[0].module.parameters()).view(-1)[0] = 1e38
    with CountCopies():
        assert grpo_update(policy, samples, old, mini_batch_size=4, **STEP_KW)["skipped_steps"] == 0
    assert sum(copies) == sum(p.numel() for c in policy.chunks for p in c.parameters())


@pytest.mark.slow
def test_all_ranks_skip_together(tmp_path):
    """2 ranks (DP2, DP2 with the distributed optimizer, TP2): a NaN in one rank's gradients skips the step on both."""
    for v in _torchrun(tmp_path, "guard2", 2):
        for layout in ("dp2", "dp2_distopt", "tp2"):
            g = v[layout]
            assert g["skipped"] == [0, 1, 0] and g["unchanged_after_nan"], (layout, g)
            assert (g["streak_after_nan"], g["streak_after_good"]) == (1, 0), (layout, g)
            assert g["moved_after_good"] and g["finite"], (layout, g)


# justrl-train's loop (tests/mp/loop_recording.py's engine in place of vLLM) with a NaN put into the gradients of every
# optimizer step from the second RL step on
_DIVERGING_RUN = """
import json, sys
sys.path.insert(0, sys.argv[1])
import justrl_megatron.compat  # noqa: F401
from loop_recording import RecordingEngine
from justrl_megatron.config import compose
from justrl_megatron.train import loop
from justrl_megatron.train_entry import apply_memory_plan, check_config


def nan_grads(policy, step_index):
    next(policy.chunks[0].module.parameters()).main_grad.view(-1)[0] = float("nan")


def poisoned(update):
    def wrapped(policy, *args, **kw):
        return update(policy, *args, **kw, **({"on_grads": nan_grads} if policy.scheduler.num_steps >= 1 else {}))
    return wrapped


loop.grpo_update, loop.grpo_update_on_policy = poisoned(loop.grpo_update), poisoned(loop.grpo_update_on_policy)
cfg = compose(sys.argv[3:])
model_dir, shape = check_config(cfg)
apply_memory_plan(cfg, shape)
engine = RecordingEngine(shape.vocab_size)
try:
    code = loop.run(cfg, model_dir, shape, engine=engine) and 0
except SystemExit as exc:
    code = exc.code
with open(sys.argv[2], "w") as f:
    json.dump({"code": code, "calls": engine.calls}, f)
"""


@pytest.mark.slow
def test_consecutive_skips_stop_the_run_after_a_checkpoint_of_the_last_good_weights(tmp_path, tiny_llama):
    import json
    import sys

    from helpers import MP, SHORT_TRAIN, run_ok
    from justrl_megatron.checkpoint import latest_step
    from justrl_megatron.metrics import read_metrics

    run_dir, out = tmp_path / "run", tmp_path / "out.json"
    proc = run_ok([sys.executable, "-c", _DIVERGING_RUN, MP, out, f"model.path={tiny_llama}",
                   f"trainer.run_dir={run_dir}", *SHORT_TRAIN, "trainer.total_steps=6", "trainer.save_every=100",
                   "trainer.max_skipped_steps=2", "trainer.warmup_steps=0", "trainer.weight_decay=0.1",
                   "logging.wandb_mode=disabled"], timeout=600)
    result = json.loads(out.read_text())
    assert result["code"] == 1  # a failed run: not a requeue, not a success
    assert "the last 2 optimizer steps were skipped" in proc.stdout + proc.stderr
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["actor/skipped_steps"] for r in records] == [0, 1, 1]
    syncs = {c[1]: c[3] for c in result["calls"] if c[0] == "update_weights"}  # weight version -> digest
    # step 1 moved the weights (weight decay, at least); the NaN never reached them
    assert syncs[0] != syncs[1] == syncs[2] == syncs[3]
    assert latest_step(run_dir) == 3  # the stop checkpoint (periodic saves are off): the step-1 weights


def test_skip_limit_decides_the_stop():
    from justrl_megatron.train.step import skip_limit_message

    assert skip_limit_message(2, 3) is None and skip_limit_message(0, 3) is None
    assert "trainer.max_skipped_steps=3" in skip_limit_message(3, 3)
    assert skip_limit_message(1, 1) is not None
    assert skip_limit_message(50, 0) is None  # 0: never stop, skip on as verl does


# lengths (prompt 3 + response) 8, 5, 11, 4, 9, 3 under a 16-token budget: three micro-batches, longest first into the
# lightest (checked below), with 8, 7 and 7 response tokens; sample 5's response is empty
AGG_LENGTHS = [5, 2, 8, 1, 6, 0]
AGG_PACKING = [[2, 5], [3, 4], [0, 1]]


def _hand_loss(samples, lp, old, agg):
    """The mini-batch loss from per-token values with plain torch: clipped GRPO loss per token, then each mode's
    weights (token-mean: 1 / all tokens; verl04-dynbsz: sequences in the micro-batch / all sequences / tokens in the
    micro-batch; seq-mean-token-mean: 1 / (non-empty sequences x own length); seq-mean-token-sum: 1 / non-empty)."""
    c, lo, hi = STEP_KW["dual_clip_c"], STEP_KW["clip_low"], STEP_KW["clip_high"]
    tokens = sum(len(s.response_ids) for s in samples)
    nonempty = sum(1 for s in samples if s.response_ids)
    mb_of = {i: mb for mb in AGG_PACKING for i in mb}
    mb_tokens = {i: sum(len(samples[j].response_ids) for j in mb) for i, mb in mb_of.items()}
    total, weights = 0.0, []
    for i, s in enumerate(samples):
        a, r = s.advantage, torch.exp(lp[i].double() - old[i].double())
        pg = torch.maximum(-a * r, -a * r.clamp(1 - lo, 1 + hi))
        if a < 0:
            pg = torch.minimum(pg, torch.full_like(pg, -a * c))
        n = len(s.response_ids)
        w = {"token-mean": 1 / tokens,
             "verl04-dynbsz": len(mb_of[i]) / len(samples) / mb_tokens[i],
             "seq-mean-token-mean": 1 / (nonempty * max(n, 1)),
             "seq-mean-token-sum": 1 / nonempty}[agg]
        total += w * float(pg.sum())
        weights.append(w)
    return total, weights


def test_loss_aggregation_modes_on_the_policy_match_hand_computations():
    """Each algo.loss_agg through the real step (megatron schedule, packed micro-batches): the loss equals the hand
    computation from per-token logprobs, and the gradient equals token-mean's with each advantage scaled by the hand
    weight ratio (the GRPO token loss is positively homogeneous in A, clipping included). lr 0 keeps the weights."""
    from justrl_megatron.algo.grpo import AGG_MODES
    from justrl_megatron.train.step import compute_logprobs, grpo_update, plan_micro_batches

    policy = _policy(lr=0.0)
    samples = _batch(AGG_LENGTHS, seed=3)
    assert [mb.sample_ids for mb in plan_micro_batches(policy, samples, range(6), 16)] == AGG_PACKING
    lp = compute_logprobs(policy, samples, max_tokens_per_micro_batch=16)
    g = torch.Generator().manual_seed(1)
    old = [x + 0.3 * torch.randn(x.shape, generator=g) for x in lp]  # ratios on both sides of the clip range

    def update(batch, agg):
        grads = {}

        def capture(pol, step):
            grads.update({n: p.main_grad.clone() for n, p in pol.chunks[0].module.named_parameters()})
        m = grpo_update(policy, batch, old, mini_batch_size=6, **{**STEP_KW, "max_tokens_per_micro_batch": 16},
                        loss_agg=agg, on_grads=capture)
        return m, grads

    tokens = sum(AGG_LENGTHS)
    results = {}
    for agg in AGG_MODES:
        m, grads = update(samples, agg)
        expect, weights = _hand_loss(samples, lp, old, agg)
        assert m["clip_frac_low"] + m["clip_frac_high"] > 0 and m["num_micro_batches"] == 3
        assert m["loss"] == pytest.approx(expect, rel=1e-5), agg
        scaled = [Sample(s.prompt_ids, s.response_ids, s.advantage * w * tokens) for s, w in zip(samples, weights)]
        _, ref = update(scaled, "token-mean")
        for n in grads:
            torch.testing.assert_close(grads[n], ref[n], rtol=1e-4, atol=1e-8)
        assert max(float(v.abs().max()) for v in grads.values()) > 1e-4
        results[agg] = m["loss"]
    assert results["verl04-dynbsz"] != pytest.approx(results["token-mean"], rel=1e-3)  # they do differ here
