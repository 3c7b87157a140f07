"""GSM8K-style numeric answers: find the response's final number, compare numerically with the ground truth.

Where the final answer is looked for, in order (``mode="flexible"``, the default):
``#### N`` (GSM8K's own format), the last ``\\boxed{…}``, the last ``<answer>…</answer>``, the last "answer is N" /
"Answer: N", and finally the last number anywhere. ``mode="strict"`` accepts only ``#### N`` (verl's gsm8k strict).
Within the chosen span the last number counts; commas, ``$``, ``%``, and units around it are ignored.
Only the response's last ``clip_chars`` characters are searched (the answer is at the end), and never more than
``MAX_PARSE_CHARS`` (``clip_chars=None``): parsing is linear in what is searched (tags are found with ``rfind``, not
lazy regexes, which go quadratic on many unclosed tags), so a 1 MB response costs what its tail costs.
"""
from __future__ import annotations

import re
from fractions import Fraction

from ..boxed import BOXED_ONLY, last_boxed_content
from .base import Verifier

MAX_PARSE_CHARS = 50_000
_NUM = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+"
_NUM_RE = re.compile(_NUM)
_FRAC = re.compile(r"\\[dt]?frac\{\s*(-?\d+)\s*\}\{\s*(\d+)\s*\}")
_ANSWER_IS = re.compile(r"(?i)answer\s*(?:is\s*:?|:)\s*([^\n]*)")


def to_number(text: str) -> Fraction | None:
    """The last number in ``text`` as an exact Fraction ("1,234.50" -> 2469/2, "3/4" and "\\frac{3}{4}" -> 3/4),
    or None."""
    text = _FRAC.sub(r"\1/\2", text.replace("$", "").replace("\\!", "").replace("{,}", ","))
    found = _NUM_RE.findall(text)
    if not found:
        return None
    token = found[-1].replace(",", "")
    try:
        if "/" in token:
            num, den = token.split("/")
            return Fraction(Fraction(num), Fraction(den)) if Fraction(den) != 0 else None
        return Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None


def _last_hashes(text: str) -> str | None:
    """The rest of the line after the last ``####`` (the whitespace after it may span lines, as in GSM8K)."""
    at = text.rfind("####")
    if at < 0:
        return None
    rest = text[at + 4:]
    return rest[len(rest) - len(rest.lstrip()):].split("\n", 1)[0]


def _last_answer_tag(text: str) -> str | None:
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, max(end, 0))
    return None if end < 0 or start < 0 else text[start + len("<answer>"):end]


def extract_final_number(response: str, mode: str = "flexible") -> Fraction | None:
    response = response[-MAX_PARSE_CHARS:]
    hashes = _last_hashes(response)
    if hashes is not None:
        return to_number(hashes)
    if mode == "strict":
        return None
    spans = []
    boxed = last_boxed_content(response, BOXED_ONLY)
    if boxed is not None:
        spans.append(boxed)
    tag = _last_answer_tag(response)
    if tag is not None:
        spans.append(tag)
    said = _ANSWER_IS.findall(response)
    if said:
        spans.append(said[-1])
    spans.append(response)
    for span in spans:
        value = to_number(span)
        if value is not None:
            return value
    return None


class Gsm8kReward(Verifier):
    """Numeric match of the final number (exact for integers and fractions; ``rel_tol`` for decimals)."""

    in_process = True

    def __init__(self, mode: str = "flexible", correct: float | None = None, wrong: float | None = None,
                 no_answer: float | None = None, clip_chars: int | None = 2000, rel_tol: float = 1e-6):
        super().__init__(correct, wrong, no_answer)
        if mode not in ("flexible", "strict"):
            raise ValueError(f"gsm8k mode must be 'flexible' or 'strict', got {mode!r}")
        self.mode = mode
        self.clip_chars = clip_chars
        self.tail_chars = min(clip_chars or MAX_PARSE_CHARS, MAX_PARSE_CHARS)
        self.rel_tol = float(rel_tol)

    def grade(self, response: str, answer) -> float | None:
        response = response[-self.tail_chars:]
        pred = extract_final_number(response, self.mode)
        if pred is None:
            return None
        gt = to_number(str(answer))
        if gt is None:
            return 0.0
        if pred == gt:
            return 1.0
        return 1.0 if abs(pred - gt) <= self.rel_tol * max(abs(gt), 1) else 0.0
