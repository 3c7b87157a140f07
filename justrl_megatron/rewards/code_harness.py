"""The code reward's two ends of the sandbox channel: the harness that runs inside it, and the strict decoder here.

The harness reads ``{"code", "setup", "tests": [[[kind, source], ...], ...], "per_test_s"}`` from stdin, runs setup
and code, then each test's steps (``exec`` a statement, or ``eval`` an expression), and writes one JSON line
``[test, step, value]`` per step. It runs in the same interpreter as the solution, so the solution can rewrite or
imitate anything it does: nothing it writes is trusted beyond "the solution produced this value". ``decode`` turns a
value back into plain Python data only (tagged, so a tuple stays a tuple, a set a set) and rejects anything else.
"""
from __future__ import annotations

MAX_DEPTH = 64

HARNESS = r"""
import json, os, signal, sys


def _on_alarm(signum, frame):
    raise TimeoutError("test timed out")


def _enc(v, depth=0):
    if depth > 64:
        raise ValueError("too deep")
    d = depth + 1
    if v is None or v is True or v is False:
        return v
    if isinstance(v, bool):
        return bool(v)
    if isinstance(v, int):
        return ["i", str(int(v))]
    if isinstance(v, float):
        return ["f", repr(float(v))]
    if isinstance(v, complex):
        return ["c", repr(complex(v))]
    if isinstance(v, str):
        return ["s", str(v)]
    if isinstance(v, (bytes, bytearray)):
        return ["b", bytes(v).hex()]
    if isinstance(v, dict):
        return ["d", [[_enc(k, d), _enc(x, d)] for k, x in v.items()]]
    for tag, kind in (("l", list), ("t", tuple), ("S", set), ("F", frozenset)):
        if isinstance(v, kind):
            return [tag, [_enc(x, d) for x in v]]
    if isinstance(v, range):
        return ["r", [v.start, v.stop, v.step]]
    if hasattr(type(v), "__next__") and hasattr(type(v), "__iter__"):  # generators, map, zip, ...
        items = []
        for x in v:
            if len(items) >= 100000:
                raise ValueError("iterator too long")
            items.append(_enc(x, d))
        return ["I", items]
    raise TypeError("not plain data: %s" % type(v).__name__)


def main():
    spec = json.loads(sys.stdin.buffer.read())
    out = os.dup(1)  # the solution's own prints go to /dev/null
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    write, dumps, per_test_s = os.write, json.dumps, spec["per_test_s"]
    signal.signal(signal.SIGALRM, _on_alarm)
    g = {"__name__": "solution"}  # a main guard in the response must not run
    try:
        signal.alarm(per_test_s)
        exec(compile(spec["setup"] + "\n" + spec["code"], "solution.py", "exec"), g)
    except BaseException:
        pass
    finally:
        signal.alarm(0)
    for i, steps in enumerate(spec["tests"]):
        for j, (kind, source) in enumerate(steps):
            try:
                signal.alarm(per_test_s)
                if kind == "exec":
                    exec(source, g)
                    value = ["ok"]
                else:
                    value = _enc(eval(source, g))
                line = dumps([i, j, value])
            except BaseException:
                line = dumps([i, j, ["err"]])
            finally:
                signal.alarm(0)
            write(out, line.encode() + b"\n")


main()
"""

_SEQUENCES = {"l": list, "t": tuple, "S": set, "F": frozenset}


def decode(value, depth: int = 0):
    """Plain Python data from the harness's tagged JSON; ValueError / TypeError for anything malformed."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deep")
    if value is None or value is True or value is False:
        return value
    if type(value) is not list or len(value) != 2 or type(value[0]) is not str:
        raise ValueError("malformed value")
    tag, body = value
    if tag in ("i", "f", "c", "s", "b"):
        if type(body) is not str:
            raise ValueError("malformed scalar")
        return {"i": int, "f": float, "c": complex, "s": str, "b": bytes.fromhex}[tag](body)
    if type(body) is not list:
        raise ValueError("malformed container")
    if tag in _SEQUENCES:
        return _SEQUENCES[tag](decode(x, depth + 1) for x in body)
    if tag == "I":
        return iter([decode(x, depth + 1) for x in body])
    if tag == "d":
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
    if tag == "r" and len(body) == 3 and all(type(x) is int for x in body):
        return range(*body)
    raise ValueError(f"unknown tag {tag!r}")
