"""Verifier throughput (verifications per second) through a BatchScorer, on synthetic but realistic responses.

Responses are ~``response_chars`` characters of LaTeX-heavy reasoning ending the way policies end them: a correct
box, a wrong box, a box followed by chatter, or no box (truncated). Targets, on 2 cores: dapo >= 20,000/s,
math_verify >= 1,000/s through the worker pool. ``run_reward_bench`` is what ``tools/bench_rewards.py`` (and the
CLI's bench phase) call.

Wall-clock rates depend on what else runs on the machine; the verifications per CPU-second (this process plus the
pool workers; the code sandbox's own subprocesses are not counted) say what the verifiers cost.
"""
from __future__ import annotations

import os
import random
import time

from ..rewards import BatchScorer, get_reward_fn

TARGETS = {"dapo": 20_000, "math_verify": 1_000}

_ANSWERS = ["42", "\\frac{3}{4}", "2\\sqrt{3}", "x^2+1", "-7", "\\frac{\\pi}{6}", "1024", "(2,3)", "17", "0.25"]
_WRONG = ["41", "\\frac{4}{3}", "3\\sqrt{2}", "x^2-1", "7", "\\frac{\\pi}{3}", "1023", "(3,2)", "71", "0.5"]


def _reasoning(rng: random.Random, chars: int) -> str:
    parts, size = [], 0
    while size < chars:
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
        s = rng.choice([
            f"We have $x^2 + {a}x + {b} = 0$, so $x = \\frac{{-{a} \\pm \\sqrt{{{a}^2 - 4 \\cdot {b}}}}}{{2}}$. ",
            f"Since ${a} \\equiv {a % c} \\pmod{{{c}}}$, the remainder is ${a % c}$. ",
            f"Let me double-check: ${a} \\times {b} = {a * b}$, and ${a * b} + {c} = {a * b + c}$. ",
            f"Wait, that is not right. Consider the triangle with sides {a}, {b} and angle $\\theta$ where "
            f"$\\cos\\theta = \\frac{{{c}}}{{10}}$. ",
        ])
        parts.append(s)
        size += len(s)
    return "".join(parts)[:chars]


def math_batch(n: int, response_chars: int = 3000, seed: int = 0) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    responses, answers = [], []
    for _ in range(n):
        k = rng.randrange(len(_ANSWERS))
        body = _reasoning(rng, response_chars)
        kind = rng.random()
        if kind < 0.4:
            end = f"\n\nTherefore the answer is $\\boxed{{{_ANSWERS[k]}}}$."
        elif kind < 0.8:
            end = f"\n\nTherefore the answer is $\\boxed{{{_WRONG[k]}}}$."
        elif kind < 0.9:
            end = f"\n\nSo $\\boxed{{{_ANSWERS[k]}}}$. " + _reasoning(rng, 200)  # box followed by > 100 chars
        else:
            end = ""  # truncated: no box
        responses.append(body + end)
        answers.append(_ANSWERS[k])
    return responses, answers


def gsm8k_batch(n: int, response_chars: int = 1500, seed: int = 0):
    rng = random.Random(seed)
    out, ans = [], []
    for _ in range(n):
        v = rng.randint(1, 5000)
        out.append(_reasoning(rng, response_chars) + f"\n#### {v if rng.random() < 0.5 else v + 1:,}")
        ans.append(str(v))
    return out, ans


def countdown_batch(n: int, seed: int = 0):
    rng = random.Random(seed)
    out, ans = [], []
    for _ in range(n):
        a, b, c = rng.randint(1, 50), rng.randint(1, 50), rng.randint(1, 9)
        expr = rng.choice([f"({a} + {b}) * {c}", f"{a} * {c} - {b}", f"({a} - {b}) / {c}"])
        out.append(f"Let me try some combinations of {a}, {b}, {c}...</think>\n<answer>{expr}</answer>")
        ans.append({"numbers": [a, b, c], "target": (a + b) * c})
    return out, ans


def code_batch(n: int, seed: int = 0):
    rng = random.Random(seed)
    tests = {"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"], "setup": ""}
    bodies = ["return a + b", "return a - b", "return a + b if a > 0 else b"]
    return ([f"```python\ndef add(a, b):\n    {rng.choice(bodies)}\n```" for _ in range(n)], [tests] * n)


def _cpu_seconds(scorer: BatchScorer) -> float:
    """CPU time of this process plus the scorer's workers (Linux /proc): verifications per CPU-second stay
    meaningful when other jobs share the cores and wall-clock throughput does not."""
    total = time.process_time()
    for w in scorer._workers:
        try:
            with open(f"/proc/{w.process.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        except (OSError, IndexError, ValueError):
            pass
    return total


def _measure(name: str, fn, responses, answers, workers: int, timeout_s: float, in_process=None) -> dict:
    with BatchScorer(fn, num_workers=workers, timeout_s=timeout_s, in_process=in_process) as scorer:
        scorer.score(responses[:min(len(responses), 4 * max(workers, 1))],
                     answers[:min(len(answers), 4 * max(workers, 1))])  # start the workers, warm caches
        cpu0, t0 = _cpu_seconds(scorer), time.perf_counter()
        scores = scorer.score(responses, answers)
        dt, cpu = time.perf_counter() - t0, _cpu_seconds(scorer) - cpu0
        mode = "in-process" if scorer.in_process else f"pool x{workers}"
        stats = dict(scorer.stats)
    return {"name": name, "mode": mode, "items": len(responses), "seconds": dt, "per_s": len(responses) / dt,
            "cpu_seconds": cpu, "per_cpu_s": len(responses) / max(cpu, 1e-9),
            "mean_reward": sum(scores) / len(scores), "timeouts": stats["timeouts"], "crashes": stats["crashes"],
            "errors": stats["errors"], "target": TARGETS.get(name)}


def run_reward_bench(n_fast: int = 100_000, n_slow: int = 4_000, n_code: int = 40, workers: int = 2,
                     response_chars: int = 3000, timeout_s: float = 10.0, only: list[str] | None = None) -> list[dict]:
    """Measure each verifier; returns one dict per row (name, mode, items, seconds, per_s, target, ...)."""
    math_fast = math_batch(n_fast, response_chars)
    math_slow = (math_fast[0][:n_slow], math_fast[1][:n_slow])
    plan = [
        ("dapo", get_reward_fn("dapo"), math_fast, None),
        ("dapo", get_reward_fn("dapo"), math_fast, False),
        ("dapo_minerva", get_reward_fn("dapo_minerva"), math_fast, None),
        ("gsm8k", get_reward_fn("gsm8k"), gsm8k_batch(n_fast), None),
        ("countdown", get_reward_fn("countdown"), countdown_batch(n_fast), None),
        ("weighted", get_reward_fn("weighted", correctness="gsm8k"), gsm8k_batch(n_fast // 4), None),
        ("math_verify", get_reward_fn("math_verify"), math_slow, None),
        ("dapo_then_math_verify", get_reward_fn("dapo_then_math_verify"), math_slow, None),
        ("code", get_reward_fn("code"), code_batch(n_code), None),
    ]
    rows = []
    for name, fn, (responses, answers), in_process in plan:
        if only and name not in only:
            continue
        rows.append(_measure(name, fn, responses, answers, workers, timeout_s, in_process))
    return rows


def format_rows(rows: list[dict]) -> str:
    head = (f"{'verifier':<24}{'mode':<12}{'items':>9}{'seconds':>9}{'verif/s':>12}{'verif/CPU-s':>13}{'target':>9}"
            f"  ok")
    lines = [head, "-" * len(head)]
    for r in rows:
        ok = "" if r["target"] is None else ("yes" if r["per_s"] >= r["target"] else "NO")
        target = f"{r['target']:,}" if r["target"] else "-"
        lines.append(f"{r['name']:<24}{r['mode']:<12}{r['items']:>9,}{r['seconds']:>9.2f}{r['per_s']:>12,.0f}"
                     f"{r['per_cpu_s']:>13,.0f}{target:>9}  {ok}")
        if r["timeouts"] or r["crashes"] or r["errors"]:
            lines.append(f"{'':<24}timeouts={r['timeouts']} crashes={r['crashes']} errors={r['errors']}")
    return "\n".join(lines)
