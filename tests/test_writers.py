"""Writers of the run dir (issue 50 item 2): a dying async checkpoint writer skips that save, said once, and the
training goes on; a full disk under any writer (metrics.jsonl, wandb, HF snapshots, checkpoints) is the same one
line, with no torn row and no staging folder left. Full disks are real (a tiny tmpfs: root, as CI has); wandb and HF
snapshots get the error from a stand-in."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
from omegaconf import OmegaConf

from justrl_megatron import checkpoint as ckpt
from justrl_megatron.metrics import MetricsLogger, read_metrics

LOGGING = OmegaConf.create({"console_every": 1000, "wandb_mode": "disabled", "wandb_project": "p", "wandb_name": None,
                            "progress": False})


def _logger(run_dir, start_step=0):
    return MetricsLogger(run_dir, LOGGING, config={}, total_steps=10, start_step=start_step)


@contextlib.contextmanager
def _tiny_disk(path: Path, size: str):
    """A real filesystem of `size` at `path` (tmpfs). Mounting needs root, which CI has (as test_run_safety's
    full-disk checks, these fail rather than skip without it: a skip would hide them)."""
    path.mkdir(parents=True, exist_ok=True)
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                         text=True)
    if got.returncode != 0:
        why = got.stderr.strip() or got.returncode
        pytest.fail(f"the full-disk checks need a tiny tmpfs (root: mount -t tmpfs), as CI has; mounting failed: {why}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(folder: Path) -> Path:
    """Fill the disk under `folder` to the last byte."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (1 << 16, 4096, 1):
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * size):
                    pass
    finally:
        os.close(fd)
    return filler


def _one_line(message: str) -> str:
    assert "\n" not in message and "Traceback" not in message, message
    return message


# --- metrics.jsonl -----------------------------------------------------------------------------------------------

def test_a_full_disk_under_metrics_is_one_line_and_leaves_no_torn_row(tmp_path):
    with _tiny_disk(tmp_path / "disk", "256k") as disk:
        run_dir = disk / "run"
        run_dir.mkdir()
        logger = _logger(run_dir)
        logger.log(1, {"reward/mean": 0.5})
        logger.log(2, {"reward/mean": 0.25})
        before = (run_dir / "metrics.jsonl").read_bytes()
        _fill(disk)
        with pytest.raises(ckpt.CheckpointWriteError) as err:  # (a row that needs new blocks: the disk has none)
            logger.log(3, {"reward/mean": 0.75, "note": "x" * 20000})
        message = _one_line(str(err.value))
        assert message.startswith(f"metrics.jsonl row of step 3 in {run_dir}: stopped: the disk is full (")
        assert "the partial row was removed: free some space" in message
        assert (run_dir / "metrics.jsonl").read_bytes() == before  # cut back: nothing torn
        assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
        assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]


def test_a_short_write_then_a_full_disk_is_cut_back_to_the_previous_row(tmp_path, monkeypatch):
    """The row went half-way (a short write) before the disk filled: the half is removed."""
    from justrl_megatron import metrics

    logger = _logger(tmp_path)
    logger.log(1, {"reward/mean": 0.5})
    before = (tmp_path / "metrics.jsonl").read_bytes()
    real_write, calls = os.write, []

    def write(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(metrics.os, "write", write)
    with pytest.raises(ckpt.CheckpointWriteError, match="metrics.jsonl row of step 2 .* the disk is full"):
        logger.log(2, {"reward/mean": 0.25})
    monkeypatch.undo()
    assert len(calls) == 2 and (tmp_path / "metrics.jsonl").read_bytes() == before
    logger.log(2, {"reward/mean": 0.25})  # the next row starts on a fresh line
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_another_metrics_failure_is_not_called_a_full_disk(tmp_path, monkeypatch):
    from justrl_megatron import metrics

    logger = _logger(tmp_path)
    monkeypatch.setattr(metrics.os, "write", lambda fd, data: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    monkeypatch.setattr(ckpt.save.shutil, "disk_usage", lambda p: type("U", (), {"free": 1 << 40})())
    with pytest.raises(OSError, match="I/O error") as err:
        logger.log(1, {"reward/mean": 0.5})
    assert not isinstance(err.value, ckpt.CheckpointWriteError)


def test_a_full_disk_under_wandb_is_the_same_one_line(tmp_path, monkeypatch):
    class FullWandb:
        def log(self, record, step):
            raise RuntimeError("wandb: writing the run file failed") from OSError(errno.ENOSPC, "No space left")

        def finish(self):
            raise OSError(errno.EDQUOT, "Disk quota exceeded")

    logger = _logger(tmp_path)
    logger._wandb = FullWandb()
    with pytest.raises(ckpt.CheckpointWriteError) as err:
        logger.log(1, {"reward/mean": 0.5})
    message = _one_line(str(err.value))
    assert message.startswith(f"wandb's log of step 1 in {tmp_path}: stopped: the disk is full (")
    assert "metrics.jsonl has the row: free some space" in message
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    with pytest.raises(ckpt.CheckpointWriteError, match=r"^wandb's finish in .*: stopped: the disk is full"):
        logger.close()


def test_the_rows_rewrite_at_a_resume_on_a_full_disk_leaves_no_temp_file(tmp_path, monkeypatch):
    rows = "".join(json.dumps({"step": s, "time": 0.0}) + "\n" for s in (1, 2, 3))
    (tmp_path / "metrics.jsonl").write_text(rows)
    real = Path.write_text

    def write_text(self, *args, **kwargs):
        if self.name.endswith(".tmp"):
            real(self, "{\"step\": 1, \"ti")  # a part, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    with pytest.raises(ckpt.CheckpointWriteError, match=r"^metrics.jsonl \(dropping the rows after step 1\) in .*"
                                                        r"the disk is full .*the file is unchanged"):
        _logger(tmp_path, start_step=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    assert (tmp_path / "metrics.jsonl").read_text() == rows


# --- a full disk elsewhere while a checkpoint is being written -----------------------------------------------------

def _fake_pending(run_dir, step):
    from justrl_megatron.checkpoint.save import _Pending

    tmp = ckpt.checkpoint_root(run_dir) / f".tmp_step_{step:08d}.{os.getpid()}"
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(b"x" * 100)
    return _Pending(step, tmp, None, contextlib.ExitStack(), None)


def test_an_hf_snapshot_on_a_full_disk_also_removes_a_checkpoint_being_written(tmp_path, monkeypatch):
    from justrl_megatron.train import hf_snapshots
    from test_checkpoint import save_hf_onto_a_full_disk

    monkeypatch.setattr(hf_snapshots, "save_hf", save_hf_onto_a_full_disk)
    saver = ckpt.Checkpointer(tmp_path, async_save=True)
    saver._pending = _fake_pending(tmp_path, 4)
    with pytest.raises(ckpt.CheckpointWriteError) as err:
        hf_snapshots.HFSnapshots(tmp_path, 1, 2, 10, None, None, None).save(4)
    message = _one_line(str(err.value))
    assert message.startswith(f"HF snapshot step 4 in {tmp_path / 'hf'}: stopped: the disk is full (")
    assert ("the partial folder was removed, and so was the unfinished save of checkpoint step 4 (`latest` is "
            "unchanged): free some space") in message
    assert list((tmp_path / "hf").iterdir()) == [] and list(ckpt.checkpoint_root(tmp_path).iterdir()) == []
    assert saver.pending_step is None


# --- real async saves of a tiny policy: a killed writer, a disk that fills while one writes ------------------------

def _hold(monkeypatch, method: str, hold: Path, on_entry=None) -> Path:
    """megatron's FileSystemWriterAsync.`method` waits (up to 60 s) while the file `hold` exists, after calling
    `on_entry()` (so that a test acts on a process that is surely still writing)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    original = getattr(FileSystemWriterAsync, method)

    def held(*args, **kwargs):
        if on_entry is not None:
            on_entry()
        deadline = time.monotonic() + 60
        while hold.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return original(*args, **kwargs)

    monkeypatch.setattr(FileSystemWriterAsync, method, staticmethod(held))
    return hold


@pytest.fixture
def held_writers(monkeypatch, tmp_path):
    """megatron's async writer waits while tmp_path/hold exists."""
    return _hold(monkeypatch, "write_preloaded_data_multiproc", tmp_path / "hold")


@pytest.fixture(scope="module")
def policy():
    from test_step import _policy

    return _policy(distopt=False)


def _save(saver, step, policy):
    saver.save(step, policy.chunks, policy.optimizer, policy.scheduler, {"step": step})


def _staging(run_dir):
    root = ckpt.checkpoint_root(run_dir)
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp_")) if root.is_dir() else []


def _kill_pending_writer(saver):
    writer = saver._pending.writer
    assert writer is not None and writer.is_alive()
    os.kill(writer.pid, signal.SIGKILL)
    writer.join(10)
    return writer.pid


def test_a_killed_async_writer_skips_that_save_once_and_training_goes_on(tmp_path, policy, held_writers, capfd):
    from justrl_megatron.train.loop import _finish_saves

    run_dir = tmp_path / "run"
    saver = ckpt.Checkpointer(run_dir, async_save=True, keep_last=5)
    _save(saver, 1, policy)
    assert saver.wait() == ckpt.step_dir(run_dir, 1)
    capfd.readouterr()

    held_writers.touch()
    _save(saver, 2, policy)
    pid = _kill_pending_writer(saver)  # what the out-of-memory killer does
    held_writers.unlink()
    assert saver.poll() is None  # no CheckpointException: the save is skipped
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"justrl-train: warning: checkpoint step 2 skipped: its writer process (pid {pid}) was "
                     f"killed by SIGKILL (the out-of-memory killer's usual choice: it has the trainer's footprint); "
                     f"its staging folder was removed and `latest` still points to step 1; training goes on (the next "
                     f"save writes a complete checkpoint)"], err
    assert ckpt.latest_step(run_dir) == 1 and _staging(run_dir) == [] and saver.pending_step is None
    assert saver.wait() is None and capfd.readouterr().err == ""  # said once

    _save(saver, 3, policy)  # training goes on: the next save is complete
    assert saver.wait() == ckpt.step_dir(run_dir, 3) and ckpt.checkpoint_problem(ckpt.step_dir(run_dir, 3)) is None

    # the last step (or a stop): no later save comes, so the skipped one is written again at once
    held_writers.touch()
    _save(saver, 4, policy)
    _kill_pending_writer(saver)
    held_writers.unlink()
    _finish_saves(saver, 4, None, None, run_dir, stopping=False)
    assert ckpt.latest_step(run_dir) == 4 and ckpt.checkpoint_problem(ckpt.step_dir(run_dir, 4)) is None
    assert _staging(run_dir) == []
    err = capfd.readouterr().err
    assert "checkpoint step 4 skipped" in err and "checkpoint step 4 written again (synchronously)" in err
    assert "Traceback" not in err


def test_a_disk_that_fills_during_an_async_save_ends_on_the_next_metrics_row(tmp_path, policy, held_writers):
    """The issue's case: the async save of step 2 is being written when the disk fills; the next metrics row is one
    line, the row is not torn, the save in progress is abandoned (writer stopped, staging removed), `latest` stays."""
    with _tiny_disk(tmp_path / "disk", "4m") as disk:
        run_dir = disk / "run"
        run_dir.mkdir()
        logger = _logger(run_dir)
        saver = ckpt.Checkpointer(run_dir, async_save=True, keep_last=5)
        logger.log(1, {"reward/mean": 0.5})
        _save(saver, 1, policy)
        saver.wait()
        held_writers.touch()
        _save(saver, 2, policy)
        writer = saver._pending.writer
        assert _staging(run_dir) and writer.is_alive()
        before = (run_dir / "metrics.jsonl").read_bytes()
        _fill(disk)
        with pytest.raises(ckpt.CheckpointWriteError) as err:
            logger.log(2, {"reward/mean": 0.25, "note": "x" * 20000})
        message = _one_line(str(err.value))
        assert message.startswith(f"metrics.jsonl row of step 2 in {run_dir}: stopped: the disk is full (")
        assert ("the partial row was removed, and so was the unfinished save of checkpoint step 2 (`latest` is "
                "unchanged)") in message
        assert (run_dir / "metrics.jsonl").read_bytes() == before
        assert _staging(run_dir) == [] and ckpt.latest_step(run_dir) == 1 and saver.pending_step is None
        assert not writer.is_alive()


@pytest.fixture
def held_workers(monkeypatch, tmp_path):
    """megatron's write workers (one per write bucket, forked by the writer) wait while tmp_path/hold_workers exists;
    each leaves tmp_path/worker.<pid>."""
    return _hold(monkeypatch, "write_preloaded_data", tmp_path / "hold_workers",
                 on_entry=lambda: (tmp_path / f"worker.{os.getpid()}").touch())


def test_a_killed_write_worker_does_not_hang_the_trainer(tmp_path, policy, held_workers, capfd):
    """Killing one of the workers the writer forks left megatron's writer waiting for it forever (and the next
    wait with it): the writer is stopped, the save skipped, said once."""
    run_dir = tmp_path / "run"
    saver = ckpt.Checkpointer(run_dir, async_save=True, keep_last=5)
    _save(saver, 1, policy)
    saver.wait()
    for marker in tmp_path.glob("worker.*"):
        marker.unlink()
    capfd.readouterr()
    held_workers.touch()
    _save(saver, 2, policy)
    deadline = time.monotonic() + 20
    while not (workers := sorted(tmp_path.glob("worker.*"))) and time.monotonic() < deadline:
        time.sleep(0.02)
    victim = int(workers[0].name.split(".")[1])
    os.kill(victim, signal.SIGKILL)
    held_workers.unlink()  # the others finish; the writer waits for the killed one
    writer, got = saver._pending.writer, []
    waiting = threading.Thread(target=lambda: got.append(saver.wait()), daemon=True)
    waiting.start()
    waiting.join(15)
    if waiting.is_alive():  # (before the fix: forever; the writer is killed so that the test ends)
        with contextlib.suppress(Exception):
            for child in psutil.Process(writer.pid).children(recursive=True):
                child.kill()
        writer.kill()
        waiting.join(30)
        pytest.fail("the trainer's wait for the save hung on the writer waiting for its killed worker")
    assert got == [None]
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        f"justrl-train: warning: checkpoint step 2 skipped: a worker of its writer process (pid {victim}) was killed "
        f"by SIGKILL"), err
    assert ckpt.latest_step(run_dir) == 1 and _staging(run_dir) == []
    _save(saver, 3, policy)
    assert saver.wait() == ckpt.step_dir(run_dir, 3)
