"""Reward verifiers (case tables + properties) and the BatchScorer's survival of crashes and hangs."""
import json
import os
import pickle
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from justrl_megatron.rewards import (REWARD_NAMES, BatchScorer, CountdownReward, DapoReward, MathVerifyReward,
                                     get_reward_fn)
from justrl_megatron.rewards.countdown import evaluate
from justrl_megatron.rewards.dapo import normalize_final_answer, strict_box_answer

MB = 1 << 20
BOX = "\\boxed{42}"


# ------------------------------------------------------------------------------------------- dapo (strict box)
@pytest.mark.parametrize("response, answer, expected", [
    ("So the answer is \\boxed{42}.", "42", 1.0),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),  # nested braces
    ("\\boxed{\\frac{1}{2}}", "1/2", -1.0),  # no normalisation: plain string equality
    ("\\boxed{\\frac{1}{2}}", "0.5", -1.0),
    ("\\boxed{ 42}", "42", -1.0),  # not even whitespace
    ("\\boxed{{a}{b}}", "{a}{b}", 1.0),
    ("\\boxed{\\sqrt{\\frac{x^{2}}{4}}}", "\\sqrt{\\frac{x^{2}}{4}}", 1.0),
    ("first \\boxed{1}, finally \\boxed{2}", "2", 1.0),  # several boxes: the last counts
    ("first \\boxed{1}, finally \\boxed{2}", "1", -1.0),
    ("\\boxed{1} but then \\boxed{2", "1", -1.0),  # unclosed last box: an earlier box does not count
    ("\\boxed{42" + "}" * 3, "42", 1.0),
    (BOX + "x" * 90, "42", 1.0),  # box + 90 chars: exactly the last 100
    (BOX + "x" * 91, "42", -1.0),  # one more character and the box falls out of the window
    (BOX + " " * 101, "42", -1.0),
    ("", "42", -1.0),
    ("42", "42", -1.0),  # no box at all
    ("\\boxed{}", "", 1.0),
    ("\\fbox{42}", "42", -1.0),
    ("y" * MB + BOX, "42", 1.0),  # 1 MB response
    (BOX + "y" * MB, "42", -1.0),
])
def test_dapo_strict_table(response, answer, expected):
    assert DapoReward()(response, answer) == expected
    assert get_reward_fn("dapo")(response, answer) == expected


def test_dapo_reward_values_are_configurable():
    fn = get_reward_fn("dapo", correct=1.0, wrong=-1.0, no_answer=-0.5)
    assert fn(BOX, "42") == 1.0 and fn("\\boxed{41}", "42") == -1.0 and fn("no box", "42") == -0.5
    assert fn("\\boxed{4", "42") == -0.5 and fn.is_correct(BOX, "42") and not fn.is_correct("x", "42")
    assert DapoReward().failure_value == -1.0


def _brute_force_box(tail: str):
    """Independent definition: the shortest brace-balanced content after the last '\\boxed{' of the window."""
    tail = tail[-100:]
    start = tail.rfind("\\boxed{")
    if start < 0:
        return None
    body = tail[start + len("\\boxed{"):]
    for end in range(len(body)):
        if body[end] == "}" and body[:end].count("{") == body[:end].count("}") and all(
                body[:k].count("{") >= body[:k].count("}") for k in range(end + 1)):
            return body[:end]
    return None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["\\boxed{", "{", "}", "1", "ab", " ", "\\frac", "\n"]), max_size=60))
def test_dapo_strict_extraction_matches_brute_force(parts):
    text = "".join(parts)
    assert strict_box_answer(text) == _brute_force_box(text)


@pytest.mark.parametrize("response, answer, expected", [
    ("Reasoning...\nAnswer: 42", "42", 1.0),
    ("Answer: 1,000", "1000", 1.0),
    ("Answer: $\\frac{1}{2}$", "\\frac12", 1.0),  # shorthand \frac normalised
    ("Answer: 5 dollars", "5", 1.0),
    ("answer : 7\nmore text", "7", 1.0),
    ("So \\boxed{42}", "42", -1.0),  # FACTS: with a \boxed{} prompt the Minerva path scores right answers wrong
    ("Answer: 41", "42", -1.0),
])
def test_dapo_minerva_table(response, answer, expected):
    assert get_reward_fn("dapo_minerva")(response, answer) == expected
    assert DapoReward(strict=False)(response, answer) == expected


def test_minerva_normalisation():
    assert normalize_final_answer("x = \\text{5 units}") == "5"
    assert normalize_final_answer("\\$1,000") == "1000"
    assert normalize_final_answer("10^\\circ") == "10"


# ---------------------------------------------------------------------------------------------- math_verify
@pytest.mark.parametrize("response, answer, expected", [
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("so \\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("first $1$, finally \\boxed{2}", "2", 1.0),  # a box outranks inline math
    ("\\boxed{3}", "4", 0.0),
    ("so \\boxed{3", "3", 0.0),  # unclosed box: no answer
    (BOX + " and some more words" * 10, "42", 1.0),  # unlike dapo, no 100-character window
    ("no math here at all", "4", 0.0),
    ("", "4", 0.0),
    ("z" * MB + "\\boxed{5}", "5", 1.0),  # the tail is what gets parsed
])
def test_math_verify_table(response, answer, expected):
    assert MathVerifyReward()(response, answer) == expected


def test_math_verify_values_and_threads():
    fn = get_reward_fn("math_verify", correct=1, wrong=-1, no_answer=-0.5)
    assert fn("\\boxed{7}", "7") == 1 and fn("\\boxed{8}", "7") == -1 and fn("words", "7") == -0.5
    out = []  # its signal-based timeouts cannot run off the main thread: they must be switched off, not raise
    t = threading.Thread(target=lambda: out.append(fn("\\boxed{\\frac{1}{2}}", "0.5")))
    t.start()
    t.join()
    assert out == [1]


# --- issue 32: math-verify's work is bounded on both sides -----------------------------------------------------------

def _nested(levels: int, inner: str = "1") -> str:
    return "{" * levels + inner + "}" * levels


@pytest.mark.parametrize("levels", [12, 14, 20])
def test_math_verify_deep_braces_score_correct_fast(levels):
    """12 levels took 5.8 s and from 14 levels correct answers timed out and scored wrong (issue 32)."""
    fn, answer = MathVerifyReward(), _nested(levels)
    for response in (f"so \\boxed{{{answer}}}", f"so \\boxed{{{answer}+0}}", "so \\boxed{1}"):
        start = time.monotonic()
        assert fn.evaluate(response, answer) == (1.0, True), response
        assert time.monotonic() - start < 1.0, (response, time.monotonic() - start)


def test_math_verify_refuses_deep_nesting_before_sympy():
    start = time.monotonic()  # 20 levels that no doubled pair can flatten: not parsed at all, so no answer
    assert MathVerifyReward(no_answer=-0.5)("\\boxed{" + "{1" * 20 + "}" * 20 + "}", "2") == -0.5
    assert time.monotonic() - start < 0.5


def test_math_verify_bounds_a_huge_ground_truth():
    """A 5 MB ground truth took 5 s (only the response side was clipped)."""
    fn, huge = MathVerifyReward(), "1" * (5 * MB)
    start = time.monotonic()
    assert fn("\\boxed{1}", huge) == 0.0 and fn("no answer", huge) == 0.0
    assert time.monotonic() - start < 0.5


@pytest.mark.parametrize("text,flat,depth", [
    ("{{{1}}}", "{1}", 1), ("\\frac{{1}}{((2))}", "\\frac{1}{(2)}", 2), ("{{1}{2}}", "{{1}{2}}", 2),
    ("[0, 1)", "[0, 1)", 1), ("\\{\\{1\\}\\}", "\\{\\{1\\}\\}", 0), ("x)) + ((", "x)) + ((", 2),
])
def test_flatten_nesting_drops_only_redundant_pairs(text, flat, depth):
    from justrl_megatron.rewards.mathverify import flatten_nesting

    assert flatten_nesting(text) == (flat, depth)


# --- issue 32: a missing ground truth is never the text "None" -----------------------------------------------------

@pytest.mark.parametrize("name", ["dapo", "math_verify"])
def test_none_ground_truth_is_refused(name):
    fn = get_reward_fn(name)
    for missing in (None, "None", "nan"):
        with pytest.raises(ValueError, match="no ground truth"):
            fn.grade("\\boxed{None}", missing)
    with BatchScorer(fn, num_workers=0) as scorer:
        with pytest.raises(ValueError, match=r"1 of 2 answers are missing .* positions \[1\]"):
            scorer.score(["\\boxed{1}", "\\boxed{None}"], ["1", None])
        assert scorer.stats["items"] == 0  # refused before anything was scored


def test_dapo_then_math_verify():
    fn = get_reward_fn("dapo_then_math_verify")
    assert fn("\\boxed{42}", "42") == 1.0  # dapo alone
    assert fn("\\boxed{\\frac{1}{2}}", "0.5") == 1.0  # math_verify rescues it
    assert fn("\\boxed{3}", "4") == 0.0 and fn("nothing", "4") == 0.0
    assert fn.is_correct("\\boxed{0.5}", "\\frac{1}{2}")


# --------------------------------------------------------------------------------------------------- gsm8k
@pytest.mark.parametrize("response, answer, expected", [
    ("She pays 3 * 4 = 12.\n#### 12", "12", 1.0),
    ("#### 1,234", "1234", 1.0),
    ("The total is $1,234.", "1234", 1.0),
    ("The answer is 18 dollars.", "18", 1.0),
    ("\\boxed{\\$1{,}000}", "1000", 1.0),
    ("<think>2+2</think><answer>4 apples</answer>", "4", 1.0),
    ("I think 7, no wait, 9", "9", 1.0),
    ("Answer: -3.50", "-3.5", 1.0),
    ("It is 3/4 of it: 3/4", "0.75", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{\\dfrac{3}{2}}", "2", 0.0),
    ("#### 12\nbut actually 13", "12", 1.0),  # the #### line wins
    ("The answer is 12", "13", 0.0),
    ("no numbers", "13", 0.0),
    ("", "13", 0.0),
    ("q" * MB + " 77", "77", 1.0),
])
def test_gsm8k_table(response, answer, expected):
    assert get_reward_fn("gsm8k")(response, answer) == expected


@pytest.mark.parametrize("response, answer, expected", [
    # digits of any script are the digits they are, in the response and in the ground truth
    ("#### \uff11\uff12", "12", 1.0),  # fullwidth
    ("#### \u0661\u0662", "12", 1.0),  # Arabic-Indic
    ("\\boxed{\u0967\u0968}", "12", 1.0),  # Devanagari
    ("The answer is \uff11\uff0c\uff12\uff13\uff14\uff0e\uff15", "1234.5", 1.0),  # fullwidth comma and point
    ("#### \u0663\u066b\u0665", "3.5", 1.0),  # the Arabic decimal separator
    ("#### \u22125", "-5", 1.0),  # the minus sign
    ("#### 12", "\uff11\uff12", 1.0),
    ("The area is 12 m\u00b2", "2", 0.0),  # a superscript is no digit: the last number is 12
    # exact, or within rel_tol (1e-9 of the truth): a double's printing noise counts, a different number does not
    ("#### 12.0000001", "12", 0.0),
    ("#### 0.30000000000000004", "0.3", 1.0),
    ("#### 12.000000000001", "12", 1.0),
    ("#### 11.9999", "12", 0.0),
])
def test_gsm8k_digits_and_tolerance_follow_the_stated_rule(response, answer, expected):
    assert get_reward_fn("gsm8k")(response, answer) == expected


def test_gsm8k_rewards_stay_in_range_and_the_tolerance_is_the_users():
    fn = get_reward_fn("gsm8k", correct=1, wrong=-1, no_answer=-0.5)
    hostile = ["", "####", "#### 1/0", "#### " + "9" * 5000, "\\boxed{" * 1000, "#### nan", "#### inf", "#### -0",
               "".join(chr(c) for c in range(0x660, 0x66e)) * 50, "".join(map(chr, range(0x2000, 0x2400)))]
    low, high = fn.reward_range
    assert all(low <= fn(r, a) <= high for r in hostile for a in ("12", "0", "-3.5", "\u0661"))
    assert get_reward_fn("gsm8k", rel_tol=1e-6)("#### 12.0000001", "12") == 1.0  # looser, when asked for
    for bad in (-1e-9, float("nan"), float("inf"), 1.0, "1e-9"):
        with pytest.raises(ValueError, match="rel_tol must be a number in"):
            get_reward_fn("gsm8k", rel_tol=bad)


def test_gsm8k_strict_and_values():
    strict = get_reward_fn("gsm8k", mode="strict", correct=1, wrong=-1, no_answer=-0.5)
    assert strict("#### 5", "5") == 1 and strict("The answer is 5", "5") == -0.5 and strict("#### 6", "5") == -1
    with pytest.raises(ValueError):
        get_reward_fn("gsm8k", mode="lenient")


# ------------------------------------------------------------------------------------------------ countdown
CD = {"numbers": [1, 2, 3], "target": 9}


@pytest.mark.parametrize("response, expected", [
    ("<think>...</think><answer>(1 + 2) * 3</answer>", 1.0),
    ("<answer>(1+2)*3 = 9</answer>", 1.0),
    ("<answer>3 × (2 + 1)</answer>", 1.0),
    ("<answer>(3 ÷ 1) * (2 + 1)</answer>", 0.1),  # 3 used twice
    ("<answer>3 * 3</answer>", 0.1),  # 3 reused, 1 and 2 unused
    ("<answer>1 + 2 + 3</answer>", 0.1),  # valid but 6
    ("<answer>(1 + 2) * 3</answer> then <answer>1+2+3</answer>", 0.1),  # the last answer counts
    ("<answer>__import__('os').system('true')</answer>", 0.1),
    ("<answer>(1+2)**3</answer>", 0.1),
    ("<answer>-1 + 2 * 3 + 4</answer>", 0.1),  # unary minus, 4 not given
    ("<answer>3 / (2 - 2) * 1</answer>", 0.1),  # division by zero
    ("<answer>" + "(" * 400 + "1" + ")" * 400 + "</answer>", 0.1),  # nesting bomb
    ("<answer></answer>", 0.0),
    ("(1 + 2) * 3", 0.0),  # no answer tag
    ("", 0.0),
    ("w" * MB + "<answer>(1+2)*3</answer>", 1.0),
])
def test_countdown_table(response, expected):
    fn = get_reward_fn("countdown")
    assert fn(response, CD) == expected
    assert fn(response, json.dumps(CD)) == expected  # as stored in the prepared parquet


def test_countdown_options_and_parser():
    subset = CountdownReward(use_all=False, correct=1, wrong=-1, no_answer=-0.5)
    assert subset("<answer>3 * 3</answer>", {"numbers": [3, 3, 5], "target": 9}) == 1
    assert subset("<answer>3 * 3</answer>", {"numbers": [3, 5], "target": 9}) == -1
    assert subset("none", CD) == -0.5
    assert evaluate("7 / 2 * 2") == (7, [7, 2, 2])  # exact fractions, left to right
    assert evaluate("2 + 3 * 4")[0] == 14 and evaluate("(2 + 3) * 4")[0] == 20 and evaluate("8 - 3 - 2")[0] == 3
    for bad in ["2 +", "(2", "2 3", "2.5 * 2", "x + 1", ""]:
        with pytest.raises(ValueError):
            evaluate(bad)


# ----------------------------------------------------------------------------------------------------- code
MBPP = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 0) == 1"], "setup": ""}
FAST = dict(timeout_s=4.0, per_test_s=1)


def py(code):
    return f"Here it is:\n```python\n{code}\n```\nDone."


@pytest.mark.parametrize("response, expected", [
    (py("def add(a, b):\n    return a + b"), 2 / 3),  # partial credit
    (py("def add(a, b):\n    return a + b + (a == 0)"), 1.0),
    ("```\ndef add(a, b):\n    return a + b + (a == 0)\n```", 1.0),  # unlabelled fence
    ("<answer>def add(a, b):\n    return a + b + (a == 0)</answer>", 1.0),
    (py("def add(a, b) return"), 0.0),  # syntax error
    (py("import socket\ndef add(a, b):\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\n    return a + b"),
     0.0),  # no network
    (py("import subprocess\ndef add(a, b):\n    subprocess.run(['cat', '/etc/hostname'], check=True)\n"
        "    return a + b"), 0.0),  # processes run, but see no host files
    (py("import os\nos._exit(0)"), 0.0),
    (py("x = bytearray(4 << 30)\ndef add(a, b):\n    return a + b"), 0.0),  # memory limit
    (py("def add(a, b):\n    return a + b + (a == 0)\nif __name__ == '__main__':\n    input()"), 1.0),
    (py("print('tests pass: true')\ndef add(a, b):\n    return 0"), 0.0),  # printing cannot fake a pass
    ("no code at all", 0.0),
])
def test_code_table(response, expected):
    fn = get_reward_fn("code", **FAST)
    assert fn(response, MBPP) == pytest.approx(expected)
    assert fn(response, json.dumps(MBPP)) == pytest.approx(expected)


def test_code_time_limits_and_setup(tmp_path):
    fn = get_reward_fn("code", timeout_s=2.0, per_test_s=1, correct=1, wrong=-1, no_answer=-0.5)
    t0 = time.monotonic()
    assert fn(py("def add(a, b):\n    while True:\n        pass"), MBPP) == -1  # every test times out
    assert time.monotonic() - t0 < 4
    assert fn("none", MBPP) == -0.5
    with_setup = {"tests": ["assert twice(K) == 6"], "setup": "K = 3"}
    assert fn(py("def twice(x):\n    return 2 * x"), with_setup) == 1
    # the sandbox's working directory is private: nothing is written into ours
    assert fn(py("open('leak.txt', 'w').write('x')\ndef add(a, b):\n    return a + b"), MBPP) == pytest.approx(1 / 3)
    assert not os.path.exists("leak.txt")


# ------------------------------------------------------------------------------------------------- weighted
GOOD = "<think>\n6 * 7 = 42\n</think>\n<answer>42</answer>"


def test_weighted_components():
    fn = get_reward_fn("weighted", correctness="gsm8k")
    assert fn.components(GOOD, "42") == {"correctness": 1.0, "strict_format": 1.0, "has_thinking": 1.0,
                                         "has_answer": 1.0, "no_trailing_text": 1.0}
    assert fn(GOOD, "42") == pytest.approx(1.5)
    parts = fn.components(GOOD + "\nHope this helps!", "41")
    assert parts == {"correctness": 0.0, "strict_format": 0.0, "has_thinking": 1.0, "has_answer": 1.0,
                     "no_trailing_text": 0.0}
    assert fn.components("The answer is 42", "42") == {"correctness": 1.0, "strict_format": 0.0,
                                                        "has_thinking": 0.0, "has_answer": 0.0,
                                                        "no_trailing_text": 0.0}
    assert fn.components("<think></think><answer>42</answer>", "42")["strict_format"] == 0.0  # empty thinking
    two = "<think>a</think><answer>1</answer><answer>42</answer>"
    assert fn.components(two, "42")["strict_format"] == 0.0 and fn.components(two, "42")["correctness"] == 1.0


def test_weighted_weights_values_and_inner_verifiers():
    fn = get_reward_fn("weighted", correctness="gsm8k", correctness_options=dict(correct=1, wrong=-1, no_answer=-0.5),
                       weights={"correctness": 2.0, "strict_format": 0.5, "has_thinking": 0, "has_answer": 0,
                                "no_trailing_text": 0})
    assert fn(GOOD, "42") == 2.5 and fn(GOOD, "41") == -1.5 and fn("<think>x</think>", "1") == -1.0
    assert fn.failure_value == -2.0
    assert fn.evaluate(GOOD, "42") == (2.5, True) and fn.is_correct(GOOD, "42") and not fn.is_correct(GOOD, "41")
    with BatchScorer(fn) as scorer:  # gsm8k inside: scored in-process
        assert scorer.in_process and scorer.evaluate([GOOD, GOOD], ["42", "41"]) == ([2.5, -1.5], [True, False])
    with pytest.raises(ValueError, match="unknown reward components"):
        get_reward_fn("weighted", weights={"style": 1.0})
    # countdown with a prompt that pre-fills <think>; only the <answer> block is graded
    cd = get_reward_fn("weighted", correctness="countdown", think_prefilled=True, grade_answer_tag_only=True)
    parts = cd.components("1+2=3, 3*3=9 </think>\n<answer>(1 + 2) * 3</answer>", CD)
    assert parts["correctness"] == 1.0 and parts["strict_format"] == 1.0
    code = get_reward_fn("weighted", correctness="code", correctness_options=FAST)
    resp = "<think>add</think>\n<answer>\n```python\ndef add(a, b):\n    return a + b\n```\n</answer>"
    assert code.components(resp, MBPP)["correctness"] == pytest.approx(2 / 3)
    t0 = time.monotonic()
    huge = fn("<think>" * (MB // 7) + "<answer>" * 10, "1")  # unclosed tags everywhere: linear time
    assert time.monotonic() - t0 < 2 and huge == pytest.approx(-1.0)


# ------------------------------------------------------------------------------------------------- registry
def test_registry_builds_picklable_verifiers():
    samples = {"countdown": ("<answer>(1+2)*3</answer>", CD), "code": (py("def add(a, b): return 1"), MBPP)}
    for name in REWARD_NAMES:
        fn = get_reward_fn(name)
        clone = pickle.loads(pickle.dumps(fn))
        response, answer = samples.get(name, ("so \\boxed{42}\n#### 42", "42"))
        assert clone(response, answer) == fn(response, answer)
    with pytest.raises(ValueError, match="unknown reward"):
        get_reward_fn("bleu")
    with pytest.raises(TypeError):
        get_reward_fn("dapo", strictness=True)


# ---------------------------------------------------------------------------------------------- BatchScorer
class Faulty:
    """A verifier that crashes, hangs or raises on command (the module is importable by the workers)."""

    failure_value = -1.0

    def __call__(self, response, answer):
        if response == "exit":
            os._exit(3)
        if response == "segv":
            import ctypes
            ctypes.string_at(0)
        if response == "hang":
            time.sleep(60)
        if response == "raise":
            raise RuntimeError("verifier bug")
        return float(answer)


def test_batch_scorer_survives_crashes_hangs_and_errors():
    responses = ["ok"] * 7 + ["exit"] + ["ok"] * 3 + ["hang"] + ["raise", "segv"] + ["ok"] * 6
    answers = list(range(len(responses)))
    with BatchScorer(Faulty(), num_workers=2, timeout_s=1.0) as scorer:
        t0 = time.monotonic()
        out = scorer.score(responses, answers)
        assert time.monotonic() - t0 < 20
        bad = {"exit", "hang", "raise", "segv"}
        assert out == [-1.0 if r in bad else float(a) for r, a in zip(responses, answers)]
        assert (scorer.stats["crashes"], scorer.stats["timeouts"], scorer.stats["errors"]) == (2, 1, 1)
        assert scorer.stats["restarts"] == 3
        # the rebuilt pool keeps working; failed items are never "correct"
        rewards, correct = scorer.evaluate(["ok", "ok", "raise", "exit"], [1, 2, 1, 1])
        assert rewards == [1.0, 2.0, -1.0, -1.0] and correct == [True, False, False, False]
        assert scorer.score(["ok"] * 5, [1, 2, 3, 4, 5]) == [1.0, 2.0, 3.0, 4.0, 5.0]
        assert scorer.score([], []) == []
        with pytest.raises(ValueError):
            scorer.score(["a"], [])


def test_batch_scorer_matches_direct_scoring():
    fn = get_reward_fn("math_verify")
    responses = [f"step {i}: \\boxed{{{i % 4}}}" for i in range(40)] + ["nothing", "\\boxed{\\frac{1}{2}}"]
    answers = [str(i % 3) for i in range(40)] + ["1", "0.5"]
    with BatchScorer(fn, num_workers=2, timeout_s=10, chunk_size=3) as scorer:
        assert not scorer.in_process
        rewards, correct = scorer.evaluate(responses, answers)
        assert rewards == [fn(r, a) for r, a in zip(responses, answers)]
        assert correct == [fn.is_correct(r, a) for r, a in zip(responses, answers)] and any(correct)
        assert scorer.stats["crashes"] == scorer.stats["timeouts"] == 0


def test_fast_verifiers_score_in_process_and_errors_are_contained():
    fn = get_reward_fn("countdown")
    scorer = BatchScorer(fn)
    assert scorer.in_process and scorer.failure_value == 0.1
    out = scorer.score(["<answer>(1+2)*3</answer>", "<answer>1</answer>"], [CD, "not json"])
    assert out == [1.0, 0.1] and scorer.stats["errors"] == 1
    forced = BatchScorer(get_reward_fn("dapo"), num_workers=2, in_process=False)
    with forced:
        resp = ["x" * 5000 + "\\boxed{%d}" % i for i in range(100)]
        assert forced.score(resp, [str(i) if i % 2 else "no" for i in range(100)]) == [
            1.0 if i % 2 else -1.0 for i in range(100)]


def test_batch_scorer_reports_a_verifier_workers_cannot_load(monkeypatch):
    import sys
    import types

    # picklable here (by reference to a module), but the module exists only in this process
    module = types.ModuleType("justrl_test_parent_only")
    exec("class Verifier:\n    def __call__(self, response, answer):\n        return 1.0\n", module.__dict__)
    module.Verifier.__module__ = module.__name__
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.raises(RuntimeError, match="did not start"):
        with BatchScorer(module.Verifier(), num_workers=1) as scorer:
            scorer.score(["x"], ["y"])


def test_make_scorer_builds_the_configured_scorer_on_the_scoring_rank_only():
    from justrl_megatron.config import compose
    from justrl_megatron.rewards import make_scorer

    algo = compose(["recipe=justrl_deepseek_1p5b"]).algo  # reward: dapo (strict box, +1 / -1)
    assert make_scorer(algo, enabled=False) is None
    with make_scorer(algo, enabled=True) as scorer:
        rewards, correct = scorer.evaluate(["so \\boxed{42}", "so \\boxed{41}"], ["42", "42"])
    assert rewards == [1.0, -1.0] and correct == [True, False]
