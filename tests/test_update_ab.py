"""The same-card A/B of gpu_check's `moe` and `fp8` stages (bench/update_ab.py), run on the CPU with tiny models:
the trajectories it compares come from real policies with the setting off and on, and stay within the tolerance
the stage holds the GPU to; the stage summaries read their records."""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)
from justrl_megatron.bench import gpu_check, update_ab
from justrl_megatron.model.hf_config import ModelShape

TINY_MOE = ModelShape(family="qwen3_moe", num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                      num_query_groups=2, head_dim=16, vocab_size=96, max_position_embeddings=128, rope_theta=1e4,
                      rms_norm_eps=1e-6, qkv_bias=False, tie_word_embeddings=False, init_std=0.05, qk_norm=True,
                      num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16)
TINY = ModelShape(family="qwen2", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                  num_query_groups=2, head_dim=16, vocab_size=96, max_position_embeddings=128, rope_theta=1e4,
                  rms_norm_eps=1e-6, qkv_bias=True, tie_word_embeddings=False, init_std=0.05)
SMALL = dict(updates=3, count=2, length=48, prompt_len=8, lr=1e-3)


def test_compare_holds_every_update_to_the_tolerance():
    ref = [{"loss": 0.1, "grad_norm": 2.0}, {"loss": 0.2, "grad_norm": 1.0}]
    got = update_ab.compare(ref, [{"loss": 0.101, "grad_norm": 2.02}, {"loss": 0.2, "grad_norm": 1.0}],
                            loss_abs=5e-3, grad_rel=0.02)
    assert got["ok"] and abs(got["max_grad_norm_rel_diff"] - 0.01) < 1e-9
    assert not update_ab.compare(ref, [ref[0], {"loss": 0.21, "grad_norm": 1.0}], loss_abs=5e-3, grad_rel=0.02)["ok"]
    assert not update_ab.compare(ref, ref[:1], loss_abs=1, grad_rel=1)["ok"]  # a run cut short is no match


def test_grouped_experts_track_the_sequential_ones_over_updates():
    ref = update_ab.trajectory(TINY_MOE, moe_grouped_gemm=False, **SMALL)
    got = update_ab.trajectory(TINY_MOE, moe_grouped_gemm=True, **SMALL)
    assert len({round(r["loss"], 6) for r in ref}) > 1  # the updates move the policy
    assert update_ab.compare(ref, got, **update_ab.TOLERANCES["moe_grouped_gemm"])["ok"], (ref, got)


def test_fp8_tracks_bf16_over_updates():
    ref = update_ab.trajectory(TINY, fp8=False, **SMALL)
    got = update_ab.trajectory(TINY, fp8=True, **SMALL)
    assert got != ref  # FP8 rounding shows
    assert update_ab.compare(ref, got, **update_ab.TOLERANCES["fp8"])["ok"], (ref, got)


def test_the_new_stages_summarise_their_records():
    side = {"update_tokens_per_s": 1000.0, "update_mfu": 0.3}
    moe = {"stage": "moe", "ok": True, "speedup": 2.5, "on": {**side, "update_tokens_per_s": 2500.0}, "off": side,
           "loss_abs_diff": 1e-4, "grad_norm_rel_diff": 0.001}
    assert "grouped 2,500 vs sequential 1,000 tok/s (2.50x)" in gpu_check._summary(moe)
    fp8 = {"stage": "fp8", "ok": False, "speed": {"speedup": 1.3, "off": side, "on": {**side, "update_mfu": 0.39}},
           "trajectory": {"updates": 20, "max_loss_abs_diff": 0.03, "max_grad_norm_rel_diff": 0.05, "ok": False}}
    text = gpu_check._summary(fp8)
    assert "update 1.30x (MFU bf16 30.0%, fp8 39.0%)" in text and "OUTSIDE tolerance" in text
    mfu = {"stage": "mfu", "ok": True, "variants": {"all": {"update": {"mfu": 0.45}}},
           "justrl_packed": {"auto": {"update": {"mfu": 0.41}}, "flash": {"error": "x"}}}
    assert gpu_check._summary(mfu) == "update MFU: all 45.0%, justrl_packed[auto] 41.0%, justrl_packed[flash] n/a"
