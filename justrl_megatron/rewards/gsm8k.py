"""GSM8K-style numeric answers: find the response's final number, compare numerically with the ground truth.

Where the final answer is looked for, in order (``mode="flexible"``, the default):
``#### N`` (GSM8K's own format), the last ``\\boxed{…}``, the last ``<answer>…</answer>``, the last "answer is N" /
"Answer: N", and finally the last number anywhere. ``mode="strict"`` accepts only ``#### N`` (verl's gsm8k strict).
Within the chosen span the last number counts; commas, ``$``, ``%``, and units around it are ignored.
Only the response's last ``clip_chars`` characters are searched (the answer is at the end), and never more than
``MAX_PARSE_CHARS`` (``clip_chars=None``): parsing is linear in what is searched (tags are found with ``rfind``, not
lazy regexes, which go quadratic on many unclosed tags), so a 1 MB response costs what its tail costs.

The rule, in the ground truth as in the response:
* digits: every Unicode decimal digit (fullwidth ``１２``, Arabic-Indic ``١٢``, Devanagari, ...) is read as the digit
  it is, and the fullwidth or Arabic forms of a number's sign, point, comma and slash as theirs (``_PUNCTUATION``):
  ``１２``, ``١٢`` and ``12`` are the same number. Nothing else becomes a digit: a superscript (``m²``) is not one.
* comparison: exact, as fractions (``0.5`` = ``1/2`` = ``\\frac{1}{2}``); a prediction within ``rel_tol`` x max(|truth|,
  1) counts too, default 1e-9: the noise of printing a double (``0.30000000000000004`` for 0.3), not rounding:
  ``12.0000001`` is not 12 (raise ``rel_tol`` in algo.reward_options to accept such answers).
* the reward is always one of the verifier's three values (correct, wrong, no answer): it never leaves its range.
"""
from __future__ import annotations

import math
import re
import unicodedata
from fractions import Fraction

from ..boxed import BOXED_ONLY, last_boxed_content
from .base import Verifier

MAX_PARSE_CHARS = 50_000
CACHED_CHARACTERS = 4096  # non-ASCII characters whose ASCII form is remembered
_NUM = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+"
_NUM_RE = re.compile(_NUM, re.ASCII)  # ASCII digits only: others were made ASCII first (`ascii_digits`)
_FRAC = re.compile(r"\\[dt]?frac\{\s*(-?\d+)\s*\}\{\s*(\d+)\s*\}", re.ASCII)
_ANSWER_IS = re.compile(r"(?i)answer\s*(?:is\s*:?|:)\s*([^\n]*)")
# a number's punctuation in its fullwidth and Arabic forms, and the minus sign (U+2212)
_PUNCTUATION = {"\uff0e": ".", "\uff0c": ",", "\uff0d": "-", "\uff0f": "/", "\uff04": "$", "\u2212": "-",
                "\u066b": ".", "\u066c": ","}


class _AsciiDigits(dict):
    """str.translate's table: a Unicode decimal digit -> its ASCII digit, _PUNCTUATION -> its ASCII form, anything
    else -> itself (each character looked up once)."""

    def __missing__(self, code: int) -> str:
        char = chr(code)
        digit = unicodedata.decimal(char, None)
        out = str(digit) if digit is not None else _PUNCTUATION.get(char, char)
        if len(self) < CACHED_CHARACTERS:  # a response of every character there is stays bounded in memory
            self[code] = out
        return out


_ASCII_DIGITS = _AsciiDigits()


def ascii_digits(text: str) -> str:
    """`text` with every decimal digit and number punctuation in its ASCII form (the module's rule)."""
    return text if text.isascii() else text.translate(_ASCII_DIGITS)


def to_number(text: str) -> Fraction | None:
    """The last number in ``text`` as an exact Fraction ("1,234.50" -> 2469/2, "3/4" and "\\frac{3}{4}" -> 3/4),
    or None."""
    text = _FRAC.sub(r"\1/\2", ascii_digits(text).replace("$", "").replace("\\!", "").replace("{,}", ","))
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
    """Numeric match of the final number: exact as fractions, or within ``rel_tol`` (the module's rule)."""

    in_process = True

    def __init__(self, mode: str = "flexible", correct: float | None = None, wrong: float | None = None,
                 no_answer: float | None = None, clip_chars: int | None = 2000, rel_tol: float = 1e-9):
        super().__init__(correct, wrong, no_answer)
        if mode not in ("flexible", "strict"):
            raise ValueError(f"gsm8k mode must be 'flexible' or 'strict', got {mode!r}")
        if not (isinstance(rel_tol, (int, float)) and math.isfinite(rel_tol) and 0 <= rel_tol < 1):
            raise ValueError(f"gsm8k rel_tol must be a number in [0, 1) (the relative distance from the truth that "
                             f"still counts; default 1e-9), got {rel_tol!r}")
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
