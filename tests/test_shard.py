"""Each DP replica's shard (train/shard.py) against the plan every rank makes from the whole batch (train/batching.py:
split_over_dp + pack_micro_batches, the plan train/step.py computed before shards): the same micro-batches, the same
global loss denominators and token counts, every sample held where a pass needs it and nowhere else. No megatron."""

import random

import pytest

from justrl_megatron.train.batching import Sample, pack_micro_batches, prompt_units, split_over_dp, unit_length
from justrl_megatron.train.shard import Layout, loss_denominator, plan_shards


def _batch(groups=6, n=4, seed=0, tools=False):
    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(100) for _ in range(rng.randint(2, 9))]
        for _ in range(n):
            response = [rng.randrange(100) for _ in range(rng.randint(0, 20))]
            mask = [rng.randint(0, 1) for _ in response] if tools else None
            samples.append(Sample(prompt, response, advantage=rng.uniform(-1, 1), group=g,
                                  truncated=rng.random() < 0.3, sampled_mask=mask))
    return samples


def _whole_batch_plan(samples, ids, budget, dp, shared, multiple):
    """The plan as train/step.py made it on every rank from the whole batch (before shards), in global ids."""
    units = prompt_units(samples, ids, budget) if shared else [[i] for i in ids]
    lengths = [unit_length(samples, u) for u in units]
    plans = pack_micro_batches(split_over_dp(range(len(units)), lengths, dp), lengths, budget, multiple_of=multiple)
    return [[[units[u] for u in b] for b in rank] for rank in plans]


def _global(shard, micro_batches):
    return [[[shard.ids[k] for k in unit] for unit in mb] for mb in micro_batches]


@pytest.mark.parametrize("dp,shared,multiple,mini,agg,mask", [
    (1, False, 1, 8, "token-mean", False), (2, False, 1, 8, "token-mean", True), (3, True, 1, 6, "seq-mean-token-mean", False),
    (2, False, 2, 24, "verl04-dynbsz", True), (4, True, 1, 5, "token-mean", False), (2, False, 1, 100, "token-mean", False)])
def test_shards_hold_the_whole_batch_plan(dp, shared, multiple, mini, agg, mask):
    samples = _batch(tools=dp == 4)
    budget = 64
    layout = Layout(dp, budget, shared_prompt=shared, multiple_of=multiple)
    shards = plan_shards(samples, layout, mini_batch_size=mini, loss_agg=agg, mask_truncated=mask)
    whole = plan_shards(samples, layout, mini_batch_size=mini, loss_agg=agg, mask_truncated=mask, whole=True)
    n = len(samples)
    logprob = _whole_batch_plan(samples, range(n), budget, dp, shared, multiple)
    minis = [range(a, min(a + mini, n)) for a in range(0, n, mini)]
    updates = [_whole_batch_plan(samples, ids, budget, dp, shared, multiple) for ids in minis]
    for r, (shard, full) in enumerate(zip(shards, whole)):
        assert full.samples == samples and full.ids == list(range(n))
        for s in (shard, full):
            assert _global(s, s.logprob_pass.micro_batches) == logprob[r]
            assert [_global(s, p.micro_batches) for p in s.update_passes] == [u[r] for u in updates]
            assert [p.denominator for p in s.update_passes] == [
                max(loss_denominator(samples, ids, agg, mask), 1) for ids in minis]
            assert [p.num_tokens for p in s.update_passes] == [sum(samples[i].length for i in ids) for ids in minis]
            assert s.response_lengths == [len(x.response_ids) for x in samples] and s.num_samples == n
        # only the samples its passes hold, in the batch's order, the same objects
        needed = {i for plan in (logprob[r], *(u[r] for u in updates)) for mb in plan for unit in mb for i in unit}
        assert shard.ids == sorted(needed)
        assert all(shard.samples[k] is samples[g] for k, g in enumerate(shard.ids))
    # each sample counted once by the logprob passes (the logprob gap), and trained once
    owned = sorted(shard.ids[k] for shard in shards for k in shard.logprob_pass.sample_indices())
    assert owned == list(range(n))
    trained = sorted(shard.ids[k] for shard in shards for p in shard.update_passes for k in p.sample_indices())
    assert trained == list(range(n))
    # a sample goes to at most two replicas (its logprob pass's and its mini-batch's)
    assert all(sum(g in s.ids for s in shards) <= 2 for g in range(n))


def test_one_mini_batch_sends_each_sample_to_one_replica():
    samples = _batch(groups=8)
    shards = plan_shards(samples, Layout(4, 64), mini_batch_size=len(samples))
    assert sorted(g for s in shards for g in s.ids) == list(range(len(samples)))


def test_routing_replay_of_recorded_experts_keeps_the_whole_batch():
    samples = _batch()
    shards = plan_shards(samples, Layout(2, 64, whole=True), mini_batch_size=4)
    assert all(s.samples == samples and s.ids == list(range(len(samples))) for s in shards)


def test_settings_other_than_the_plans_are_refused():
    shard = plan_shards(_batch(), Layout(1, 64), mini_batch_size=8)[0]
    shard.check(max_tokens=64, mini_batch_size=8, loss_agg="token-mean", mask_truncated=False)
    with pytest.raises(ValueError, match="mini_batch_size 4 \\(planned with 8\\)"):
        shard.check(max_tokens=64, mini_batch_size=4)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch 32"):
        shard.check(max_tokens=32)
    with pytest.raises(ValueError, match="mini_batch_size must be >= 1"):
        plan_shards(_batch(), Layout(1, 64), mini_batch_size=0)
    with pytest.raises(ValueError, match="more than trainer.max_tokens_per_micro_batch=8"):
        plan_shards(_batch(), Layout(2, 8), mini_batch_size=8)
