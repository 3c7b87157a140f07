"""Multi-rank launches (issue 42): justrl's launcher (`justrl-train --nproc-per-node=N`, justrl_megatron/launch.py)
and bare torchrun.

The SIGKILLed launcher of a 2-rank run (no rank alive within seconds, the relaunch resumes) shares the launches of
tests/test_slurm.py's launch/local/train.sh test.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from helpers import ENV, REPO, TORCHRUN

TRAIN = [sys.executable, "-m", "justrl_megatron.cli", "train"]

HOLDER = """
import sys, time
from justrl_megatron import run_lock
run_lock.hold(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""

# a rank for the launcher (JUSTRL_ENTRY): rank 1 fails once rank 0 has said its pid (a file in the shared cwd: under
# load rank 0 may start seconds later), rank 0 would run for 10 minutes
FAILING_RANK = ("-c", "import os, signal, sys, time; rank = int(os.environ['RANK']); "
                "print(f'rank {rank} pid {os.getpid()}', flush=True); open(f'started.{rank}', 'w').close(); "
                "deadline = time.time() + 60\n"
                "while rank == 1 and not os.path.exists('started.0') and time.time() < deadline: time.sleep(0.1)\n"
                "time.sleep(0.5 if rank == 1 else 600); how = sys.argv[1]; "
                "os.kill(os.getpid(), signal.SIGKILL) if how == 'kill' else sys.exit(int(how))")


def test_nproc_per_node_is_taken_off_the_command_line():
    from justrl_megatron.launch import split_nproc

    assert split_nproc(["--nproc-per-node", "2", "a=1"]) == (2, ["a=1"])
    assert split_nproc(["a=1", "--nproc-per-node=3"]) == (3, ["a=1"])
    assert split_nproc(["a=1"]) == (None, ["a=1"])
    with pytest.raises(SystemExit) as bad:
        split_nproc(["--nproc-per-node=zero"])
    assert bad.value.code == 2


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("how, code, line", [
    ("4", 4, "justrl-train: error: rank 1 exited with code 4 (its output above says why); the other 1 rank(s) were "
             "stopped"),
    # lifeline.SAID_AND_FAILED: the rank's failure was named already (rank 0's one line): the launcher adds nothing,
    # stops the others at once and exits 1
    ("3", 1, None),
    ("kill", 137, "justrl-train: error: rank 1 was killed by SIGKILL (the out-of-memory killer?); the other 1 rank(s) "
                  "were stopped"),
])
def test_a_failing_rank_stops_the_others_at_once_in_one_line(tmp_path, how, code, line):
    env = {**ENV, "JUSTRL_ENTRY": shlex.join(FAILING_RANK)}
    start = time.monotonic()
    proc = subprocess.run([*TRAIN, "--nproc-per-node=2", how], env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert time.monotonic() - start < 60, "rank 0 was left running after rank 1 failed"
    assert proc.returncode == code, proc.stderr
    said = [w for w in proc.stderr.strip().splitlines() if "process(es)" not in w]
    assert said == ([line] if line else []), proc.stderr
    rank0 = int(next(w.split()[-1] for w in proc.stdout.splitlines() if w.startswith("rank 0 pid")))
    assert not _alive(rank0)


# a rank for the launcher: rank 0 lets a stranger try MASTER_PORT before it starts the job's store (a stranger that
# gets the port keeps it for a minute, as a process on a shared node would), then both ranks rendezvous and all-reduce
STRANGER = """
import socket, sys, time
s = socket.socket()
try:
    s.bind(("", int(sys.argv[1])))
    s.listen()
except OSError as exc:
    print(exc.errno, flush=True)
    sys.exit()
print("taken", flush=True)
time.sleep(60)
"""
RENDEZVOUS_AFTER_A_STRANGER = ("-c", "import os, subprocess, sys\n"
                               "if os.environ['RANK'] == '0':\n"
                               "    stranger = subprocess.Popen([sys.executable, '-c', sys.argv[1], "
                               "os.environ['MASTER_PORT']], stdout=subprocess.PIPE, text=True)\n"
                               "    print('stranger:', stranger.stdout.readline().strip(), flush=True)\n"
                               "import torch, torch.distributed as dist\n"
                               "from justrl_megatron.distributed import init_distributed\n"
                               "rank, world = init_distributed()\n"
                               "total = torch.ones(1); dist.all_reduce(total)\n"
                               "print(f'rank {rank} of {world}: sum {total.item()}', flush=True)")


def test_the_rendezvous_port_cannot_be_taken_between_the_launcher_and_rank_0():
    """The launcher chooses MASTER_PORT before any rank exists and rank 0 binds its store seconds later, after its
    imports: a process that tries the port in between finds it taken (the launcher held it and rank 0 inherited the
    listening socket), and the ranks still meet. With a port that was merely free a moment ago, the stranger got it and
    rank 0 failed with EADDRINUSE after loading."""
    import errno

    env = {**ENV, "JUSTRL_ENTRY": shlex.join(RENDEZVOUS_AFTER_A_STRANGER)}
    proc = subprocess.run([*TRAIN, "--nproc-per-node=2", STRANGER], env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert f"stranger: {errno.EADDRINUSE}\n" in proc.stdout, proc.stdout
    for rank in (0, 1):  # (the two ranks' lines may interleave at their ends)
        assert f"rank {rank} of 2: sum 2.0" in proc.stdout, proc.stdout


def test_a_refused_launch_touches_nothing_on_any_rank(tmp_path):
    """A live holder of the run dir: justrl's launcher refuses before any rank starts (one line, exit 2); under bare
    torchrun rank 0 refuses in one line and rank 1 waits for the lock's decision and writes nothing either."""
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        lock_line = (run_dir / ".justrl.lock").read_text()
        ours = subprocess.run([*TRAIN, "--nproc-per-node=2", f"trainer.run_dir={run_dir}"], env=ENV,
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert ours.returncode == 2, ours.stderr
        assert ours.stderr.strip().startswith("justrl-train: error: ") and len(ours.stderr.strip().splitlines()) == 1
        assert f"pid {holder.pid}," in ours.stderr and "process(es)" not in ours.stderr
        bare = subprocess.run([*TORCHRUN, "--nproc-per-node=2", "-m", "justrl_megatron.cli", "train",
                               f"trainer.run_dir={run_dir}"], env=ENV, capture_output=True, text=True, timeout=300,
                              cwd=tmp_path)
        assert bare.returncode != 0
        assert bare.stderr.count("justrl-train: error: ") == 1 and f"pid {holder.pid}," in bare.stderr, bare.stderr
        assert sorted(p.name for p in run_dir.iterdir()) == [".justrl.lock"]  # no hydra/, no config_history/
        assert (run_dir / ".justrl.lock").read_text() == lock_line
    finally:
        holder.kill()
        holder.wait()


def test_a_config_every_rank_refuses_leaves_no_run_dir(tmp_path):
    """The launcher creates the run dir for its lock; when the ranks refuse the config (exit 2, rank 0 said why) the
    launch ends with 2, nothing more said, and the run dir (and the folder above it) gone again (issue 50)."""
    run_dir = tmp_path / "new" / "run"
    refusing = ("-c", "import os, sys; os.environ['RANK'] == '0' and print('refused', file=sys.stderr); sys.exit(2)")
    proc = subprocess.run([*TRAIN, "--nproc-per-node=2", f"trainer.run_dir={run_dir}"], capture_output=True, text=True,
                          env={**ENV, "JUSTRL_ENTRY": shlex.join(refusing)}, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert [w for w in proc.stderr.splitlines() if "process(es)" not in w] == ["refused"], proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("sig, code, said", [
    (signal.SIGINT, 130, "justrl-train: interrupted before training started; nothing was saved"),
    # a stop exits 0 as a stop during training does (it exited 143): nothing to save yet, said in one line
    (signal.SIGTERM, 0, "justrl-train: stopped by SIGTERM before training started; nothing to save"),
])
@pytest.mark.parametrize("nproc", [None, 2])
def test_ctrl_c_or_a_stop_while_importing_is_one_line(tmp_path, nproc, sig, code, said):
    """Ctrl-C or SIGTERM to the process group a moment after the start (imports under way), alone and under the
    launcher."""
    cmd = [*TRAIN, *([f"--nproc-per-node={nproc}"] if nproc else []), f"trainer.run_dir={tmp_path / 'run'}"]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, cwd=tmp_path)
    if nproc:  # the ranks are importing once the launcher has said how many it started
        line = proc.stderr.readline()
        assert "2 process(es)" in line, line
        time.sleep(0.5)
    else:
        time.sleep(1.0)
    os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert [w for w in err.splitlines() if "process(es)" not in w] == [said], err


def test_a_stop_once_training_started_is_the_trainers(monkeypatch):
    """The trainer's handlers put the early one back at exit (slurm.StopSignal.restore): a stop repeated then (Slurm
    repeats SIGUSR1) neither exits nor says "before training started"."""
    from justrl_megatron import early_interrupt

    monkeypatch.setattr(early_interrupt, "_training", True)
    assert early_interrupt.stopped_before_training(signal.SIGUSR1, None) is None


def test_the_early_stop_handler_leaves_an_ignored_signal_and_a_rank_of_several_alone(monkeypatch):
    """A launcher's rank still importing ignores SIGUSR1 (the batch script repeats it until the trainer's handler
    takes it); a rank of several is left to die of a stop, so that its launcher ends its peers at once."""
    from justrl_megatron import early_interrupt

    saved = {sig: signal.getsignal(sig) for sig in early_interrupt.STOP_SIGNALS}
    try:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        monkeypatch.setenv("WORLD_SIZE", "2")
        early_interrupt.install_stop()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        monkeypatch.setenv("WORLD_SIZE", "1")
        early_interrupt.install_stop()
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is early_interrupt.stopped_before_training
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
