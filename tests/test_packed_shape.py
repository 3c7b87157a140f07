"""The JustRL-shaped update batch (bench/packed_shape.py): its length distribution, its FLOP count with shared
prompts, and the train benchmark running it with trainer.shared_prompt on (gpu_check's `mfu` stage row
`justrl_packed`)."""

import math
import statistics

from justrl_megatron.bench import packed_shape
from justrl_megatron.model.hf_config import ModelShape

SHAPE = ModelShape(family="qwen2", num_layers=3, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4,
                   num_query_groups=2, head_dim=16, vocab_size=500, max_position_embeddings=512, rope_theta=1e4,
                   rms_norm_eps=1e-6, qkv_bias=True, tie_word_embeddings=False, init_std=0.02)


def test_response_lengths_are_justrl_shaped():
    groups = packed_shape.response_lengths(400, seed=3)
    assert groups == packed_shape.response_lengths(400, seed=3) and len(groups) == 400
    assert all(len(g) == 8 for g in groups)
    flat = [n for g in groups for n in g]
    assert abs(statistics.median(flat) / 5000 - 1) < 0.05
    at_cap = sum(n == 15360 for n in flat) / len(flat)
    # P(log-normal(ln 5000, 0.8) > 15360) = P(z > ln(3.072) / 0.8 = 1.40) = 8.0 %
    assert 0.065 < at_cap < 0.095 and max(flat) == 15360 and min(flat) >= 1


def test_shared_prompt_flops_count_each_prompt_once():
    samples = packed_shape.justrl_samples(2, SHAPE.vocab_size, seed=0, prompt_len=30, median=40, cap=90)
    assert len(samples) == 16 and len({tuple(s.prompt_ids) for s in samples}) == 2
    assert {s.group for s in samples} == {0, 1} and {s.advantage for s in samples} == {-1.0, 1.0}
    s, q = SHAPE, SHAPE.num_attention_heads * SHAPE.head_dim
    per_token = 2 * s.num_layers * (s.hidden_size * (q + 2 * s.num_query_groups * s.head_dim) + q * s.hidden_size
                                    + 3 * s.hidden_size * s.ffn_hidden_size)
    responses = [len(x.response_ids) for x in samples]
    tokens = 2 * 30 + sum(responses)
    causal = 2 * 30 * 31 / 2 + sum(30 * r + r * (r + 1) / 2 for r in responses)
    expected = per_token * tokens + 4 * q * s.num_layers * causal + 2 * s.hidden_size * 512 * sum(responses)
    got = packed_shape.shared_prompt_forward_flops(SHAPE, samples, vocab=512)
    assert math.isclose(got, expected, rel_tol=1e-12)


def test_the_train_benchmark_runs_a_justrl_batch_with_shared_prompts(monkeypatch):
    from justrl_megatron.bench import train as bench

    monkeypatch.setattr(bench, "resolve_shape", lambda name: SHAPE)
    samples = packed_shape.justrl_samples(2, SHAPE.vocab_size, seed=1, prompt_len=20, median=30, cap=60)
    raw = bench.bench_train(model="justrl-tiny", samples=samples, shared_prompt="on", dtype="fp32",
                            transformer_impl="local", steps=1, warmup=0, max_tokens_per_micro_batch=256)
    assert raw["shared_prompt"] is True and raw["num_sequences"] == 16
    assert raw["tokens_per_step"] == 2 * 20 + sum(len(x.response_ids) for x in samples)
    assert raw["micro_batches"] >= 2  # packed to the budget: several micro-batches of several sequences
    flops = packed_shape.shared_prompt_forward_flops(SHAPE, samples, vocab=512)  # 500 padded to a multiple of 128
    assert math.isclose(raw["update"]["flops"], 3 * flops, rel_tol=1e-12)
