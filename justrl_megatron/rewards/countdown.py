"""Countdown (TinyZero): an equation over the given numbers that equals the target.

The answer is the last ``<answer>…</answer>`` of the response (none: the no-answer value). The expression is parsed
by a small recursive-descent parser over exact fractions — never ``eval`` — that allows integer literals, binary
``+ - * /`` (also written ``× ÷ −``) and parentheses. Each literal must be one of the given numbers, each number used
at most once; with ``use_all=True`` (TinyZero) every number exactly once. Text after an ``=`` is ignored
("(1 + 2) * 3 = 9"). Unary signs, decimals, exponents, names, and division by zero make the answer wrong.
Defaults follow TinyZero: 1.0 correct, 0.1 for a well-formed but wrong equation, 0.0 for no answer.
"""
from __future__ import annotations

import re
from collections import Counter
from fractions import Fraction

from .base import Verifier, structured_answer

_ANSWER_OPEN, _ANSWER_CLOSE = "<answer>", "</answer>"
_TOKEN = re.compile(r"\s*(?:(\d+)|(.))")
_MAX_EXPR_CHARS = 300  # a bounded parse: deep nesting must not exhaust the recursion limit


class _Invalid(Exception):
    pass


def last_answer_tag(text: str) -> str | None:
    end = text.rfind(_ANSWER_CLOSE)
    if end < 0:
        return None
    start = text.rfind(_ANSWER_OPEN, 0, end)
    if start < 0:
        return None
    return text[start + len(_ANSWER_OPEN):end]


def _tokens(expr: str) -> list:
    expr = expr.replace("×", "*").replace("÷", "/").replace("−", "-").replace("\\times", "*").replace("\\div", "/")
    out = []
    for number, char in _TOKEN.findall(expr):
        if number:
            out.append(int(number))
        elif char.strip():
            if char not in "+-*/()":
                raise _Invalid(f"character {char!r} not allowed")
            out.append(char)
    return out


class _Parser:
    """expr := term (('+'|'-') term)* ; term := atom (('*'|'/') atom)* ; atom := INT | '(' expr ')'."""

    def __init__(self, tokens):
        self.tokens, self.pos, self.used = tokens, 0, []

    def peek(self):
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self):
        tok = self.peek()
        self.pos += 1
        return tok

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.term()
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self) -> Fraction:
        value = self.atom()
        while self.peek() in ("*", "/"):
            op = self.take()
            rhs = self.atom()
            if op == "*":
                value = value * rhs
            elif rhs == 0:
                raise _Invalid("division by zero")
            else:
                value = value / rhs
        return value

    def atom(self) -> Fraction:
        tok = self.take()
        if isinstance(tok, int):
            self.used.append(tok)
            return Fraction(tok)
        if tok == "(":
            value = self.expr()
            if self.take() != ")":
                raise _Invalid("unbalanced parentheses")
            return value
        raise _Invalid(f"unexpected token {tok!r}")


def evaluate(expr: str) -> tuple[Fraction, list[int]]:
    """Exact value of an arithmetic expression and the integer literals it uses; raises ValueError if invalid."""
    if len(expr) > _MAX_EXPR_CHARS:
        raise ValueError("expression too long")
    try:
        tokens = _tokens(expr)
        if not tokens:
            raise _Invalid("empty expression")
        parser = _Parser(tokens)
        value = parser.expr()
        if parser.pos != len(tokens):
            raise _Invalid("trailing tokens")
    except _Invalid as e:
        raise ValueError(str(e)) from None
    return value, parser.used


class CountdownReward(Verifier):
    """answer: ``{"numbers": [...], "target": int}`` (or its JSON string)."""

    in_process = True
    default_correct = 1.0
    default_wrong = 0.1  # TinyZero's format score

    def __init__(self, use_all: bool = True, correct: float | None = None, wrong: float | None = None,
                 no_answer: float | None = 0.0):
        super().__init__(correct, wrong, no_answer)
        self.use_all = bool(use_all)

    def grade(self, response: str, answer) -> float | None:
        spec = structured_answer(answer)
        numbers, target = [int(n) for n in spec["numbers"]], Fraction(int(spec["target"]))
        expr = last_answer_tag(response)
        if expr is None or not expr.strip():
            return None
        try:
            value, used = evaluate(expr.split("=", 1)[0])
        except ValueError:
            return 0.0
        available, used = Counter(numbers), Counter(used)
        if self.use_all and used != available:
            return 0.0
        if any(used[n] > available[n] for n in used):
            return 0.0
        return 1.0 if value == target else 0.0
