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
                  "--n", "2", "--prompt-len", "16", "--response-len", "8", "--train-tokens", "96", "--warmup", "1",
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
    # step: the real loop ran warm-up + 2 steps of 2 prompts x 2 responses
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


# --- the throughput planner (bench/plan.py): its event model by hand, per mode ---------------------------------------

def _plan_inputs(**kw):
    from justrl_megatron.bench.plan import DecodeCost, PlanInputs

    base = dict(decode=DecodeCost(fixed_s=0.1, per_seq_s=0.01), update_fixed_s=2.0, update_s_per_token=0.001,
                sync_s=1.0, lengths=[50], prompt_len=10, prompts_per_step=4, n=2, max_response_length=100,
                reward_s_per_group=0.25, overhead_s=0.5)
    return PlanInputs(**{**base, **kw})


def test_plan_colocated_sync_is_the_sum_of_its_phases():
    from justrl_megatron.bench.plan import predict

    x = _plan_inputs(colocated_switch_s=0.3)
    rollout = 50 * (0.1 + 0.01 * 8)  # 50 steps of 8 running sequences: 9.0 s
    tokens = 8 * (10 + 50)  # prompt + response tokens of the batch
    update = 2.0 + 0.001 * tokens  # 2.48 s
    p = predict(x, "colocated sync", trainers=1)
    assert p["step_s"] == pytest.approx(rollout + 4 * 0.25 + update + 0.5 + 0.3 + 1.0)
    assert p["tokens_per_step"] == tokens and p["gpus"] == 1 and p["staleness_max"] == 0
    assert p["trained_tokens_per_s_per_gpu"] == pytest.approx(tokens / p["step_s"])
    assert p["trainer_idle_frac"] == pytest.approx(1 - (update + 1.0) / p["step_s"])  # busy: update + rewards
    split = predict(x, "split sync", trainers=1, engines=1)  # the same phases, one after the other, on 2 devices
    assert split["step_s"] == pytest.approx(p["step_s"] - 0.3) and split["gpus"] == 2
    assert predict(_plan_inputs(optimizer_steps=4, logprob_s_per_token=0.0005), "split sync")["step_s"] \
        == pytest.approx(split["step_s"] + 3 * 2.0 + 0.0005 * tokens)  # per mini-batch fixed cost, old logprobs
    shared = predict(_plan_inputs(shared_prompt=True), "split sync")  # each group's prompt computed once, not n times
    assert shared["step_s"] == pytest.approx(split["step_s"] - 0.001 * 4 * 10 * (2 - 1))
    assert shared["tokens_per_step"] == tokens  # the trained tokens still count every sample's prompt


def test_plan_window_of_a_bench_run_against_the_steady_state():
    """predict_window: what a run of warmup + timed steps from a cold start measures, over several length draws.
    One draw of the default window is `predict` itself; streaming eta=4's first steps (the bound not reached yet)
    are not its steady state; the draws' spread brackets their mean; deterministic."""
    from justrl_megatron.bench.plan import predict, predict_window

    x = _plan_inputs(lengths=[5, 10, 20, 40, 80, 100, 100], max_response_length=100, update_s_per_token=0.002)
    steady = predict(x, "streaming", eta=4)
    assert predict_window(x, "streaming", eta=4, warmup=4, timed=36, draws=1)["step_s"] \
        == predict(x, "streaming", eta=4, run_ends=True)["step_s"]  # a run ends: its last steps drain the engine
    w = predict_window(x, "streaming", eta=4, warmup=1, timed=3, draws=20)
    assert w["step_s"] != pytest.approx(steady["step_s"], rel=0.05) and w["draws"] == 20
    assert w["step_s_p10"] <= w["step_s"] <= w["step_s_p90"]
    assert predict_window(x, "streaming", eta=4, warmup=1, timed=3, draws=20) == w


def test_plan_a_run_that_ends_generates_nothing_beyond_its_last_step():
    """run_ends (what a bench run of `steps` steps does, as the batch sources stop at trainer.total_steps): the
    last one-step-off step does not wait for a batch in flight, streaming admits no more than the remaining steps
    take (fewer running sequences: faster engine steps, then the engine runs dry)."""
    from justrl_megatron.bench.plan import DecodeCost, predict

    x = _plan_inputs()  # rollout-bound one-step-off: 9.0 s of rollout, 2.48 s of update
    endless, ends = predict(x, "one-step-off", steps=3, warmup=0), predict(x, "one-step-off", steps=3, warmup=0,
                                                                          run_ends=True)
    assert endless["step_s_all"][-1] == pytest.approx(9.0 + 1.0)
    assert ends["step_s_all"][-1] == pytest.approx(2.48 + 0.5 + 1.0) and ends["step_s_all"][:2] == \
        pytest.approx(endless["step_s_all"][:2])
    y = _plan_inputs(decode=DecodeCost(fixed_s=0.0, per_seq_s=0.01), lengths=[5, 50, 100])
    endless, ends = (predict(y, "streaming", eta=4, steps=3, warmup=0, run_ends=r) for r in (False, True))
    assert ends["step_s_all"][0] < endless["step_s_all"][0]  # 12 groups in the engine, not 20


def test_plan_decode_cost_from_a_table_of_batch_sizes():
    """by_seqs: measured step seconds at some running-sequence counts, interpolated (its first value below it,
    its last segment's line above it), the context term added; it survives the inputs file (JSON keys are text)."""
    from justrl_megatron.bench.plan import DecodeCost, PlanInputs

    table = DecodeCost(fixed_s=9.0, per_seq_s=9.0, per_context_token_s=1e-5,
                       by_seqs={"1": 0.03, "4": 0.03, "16": 0.06, "64": 0.18})
    assert [table.base_s(b) for b in (1, 2, 4, 10, 16, 40, 128)] == \
        pytest.approx([0.03, 0.03, 0.03, 0.045, 0.06, 0.12, 0.34])
    assert table.step_s(2, 1000) == pytest.approx(0.03 + 0.01)
    assert DecodeCost(fixed_s=0.1, per_seq_s=0.01).step_s(4, 0) == pytest.approx(0.14)  # no table: the line
    x = _plan_inputs(decode=table)
    again = PlanInputs.from_dict(json.loads(json.dumps(x.to_dict())))
    assert again.decode.base_s(10) == pytest.approx(0.045)


def test_plan_update_cost_fit_separates_response_tokens():
    """fit_update_cost: the fixed cost per update, seconds per computed token and the extra per response token,
    recovered from exact points of three update sizes; two sizes alone (the old calibration) cannot tell a fixed
    cost from a rate, so the fit runs through the origin; points whose response share does not vary fall back to
    one rate per computed token."""
    from justrl_megatron.bench.longtail import LOOP_RUNS, fit_update_cost

    sizes = ((641, 247), (645, 251), (1484, 1090), (1657, 1263), (170, 60), (175, 66))
    points = [(c, r, 2.5 + 0.007 * c + 0.004 * r) for c, r in sizes]
    assert fit_update_cost(points) == pytest.approx((2.5, 0.007, 0.004))
    no_fixed = [(c, r, 0.007 * c + 0.004 * r) for c, r in sizes[:4]]
    assert fit_update_cost(no_fixed) == pytest.approx((0.0, 0.007, 0.004), abs=1e-9)
    same_share = [(100, 50, 1.0), (200, 100, 2.0)]
    assert fit_update_cost(same_share) == pytest.approx((0.0, 0.01, 0.0))
    assert len(LOOP_RUNS) == 3 and any("trainer.prompts_per_step=2" in run for run in LOOP_RUNS)


def test_plan_update_point_from_a_loop_step_counts_computed_tokens():
    """A loop step's update in the planner's unit: 8 groups x 4 responses of mean 20 after 50-token prompts."""
    from justrl_megatron.bench.longtail import loop_update_point

    record = {"throughput/tokens_per_s": 100.0, "time/step_s": 32 * 70 / 100.0, "response/length_mean": 20.0,
              "time/update_s": 3.0}
    assert loop_update_point(record, 8, 4, shared_prompt=False) == pytest.approx((32 * 70, 32 * 20, 3.0))
    assert loop_update_point(record, 8, 4, shared_prompt=True) == pytest.approx((32 * 20 + 8 * 50, 32 * 20, 3.0))


def test_plan_one_step_off_hides_the_shorter_side():
    from justrl_megatron.bench.plan import predict

    x = _plan_inputs()
    update_bound = predict(x, "one-step-off")  # rollout 9.0 s > update 2.48 + overhead 0.5
    assert update_bound["staleness_max"] == 1
    # rollout-bound: the step is the rollout plus what follows it (the sync, or the scoring if longer)
    assert update_bound["step_s"] == pytest.approx(9.0 + max(1.0, 4 * 0.25))
    # update-bound (a slow update): the step is update + overhead + sync; the rollout and its scoring hide behind it
    slow = _plan_inputs(update_fixed_s=20.0)
    assert predict(slow, "one-step-off")["step_s"] == pytest.approx(20.0 + 0.48 + 0.5 + 1.0)
    assert predict(slow, "one-step-off")["trainer_idle_frac"] == pytest.approx(1 - (20.48 + 1.0) / 21.98)


def test_plan_streaming_keeps_two_batches_in_the_engine_at_eta_1():
    from justrl_megatron.bench.plan import DecodeCost, predict

    # a decode step costs 1 s whatever the batch; free updates and syncs: admission holds 2 batches at eta=1, so the
    # steps alternate between waiting a whole generation (50 s) and taking the batch that finished beside it (0 s)
    x = _plan_inputs(decode=DecodeCost(fixed_s=1.0, per_seq_s=0.0), update_fixed_s=0.0, update_s_per_token=0.0,
                     sync_s=0.0, reward_s_per_group=0.0, overhead_s=0.0)
    p = predict(x, "streaming", eta=1, steps=20, warmup=4)
    assert p["step_s_all"][4:8] == pytest.approx([50.0, 0.0, 50.0, 0.0])
    assert p["step_s"] == pytest.approx(25.0) and p["staleness_max"] == 1
    assert predict(x, "one-step-off")["step_s"] == pytest.approx(50.0)


@pytest.mark.parametrize("eta", [1, 2, 3, 4])
def test_plan_streaming_bounds_staleness_and_fractions(eta):
    from justrl_megatron.bench.plan import predict

    x = _plan_inputs(lengths=[5, 10, 20, 40, 80, 100, 100], max_response_length=100)  # a long tail, some at the cap
    for mode in ("colocated sync", "split sync", "one-step-off", "streaming"):
        p = predict(x, mode, eta=eta, trainers=2, engines=2)
        assert 0.0 <= p["trainer_idle_frac"] <= 1.0 and 0.0 <= p["engine_idle_frac"] <= 1.0
        assert p["staleness_max"] <= (eta if mode == "streaming" else 1)
        assert p["step_s"] > 0 and p["tokens_per_step"] > 0
    assert predict(x, "streaming", eta=eta)["staleness_max"] == eta  # groups do wait up to the bound


def test_plan_best_split_and_every_mode_from_an_inputs_file(tmp_path):
    from justrl_megatron.bench.plan import best_split, load_inputs, plan_all, predict, table

    x = _plan_inputs(lengths=[5, 10, 20, 40, 80, 100], update_s_per_token=0.01)
    best = best_split(x, "one-step-off", gpus=6)
    every = [predict(x, "one-step-off", trainers=6 - e, engines=e) for e in range(1, 6)]
    assert best["trained_tokens_per_s"] == max(p["trained_tokens_per_s"] for p in every)
    path = tmp_path / "inputs.json"  # what `justrl-bench --plan FILE` reads
    path.write_text(json.dumps(x.to_dict()))
    plans = plan_all(load_inputs(str(path)), gpus=4, etas=(1, 2))
    assert [p["mode"] for p in plans] == ["colocated sync", "split sync", "one-step-off", "streaming eta=1",
                                          "streaming eta=2"]
    assert all(p["gpus"] == 4 for p in plans)
    assert table(plans).splitlines()[-1].startswith("streaming eta=2")


def test_plan_replays_a_runs_own_lengths():
    """run_trace reads a run's groups from metrics.jsonl in the order it started them (streaming: by admission
    number, a step's dropped finished groups too, a gap where an engine aborted one); the planner replays them: a
    batch step whose trace holds a response at the cap lasts the cap's engine steps, the others the short ones',
    whatever the distribution would draw."""
    from justrl_megatron.bench.longtail import run_trace
    from justrl_megatron.bench.plan import DecodeCost, PlanInputs, predict

    batch = [{"response/lengths": [5, 6, 7, 8]}, {"response/lengths": [100, 1, 2, 3]}]
    assert run_trace(batch, n=2) == [[5, 6], [7, 8], [100, 1], [2, 3]]
    stream = [{"response/lengths": [5, 6, 7, 8], "rollout/group_admission": [1, 0]},
              {"response/lengths": [9, 9], "rollout/group_admission": [4], "rollout/untrained_admission": [2],
               "rollout/untrained_lengths": [70, 80]}]
    assert run_trace(stream, n=2) == [[7, 8], [5, 6], [70, 80], None, [9, 9]]
    x = PlanInputs(decode=DecodeCost(0.01, 0.0), update_fixed_s=0.0, update_s_per_token=0.0, sync_s=0.0,
                   lengths=[50] * 10, prompt_len=0, prompts_per_step=2, n=2, max_response_length=100)
    steps = predict(x, "split sync", steps=3, warmup=0, run_ends=True, trace=run_trace(batch * 2, n=2))["step_s_all"]
    # a step waits for its batch (generated after the previous sync): 8 engine steps, 100, 8 again
    assert steps == pytest.approx([0.08, 1.00, 0.08])
    drawn = predict(x, "split sync", steps=3, warmup=0, run_ends=True)["step_s_all"]
    assert drawn == pytest.approx([0.5, 0.5, 0.5])


def test_plan_check_measures_the_machine_speed_it_compares_against():
    """The check re-times the machine before each workload: a drift from when the inputs were measured is visible."""
    from justrl_megatron.bench.longtail import machine_speed, speed_drift

    now = machine_speed(repeats=1)
    assert now["matmul_gflops"] > 0 and now["steal_s"] >= 0
    assert speed_drift({"matmul_gflops": 100.0}, {"matmul_gflops": 80.0}) == pytest.approx(0.25)
    assert speed_drift(now, now) == 0.0
