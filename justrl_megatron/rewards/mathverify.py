"""math-verify (HuggingFace) as a verifier: symbolic equivalence, so ``\\boxed{\\frac{1}{2}}`` matches ``0.5``.

It can be slow or hang on adversarial LaTeX (sympy), and its own timeout uses ``signal.alarm`` — which only works in a
process's main thread. So: run it through a BatchScorer (worker processes, which also enforce a hard per-item
timeout by killing the worker); in a non-main thread its internal timeouts are switched off instead of raising.
When its own timeout fires (parsing the response or the answer, or a comparison that found no match) the verifier
raises ``VerifierTimeout``, so the scorer counts it with the timeouts instead of math-verify swallowing it.
The ground truth is parsed as ``\\boxed{answer}`` (as verl's math_verify reward does), cached per process.

Bounded work on both sides. math-verify's LaTeX parser is exponential in bracket nesting (``{{{…1…}}}``: 12 levels
took 1.5-5.8 s, from 14 levels correct answers timed out), and a 5 MB ground truth took 5 s to parse. So, before any
sympy: a final box written exactly as the ground truth is correct at once; redundant doubled pairs (``{{x}}`` ->
``{x}``, ``((x))`` -> ``(x)``; the same in LaTeX) are dropped from both sides; a text still nested deeper than
``MAX_NESTING`` is not parsed (a response: no answer; a ground truth: compared as text only), nor is a ground truth
longer than ``GOLD_MAX_CHARS``.
"""
from __future__ import annotations

import functools
import itertools
import logging
import threading

from ..boxed import BOXED_ONLY, last_boxed_content
from .base import Verifier, VerifierTimeout, ground_truth_text

MAX_NESTING = 12  # brackets nested deeper than this (after dropping redundant pairs) are never handed to sympy
GOLD_MAX_CHARS = 1000  # a longer ground truth is compared as text only (the response side is clipped alike)


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


def flatten_nesting(text: str) -> tuple[str, int]:
    """(``text`` without redundant doubled pairs -- ``{{x}}`` -> ``{x}``, ``((x))`` -> ``(x)`` --, the deepest
    nesting of ``{ ( [`` left). One linear pass; escaped characters (``\\{``) are text, any closer ends the innermost
    open bracket (intervals such as ``[0, 1)``), unmatched closers are ignored."""
    closer_of, stack, i = {}, [], 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 1  # the escaped character is not a bracket
        elif c in "{([":
            stack.append(i)
        elif c in "})]" and stack:
            closer_of[stack.pop()] = i
        i += 1
    drop = set()
    for i, j in closer_of.items():  # the pair opened at i + 1 holds exactly what the pair at i holds: drop it
        if text[i] in "{(" and text[i + 1:i + 2] == text[i] and closer_of.get(i + 1) == j - 1 \
                and text[j] == text[j - 1]:
            drop.update((i + 1, j - 1))
    flat = "".join(c for k, c in enumerate(text) if k not in drop) if drop else text
    depth = deepest = 0
    i = 0
    while i < len(flat):
        c = flat[i]
        if c == "\\":
            i += 1
        elif c in "{([":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "})]" and depth:
            depth -= 1
        i += 1
    return flat, deepest


def _parse_bounded(text: str, timeout, **options) -> list:
    """`_parse` of the flattened text; nothing (no sympy at all) when it is still nested deeper than MAX_NESTING."""
    flat, depth = flatten_nesting(text)
    return [] if depth > MAX_NESTING else _parse(flat, timeout, **options)


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str, timeout):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    if len(answer) > GOLD_MAX_CHARS:
        return []
    gold = _parse_bounded("\\boxed{" + answer + "}", timeout, extraction_config=[LatexExtractionConfig()])
    if not gold:  # plain-text answers ("7 days", "x=2") that are not valid LaTeX inside a box
        gold = _parse_bounded(answer, timeout, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()])
    return gold


def _boxed_as_written(response: str, answer: str) -> bool:
    """The response's final box holds the ground truth exactly (up to surrounding space and redundant pairs)."""
    box = last_boxed_content(response, BOXED_ONLY)
    if box is None:
        return False
    box, answer = box.strip(), answer.strip()
    return box == answer or (len(answer) <= GOLD_MAX_CHARS and flatten_nesting(box)[0] == flatten_nesting(answer)[0])


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
        answer = ground_truth_text(answer)
        timeout = _timeout(self.timeout_s)
        if self.clip_chars is not None:
            response = response[-self.clip_chars:]
        if _boxed_as_written(response, answer):  # no sympy needed (nor any time limit risked)
            return 1.0
        pred = _parse_bounded(response, timeout)
        if not pred:
            return None
        gold = _parse_gold(answer, timeout)
        if not gold:
            return 0.0
        return 1.0 if _equivalent(gold, pred, timeout) else 0.0
