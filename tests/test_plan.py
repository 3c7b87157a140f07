"""The throughput planner (bench/plan*.py): its event model by hand per mode, the engine assignment, the inputs
refused in one line, the check's scoring rule and rescoring, the shapes and calibration runs, the sensitivity and
the robust split, and the 32-H100 figures docs/benchmarks.md prints reproduced from its printed inputs."""

import json
import math

import pytest

# --- the event model by hand, per mode --------------------------------------------------------------------------------

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
    from justrl_megatron.bench.plan_calibrate import fit_update_cost

    sizes = ((641, 247), (645, 251), (1484, 1090), (1657, 1263), (170, 60), (175, 66))
    points = [(c, r, 2.5 + 0.007 * c + 0.004 * r) for c, r in sizes]
    assert fit_update_cost(points) == pytest.approx((2.5, 0.007, 0.004))
    no_fixed = [(c, r, 0.007 * c + 0.004 * r) for c, r in sizes[:4]]
    assert fit_update_cost(no_fixed) == pytest.approx((0.0, 0.007, 0.004), abs=1e-9)
    same_share = [(100, 50, 1.0), (200, 100, 2.0)]
    assert fit_update_cost(same_share) == pytest.approx((0.0, 0.01, 0.0))
    # several optimizer steps per update: the fixed cost is per optimizer step (a 4th element; 1 where absent)
    steps = [(c, r, 3 * 2.5 + 0.007 * c + 0.004 * r, 3) for c, r in sizes[:4]] + points[4:]
    assert fit_update_cost(steps) == pytest.approx((2.5, 0.007, 0.004))


def test_plan_update_point_from_a_loop_step_counts_computed_tokens():
    """A loop step's update in the planner's unit: 8 groups x 4 responses of mean 20 after 50-token prompts."""
    from justrl_megatron.bench.plan_calibrate import loop_update_point

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
    assert table(plans).splitlines()[-1].startswith("| streaming eta=2 | static | ")


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
    from justrl_megatron.bench.plan_calibrate import machine_speed, speed_drift

    now = machine_speed(repeats=1)
    assert now["matmul_gflops"] > 0 and now["steal_s"] >= 0
    assert speed_drift({"matmul_gflops": 100.0}, {"matmul_gflops": 80.0}) == pytest.approx(0.25)
    assert speed_drift(now, now) == 0.0
