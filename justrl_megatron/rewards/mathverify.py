"""math-verify (HuggingFace) as a verifier: symbolic equivalence, so ``\\boxed{\\frac{1}{2}}`` matches ``0.5``.

It can be slow or hang on adversarial LaTeX (sympy), and its own timeout uses ``signal.alarm`` — which only works in a
process's main thread. So: run it through a BatchScorer (worker processes, which also enforce a hard per-item
timeout by killing the worker); in a non-main thread its internal timeouts are switched off instead of raising.
When its own timeout fires (parsing the response or the answer, or a comparison that found no match) the verifier
raises ``VerifierTimeout``, so the scorer counts it with the timeouts instead of math-verify swallowing it.
The ground truth is parsed as ``\\boxed{answer}`` (as verl's math_verify reward does), cached per process.
"""
from __future__ import annotations

import functools
import itertools
import logging
import threading

from .base import Verifier, VerifierTimeout


class _QuietTimeouts(logging.Filter):
    """math-verify warns when its timeout is off (deliberate off the main thread, see above) and, on a parse timeout,
    logs the whole response; keep the fact, drop the text."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Timeout is disabled"):
            return False
        if message.startswith("Timeout during parsing:"):
            record.msg, record.args = "math-verify: timeout while parsing a %d-character response", (len(message),)
        return True


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_QuietTimeouts())


def _timeout(seconds):
    return seconds if threading.current_thread() is threading.main_thread() else None


def _parse(text: str, timeout, **options) -> list:
    """math-verify's parse, errors as "nothing parsed" (as it does itself) but its timeout as VerifierTimeout."""
    from math_verify import parse
    from math_verify.errors import TimeoutException

    try:
        return parse(text, parsing_timeout=timeout, raise_on_error=True, **options)
    except TimeoutException:
        raise VerifierTimeout("math-verify timed out while parsing") from None
    except Exception:  # noqa: BLE001 - what parse(raise_on_error=False) returns [] for
        return []


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str, timeout):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    gold = _parse("\\boxed{" + answer + "}", timeout, extraction_config=[LatexExtractionConfig()])
    if not gold:  # plain-text answers ("7 days", "x=2") that are not valid LaTeX inside a box
        gold = _parse(answer, timeout, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()])
    return gold


def _equivalent(gold: list, pred: list, timeout) -> bool:
    """math-verify's verify over every (gold, pred) pair, as it does itself, but a timed-out pair is remembered:
    no match after one is a VerifierTimeout, not a wrong answer."""
    from math_verify import verify
    from math_verify.errors import TimeoutException

    timed_out = False
    for g, p in itertools.product(gold, pred):
        try:
            if verify(g, p, timeout_seconds=timeout, raise_on_error=True):
                return True
        except TimeoutException:
            timed_out = True
        except Exception:  # noqa: BLE001 - what verify(raise_on_error=False) counts as "not equal"
            pass
    if timed_out:
        raise VerifierTimeout("math-verify timed out while comparing")
    return False


class MathVerifyReward(Verifier):
    """Correct when math-verify finds the response's final answer equivalent to the ground truth.

    ``clip_chars`` keeps only the response's tail: the final answer is at the end, and parsing the LaTeX of the
    reasoning before it is what costs time (measured on 3,000-char responses, one core: ~490/s with 2,000 chars,
    ~840/s with 1,000, identical verdicts). None parses it all. ``timeout_s`` is math-verify's own per-call timeout.
    """

    in_process = False

    def __init__(self, correct: float | None = None, wrong: float | None = None, no_answer: float | None = None,
                 timeout_s: int = 5, clip_chars: int | None = 1000):
        super().__init__(correct, wrong, no_answer)
        self.timeout_s = int(timeout_s)
        self.clip_chars = self.tail_chars = clip_chars

    def grade(self, response: str, answer) -> float | None:
        timeout = _timeout(self.timeout_s)
        if self.clip_chars is not None:
            response = response[-self.clip_chars:]
        gold = _parse_gold(str(answer), timeout)
        pred = _parse(response, timeout)
        if not pred:
            return None
        if not gold:
            return 0.0
        return 1.0 if _equivalent(gold, pred, timeout) else 0.0
