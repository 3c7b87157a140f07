"""BatchScorer: score many (response, answer) pairs in worker processes, surviving hangs and crashes.

Why not ``concurrent.futures``: when a worker dies there it breaks the whole pool and cannot say which item killed it,
and a hung item cannot be timed out at all. Here each worker owns a pipe and some shared memory — the index of the
item it is on, when that item started, and a result slot per item of its chunk — so the parent knows, at any moment,
which item is running and which results are already done:

* an item running longer than ``timeout_s`` gets its worker SIGKILLed: the item scores ``failure_value``,
  ``stats["timeouts"]`` grows, the finished items of that chunk are kept, the rest are re-queued;
* a worker that dies (``os._exit``, segfault, OOM kill) is handled the same way, counted in ``stats["crashes"]``;
* an exception inside the verifier (or a NaN reward) scores ``failure_value`` and counts in ``stats["errors"]``;
  a ``VerifierTimeout`` (the verifier's own clock: math-verify's alarm, the code sandbox's deadline) scores the same
  and counts in ``stats["timeouts"]``;
* dead workers are replaced at once (``stats["restarts"]``); the batch always completes.

The timeout is never below the verifier's own ``time_limit_s`` plus ``TIMEOUT_MARGIN_S``: the verifier's clock fires
first and cleans up after itself (the code sandbox kills its namespace) before the scorer would kill the worker. Every
reward is clamped into the verifier's ``reward_range`` here, the one place all of them pass
(``stats["clamped"]`` counts the ones that were out of range).

``evaluate`` returns, with each reward, whether the verifier judged the response fully correct (for accuracy
metrics) from the same verification — no second, unprotected pass in the caller.

Pure verifiers that parse a bounded tail in linear time (``fn.in_process``: dapo, gsm8k, countdown) are scored in the
calling process: for them pickling and pipes would cost more than the verification. Verifiers that only read the
response's tail (``fn.tail_chars``) get only that tail, in either place.

Workers start with ``forkserver`` (never plain ``fork``: the trainer has threads, and forking a threaded process can
deadlock the child), so ``fn`` must be picklable and importable by module path, and a script that uses a
BatchScorer needs an ``if __name__ == "__main__":`` guard.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
import time
from collections import Counter, deque
from multiprocessing.connection import wait

from ..lifeline import exit_with_starter, leave_stop_signals_to_the_trainer
from .base import VerifierTimeout, check_answers, evaluate_with, reward_range

MAX_CHUNK = 512
DEFAULT_TIMEOUT_S = 10.0
TIMEOUT_MARGIN_S = 3.0
_TIMED_OUT = -1.0  # in a correct[] slot: the verifier raised VerifierTimeout
STARTUP_TIMEOUT_S = 120.0  # a worker imports the verifier's module; slow on a loaded machine, never minutes


def _evaluate_one(fn, response, answer) -> tuple[float, float]:
    """(reward, correct flag) as floats; (NaN, 0) when the verifier raised, (NaN, _TIMED_OUT) when it timed out."""
    try:
        reward, ok = evaluate_with(fn, response, answer)
        return float(reward), float(bool(ok))
    except VerifierTimeout:
        return math.nan, _TIMED_OUT
    except Exception:  # noqa: BLE001 - any verifier bug costs the item, never the batch
        return math.nan, 0.0


def _worker_main(conn, fn, progress, started, rewards, correct):
    """Score chunks until told to stop. Item i of a chunk: set progress/started, then write rewards[i] (NaN: it
    raised) and correct[i]."""
    leave_stop_signals_to_the_trainer()
    exit_with_starter()  # a busy worker must not outlive a killed trainer (an idle one leaves on the pipe's EOF)
    conn.send("ready")  # fn is unpickled (its module imported): item timeouts may start counting
    while True:
        try:
            items = conn.recv()
        except (EOFError, OSError):
            return
        if items is None:
            return
        for i, (response, answer) in enumerate(items):
            started.value = time.monotonic()
            progress.value = i
            rewards[i], correct[i] = _evaluate_one(fn, response, answer)
        progress.value = len(items)
        conn.send(True)


class _Worker:
    def __init__(self, ctx, fn):
        self.progress = ctx.RawValue("l", 0)
        self.started = ctx.RawValue("d", 0.0)
        self.rewards = ctx.RawArray("d", MAX_CHUNK)
        self.correct = ctx.RawArray("d", MAX_CHUNK)
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_worker_main, daemon=True, name="justrl-reward-worker",
                                   args=(child, fn, self.progress, self.started, self.rewards, self.correct))
        self.process.start()
        child.close()
        self.chunk = None  # (start, end) while busy

    def wait_ready(self, timeout_s: float):
        """Block until the worker has started; a worker that cannot start is a setup error, not an item failure."""
        try:
            ok = self.conn.poll(timeout_s) and self.conn.recv() == "ready"
        except (EOFError, OSError):
            ok = False
        if not ok:
            self.kill()
            raise RuntimeError(f"reward worker did not start within {timeout_s:.0f}s (exit code "
                               f"{self.process.exitcode}); the verifier must be picklable and importable by module "
                               f"path, and a script using BatchScorer needs an `if __name__ == '__main__':` guard")

    def dispatch(self, start: int, end: int, items: list):
        self.progress.value = 0
        self.started.value = time.monotonic()  # before the send: a stale value must not look like a hang
        self.chunk = (start, end)
        self.conn.send(items)

    def results(self, n: int) -> tuple[list, list]:
        return self.rewards[:n], self.correct[:n]

    def kill(self):
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(timeout=5)
        self.conn.close()

    def stop(self):
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout=2)
        if self.process.is_alive():
            self.kill()
        else:
            self.conn.close()


class BatchScorer:
    """``with BatchScorer(fn, num_workers=2, timeout_s=10) as s: rewards = s.score(responses, answers)``.

    ``failure_value`` defaults to ``fn.failure_value`` (the verifier's wrong-answer reward). ``in_process`` overrides
    the verifier's own flag (``num_workers=0`` also means in-process). ``timeout_s`` (default 10 s) is raised to the
    verifier's ``time_limit_s`` + ``TIMEOUT_MARGIN_S`` where that is longer. ``stats`` counts items, timeouts,
    crashes, errors, worker restarts and clamped rewards over the scorer's life.
    """

    def __init__(self, fn, num_workers: int = 2, timeout_s: float | None = None, *, failure_value: float | None = None,
                 in_process: bool | None = None, chunk_size: int | None = None, start_method: str | None = None):
        self.fn = fn
        self.num_workers = int(num_workers)
        own = getattr(fn, "time_limit_s", None)
        self.timeout_s = max(float(DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s),
                             0.0 if own is None else own + TIMEOUT_MARGIN_S)
        self.reward_range = reward_range(fn)
        self.failure_value = float(getattr(fn, "failure_value", 0.0) if failure_value is None else failure_value)
        flag = getattr(fn, "in_process", False) if in_process is None else in_process
        self.in_process = bool(flag) or self.num_workers <= 0
        self.chunk_size = chunk_size
        self.tail_chars = getattr(fn, "tail_chars", None)
        if start_method is None:
            start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        self._ctx = mp.get_context(start_method)
        self._workers: list[_Worker] = []
        self.stats = Counter(items=0, timeouts=0, crashes=0, errors=0, restarts=0, clamped=0)

    # ------------------------------------------------------------------------------------------------ lifecycle
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        for w in self._workers:
            w.stop()
        self._workers = []

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _ensure_workers(self):
        fresh = [_Worker(self._ctx, self.fn) for _ in range(self.num_workers - len(self._workers))]
        for w in fresh:  # started together, awaited together
            w.wait_ready(STARTUP_TIMEOUT_S)
        self._workers.extend(fresh)

    def _replace(self, worker: _Worker) -> _Worker:
        # Waiting for the replacement keeps its start-up time (imports) off the next item's timeout clock.
        worker.kill()
        fresh = _Worker(self._ctx, self.fn)
        fresh.wait_ready(STARTUP_TIMEOUT_S)
        self._workers[self._workers.index(worker)] = fresh
        self.stats["restarts"] += 1
        return fresh

    # -------------------------------------------------------------------------------------------------- scoring
    def score(self, responses: list[str], answers: list) -> list[float]:
        """Rewards in input order. Never raises for a bad item: it gets ``failure_value`` and is counted."""
        return self.evaluate(responses, answers)[0]

    def evaluate(self, responses: list[str], answers: list) -> tuple[list[float], list[bool]]:
        """(rewards, fully-correct flags) in input order; a failed item is (failure_value, False). A missing ground
        truth (None) is refused (ValueError) before any scoring."""
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
        check_answers(answers)  # a None ground truth would be compared as the text "None"
        self.stats["items"] += len(responses)
        if not responses:
            return [], []
        if self.tail_chars is not None:
            responses = [r[-self.tail_chars:] for r in responses]
        rewards, correct = (self._score_here if self.in_process else self._score_pool)(responses, answers)
        lo, hi = self.reward_range
        for i, r in enumerate(rewards):
            if r != r:  # NaN: the verifier raised, timed out, or returned NaN
                self.stats["timeouts" if correct[i] == _TIMED_OUT else "errors"] += 1
                rewards[i], correct[i] = self.failure_value, 0.0
            elif not lo <= r <= hi:
                self.stats["clamped"] += 1
                rewards[i] = min(max(r, lo), hi)
        return [float(r) for r in rewards], [c == 1.0 for c in correct]

    def _score_here(self, responses, answers):
        scored = [_evaluate_one(self.fn, response, answer) for response, answer in zip(responses, answers)]
        return [r for r, _ in scored], [c for _, c in scored]

    def _chunks(self, n: int) -> deque:
        size = self.chunk_size or math.ceil(n / (self.num_workers * 4))
        size = max(1, min(size, MAX_CHUNK))
        return deque((s, min(s + size, n)) for s in range(0, n, size))

    def _score_pool(self, responses, answers):
        self._ensure_workers()
        rewards: list = [None] * len(responses)
        correct: list = [0.0] * len(responses)
        pending = self._chunks(len(responses))
        idle = list(self._workers)
        busy: dict = {}  # conn -> worker

        while pending or busy:
            while pending and idle:
                w = idle.pop()
                if not w.process.is_alive():  # died while idle (killed from outside)
                    w = self._replace(w)
                start, end = pending.popleft()
                w.dispatch(start, end, list(zip(responses[start:end], answers[start:end])))
                busy[w.conn] = w
            now = time.monotonic()
            next_deadline = min(w.started.value + self.timeout_s for w in busy.values())
            ready = wait(list(busy) + [w.process.sentinel for w in busy.values()],
                         timeout=max(0.0, min(next_deadline - now, 1.0)))
            now = time.monotonic()
            for conn, w in list(busy.items()):
                # A worker that finished its chunk and then died still left its message in the pipe: read first.
                if conn in ready or not w.process.is_alive():
                    try:
                        message = conn.recv() if conn.poll() else None
                    except (EOFError, OSError):
                        message = None
                    if message is not None:
                        start, end = w.chunk
                        rewards[start:end], correct[start:end] = w.results(end - start)
                        del busy[conn]
                        idle.append(w)
                        continue
                dead = not w.process.is_alive()
                hung = not dead and now - w.started.value > self.timeout_s
                if dead or hung:
                    # Keep the chunk's finished items, fail the running one, re-queue the rest.
                    start, end = w.chunk
                    done = min(w.progress.value, end - start)
                    rewards[start:start + done], correct[start:start + done] = w.results(done)
                    if done < end - start:
                        rewards[start + done] = self.failure_value
                        if start + done + 1 < end:
                            pending.appendleft((start + done + 1, end))
                    self.stats["timeouts" if hung else "crashes"] += 1
                    del busy[conn]
                    idle.append(self._replace(w))
        return rewards, correct
