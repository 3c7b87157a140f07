"""Run safety (issue 32): one writer per run dir, a full disk, Ctrl-C twice, a torn metrics row.

The trainer-level halves (two real launches on one run dir, kill -9 with the process table scanned, a real Ctrl-C
that saves, HF snapshots) share the launches of tests/test_train.py's SIGKILL test and its 3-step run.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import ENV, MP, SHORT_TRAIN
from justrl_megatron.interrupt import ABORTED, REPEAT_S

ROOT = Path(__file__).resolve().parent.parent


# --- the run-dir lock: real processes ----------------------------------------------------------------------------

HOLDER = """
import sys, time
from justrl_megatron import run_lock
run_lock.hold(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_writer_is_refused_naming_the_holder_and_a_dead_holder_never_blocks(tmp_path):
    from justrl_megatron import run_lock

    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(run_lock.RunDirBusy) as busy:
            run_lock.hold(run_dir)
        message = str(busy.value)
        assert "\n" not in message and f"pid {holder.pid}," in message and "started 20" in message, message
        assert str(run_dir.resolve()) in message and not run_lock.holds(run_dir)
    finally:
        holder.kill()  # SIGKILL: no chance to clean up; its lock file stays
        holder.wait()
    assert (run_dir / run_lock.LOCK_FILE).exists()
    run_lock.hold(run_dir)  # the kernel released the dead holder's lock
    try:
        assert run_lock.holds(run_dir) and f"pid {os.getpid()}," in (run_dir / run_lock.LOCK_FILE).read_text()
    finally:
        run_lock.release(run_dir)


def test_only_the_lock_holder_removes_stale_staging_folders(tmp_path):
    from justrl_megatron import run_lock

    (tmp_path / "ck" / ".tmp_step_00000001.123").mkdir(parents=True)
    run_lock.remove_stale(tmp_path / "ck", ".tmp_step_*", tmp_path)  # not the holder: another writer's, maybe live
    assert (tmp_path / "ck" / ".tmp_step_00000001.123").exists()
    run_lock.hold(tmp_path)
    try:
        run_lock.remove_stale(tmp_path / "ck", ".tmp_step_*", tmp_path)
        assert not (tmp_path / "ck" / ".tmp_step_00000001.123").exists()
    finally:
        run_lock.release(tmp_path)


# --- a full disk and a double Ctrl-C: one real process (tests/mp/run_safety.py) ---------------------------------

def _tmpfs_works() -> bool:
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.fixture(scope="module")
def safety(tmp_path_factory):
    """Runs the worker: the disk scenarios on a 4 MiB tmpfs in a private mount namespace (when this machine allows
    mounting), then the save it stops in, where the test presses Ctrl-C twice."""
    out = tmp_path_factory.mktemp("run_safety")
    cmd = [sys.executable, str(MP / "run_safety.py"), str(out)]
    tmpfs = _tmpfs_works()
    if tmpfs:
        full = out / "full"
        full.mkdir()
        # unshare -m without --fork execs: the pid stays the worker's, so the test's SIGINTs reach it
        cmd = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size=4m tmpfs "{full}" && exec "$@"', "sh", *cmd,
               str(full)]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (out / "staged").exists():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise AssertionError(f"the worker never reached its staged save:\n{proc.communicate()[1][-5000:]}")
        time.sleep(0.05)
    staged = Path((out / "staged").read_text())
    was_staged = sorted(p.name for p in staged.iterdir())
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)  # at once, as torchrun forwards the terminal's Ctrl-C: still the first press
    time.sleep(1.5)
    alive_after_first = proc.poll() is None
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    stdout, stderr = proc.communicate(timeout=60)
    return dict(out=out, tmpfs=tmpfs, rc=proc.returncode, stdout=stdout, stderr=stderr, staged=staged,
                was_staged=was_staged, alive_after_first=alive_after_first, exit_s=time.monotonic() - sent)


def test_a_second_ctrl_c_aborts_at_once_without_a_half_checkpoint(safety):
    from justrl_megatron.interrupt import INTERRUPTED

    assert any(name.endswith(".distcp") for name in safety["was_staged"])  # the shards were being written
    assert safety["alive_after_first"]  # the first Ctrl-C (sent twice at once) only asks to stop after the step
    assert safety["rc"] == 130 and safety["exit_s"] < 10, (safety["rc"], safety["stderr"][-3000:])
    lines = safety["stderr"].strip().splitlines()
    assert lines == [INTERRUPTED, "justrl-train: aborted by a second Ctrl-C: the checkpoint being written was removed; "
                     "`latest` is unchanged"], safety["stderr"][-3000:]
    assert "the save returned" not in safety["stdout"]
    assert not safety["staged"].exists() and safety["staged"].name.startswith(".tmp_step_00000002.")
    assert (safety["out"] / "run" / "checkpoints" / "latest").read_text() == "step_00000001\n"


def test_a_full_disk_is_one_line_and_leaves_nothing_behind(safety):
    if not safety["tmpfs"]:
        pytest.fail("the full-disk checks need a private tmpfs mount (root: unshare -m, mount -t tmpfs), as CI has")
    v = json.loads((safety["out"] / "disk.json").read_text())
    root = safety["out"] / "full"
    # size known (step 1's): refused before writing, with the space needed
    assert v["precheck"].startswith(f"checkpoint step 2 in {root}/run/checkpoints: not started: too little free "
                                    f"space ("), v["precheck"]
    assert "needed: the step-1 checkpoint's size and a margin); nothing was written and `latest` still points to " \
        "step 1" in v["precheck"], v["precheck"]
    assert v["precheck_staging"] == [] and v["precheck_latest"] == 1
    # size unknown (a first save): the write runs out of space; its staging folder is removed
    assert v["midwrite"].startswith(f"checkpoint step 1 in {root}/fresh/checkpoints: stopped: the disk is full ("), \
        v["midwrite"]
    assert "written before it filled are needed); the partial checkpoint was removed and no checkpoint exists " \
        "yet" in v["midwrite"], v["midwrite"]
    assert v["midwrite_staging"] == [] and v["midwrite_latest"] is None
    for message in (v["precheck"], v["midwrite"]):
        assert "\n" not in message and len(message) < 400
    assert "Traceback" not in safety["stderr"] and "No space left" not in safety["stderr"], safety["stderr"][-3000:]


@pytest.mark.slow
def test_a_trainer_on_a_full_disk_stops_with_one_line(tmp_path, tiny_llama):
    """justrl-train with its run dir on a 20 MiB tmpfs (a checkpoint of the tiny model is ~80 MiB): the first save
    runs out of space. Before: 161 lines and 5 tracebacks, the staging folder kept. Now: exit 1, one error line naming
    the folder and the space, no traceback, nothing of the checkpoint left."""
    if not _tmpfs_works():
        pytest.fail("the full-disk run needs a private tmpfs mount (root: unshare -m, mount -t tmpfs), as CI has")
    full = tmp_path / "full"
    full.mkdir()
    train = [sys.executable, "-m", "justrl_megatron.cli", "train", f"model.path={tiny_llama}",
             f"trainer.run_dir={full / 'run'}", *SHORT_TRAIN, "trainer.eval_samples=0"]
    # what the failed run left, seen inside the mount (vLLM logs to stdout too: the listing follows a marker)
    probe = 'echo ==left; ls -A "$0"/run/checkpoints; cat "$0"/run/metrics.jsonl'
    script = f'mount -t tmpfs -o size=20m tmpfs "$0" && "$@"; rc=$?; {probe}; exit $rc'
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script, str(full), *train], env=ENV, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-5000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(errors) == 1 and errors[0].startswith(
        f"justrl-train: error: checkpoint step 1 in {full}/run/checkpoints: stopped: the disk is full ("), errors
    assert "the partial checkpoint was removed and no checkpoint exists yet" in errors[0]
    left = proc.stdout.split("==left\n")[-1].splitlines()
    # no staging folder, no latest; step 1 logged (and step 2: an async write's failure surfaces at the next step's
    # commit, after its rollout)
    assert [json.loads(row)["step"] for row in left] in ([1], [1, 2]), left


# --- a second Ctrl-C is one line, whatever the helpers left to the resource tracker ------------------------------

CHILD = textwrap.dedent("""
    import os, sys, threading, time
    from multiprocessing import shared_memory
    from justrl_megatron import interrupt, run_lock

    interrupt.Interruptible().install()
    kept = shared_memory.SharedMemory(create=True, size=4096)  # a helper's, never unlinked: the tracker's to clean
    late = shared_memory.SharedMemory(create=True, size=4096)  # unlinked while the abort is under way
    aborting = threading.Event()
    remove = run_lock.remove_staging

    def slow_remove():  # removing a large staging folder takes a while; other threads run meanwhile
        aborting.set()
        time.sleep(0.5)
        return remove()

    run_lock.remove_staging = slow_remove

    def unlink_late():  # as a library's thread does when its engine process was killed under it
        aborting.wait()
        late.close()
        late.unlink()

    threading.Thread(target=unlink_late, daemon=True).start()
    print(kept.name, late.name, flush=True)
    while True:
        time.sleep(0.02)
""")


def test_second_ctrl_c_leaves_no_traceback_and_no_shared_memory():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": "0"}
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)
    names, left = [], []
    try:
        names = child.stdout.readline().split()
        assert len(names) == 2, child.communicate(timeout=60)
        child.send_signal(signal.SIGINT)
        time.sleep(REPEAT_S + 0.5)  # a second press, not the terminal's and torchrun's copies of the first
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=120)  # stderr's EOF: the resource tracker, which holds it too, is gone
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        left = [name for name in names if Path("/dev/shm", name.lstrip("/")).exists()]
        for name in left:  # only what this test made
            Path("/dev/shm", name.lstrip("/")).unlink()
    assert child.returncode == 130, err
    assert "Traceback" not in err and "resource_tracker" not in err, err
    lines = err.splitlines()
    assert len(lines) == 2 and lines[1].startswith(ABORTED.split(":")[0]), err
    assert not left, f"{left} leaked: the resource tracker was killed before it could unlink them"


def test_the_resource_tracker_leaves_stop_signals_to_the_rank():
    """A SIGUSR1 to every process (Slurm) killed the tracker a rank shares with its helpers: what it tracked leaked,
    and the next unregistration relaunched it into the KeyError traceback above."""
    code = ("import os, signal, time\nfrom multiprocessing import resource_tracker\n"
            "from justrl_megatron.interrupt import Interruptible\nInterruptible().install()\n"
            "pid = resource_tracker._resource_tracker._pid\n"
            "for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):\n    os.kill(pid, sig)\n"
            "time.sleep(0.5)\nprint(os.waitpid(pid, os.WNOHANG))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.strip() == "(0, 0)", (done.stdout, done.stderr)  # still running


# --- metrics.jsonl: a torn row -------------------------------------------------------------------------------------

def test_a_torn_metrics_row_is_named_and_the_intact_rows_are_kept(tmp_path):
    """The file cut inside step 2's row with an intact step-3 checkpoint: today only step 1 stays and nothing is
    said. Now: the rows that are intact stay (an intact row glued behind the cut one too), and one line names the
    torn row and the steps left without a row."""
    from justrl_megatron.metrics import drop_rows_after, read_metrics

    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "time": 1.0, "reward/mean": s / 10}) for s in (1, 2, 3)]
    path.write_text(rows[0] + "\n" + rows[1][:25])
    said = drop_rows_after(path, 3)
    assert said == (f"{path}: dropped 1 torn row(s) (step 2's, cut after 25 characters); no row is left for step(s) "
                    f"2-3, which the checkpoint at step 3 covers: they are not logged again")
    assert path.read_text() == rows[0] + "\n"

    path.write_text(rows[0] + "\n" + rows[1][:25] + rows[2] + "\n")  # a cut file appended to: row 3 is intact
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 3]
    said = drop_rows_after(path, 3)
    assert "step 2's, cut after 25 characters" in said and "step(s) 2," in said
    assert path.read_text() == rows[0] + "\n" + rows[2] + "\n"

    path.write_text(rows[0] + "\n" + rows[1] + "\n" + rows[2][:10])  # killed while writing step 3, resumed at 2
    assert drop_rows_after(path, 2) is None  # nothing lost: step 3 is trained and logged again
    assert path.read_text() == rows[0] + "\n" + rows[1] + "\n"


def test_the_last_line_of_a_stop_says_what_was_kept():
    """A stop during step 1's rollout keeps nothing (a rerun starts over); later, the step before it is saved."""
    import signal as sig

    from justrl_megatron.slurm import requeue_message
    from justrl_megatron.interrupt import NOTHING_SAVED, Interruptible

    stop = Interruptible()
    stop.received = sig.SIGTERM
    assert stop.message(0) == f"{NOTHING_SAVED}; exiting for requeue" and stop.message(2) == requeue_message(2)
    stop.received = sig.SIGINT
    assert stop.message(2).startswith("checkpoint saved at step 2; exiting on Ctrl-C")
    assert stop.message(0).startswith(f"{NOTHING_SAVED}; exiting on Ctrl-C")
