"""Heartbeats and deadlines between processes that wait on each other (justrl_megatron/liveness.py): a stopped process,
a stopped store host, an engine step past its deadline and a wait only a lost peer could end, each named in one line
within a stated bound. No vLLM, no megatron: real TCPStores, real processes, real SIGSTOP. (The whole split job with a
stopped rollout rank: tests/test_split.py.)"""

from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from helpers import ENV

FAST = dict(heartbeat_s=0.2, missed_beats=5)  # silent for 1 s: lost

_BEATING = """
import datetime, time
import torch.distributed as dist
from justrl_megatron.liveness import Deadlines, Liveness

store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
print(store.port, flush=True)  # the store the watcher reads through lives in this process
Liveness(store, 1, {0: "trainer rank 0"}, Deadlines(heartbeat_s=0.2, missed_beats=5), on_lost=lambda line: None).start()
print("beating", flush=True)
time.sleep(300)
"""


def _watch(store):
    """Trainer rank 0's watch over rollout rank 1: (its Liveness, the lines it said)."""
    from justrl_megatron.liveness import Deadlines, Liveness

    said = []
    return Liveness(store, 0, {1: "rollout rank 1"}, Deadlines(**FAST), on_lost=said.append), said


def _until(said, seconds):
    deadline = time.monotonic() + seconds
    while not said and time.monotonic() < deadline:
        time.sleep(0.05)
    return said


def test_a_stopped_process_is_named_in_one_line_within_its_silence():
    """A process stopped with SIGSTOP (what a hung GPU, a stalled read or a wedged driver look like from outside) is
    lost once silent for missed_beats x heartbeat_s (1 s here): one line with its pid and node, within 1-3 s, once.
    Here it also hosts the store the watcher reads through (as trainer rank 0 does under justrl's launcher, seen from
    a rollout rank): a read from a stopped store host blocks for good (torch's store timeout does not bound it), and
    the watcher still decides in time. (A stopped peer whose store lives elsewhere: the split end-to-end test.)"""
    import socket

    import torch.distributed as dist

    child = subprocess.Popen([sys.executable, "-c", _BEATING], stdout=subprocess.PIPE, text=True, env=ENV)
    liveness = None
    try:
        store = dist.TCPStore("127.0.0.1", int(child.stdout.readline()), None, False,
                              datetime.timedelta(seconds=30), wait_for_workers=False)
        assert child.stdout.readline().strip() == "beating"
        liveness, said = _watch(store)
        liveness.start()
        time.sleep(2.0)  # beating: not lost
        assert not said
        os.kill(child.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        assert _until(said, 10), "the stopped process was never named"
        seconds = time.monotonic() - stopped
        assert 0.8 <= seconds <= 3.0, seconds
        assert len(said) == 1 and liveness.lost == said[0]
        assert re.fullmatch(rf"rollout rank 1 \(pid {child.pid}, node {re.escape(socket.gethostname())}\) has not "
                            rf"answered for [123] s", said[0]), said[0]
        time.sleep(0.5)
        assert len(said) == 1  # once
    finally:
        if liveness is not None:
            liveness.stop()
        child.kill()
        child.wait()


def test_an_engine_step_past_its_deadline_silences_its_rank():
    """A rank whose beat thread lives while its main thread is stuck (an engine step on a hung GPU) stops beating once
    that step is past its deadline, says why in the store, and is named with it; before the deadline it beats."""
    import torch.distributed as dist

    from justrl_megatron.liveness import Deadlines, Liveness

    store = dist.HashStore()
    engine = Liveness(store, 1, {0: "trainer rank 0"}, Deadlines(**FAST), on_lost=lambda line: None).start()
    trainer, said = _watch(store)
    trainer.start()
    stuck = threading.Event()

    def main_thread():
        with engine.doing("an engine step", 1.0):
            stuck.wait(10)

    threading.Thread(target=main_thread, daemon=True).start()
    started = time.monotonic()
    assert _until(said, 10)
    seconds = time.monotonic() - started
    stuck.set()
    engine.stop()
    trainer.stop()
    assert 1.8 <= seconds <= 4.0, seconds  # the step's 1 s deadline, then 1 s of silence
    assert said[0].startswith(f"rollout rank 1 (pid {os.getpid()}, node ")
    assert said[0].endswith("(it was in an engine step for 1 s, past that deadline of 1 s)"), said[0]


def test_a_send_that_only_a_lost_peer_could_take_gives_up_once_it_is_lost():
    """A send to a peer blocks until the peer takes it (gloo: a stopped receiver leaves it waiting for its full
    timeout); made through `call`, the waiting thread gets PeerLost, naming the peer, once the peer is lost (here:
    it never beat, 1 s); a call that ends returns its result or raises its own error; and a call after the verdict
    raises at once."""
    import torch.distributed as dist

    from justrl_megatron.liveness import PeerLost

    liveness, said = _watch(dist.HashStore())
    liveness.start()
    assert liveness.call(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(ZeroDivisionError):
        liveness.call(lambda: 1 / 0)
    never = threading.Event()
    started = time.monotonic()
    with pytest.raises(PeerLost) as info:
        liveness.call(never.wait)
    assert 0.8 <= time.monotonic() - started <= 3.0
    assert said == [str(info.value)] and said[0].startswith("rollout rank 1 (pid and node unknown: it never answered) "
                                                            "has not answered for ")
    with pytest.raises(PeerLost, match="rollout rank 1"):
        liveness.call(print, "never sent")
    liveness.stop()
    never.set()


def test_deadlines_come_from_the_config_and_a_transfer_from_its_size():
    from justrl_megatron.config import compose
    from justrl_megatron.liveness import Deadlines

    defaults = Deadlines.from_config(compose([]).rollout.liveness)
    assert defaults == Deadlines() and defaults.silence_s == 60.0
    set_ = Deadlines.from_config(compose(["rollout.liveness.heartbeat_s=1", "rollout.liveness.missed_beats=3",
                                          "rollout.liveness.transfer_mb_per_s=100"]).rollout.liveness)
    assert set_.silence_s == 3.0 and isinstance(set_.missed_beats, int)
    # a 1.5B model streamed in fp32 (6 GB) at the slowest rate accepted: 60 s + 60 s
    assert set_.transfer(6_000_000_000) == pytest.approx(120.0)
