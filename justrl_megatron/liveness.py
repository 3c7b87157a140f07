"""Processes that wait on each other (split placement: trainer rank 0 and the rollout ranks) say they are alive, and
one that stops answering is named in one line: a heartbeat from each, and deadlines derived from what is waited for.

    liveness = Liveness(store, 1, {0: "trainer rank 0"}, Deadlines(), on_lost=...).start()
    with liveness.doing("an engine step", deadlines.engine_step_s):  # past its deadline this process falls silent
        engine.step()
    liveness.call(channel.send, message)  # a call only the peers can end: PeerLost here once one of them is lost

A thread of its own adds 1 to this process' counter in the job's store every `heartbeat_s` and reads its peers'
counters; a peer whose counter has not moved for `missed_beats` beats is lost: `on_lost(line)` runs once, with
"<peer> (pid P, node N) has not answered for S s". A thread beats as long as its process lives, also while the main
thread waits forever on an engine whose GPU hung: so a process stops beating while its main thread is past the
deadline of what it is `doing`, and leaves the reason in the store for the line. A send to a peer blocks until the
peer takes it (gloo: until the receiver has posted its receive), so the waiting thread must not be the one that
makes it: `call` makes it on a thread of its own and returns (PeerLost) once the peer is lost; every other wait on a
peer polls `lost` (rollout/engines.GroupBuffer, through `on_lost`).

A store operation whose store's host is stopped (SIGSTOP, a wedged node) blocks regardless of the store's timeout
(torch 2.13, measured): the reads happen on the beat thread, and a second thread judges from when the beat thread last
saw each peer move, so a stuck store silences its host, never the reader.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import threading
import time
from typing import Callable

from .lifeline import said_and_failed_code

BEAT, WHO, WHY = "beat/", "who/", "why/"  # store keys: a rank's counter, its pid and node, why it fell silent


class PeerLost(RuntimeError):
    """A process this one waits on stopped answering; the message is the one line that names it."""


@dataclasses.dataclass(frozen=True)
class Deadlines:
    """How long waits between the trainer and the rollout ranks may last (rollout.liveness: config/schema.py's
    LivenessConfig takes its defaults from here, so this module imports nothing but the standard library)."""

    heartbeat_s: float = 5.0  # each process beats this often, from a thread of its own
    missed_beats: int = 12  # 60 s of silence: far above a thread's scheduling delays or a long GIL-holding call
    engine_step_s: float = 600.0  # one engine step (a decode step of every running sequence, or a prefill chunk)
    # a weight transfer of B bytes may take transfer_s + B / transfer_mb_per_s (its rendezvous, the export's gathers,
    # and the slowest link accepted: 50 MB/s is ~1/200 of NCCL over NVLink, ~1/20 of gloo on one host)
    transfer_s: float = 60.0
    transfer_mb_per_s: float = 50.0

    @classmethod
    def from_config(cls, liveness) -> "Deadlines":
        kinds = {"int": int, "float": float}
        return cls(**{f.name: kinds[f.type](getattr(liveness, f.name)) for f in dataclasses.fields(cls)})

    @property
    def silence_s(self) -> float:
        """A peer silent this long is lost."""
        return self.heartbeat_s * self.missed_beats

    def transfer(self, nbytes: int) -> float:
        """Seconds a weight transfer of `nbytes` may take."""
        return self.transfer_s + nbytes / (self.transfer_mb_per_s * 1e6)


def exit_process(line: str) -> None:
    """End this process at once, after the one line (for a process with nothing to save: what it started dies with
    it, lifeline.py)."""
    os.write(2, f"justrl-train: error: {line}\n".encode())
    os._exit(said_and_failed_code())  # (justrl's launcher adds no line of its own)


class Liveness:
    """This process' heartbeat in `store` (as rank `me`) and its watch over `peers` ({rank: what to call it})."""

    def __init__(self, store, me: int, peers: dict[int, str], deadlines: Deadlines, on_lost: Callable[[str], None]):
        self.store, self.me, self.peers, self.deadlines = store, me, dict(peers), deadlines
        self.on_lost = on_lost  # called once, on the watch thread, with the line
        self.lost: str | None = None  # the line naming the first peer found lost
        self._doing: tuple[str, float, float] | None = None  # the main thread's (what, since, deadline)
        self._seen: dict[int, tuple[int | None, float]] = {}  # peer -> (its counter, when it last moved)
        self._who: dict[int, str] = {}
        self._why: dict[int, str] = {}
        self._stopped = threading.Event()

    def start(self) -> "Liveness":
        self.store.set(WHO + str(self.me), f"pid {os.getpid()}, node {socket.gethostname()}")
        now = time.monotonic()
        self._seen = {peer: (None, now) for peer in self.peers}
        for target, what in ((self._beat, "beat"), (self._watch, "watch")):
            threading.Thread(target=target, daemon=True, name=f"justrl-liveness-{what}").start()
        return self

    def stop(self) -> None:
        """Stop beating and watching (an orderly end: the peers are told by other means)."""
        self._stopped.set()

    def check(self) -> None:
        """Raise PeerLost when a peer is lost (before a wait on the peers)."""
        if self.lost is not None:
            raise PeerLost(self.lost)

    @contextlib.contextmanager
    def doing(self, what: str, deadline_s: float):
        """The main thread does `what`, which must take less than `deadline_s`: past it, this process falls silent."""
        outer, self._doing = self._doing, (what, time.monotonic(), deadline_s)
        try:
            yield
        finally:
            self._doing = outer

    def call(self, fn: Callable, *args):
        """fn(*args), a call that only the peers can end (a send to them), made on a thread of its own while this
        one waits: returns its result or raises its error, or raises PeerLost once a peer is lost (the call's thread
        is then left blocked until the process ends; nothing else uses what it blocks on)."""
        self.check()
        done, box = threading.Event(), {}

        def run():
            try:
                box["value"] = fn(*args)
            except BaseException as exc:  # noqa: BLE001  (raised to the caller)
                box["error"] = exc
            finally:
                done.set()

        threading.Thread(target=run, daemon=True, name="justrl-liveness-call").start()
        while not done.wait(0.1):
            self.check()
        if "error" in box:
            raise box["error"]
        return box.get("value")

    # -- the two threads ----------------------------------------------------------------------------------------------

    def _silence(self, now: float) -> str | None:
        """Why this process withholds its beat: what its main thread does past its deadline (None: it beats)."""
        doing = self._doing
        if doing is not None and now - doing[1] > doing[2]:
            return f"it was in {doing[0]} for {now - doing[1]:.0f} s, past that deadline of {doing[2]:.0f} s"
        return None

    def _beat(self) -> None:
        interval, said = self.deadlines.heartbeat_s, False
        while not self._stopped.is_set():
            started = time.monotonic()
            try:
                why = self._silence(started)
                if why is None:
                    self.store.add(BEAT + str(self.me), 1)
                elif not said:
                    self.store.set(WHY + str(self.me), why)
                    said = True
                for peer in self.peers:
                    self._read(peer, interval)
            except Exception:  # noqa: BLE001 - the store failed (its host is gone): the peers stay unseen
                pass
            self._stopped.wait(max(0.0, interval - (time.monotonic() - started)))

    def _read(self, peer: int, interval: float) -> None:
        count = self.store.add(BEAT + str(peer), 0)
        last, since = self._seen[peer]
        now = time.monotonic()
        if count != last and (last is not None or count > 0):  # (a first read of 0: it has not beaten yet)
            self._seen[peer] = (count, now)
            if peer not in self._who:
                self._who[peer] = self.store.get(WHO + str(peer)).decode()  # set before its first beat
        else:
            self._seen[peer] = (count, since)
            if now - since >= 2 * interval and peer not in self._why and self.store.check([WHY + str(peer)]):
                self._why[peer] = self.store.get(WHY + str(peer)).decode()

    def _watch(self) -> None:
        silence = self.deadlines.silence_s
        while not self._stopped.wait(min(1.0, self.deadlines.heartbeat_s / 2)):
            now = time.monotonic()
            quiet = {peer: now - since for peer, (_, since) in self._seen.items() if now - since >= silence}
            if quiet:
                peer = max(quiet, key=quiet.get)
                who = self._who.get(peer, "pid and node unknown: it never answered")
                why = f" ({self._why[peer]})" if peer in self._why else ""
                self.lost = f"{self.peers[peer]} ({who}) has not answered for {quiet[peer]:.0f} s{why}"
                self.on_lost(self.lost)
                return
