"""Issue 50's smaller findings: a code fence inside a string literal of a tool call, a second Ctrl-C that ended in
multiprocessing's resource tracker's `KeyError` traceback, a bool key given 2 in a YAML file (read as true)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from justrl_megatron.config import CONFIG_DIR, yaml_bool_problems
from justrl_megatron.interrupt import ABORTED, REPEAT_S
from justrl_megatron.rollout.tools import PythonTool, fenced_block_at_end

ROOT = Path(__file__).resolve().parent.parent


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


# --- a second Ctrl-C is one line, whatever the helpers left to the resource tracker ------------------------------

CHILD = textwrap.dedent("""
    import os, sys, threading, time
    from multiprocessing import shared_memory
    from justrl_megatron import interrupt, run_lock

    interrupt.Interruptible().install()
    kept = shared_memory.SharedMemory(create=True, size=4096)  # a helper's, never unlinked: the tracker's to clean
    late = shared_memory.SharedMemory(create=True, size=4096)  # unlinked while the abort is under way
    aborting = threading.Event()
    remove = run_lock.remove_staging

    def slow_remove():  # removing a large staging folder takes a while; other threads run meanwhile
        aborting.set()
        time.sleep(0.5)
        return remove()

    run_lock.remove_staging = slow_remove

    def unlink_late():  # as a library's thread does when its engine process was killed under it
        aborting.wait()
        late.close()
        late.unlink()

    threading.Thread(target=unlink_late, daemon=True).start()
    print(kept.name, late.name, flush=True)
    while True:
        time.sleep(0.02)
""")


def test_second_ctrl_c_leaves_no_traceback_and_no_shared_memory():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": "0"}
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)
    names, left = [], []
    try:
        names = child.stdout.readline().split()
        assert len(names) == 2, child.communicate(timeout=60)
        child.send_signal(signal.SIGINT)
        time.sleep(REPEAT_S + 0.5)  # a second press, not the terminal's and torchrun's copies of the first
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=120)  # stderr's EOF: the resource tracker, which holds it too, is gone
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        left = [name for name in names if Path("/dev/shm", name.lstrip("/")).exists()]
        for name in left:  # only what this test made
            Path("/dev/shm", name.lstrip("/")).unlink()
    assert child.returncode == 130, err
    assert "Traceback" not in err and "resource_tracker" not in err, err
    lines = err.splitlines()
    assert len(lines) == 2 and lines[1].startswith(ABORTED.split(":")[0]), err
    assert not left, f"{left} leaked: the resource tracker was killed before it could unlink them"


def test_the_resource_tracker_leaves_stop_signals_to_the_rank():
    """A SIGUSR1 to every process (Slurm) killed the tracker a rank shares with its helpers: what it tracked leaked,
    and the next unregistration relaunched it into the KeyError traceback above."""
    code = ("import os, signal, time\nfrom multiprocessing import resource_tracker\n"
            "from justrl_megatron.interrupt import Interruptible\nInterruptible().install()\n"
            "pid = resource_tracker._resource_tracker._pid\n"
            "for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):\n    os.kill(pid, sig)\n"
            "time.sleep(0.5)\nprint(os.waitpid(pid, os.WNOHANG))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.strip() == "(0, 0)", (done.stdout, done.stderr)  # still running


# --- bools in YAML files: OmegaConf reads 2 as true; the command line already refuses it (test_config) ---------------

def test_committed_config_files_hold_true_or_false_in_bool_keys():
    files = [("", "config")] + [(p.parent.name, p.stem) for p in sorted(CONFIG_DIR.glob("*/*.yaml"))]
    assert len(files) > 15
    assert yaml_bool_problems([str(CONFIG_DIR)], files) == []


def test_a_bool_key_of_a_yaml_file_takes_true_or_false_only(tmp_path):
    (tmp_path / "recipe").mkdir()
    (tmp_path / "parallel").mkdir()
    recipe = tmp_path / "recipe" / "mine.yaml"
    recipe.write_text("# @package _global_\ndefaults:\n  - /model: qwen3_1p7b\ntrainer:\n  async_save: 2\n"
                      "  lr: 1e-6\nrollout:\n  streaming: 'no'\n  max_staleness: 1\n"
                      "algo:\n  reward_options: {flag: 2}\nlogging:\n  wandb_mode: \"${oc.env:X,offline}\"\n")
    (tmp_path / "parallel" / "mine.yaml").write_text("tensor: 1\nsequence_parallel: 0\ndistributed_optimizer: true\n")
    assert yaml_bool_problems([str(tmp_path), str(CONFIG_DIR)], [("recipe", "mine"), ("parallel", "mine"),
                                                                   ("model", "qwen3_1p7b")]) == [
        f"{tmp_path / 'parallel' / 'mine.yaml'}: parallel.sequence_parallel must be true or false, got 0",
        f"{recipe}: rollout.streaming must be true or false, got 'no'",
        f"{recipe}: trainer.async_save must be true or false, got 2"]


def test_justrl_train_refuses_a_yaml_bool_in_one_line(tmp_path, monkeypatch, capfd):
    """Through justrl-train (hydra.main, in this process): a --config-dir file's bool read as true is refused, exit
    2, one line, among the other problems."""
    import logging

    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from justrl_megatron import train_entry

    (tmp_path / "configs" / "parallel").mkdir(parents=True)
    (tmp_path / "configs" / "parallel" / "mine.yaml").write_text(
        "tensor: 1\npipeline: 1\nsequence_parallel: false\ndistributed_optimizer: 2\n")
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    monkeypatch.setattr("sys.argv", ["justrl-train", "--config-dir", str(tmp_path / "configs"), "parallel=mine",
                                     f"trainer.run_dir={tmp_path / 'run'}", "model.path=/nonexistent/model"])
    try:
        with pytest.raises(SystemExit) as exit_:
            train_entry.main()
    finally:
        root.handlers[:], root.level = handlers, level
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None  # later validate() calls in this process compose without hydra.main
    err = capfd.readouterr().err
    line = (f"  - {tmp_path / 'configs' / 'parallel' / 'mine.yaml'}: parallel.distributed_optimizer must be true or "
            f"false, got 2")
    assert exit_.value.code == 2 and line in err.splitlines(), err
    # the refused launch leaves nothing: the run dir it would have created (its name composed with --config-dir's
    # files too) is gone
    assert not (tmp_path / "run").exists()
