"""The training loop's order of engine calls (colocated: the engine sleeps while the policy trains) and the profiler
switch, with a recording engine in place of vLLM (tests/mp/loop_recording.py); the real vLLM loop runs in
test_train.py."""

import json
import sys

import pytest

from helpers import MP, SHORT_TRAIN, run_ok
from justrl_megatron.config import ConfigError, compose, validate

SCRIPT = MP / "loop_recording.py"


@pytest.mark.slow
def test_colocated_cycle_sleeps_during_update_and_profiles(tmp_path, tiny_llama):
    run_dir, out = tmp_path / "run", tmp_path / "calls.json"
    overrides = [f"model.path={tiny_llama}", f"trainer.run_dir={run_dir}", *SHORT_TRAIN, "trainer.total_steps=3",
                 "trainer.weight_decay=0.1", "trainer.profile_steps=[2,3]", "logging.wandb_mode=disabled"]
    proc = run_ok([sys.executable, SCRIPT, out, *overrides], timeout=600)
    log = json.loads(out.read_text())
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


@pytest.mark.parametrize("steps", [[0, 1], [3, 2], [1]])
def test_profile_steps_validated(steps):
    cfg = compose([f"trainer.profile_steps=[{','.join(map(str, steps))}]"])
    with pytest.raises(ConfigError, match="trainer.profile_steps must be"):
        validate(cfg, world_size=1)
