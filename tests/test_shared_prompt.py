"""Shared-prompt updates (trainer.shared_prompt): a GRPO group's responses attend to one copy of their prompt.

Layout (train/batching.py), attention over the gathered rows (model/attention.py) against per-sample causal attention,
the config knob, and the slow parity runs (tests/mp/shared_prompt_parity.py): logprobs, loss, gradients and weights
after one step equal the unshared update at TP1, TP2 + SP, PP2 and DP2.
"""

import pytest
import torch

from helpers import rank_verdicts, run_mp
from justrl_megatron.config import ConfigError, compose, validate
from justrl_megatron.model.attention import packed_causal_attention, shared_prompt_attention
from justrl_megatron.train.batching import Sample, make_micro_batch, make_shared_micro_batch, prompt_units

P = [11, 12, 13]


def _group():
    return [Sample(P, [21, 22, 23, 24], 1.0, group=0), Sample(P, [31, 32], -1.0, group=0),
            Sample([41, 42], [51], 0.5, group=1)]


def test_units_group_by_prompt_and_respect_the_budget():
    samples = [Sample(P, [1] * 5, 0.0), Sample([9], [2] * 3, 0.0), Sample(P, [3] * 4, 0.0), Sample(P, [4] * 6, 0.0)]
    # the prompt (3) + all three responses (15) = 18 tokens: a budget of 12 cuts the group after its first two
    assert prompt_units(samples, range(4), 18) == [[0, 2, 3], [1]]
    assert prompt_units(samples, range(4), 12) == [[0, 2], [3], [1]]
    assert prompt_units(samples, [3, 1], 12) == [[3], [1]]
    with pytest.raises(ValueError, match="sample 3 has 9 tokens .* more than trainer.max_tokens_per_micro_batch=8"):
        prompt_units(samples, range(4), 8)


def test_shared_row_layout():
    samples = _group()
    mb = make_shared_micro_batch(samples, [[0, 1], [2]], pad_to_multiple_of=8)
    # unit 1: prompt 11 12 13, responses 21..24 and 31 32 (positions restart at 3); unit 2: 41 42 51; padding 4
    assert mb.tokens[0].tolist() == [11, 12, 13, 21, 22, 23, 24, 31, 32, 41, 42, 51, 0, 0, 0, 0]
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 3, 4, 0, 1, 2, 0, 1, 2, 3]
    assert mb.cu_seqlens.tolist() == [0, 9, 12, 16] and mb.max_seqlen == 9 and mb.num_real_tokens == 12
    # the last prompt token (2) predicts both first response tokens
    assert mb.logit_positions.tolist() == [2, 3, 4, 5, 2, 7, 10]
    assert mb.targets.tolist() == [21, 22, 23, 24, 31, 32, 51]
    assert mb.row.tolist() == [0, 0, 0, 0, 1, 1, 2] and mb.col.tolist() == [0, 1, 2, 3, 0, 1, 0]
    assert mb.sample_ids == [0, 1, 2] and mb.response_lengths == [4, 2, 1]
    # rows: prompt + first response, prompt + second response, the unshared sample, the padding
    sh = mb.shared
    rows = [sh.gather[a:b].tolist() for a, b in zip(sh.row_cu[:-1].tolist(), sh.row_cu[1:].tolist())]
    assert rows == [[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 7, 8], [9, 10, 11], [12, 13, 14, 15]] and sh.row_max == 7
    # every token's output: the prompt from row 1, each response from its own row
    assert sh.pick.tolist() == [0, 1, 2, 3, 4, 5, 6, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    # each row's positions are those of the unshared sample
    assert mb.position_ids[0][sh.gather].tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]


def test_units_of_one_sample_pack_exactly_as_unshared():
    samples = _group()
    a = make_shared_micro_batch(samples, [[2], [0]], pad_to_multiple_of=2)
    b = make_micro_batch(samples, [2, 0], pad_to_multiple_of=2)
    assert a.shared is None
    for field in ("tokens", "position_ids", "cu_seqlens", "logit_positions", "targets", "row", "col"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


def test_a_unit_must_share_one_prompt():
    samples = _group()
    with pytest.raises(ValueError, match=r"samples \[0, 2\] do not share one prompt"):
        make_shared_micro_batch(samples, [[0, 2]])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_attention_over_shared_rows_equals_each_sample_alone(dtype, tol):
    """q/k/v of the shared layout vs the same vectors laid out unshared (prompt copied per response): outputs and the
    gradients of q, k, v (the prompt's summed over its copies) agree; GQA, uneven lengths, an empty response."""
    g = torch.Generator().manual_seed(0)
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    samples = [Sample(prompts[0], [10] * 6, 0.0), Sample(prompts[0], [11] * 2, 0.0), Sample(prompts[0], [], 0.0),
               Sample(prompts[1], [12] * 3, 0.0), Sample(prompts[1], [13] * 7, 0.0)]
    mb = make_shared_micro_batch(samples, [[0, 1, 2], [3, 4]], pad_to_multiple_of=4)
    t, heads, groups, d, scale = mb.tokens.size(1), 4, 2, 8, 0.3
    q, k, v = (torch.randn(t, h, d, generator=g, dtype=dtype, requires_grad=True) for h in (heads, groups, groups))
    w = torch.randn(t, heads, d, generator=g, dtype=dtype)
    shared_out = shared_prompt_attention(q, k, v, mb.shared, scale)
    shared_grads = torch.autograd.grad((shared_out * w).sum(), (q, k, v))

    # unshared: each sample's prompt + response gathered on its own, then the padding segment
    index, segments = [], [0]
    unit_starts = {0: 0, 3: 13}  # where each unit starts in the shared row: 5 + 6 + 2 + 0 tokens, then the next
    for i, s in enumerate(samples):
        start = unit_starts[0 if i < 3 else 3]
        p = len(s.prompt_ids)
        offset = start + p + sum(len(samples[j].response_ids) for j in range(0 if i < 3 else 3, i))
        index += list(range(start, start + p)) + list(range(offset, offset + len(s.response_ids)))
        segments.append(len(index))
    index += list(range(mb.num_real_tokens, t))
    segments.append(len(index))
    index = torch.tensor(index)
    assert mb.num_real_tokens == 13 + 2 + 10 and mb.tokens[0][index].tolist() == sum(
        [s.prompt_ids + s.response_ids for s in samples], []) + [0] * (t - mb.num_real_tokens)
    plain_out = packed_causal_attention(q[index], k[index], v[index], torch.tensor(segments, dtype=torch.int32),
                                        max(b - a for a, b in zip(segments[:-1], segments[1:])), scale)
    # every token of the shared row equals its copy in the unshared layout (the prompt: its first copy); the loss
    # counts each token once, as the shared layout does (a prompt's output is the same in each of its copies)
    first_copy = {}
    for place, token in enumerate(index.tolist()):
        first_copy.setdefault(token, place)
    where = torch.tensor([first_copy[token] for token in range(t)])
    once = torch.zeros(len(index), 1, 1, dtype=dtype).index_fill(0, where, 1.0)
    plain_grads = torch.autograd.grad((plain_out * w[index] * once).sum(), (q, k, v))
    assert float((shared_out - plain_out[where]).abs().max()) <= tol
    for a, b in zip(shared_grads, plain_grads):
        assert float((a - b).abs().max()) <= tol * 10
    assert float(shared_grads[1][:5].abs().max()) > 0  # the prompt's keys get gradient from every response


def test_the_config_knob():
    from justrl_megatron.model.attention import resolve_shared_prompt

    assert resolve_shared_prompt("auto", "local") and not resolve_shared_prompt("auto", "te")
    assert resolve_shared_prompt(True, "local") and not resolve_shared_prompt("off", "local")
    with pytest.raises(ValueError, match="trainer.shared_prompt=on needs model.transformer_impl=local"):
        resolve_shared_prompt("on", "te")
    with pytest.raises(ConfigError, match="trainer.shared_prompt must be auto, on or off, got 'sometimes'"):
        validate(compose(["trainer.shared_prompt=sometimes"]), world_size=1)
    with pytest.raises(ConfigError, match="trainer.shared_prompt=on needs model.transformer_impl=local or auto"):
        validate(compose(["trainer.shared_prompt=on", "model.transformer_impl=te"]), world_size=1)
    assert compose([]).trainer.shared_prompt == "auto"
    validate(compose(["trainer.shared_prompt=true"]), world_size=1)


# --- the update, shared vs unshared, on real megatron-core -----------------------------------------------------------

def _check(verdicts, layouts):
    for rank, verdict in enumerate(verdicts):
        for layout in layouts:
            for shape, v in verdict[layout].items():
                where = f"{layout}/{shape}/rank {rank}: {v}"
                assert v["start_diff"] == 0.0, where
                assert v["logprob_diff"] <= 1e-6, where
                assert v["metrics_diff"] <= 1e-6, where
                assert v["grad_diff"] <= 1e-6 and v["grad_norm"] > 1e-3, where
                # Adam's first step is lr x g / (|g| + eps): on a coordinate whose gradient is ~eps (1e-8), the
                # gradients' 1e-8 summation-order difference moves it by ~1% of lr (1.09e-6 of 1e-4 measured on an
                # AVX512 machine; <= 1e-6 on AVX2), so the bound is 2% of the step, not an absolute 1e-6
                assert v["weight_moved"] > 1e-5 and v["weight_diff"] <= 0.02 * v["weight_moved"], where
                assert 0 in v["num_logprobs"] and sum(v["num_logprobs"]) > 50, where  # the empty response too
                # the budget cuts groups into units over several micro-batches, most of them shared
                assert v["micro_batches"] >= 2 and v["shared_micro_batches"] >= 1, where
                assert v["tokens_shared"] < v["tokens_plain"], where


@pytest.mark.slow
def test_shared_prompt_update_equals_unshared_tp1(tmp_path):
    run_mp("shared_prompt_parity.py", tmp_path, "one", nproc=1)
    _check(rank_verdicts(tmp_path, 1, prefix="one_rank"), ["tp1"])


@pytest.mark.slow
def test_shared_prompt_update_equals_unshared_tp2_sp_pp2_dp2(tmp_path):
    run_mp("shared_prompt_parity.py", tmp_path, "two", nproc=2)
    _check(rank_verdicts(tmp_path, 2, prefix="two_rank"), ["tp2_sp", "pp2", "dp2"])
