"""Weighted multi-component rewards (seed 001's GSM8K / MATH / MBPP style) and the "either verifier" combinator.

``WeightedReward`` = sum of ``weights[k] * component_k`` over:

* ``correctness``: the inner verifier's reward (its own correct / wrong / no-answer values, default 1 / 0 / 0) on the
  whole response (``grade_answer_tag_only=True``: on the last ``<answer>`` block alone, when there is one);
* ``strict_format``: 1 if the whole response is ``<think>…</think>`` then ``<answer>…</answer>`` and nothing else;
* ``has_thinking``: 1 if a non-empty ``<think>…</think>`` block is present;
* ``has_answer``: 1 if a non-empty ``<answer>…</answer>`` block is present;
* ``no_trailing_text``: 1 if nothing but whitespace follows the last ``</answer>``.

Tag names are configurable; ``think_prefilled=True`` is for prompts that already open ``<think>`` (raw templates).
"""
from __future__ import annotations

from .base import Verifier, evaluate_with, reward_range

DEFAULT_WEIGHTS = {"correctness": 1.0, "strict_format": 0.2, "has_thinking": 0.1, "has_answer": 0.1,
                   "no_trailing_text": 0.1}


class WeightedReward:
    """Weighted sum of correctness and format components; ``components()`` shows the parts of one score."""

    def __init__(self, correctness: str | Verifier = "gsm8k", correctness_options: dict | None = None,
                 weights: dict | None = None, think_tag: str = "think", answer_tag: str = "answer",
                 think_prefilled: bool = False, grade_answer_tag_only: bool = False):
        if isinstance(correctness, str):
            from . import get_reward_fn

            correctness = get_reward_fn(correctness, **(correctness_options or {}))
        self.inner = correctness
        unknown = set(weights or {}) - set(DEFAULT_WEIGHTS)
        if unknown:
            raise ValueError(f"unknown reward components {sorted(unknown)}; known: {sorted(DEFAULT_WEIGHTS)}")
        self.weights = {**DEFAULT_WEIGHTS, **(weights or {})}
        self.think_tag, self.answer_tag = think_tag, answer_tag
        self.think_prefilled = bool(think_prefilled)
        self.grade_answer_tag_only = bool(grade_answer_tag_only)

    # Plain string scans, not regexes: lazy `.*?` patterns go quadratic on a long response with unclosed tags.
    def _tags(self, name: str) -> tuple[str, str]:
        return f"<{name}>", f"</{name}>"

    def _last_block(self, text: str, name: str) -> str | None:
        open_, close = self._tags(name)
        end = text.rfind(close)
        start = text.rfind(open_, 0, max(end, 0))
        return None if end < 0 or start < 0 else text[start + len(open_):end]

    def _strict(self, text: str) -> bool:
        (to, tc), (ao, ac) = self._tags(self.think_tag), self._tags(self.answer_tag)
        text = text.strip()
        if not text.startswith(to) or not text.endswith(ac):
            return False
        mid = text.find(tc)
        if mid < 0:
            return False
        think, rest = text[len(to):mid], text[mid + len(tc):].lstrip()
        if not rest.startswith(ao):
            return False
        answer = rest[len(ao):-len(ac)]
        tags = (to, tc, ao, ac)
        return (bool(think.strip()) and bool(answer.strip()) and not any(t in think for t in tags)
                and not any(t in answer for t in tags))

    @property
    def in_process(self) -> bool:
        return getattr(self.inner, "in_process", False)

    @property
    def failure_value(self) -> float:
        return self.weights["correctness"] * getattr(self.inner, "failure_value", 0.0)

    @property
    def reward_range(self) -> tuple[float, float]:
        """The sum of each component's range times its weight (format components are 0 or 1)."""
        lo, hi = reward_range(self.inner)
        ranges = [(w * lo, w * hi) if k == "correctness" else (0.0, w) for k, w in self.weights.items()]
        return sum(min(r) for r in ranges), sum(max(r) for r in ranges)

    @property
    def time_limit_s(self) -> float | None:
        return getattr(self.inner, "time_limit_s", None)

    def components(self, response: str, answer) -> dict[str, float]:
        return self._components(response, answer)[0]

    def _components(self, response: str, answer) -> tuple[dict[str, float], bool]:
        if self.think_prefilled:
            response = f"<{self.think_tag}>" + response
        last_answer = self._last_block(response, self.answer_tag)
        graded = response
        if self.grade_answer_tag_only and last_answer is not None:  # re-wrapped: tag-reading verifiers still work
            graded = f"<{self.answer_tag}>{last_answer}</{self.answer_tag}>"
        thinking = self._last_block(response, self.think_tag)
        close = self._tags(self.answer_tag)[1]
        inner_reward, inner_correct = evaluate_with(self.inner, graded, answer)
        return {
            "correctness": float(inner_reward),
            "strict_format": float(self._strict(response)),
            "has_thinking": float(thinking is not None and bool(thinking.strip())),
            "has_answer": float(last_answer is not None and bool(last_answer.strip())),
            "no_trailing_text": float(last_answer is not None
                                      and not response[response.rfind(close) + len(close):].strip()),
        }, inner_correct

    def evaluate(self, response: str, answer) -> tuple[float, bool]:
        """(weighted reward, whether the correctness verifier judged it fully correct)."""
        parts, correct = self._components(response, answer)
        return sum(self.weights[k] * v for k, v in parts.items()), correct

    def __call__(self, response: str, answer) -> float:
        return self.evaluate(response, answer)[0]

    def is_correct(self, response: str, answer) -> bool:
        return self.evaluate(response, answer)[1]

    def __repr__(self) -> str:
        return f"WeightedReward(inner={self.inner!r}, weights={self.weights})"


class AnyCorrect(Verifier):
    """Correct when any of the verifiers says so, tried in order (cheap first: eval's dapo-then-math-verify).

    The grade is the best inner grade (None only if no verifier found an answer).
    """

    def __init__(self, verifiers: list[Verifier], correct: float | None = None, wrong: float | None = None,
                 no_answer: float | None = None):
        super().__init__(correct, wrong, no_answer)
        self.verifiers = list(verifiers)
        self.in_process = all(v.in_process for v in self.verifiers)
        tails = [v.tail_chars for v in self.verifiers]
        self.tail_chars = None if None in tails else max(tails)
        limits = [v.time_limit_s for v in self.verifiers if v.time_limit_s is not None]
        self.time_limit_s = sum(limits) if limits else None

    def grade(self, response: str, answer) -> float | None:
        best = None
        for v in self.verifiers:
            g = v.grade(response, answer)
            if g is not None and (best is None or g > best):
                best = g
            if best == 1.0:
                break
        return best
