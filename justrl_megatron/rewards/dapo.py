"""DAPO's ``math_dapo`` verifier as JustRL trains with it (verl ``reward_score/math_dapo.py``, strict box on).

Strict path (JustRL default): keep the last 300 characters of the response, then the last 100 of those; take the
last ``\\boxed{`` in them and its balanced-brace content; compare with the ground truth by plain string equality —
no normalisation. A box followed by more than ~100 characters, an unclosed last box, or no box at all is wrong.

Non-strict path (``strict=False``): the Minerva "Answer: …" line with lm-eval-harness normalisation on both sides.
With a ``\\boxed{}`` prompt it scores correct answers wrong; it exists for parity with DAPO's own recipe.

Both give +1 / -1 by default, as in DAPO/JustRL.
"""
from __future__ import annotations

import re

from ..boxed import BOXED_ONLY, last_boxed_content
from .base import Verifier, ground_truth_text

def strict_box_answer(response: str) -> str | None:
    """What the strict verifier compares: the content of the last complete box in the last 100 characters."""
    tail = response[-300:][-100:]  # both cuts kept as written upstream; together they are the last 100 characters
    return last_boxed_content(tail, BOXED_ONLY)


# Minerva normalisation (lm-eval-harness hendrycks_math, as DAPO uses it). Order matters: it is applied as listed.
_SUBSTITUTIONS = [("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                  (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}")]
_REMOVED = ["square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
            "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges",
            "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2",
            "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"',
            "\\dots"]
_MINERVA_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def normalize_final_answer(answer: str) -> str:
    """lm-eval-harness / Minerva answer normalisation (units, \\text, $…$, shorthand \\frac and \\sqrt, commas)."""
    answer = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expr in _REMOVED:
        answer = answer.replace(expr, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)  # \fracab -> \frac{a}{b}
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)  # \sqrta -> \sqrt{a}
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def minerva_answer(response: str) -> str | None:
    found = _MINERVA_ANSWER.findall(response[-300:])
    return found[-1] if found else None


class DapoReward(Verifier):
    """``math_dapo.compute_score``: strict box (JustRL) or Minerva (``strict=False``); +1 / -1 by default."""

    in_process = True
    tail_chars = 300  # both paths look at the last 300 characters only
    default_correct = 1.0
    default_wrong = -1.0

    def __init__(self, strict: bool = True, correct: float | None = None, wrong: float | None = None,
                 no_answer: float | None = None):
        super().__init__(correct, wrong, no_answer)
        self.strict = bool(strict)

    def grade(self, response: str, answer) -> float | None:
        gt = ground_truth_text(answer)
        if self.strict:
            pred = strict_box_answer(response)
            if pred is None:
                return None
            return 1.0 if pred == gt else 0.0
        pred = minerva_answer(response)
        if pred is None:
            return None
        return 1.0 if normalize_final_answer(pred) == normalize_final_answer(gt) else 0.0
