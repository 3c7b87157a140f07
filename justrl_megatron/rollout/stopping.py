"""Stopping a rollout early: a stop predicate polled between engine steps, agreed by the ranks that generate together.

    check = StopCheck(slurm.stop_requested, group=agreement_group())   # group=None: this process alone
    for each engine step:  check.before_step(); step(); check.stepped(seconds)   # before_step may raise
    check.finish()                                                               # after this rank's last step

`before_step` raises RolloutInterrupted when the stop is wanted (the engine aborts its requests and re-raises).

Alone (one process, or a rank whose engine no other rank waits for) the predicate is read before every step: it is
an attribute read. Colocated ranks with several engines meet in `generate_all`'s all_gather after their shares, and
the ranks of one tensor-parallel engine meet in every forward: one rank must never abort alone. They agree in
rounds. A round is one all-reduce (MAX) over a gloo group of [stop wanted, still generating, -(steps to the next
round)], and every rank takes part in every round: a rank still generating after the number of engine steps agreed
at the previous round (the fewest any rank proposed: about ROUND_S of its generation), a rank whose share is done at
once (it waits in the all-reduce for the others). After a round every rank knows the same: a stop wanted anywhere ->
every rank aborts and raises; nobody generating -> every rank returns. Rounds are placed by step counts, not by the
clock: the ranks of one TP engine step in lockstep through the model's collectives, and a round placed by the clock
could fall between two steps on one rank and inside a step on the other (a deadlock).
"""

from __future__ import annotations

from typing import Callable

import torch

from .base import RolloutInterrupted

ROUND_S = 0.5  # generation between two agreement rounds (what a stop waits for, at most, on top of one step)
MAX_ROUND_STEPS = 10_000


class StopCheck:
    def __init__(self, stop: Callable[[], bool] | None = None, *, group=None, distributed: bool = False):
        """`stop`: the local predicate (None: never). `distributed`: agree with the other ranks of `group` (a
        gloo group; None: the default group)."""
        self.stop = stop or (lambda: False)
        self.group, self.distributed = group, distributed
        self.rounds = 0
        self._steps_to_round = 0  # a round before the first step: a stop that came earlier aborts at once
        self._steps, self._step_s = 0, 0.0  # since the last round: this rank's step time

    def before_step(self) -> None:
        if not self.distributed:
            if self.stop():
                raise RolloutInterrupted("a stop was requested during the rollout")
            return
        if self._steps_to_round <= 0:
            self._round(busy=True)

    def stepped(self, seconds: float) -> None:
        self._steps += 1
        self._step_s += seconds
        self._steps_to_round -= 1

    def finish(self) -> None:
        """This rank's generation is done: take part in rounds until every rank's is (or a stop is agreed)."""
        while self.distributed and self._round(busy=False):
            pass

    def _round(self, busy: bool) -> bool:
        """One agreement round; returns whether any rank is still generating (raises on an agreed stop)."""
        import torch.distributed as dist

        propose = MAX_ROUND_STEPS
        if busy and self._steps:
            propose = int(min(MAX_ROUND_STEPS, max(1, ROUND_S / max(self._step_s / self._steps, 1e-6))))
        elif busy:
            propose = 1  # no step measured yet
        flag = torch.tensor([int(bool(self.stop())), int(busy), -propose], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self.rounds += 1
        stop, any_busy, steps = bool(flag[0]), bool(flag[1]), int(-flag[2])
        if stop:
            raise RolloutInterrupted("a stop was requested during the rollout (agreed by every rank)")
        self._steps_to_round, self._steps, self._step_s = steps, 0, 0.0
        return any_busy


_GLOO_GROUPS: dict = {}


def agreement_group():
    """The gloo group every rank of the job agrees on (None: the default group, when it is gloo already). Creating
    one is a collective: every rank calls this at the same point (generate_all does)."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return None
    if "world" not in _GLOO_GROUPS:
        _GLOO_GROUPS["world"] = dist.new_group(backend="gloo")
    return _GLOO_GROUPS["world"]

