"""The training loop's order of engine calls (colocated: the engine sleeps while the policy trains) and the profiler
switch, with a recording engine in place of vLLM (tests/mp/loop_recording.py); the real vLLM loop runs in
test_train.py."""

import json
import sys

import pytest

from helpers import MP, SHORT_TRAIN, run_ok
from justrl_megatron.config import ConfigError, compose, validate

SCRIPT = MP / "loop_recording.py"


@pytest.fixture(scope="module")
def three_recorded_steps(tmp_path_factory, tiny_llama):
    """One uninterrupted 3-step loop with the recording engine: (its run dir, the process, the call log)."""
    tmp_path = tmp_path_factory.mktemp("recorded")
    run_dir, out = tmp_path / "run", tmp_path / "calls.json"
    overrides = [f"model.path={tiny_llama}", f"trainer.run_dir={run_dir}", *SHORT_TRAIN, "trainer.total_steps=3",
                 "trainer.weight_decay=0.1", "trainer.profile_steps=[2,3]", "logging.wandb_mode=disabled"]
    proc = run_ok([sys.executable, SCRIPT, out, *overrides], timeout=600)
    return run_dir, proc, json.loads(out.read_text())


@pytest.mark.slow
def test_colocated_cycle_sleeps_during_update_and_profiles(three_recorded_steps):
    run_dir, proc, log = three_recorded_steps
    assert log["last_step"] == 3
    calls = log["calls"]
    kinds = [c[0] for c in calls]
    # start: sync version 0, wake, greedy held-out check; each step: generate -> sleep -> (update) -> sync -> wake;
    # end: held-out check, shutdown
    assert kinds == (["update_weights", "wake_up", "generate"] + ["generate", "sleep", "update_weights", "wake_up"] * 3
                     + ["generate", "shutdown"])
    syncs = [c for c in calls if c[0] == "update_weights"]
    assert [c[1] for c in syncs] == [0, 1, 2, 3]
    assert len({c[2] for c in syncs}) == 1 and syncs[0][2] >= 9  # the full HF state every time
    assert len({c[3] for c in syncs}) == 4  # each sync carried the weights of a new update
    generated = [c[1] for c in calls if c[0] == "generate"]
    assert generated == [0, 0, 1, 2, 3]  # each batch sampled with the latest weights
    trace = run_dir / "profile" / "steps_2-3_rank0.json"
    assert f"profile of steps 2-3: {trace}" in proc.stdout + proc.stderr
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"rollout", "reward", "update", "sync"} <= names
    assert (run_dir / "heldout_accuracy.json").exists()
    assert set(json.loads((run_dir / "heldout_accuracy.json").read_text())) == {"start", "end"}


@pytest.mark.slow
def test_a_stop_during_a_rollout_saves_the_step_before_and_keeps_the_groups_in_flight(tmp_path, tiny_llama,
                                                                                     three_recorded_steps):
    """A SIGTERM while step 3 generates (the engine loop reads it between steps) ends the run on step 2, saved now
    (trainer.save_every=3 had not saved it). Nothing is lost: the checkpoint holds step 3's groups (their prompts,
    after the sampler's draw), and beside it the stop keeps what each of their samples had sampled (tokens, logprobs,
    versions) for the resumed run to continue."""
    import torch

    from helpers import ENV
    from justrl_megatron.checkpoint import TRAINER_STATE, latest_step, step_dir
    from justrl_megatron.slurm import requeue_message

    run_dir, out = tmp_path / "run", tmp_path / "calls.json"
    overrides = [f"model.path={tiny_llama}", f"trainer.run_dir={run_dir}", *SHORT_TRAIN, "trainer.total_steps=3",
                 "trainer.weight_decay=0.1", "trainer.save_every=3", "logging.wandb_mode=disabled"]
    proc = run_ok([sys.executable, SCRIPT, out, *overrides], timeout=600,
                  env={**ENV, "JUSTRL_RECORDING_STOP_AT": "4"})  # the held-out check, steps 1, 2, then step 3
    log = json.loads(out.read_text())
    assert log["last_step"] == 2 and requeue_message(2) in proc.stdout + proc.stderr
    assert latest_step(run_dir) == 2
    from justrl_megatron.checkpoint.folders import STOP_STATE

    state = torch.load(step_dir(run_dir, 2) / TRAINER_STATE, weights_only=False)["extra"]
    assert state["sampler"] == {"epoch": 0, "index": 6}  # 3 steps x 2 prompts drawn: step 3's are in flight
    groups = state["inflight"]["groups"]
    assert len(groups) == 2 and all(g["lost"] and g["samples"] is None for g in groups)  # (only after a crash)
    kept = torch.load(step_dir(run_dir, 2) / STOP_STATE, weights_only=False)
    assert kept["sampler"] == state["sampler"]
    assert [g["prompt"] for g in kept["inflight"]["groups"]] == [g["prompt"] for g in groups]
    assert all(g["samples"] is not None and not g["lost"] for g in kept["inflight"]["groups"])  # their tokens
    assert all(len(t) >= 1 for g in kept["inflight"]["groups"] for t in g["samples"]["token_ids"])
    straight = [c for c in three_recorded_steps[2]["calls"] if c[0] == "generate"]
    stopped = [c for c in log["calls"] if c[0] == "generate"]
    assert stopped == straight[:4]  # the same batches up to the stopped one, which is step 3's
    assert [c[0] for c in log["calls"]][-3:] == ["wake_up", "generate", "shutdown"]  # no update after it


def test_a_registered_source_of_its_own_trains_through_the_unchanged_loop(tmp_path, tiny_llama):
    """rollout.source names a BatchSource the test registered (tests/mp/custom_source.py: one class, one registry
    line): the loop takes its batches, trains on its rewards and checkpoints its state."""
    run_dir, out = tmp_path / "run", tmp_path / "calls.json"
    run_ok([sys.executable, MP / "custom_source.py", out, f"model.path={tiny_llama}", f"trainer.run_dir={run_dir}",
            *SHORT_TRAIN, "trainer.eval_samples=0", "rollout.source=alternating", "logging.wandb_mode=disabled",
            "trainer.async_save=false"], timeout=600)
    log = json.loads(out.read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert log["last_step"] == 2 and [r["step"] for r in records] == [1, 2]
    assert [r["reward/mean"] for r in records] == [0.5, 0.5]  # the source's own rewards: odd samples score 1
    assert all(r["actor/grad_norm"] > 0 for r in records)  # every group has reward variance: a policy gradient
    assert [c[0] for c in log["calls"]].count("generate") == 2  # one batch per step, from the placement
    import torch

    state = torch.load(run_dir / "checkpoints" / "step_00000002" / "trainer_state.pt", weights_only=False)
    assert state["extra"]["inflight"] == {"alternating_steps": [1, 2]}  # the source's state() went into it


@pytest.mark.parametrize("steps", [[0, 1], [3, 2], [1]])
def test_profile_steps_validated(steps):
    cfg = compose([f"trainer.profile_steps=[{','.join(map(str, steps))}]"])
    with pytest.raises(ConfigError, match="trainer.profile_steps must be"):
        validate(cfg, world_size=1)
