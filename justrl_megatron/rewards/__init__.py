"""Reward verifiers: ``get_reward_fn(name, **options)`` → a picklable ``fn(response: str, answer) -> float``.

=========================  ==========================================================================  ==========
name                       what                                                                        defaults
=========================  ==========================================================================  ==========
``dapo``                   DAPO math_dapo, strict box (JustRL's training reward); ``strict=False``       +1 / -1
``dapo_minerva``           DAPO math_dapo, Minerva "Answer:" path with normalisation                     +1 / -1
``math_verify``            math-verify symbolic equivalence (run it through a BatchScorer)               1 / 0
``gsm8k``                  final number, numeric comparison                                              1 / 0
``countdown``              equation over the given numbers (safe parser)                                 1 / 0.1 / 0
``code``                   MBPP tests in a namespace sandbox, judged outside it; grade = pass rate     1 / 0
``weighted``               correctness + format components (see weighted.py)                             weights
``dapo_then_math_verify``  correct if either dapo (strict) or math_verify says so (eval)                 1 / 0
=========================  ==========================================================================  ==========

Every verifier takes ``correct=``, ``wrong=``, ``no_answer=`` (e.g. +1 / -1 / -0.5; no_answer defaults to wrong),
or ``preset=`` a name from ``REWARD_PRESETS`` for all three (options given next to it win):
``seed`` = +1 correct / -1 wrong / -0.5 no answer (the binary boxed reward of TRL + PEFT LoRA GRPO setups),
and has ``is_correct(response, answer)`` for accuracy metrics. ``BatchScorer`` runs a verifier over a batch (in worker
processes with per-item timeouts, or in-process for pure verifiers of a capped tail), counts timeouts — its own and
the verifier's (``VerifierTimeout``) — and clamps every reward into the verifier's ``reward_range``.
"""
from __future__ import annotations

from .base import Verifier, VerifierTimeout
from .code import CodeReward
from .countdown import CountdownReward
from .dapo import DapoReward
from .gsm8k import Gsm8kReward
from .mathverify import MathVerifyReward
from .pool import BatchScorer
from .weighted import DEFAULT_WEIGHTS, AnyCorrect, WeightedReward


def _dapo_then_math_verify(correct=None, wrong=None, no_answer=None, **math_verify_options):
    return AnyCorrect([DapoReward(strict=True), MathVerifyReward(**math_verify_options)], correct=correct,
                      wrong=wrong, no_answer=no_answer)


def _dapo_minerva(**options):
    return DapoReward(strict=False, **options)


_REGISTRY = {
    "dapo": DapoReward,
    "dapo_minerva": _dapo_minerva,
    "math_verify": MathVerifyReward,
    "gsm8k": Gsm8kReward,
    "countdown": CountdownReward,
    "code": CodeReward,
    "weighted": WeightedReward,
    "dapo_then_math_verify": _dapo_then_math_verify,
}
REWARD_NAMES = tuple(_REGISTRY)
# reward_options presets: named (correct, wrong, no_answer) values
REWARD_PRESETS = {"seed": {"correct": 1.0, "wrong": -1.0, "no_answer": -0.5}}


def get_reward_fn(name: str, **options):
    """The verifier registered as ``name``, built with ``options`` (unknown options raise TypeError; ``preset``
    expands to the values of REWARD_PRESETS[preset])."""
    if "preset" in options:
        options = dict(options)
        preset = options.pop("preset")
        if preset not in REWARD_PRESETS:
            raise ValueError(f"unknown reward preset {preset!r}; known: {', '.join(REWARD_PRESETS)}")
        options = {**REWARD_PRESETS[preset], **options}
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; known: {REWARD_NAMES}") from None
    return factory(**options)


def make_scorer(algo_cfg, *, enabled: bool) -> BatchScorer | None:
    """The batch scorer the config's `algo` asks for (algo.reward, reward_options, reward_workers); None where not
    `enabled` (ranks other than the one that scores). Every rank builds the verifier, so bad options fail everywhere."""
    verifier = get_reward_fn(algo_cfg.reward, **dict(algo_cfg.reward_options or {}))
    return BatchScorer(verifier, num_workers=algo_cfg.reward_workers) if enabled else None


__all__ = [
    "AnyCorrect", "BatchScorer", "CodeReward", "CountdownReward", "DEFAULT_WEIGHTS", "DapoReward", "Gsm8kReward",
    "MathVerifyReward", "REWARD_NAMES", "REWARD_PRESETS", "Verifier", "VerifierTimeout", "WeightedReward",
    "get_reward_fn", "make_scorer",
]
