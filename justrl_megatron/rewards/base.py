"""What every verifier shares: a grade in [0, 1] (or None: no answer found) mapped to configurable reward values.

``grade(response, answer)`` is the verifier's judgement — 1.0 correct, 0.0 wrong, a pass rate for code, None when
the response holds no parsable answer. ``__call__`` maps it to a reward: ``no_answer`` for None, else
``wrong + (correct - wrong) * grade``; so +1 / -1 / -0.5 (correct / wrong / no answer) is one keyword each.

Every verifier declares ``reward_range`` (the lowest and highest reward it may give) and, where it keeps its own clock,
``time_limit_s`` (how long one call may take before it gives up); BatchScorer clamps every reward into the range and
sets its worker timeout above the time limit. A verifier whose own timeout fired raises ``VerifierTimeout``: the item
scores ``failure_value`` and counts as a timeout, like one the scorer had to kill.

Verifiers are plain objects with only plain attributes: picklable, stateless between calls, safe in worker processes.
"""
from __future__ import annotations

import json
import math

from ..boxed import is_null_answer


class VerifierTimeout(Exception):
    """A verifier's own time limit fired (math-verify's alarm, the code sandbox's deadline)."""


class Verifier:
    """Base class. Subclasses implement ``grade``. ``in_process`` marks pure, fast, bounded-time verifiers that a
    BatchScorer may run in the calling process; ``tail_chars`` lets it send workers only the response's tail."""

    in_process = False
    tail_chars: int | None = None  # the verifier reads only this many final characters (None: the whole response)
    time_limit_s: float | None = None  # the longest one call takes when the verifier's own clock runs out
    default_correct = 1.0
    default_wrong = 0.0

    def __init__(self, correct: float | None = None, wrong: float | None = None, no_answer: float | None = None):
        self.correct = float(self.default_correct if correct is None else correct)
        self.wrong = float(self.default_wrong if wrong is None else wrong)
        # No answer scores like a wrong one unless configured (JustRL: a truncated response has no box -> -1).
        self.no_answer = self.wrong if no_answer is None else float(no_answer)

    def grade(self, response: str, answer) -> float | None:
        raise NotImplementedError

    def value(self, grade: float | None) -> float:
        return self.no_answer if grade is None else self.wrong + (self.correct - self.wrong) * grade

    def __call__(self, response: str, answer) -> float:
        """The reward; a call whose own time limit fired gets ``failure_value`` (``evaluate`` raises instead, so a
        BatchScorer can count it)."""
        try:
            return self.value(self.grade(response, answer))
        except VerifierTimeout:
            return self.failure_value

    def evaluate(self, response: str, answer) -> tuple[float, bool]:
        """(reward, fully correct) from one verification — what BatchScorer.evaluate runs in its workers."""
        g = self.grade(response, answer)
        return self.value(g), g == 1.0

    def is_correct(self, response: str, answer) -> bool:
        try:
            return self.grade(response, answer) == 1.0
        except VerifierTimeout:
            return False

    @property
    def reward_range(self) -> tuple[float, float]:
        """Every reward lies between the correct, wrong and no-answer values (a grade in [0, 1] interpolates)."""
        values = (self.correct, self.wrong, self.no_answer)
        return min(values), max(values)

    @property
    def failure_value(self) -> float:
        """The reward an item gets when its verification crashed or timed out: the wrong-answer value."""
        return self.wrong

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({opts})"


def evaluate_with(fn, response: str, answer) -> tuple[float, bool]:
    """(reward, fully correct) for any reward callable: a verifier's own ``evaluate``, else a plain function's result
    compared with its ``correct`` value (1.0 if it has none)."""
    if hasattr(fn, "evaluate"):
        return fn.evaluate(response, answer)
    reward = fn(response, answer)
    return reward, reward == getattr(fn, "correct", 1.0)


def reward_range(fn) -> tuple[float, float]:
    """The range ``fn`` declares; unbounded for a plain function that declares none."""
    return getattr(fn, "reward_range", (-math.inf, math.inf))


def ground_truth_text(answer) -> str:
    """A text ground truth as the math verifiers compare it; None (or the text of a missing value) is refused."""
    if is_null_answer(answer):
        raise ValueError(f"no ground truth ({answer!r}): a row without an answer cannot be scored")
    return str(answer)


def check_answers(answers: list) -> None:
    """The batch form's refusal: every answer must be a ground truth (see ``is_null_answer``)."""
    missing = [i for i, a in enumerate(answers) if is_null_answer(a)]
    if missing:
        raise ValueError(f"{len(missing)} of {len(answers)} answers are missing (None, or the text of a missing "
                         f"value), at positions {missing[:8]}{' ...' if len(missing) > 8 else ''}: the data "
                         f"loaders skip such rows; a row without a ground truth cannot be scored")


def structured_answer(answer) -> dict:
    """Structured answers (countdown, MBPP) arrive as dicts from the loaders and as JSON strings from parquet."""
    if isinstance(answer, dict):
        return answer
    if isinstance(answer, (str, bytes)):
        value = json.loads(answer)
        if isinstance(value, dict):
            return value
    raise TypeError(f"expected a dict (or its JSON string) as answer, got {type(answer).__name__}")
