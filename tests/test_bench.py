"""justrl-bench: FLOP / MFU arithmetic against a hand count, the step summary, argument errors, every phase end to
end on a tiny model (valid JSON with every field), and a one-step smoke run against TRL's GRPOTrainer."""

import json
import math
import sys

import pytest

from helpers import ENV, run_ok
from justrl_megatron.bench import flops
from justrl_megatron.model.hf_config import ModelShape, padded_vocab_size

BENCH_ENV = {**ENV, "OMP_NUM_THREADS": "2"}  # the phases are timed: two threads, as a user would run them
# the tiny_llama fixture (conftest.py) at head_dim 64: vLLM's CPU attention has no kernel for 16
TINY_LLAMA = dict(num_heads=2, num_kv_heads=1, intermediate_size=256)
SMALL = ModelShape(family="llama", num_layers=2, hidden_size=8, ffn_hidden_size=12, num_attention_heads=2,
                   num_query_groups=1, head_dim=4, vocab_size=10, max_position_embeddings=64, rope_theta=1e4,
                   rms_norm_eps=1e-6, qkv_bias=False, tie_word_embeddings=True, init_std=0.02)


# --- arithmetic --------------------------------------------------------------------------------------------------------

def hand_count_forward(seq_lens, logit_rows):
    """FLOPs counted matrix by matrix and position by position (2 per multiply-add) for SMALL."""
    h, heads, groups, d, ffn, vocab, layers = 8, 2, 1, 4, 12, 10, 2
    weights = {"q": (h, heads * d), "k": (h, groups * d), "v": (h, groups * d), "o": (heads * d, h),
               "gate": (h, ffn), "up": (h, ffn), "down": (ffn, h)}
    total = 0
    for _ in range(layers):
        for length in seq_lens:
            for pos in range(1, length + 1):  # token `pos` of its sequence attends to `pos` keys (causal)
                total += sum(2 * a * b for a, b in weights.values())
                total += heads * (2 * d * pos)  # q . k for each visible key
                total += heads * (2 * d * pos)  # weights x v
    total += 2 * h * vocab * logit_rows  # output projection for the positions whose logprobs are needed
    return total


def test_forward_and_update_flops_match_a_hand_count():
    # per layer per token: 2 x (64 + 32 + 32 + 64 + 96 + 96 + 96) = 960; attention 4 x 8 x (1+2+3 + 1+2) = 288
    assert hand_count_forward([3, 2], 4) == 2 * 960 * 5 + 2 * 288 + 2 * 8 * 10 * 4 == 10816
    assert flops.forward_flops(SMALL, [3, 2], 4) == 10816
    assert flops.forward_flops(SMALL, [7], 6) == hand_count_forward([7], 6)
    assert flops.forward_flops(SMALL, [5, 1, 9], 3, vocab=128) == hand_count_forward([5, 1, 9], 3) - 2 * 8 * 10 * 3 \
        + 2 * 8 * 128 * 3  # the padded vocabulary is what the output projection multiplies
    assert flops.update_flops(SMALL, [3, 2], 4) == 3 * 10816


def test_mfu_arithmetic():
    # 1e12 FLOPs in 2 s on 4 devices = 0.125 TFLOP/s per device; against a 0.25 TFLOP/s peak: 50 %
    assert flops.tflops_per_device(1e12, 2.0, 4) == pytest.approx(0.125)
    assert flops.mfu(1e12, 2.0, 4, 0.25) == pytest.approx(0.5)
    assert flops.mfu(1e12, 2.0, 4, None) is None
    t = flops.throughput(flops=3e15, tokens=16384, seconds=4.0, devices=8, peak=989.4)
    assert t["tokens_per_s"] == 4096 and t["tokens_per_s_per_device"] == 512
    assert t["tflops_per_device"] == pytest.approx(3e15 / 4 / 8 / 1e12)
    assert t["mfu"] == pytest.approx(93.75 / 989.4)
    assert flops.device_peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4
    assert flops.device_peak_tflops("NVIDIA H100 PCIe", "bfloat16") == 756.0  # the longer name wins
    assert flops.device_peak_tflops("NVIDIA H200", "bf16") == 989.4
    assert flops.device_peak_tflops("NVIDIA H100 80GB HBM3", "float32") is None
    assert flops.device_peak_tflops("cpu", "bfloat16") is None
    with pytest.raises(ValueError, match="seconds"):
        flops.tflops_per_device(1.0, 0.0, 1)


def test_step_summary_uses_the_time_between_step_ends():
    from justrl_megatron.bench.step import summarise_steps

    def rec(step, t, step_s, tokens):
        return {"step": step, "time": t, "time/step_s": step_s, "throughput/tokens_per_s": tokens / step_s,
                "response/length_mean": 10.0, "time/rollout_s": 1.0, "time/reward_s": 0.1,
                "time/old_logprob_s": 0.5, "time/update_s": 2.0, "time/sync_s": 0.2, "reward/mean": 0.5}
    records = [rec(1, 100.0, 9.0, 800), rec(2, 104.0, 3.8, 800), rec(3, 110.0, 5.9, 1200)]
    s = summarise_steps(records, warmup=1, world_size=2, samples_per_step=8)
    assert s["step_s"] == pytest.approx([4.0, 6.0])  # warm-up dropped; the loop's own timer is kept beside
    assert s["loop_step_s"] == pytest.approx([3.8, 5.9])
    assert s["tokens"] == pytest.approx([800, 1200])
    assert s["tokens_per_s_per_device"] == pytest.approx([800 / 4 / 2, 1200 / 6 / 2])
    assert s["generated_tokens_per_s"] == pytest.approx([80.0, 80.0])
    assert s["trained_tokens_per_s"] == pytest.approx([400.0, 600.0])
    first = summarise_steps(records, warmup=0, world_size=1, samples_per_step=8)
    assert first["step_s"][0] == 9.0  # no predecessor: the loop's own step time
    with pytest.raises(ValueError, match="need more than warmup"):
        summarise_steps(records, warmup=3, world_size=1, samples_per_step=8)


def test_train_overrides():
    from justrl_megatron.bench.step import train_overrides

    out = train_overrides(prompts=4, n=2, response_len=4000, total_steps=5, run_dir="/tmp/x", extra=["trainer.lr=1"])
    assert "trainer.total_steps=5" in out and "trainer.mini_batch_size=4" in out and "rollout.n=2" in out
    assert "trainer.eval_samples=0" in out and out.index("trainer.lr=1") > out.index("rollout.n=2")
    assert "trainer.max_tokens_per_micro_batch=4128" in out  # the demo's 128 prompt tokens + 4000 must fit


def test_bad_arguments_are_clear():
    from justrl_megatron.bench.cli import parse_args

    assert parse_args(["--phase", "train,rollout", "--phase", "train"]).phase == ["train", "rollout"]
    for argv, message in ((["--phase", "trian"], "unknown phase"), ([], "nothing to do"),
                          (["--phase", "train", "--repeats", "0"], "--repeats"),
                          (["--phase", "step", "--n", "0"], "--n must be")):
        with pytest.raises(SystemExit) as exc:
            parse_args(argv)
        assert exc.value.code == 2, argv


# --- end to end on a tiny model -------------------------------------------------------------------------------------

def bench(args, timeout=1200):
    cmd = [sys.executable, "-m", "justrl_megatron.cli", "bench", *args]
    return run_ok(cmd, timeout=timeout, env=BENCH_ENV)


ROW_KEYS = {"metric", "unit", "median", "min", "max", "n", "values"}
EXPECTED_ROWS = {
    "rewards": ["dapo (in-process) verifications/s", "dapo (in-process) verifications/CPU-s",
                "gsm8k (in-process) verifications/s"],
    "rollout": ["generated tokens/s", "generated tokens/s per device", "seconds per batch"],
    "train": ["update (fwd+bwd+optim) tokens/s", "update (fwd+bwd+optim) tokens/s per device",
              "update (fwd+bwd+optim) TFLOP/s per device", "update (fwd+bwd+optim) MFU",
              "update (fwd+bwd+optim) seconds", "old logprobs (fwd) tokens/s", "old logprobs (fwd) TFLOP/s per device",
              "old logprobs (fwd) MFU", "cpu peak rss"],
    "sync": ["sync seconds (bucket 4 MB)", "sync GB/s (bucket 4 MB)", "export only seconds (bucket 4 MB, median)"],
    "step": ["GRPO step seconds", "tokens/s per device (prompt + response)", "rollout generated tokens/s",
             "update trained tokens/s", "rollout seconds", "reward seconds", "old_logprob seconds", "update seconds",
             "sync seconds", "tokens per step", "response length mean"],
}


@pytest.mark.slow
def test_every_phase_on_a_tiny_model_writes_json_with_every_field(tmp_path, tiny_llama):
    out = tmp_path / "bench.json"
    proc = bench(["--phase", "rewards,rollout,train,sync,step", "--model", str(tiny_llama), "--prompts", "2",
                  "--n", "2", "--prompt-len", "16", "--response-len", "8", "--train-tokens", "96", "--warmup", "0",
                  "--repeats", "2", "--reward-items", "2000", "--verifiers", "dapo", "gsm8k", "--bucket-mb", "4",
                  "--peak-tflops", "0.5", "--json", str(out)])
    report = json.loads(out.read_text())
    assert "GRPO step seconds" in proc.stdout and f"wrote {out}" in proc.stdout  # the table
    m = report["machine"]
    for key in ("date", "cpu", "cpu_count", "torch_threads", "gpu", "versions", "load_average", "load_average_end"):
        assert key in m, key
    assert m["gpu"] is None and m["versions"]["megatron-core"]
    assert [p["phase"] for p in report["phases"]] == list(EXPECTED_ROWS)
    for phase in report["phases"]:
        rows = {r["metric"]: r for r in phase["rows"]}
        for name in EXPECTED_ROWS[phase["phase"]]:
            assert name in rows, (phase["phase"], name, sorted(rows))
        for r in phase["rows"]:
            assert set(r) == ROW_KEYS, r
            assert r["n"] == len(r["values"]) and r["n"] in (1, 2), r  # --repeats 2 (single figures: 1)
            assert all(math.isfinite(v) and v >= 0 for v in r["values"]), r
            assert r["min"] <= r["median"] <= r["max"], r
        assert phase["config"] and phase["raw"]

    from justrl_megatron.bench.train import resolve_shape

    by = {p["phase"]: p for p in report["phases"]}
    # train: the reported TFLOP/s and MFU are the model FLOPs of the batch over the measured time
    train = by["train"]
    rows = {r["metric"]: r for r in train["rows"]}
    raw = train["raw"]
    assert train["config"]["seq_len"] == 24 and raw["num_sequences"] == 4 and raw["tokens_per_step"] == 96
    shape = resolve_shape(str(tiny_llama))
    fwd = flops.forward_flops(shape, [24] * 4, 4 * 8, vocab=padded_vocab_size(shape.vocab_size, 1))
    assert raw["update"]["flops"] == pytest.approx(3 * fwd) and raw["logprob"]["flops"] == pytest.approx(fwd)
    times = rows["update (fwd+bwd+optim) seconds"]["values"]
    assert times == raw["update"]["time_s_all"]
    assert rows["update (fwd+bwd+optim) TFLOP/s per device"]["values"] == pytest.approx([3 * fwd / t / 1e12
                                                                                          for t in times])
    assert rows["update (fwd+bwd+optim) MFU"]["values"] == pytest.approx([100 * 3 * fwd / t / 1e12 / 0.5
                                                                          for t in times])
    assert rows["update (fwd+bwd+optim) tokens/s"]["values"] == pytest.approx([96 / t for t in times])
    # rollout: every response runs to the full length (EOS ignored)
    assert by["rollout"]["raw"]["generated_tokens"] == 2 * 2 * 8
    # sync: bytes moved are the model's parameters (fp32, tied lm_head sent too)
    assert by["sync"]["config"]["bytes"] > 4 * (49152 * 128)
    # step: the real loop ran 2 steps of 2 prompts x 2 responses (no warm-up: the warm-up's drop is unit-tested)
    step = by["step"]
    assert step["config"]["samples_per_step"] == 4 and step["config"]["optimizer_steps_per_step"] == 1
    assert step["config"]["model"] == str(tiny_llama) and step["raw"]["repeats"] == 2
    step_rows = {r["metric"]: r for r in step["rows"]}
    assert all(0 < x <= 8 for x in step_rows["response length mean"]["values"])
    phases_sum = sum(step_rows[f"{p} seconds"]["median"] for p in ("rollout", "old_logprob", "update", "sync"))
    assert phases_sum <= step_rows["GRPO step seconds"]["max"] * 1.01


@pytest.mark.slow
def test_vs_trl_one_step_each_side(tmp_path, tiny_llama):
    """Smoke run of the comparison at tiny size (the real comparison is a benchmark, see docs/benchmarks.md)."""
    out = tmp_path / "vs.json"
    bench(["--vs", "trl", "--model", str(tiny_llama), "--prompts", "2", "--n", "2", "--response-len", "8",
           "--warmup", "0", "--repeats", "1", "--runs", "1", "--threads", "2", "--json", str(out)])
    raw = json.loads(out.read_text())["phases"][0]["raw"]
    assert len(raw["ours_step_s"]) == 1 and len(raw["ours_step_s"][0]) == 1
    assert len(raw["trl_step_s"]) == 1 and len(raw["trl_step_s"][0]) == 1
    assert raw["ours_median_s"] > 0 and raw["trl_median_s"] > 0
    assert raw["ratio"] == pytest.approx(raw["ours_median_s"] / raw["trl_median_s"])
    # the loop's phases, plus the engines' idle time
    assert set(raw["ours_phase_s"]) == {"rollout_s", "reward_s", "old_logprob_s", "update_s", "sync_s",
                                        "wait_rollout_s", "rollout_idle_s"}
    assert all(len(v) == 1 and v[0] >= 0 for v in raw["ours_phase_s"].values())
    assert raw["trl_compat_loaded"] is False  # TRL ran without our CPU redirections
    assert raw["trl_gradient_checkpointing"] is False
    assert raw["precision"] == "fp32" and raw["trl_bf16_autocast"] is False
    assert raw["prompts_retokenized_identical"] == 1.0  # TRL saw exactly our prompt tokens
    assert 0 < raw["trl_completion_length_mean"][0][0] <= 8 and 0 < raw["ours_response_length_mean"][0][0] <= 8
