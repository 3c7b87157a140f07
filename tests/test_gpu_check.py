"""tools/gpu_check.sh and bench/gpu_check.py on the CPU: the dry run (CI has no .whl and no network), the shell's
argument and environment plumbing, the bundle check on real (tiny) wheel files, the token-budget search against a real
threshold, the driver's process groups and incremental report, and a rehearsal of the GPU box: the kit's `pytest` and
`probe` stages run where vllm, transformer_engine, wandb, datasets, trl, math_verify and reasoning_gym cannot be
imported (as on the box), and must come back with a report."""

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)
from justrl_megatron.bench import gpu_check
from justrl_megatron.bench.gpu_check import (
    CALL_PLAN_S,
    CALLS,
    ROOT,
    STAGES,
    TOTAL_CAP_S,
    check_bundle,
    dry_run,
    markdown,
    read_pytest_log,
    required_wheels,
    search_budget,
)

def _run(*args, **env):
    return subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHON": sys.executable, **env})


def test_dry_run_without_a_bundle_says_so_and_prints_the_plan(tmp_path):
    proc = _run("--dry-run", JUSTRL_WHEELS_DIR=str(tmp_path / "absent"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bundle missing" in proc.stdout and "tools/gpu_wheels.sh" in proc.stdout
    for stage in ("probe", "pytest", "mfu", "moe", "fp8", "train", "budget"):
        assert f"  {stage}" in proc.stdout
    # the four calls, each planned to fit one device call; the first is the same-card A/B
    assert "call 1: bash tools/gpu_check.sh   (390 s of stages)" in proc.stdout
    assert "call 2: bash tools/gpu_check.sh --stages pytest   (300 s of stages)" in proc.stdout
    assert "call 3: bash tools/gpu_check.sh --stages train   (170 s of stages)" in proc.stdout
    assert "call 4: bash tools/gpu_check.sh --stages budget   (300 s of stages)" in proc.stdout
    # the 1.5B update on one 80 GB H100 fits without recompute with the CUDA kernels (fused SwiGLU and norms)
    assert "memory plan: recompute=none, 16384 tokens/micro-batch" in proc.stdout


def test_unknown_arguments_are_refused():
    for args in (["--bogus"], ["--stages"], ["--stages="], ["--dry-run", "--bogus"]):
        proc = _run(*args)
        assert proc.returncode == 2 and "usage" in proc.stderr, args


def test_each_call_fits_the_plan():
    """Every stage runs in exactly one planned call; a call's stages fit TOTAL_CAP_S, and TOTAL_CAP_S leaves a minute
    of the 8-minute call plan (itself under the device's 10-minute hard limit) for installing .whl/ and start-up."""
    assert sorted(n for call in CALLS for n in call) == sorted(STAGES)
    for call in CALLS:
        assert sum(STAGES[n][0] for n in call) <= TOTAL_CAP_S, call
    assert TOTAL_CAP_S + 60 <= CALL_PLAN_S <= 8 * 60


FAKE_PYTHON = """#!/usr/bin/env bash
# stands in for python3 on the box: records the driver's command line and environment; the backstop's one-liner
# (it imports gpu_check, stdlib only) runs for real
if [[ "$1" == "-m" ]]; then
  { printf '%s\\n' "$@"; echo "HF_HUB_OFFLINE=$HF_HUB_OFFLINE"; echo "STARTED=$JUSTRL_CALL_STARTED"; } > "$FAKE_LOG"
  exit 0
fi
case "$2" in
  *TOTAL_CAP_S*) exec "$REAL_PYTHON" "$@" ;;
  "import megatron.core, hydra, omegaconf") exit "$FAKE_IMPORT_RC" ;;
esac
exit 0
"""


@pytest.mark.parametrize("args", [["--stages", "budget"], ["--stages=pytest,budget"], []])
def test_the_shell_passes_stages_through_offline(tmp_path, args):
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "argv.txt"
    proc = _run(*args, PYTHON=str(fake), REAL_PYTHON=sys.executable, FAKE_LOG=str(log), FAKE_IMPORT_RC="0",
                JUSTRL_WHEELS_DIR=str(tmp_path / "absent"), OUT=str(tmp_path / "out"), HF_HUB_OFFLINE="0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = log.read_text().splitlines()
    assert lines[:4] == ["-m", "justrl_megatron.bench.gpu_check", "--out", str(tmp_path / "out")]
    stages = [a.split("=", 1)[1] if a.startswith("--stages=") else a for a in args if a != "--stages"]
    assert lines[4:-2] == (["--stages", *stages] if stages else [])
    assert "HF_HUB_OFFLINE=1" in lines
    assert abs(int(lines[-1].split("=")[1]) - time.time()) < 60  # the call's start, for the stages' time plan


def test_without_the_bundle_the_shell_says_to_carry_it(tmp_path):
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    proc = _run(PYTHON=str(fake), REAL_PYTHON=sys.executable, FAKE_LOG=str(tmp_path / "argv.txt"), FAKE_IMPORT_RC="1",
                JUSTRL_WHEELS_DIR=str(tmp_path / "absent"))
    assert proc.returncode == 2
    assert "must travel to the GPU box with the checkout" in proc.stderr and 'carry: [".whl"]' in proc.stderr
    assert "tools/gpu_wheels.sh" in proc.stderr
    assert not (tmp_path / "argv.txt").exists()  # no stage started


def _wheel(folder: Path, name: str, size: int = 0) -> Path:
    """A real wheel archive (a zip with a dist-info), however small."""
    path = folder / name
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name.split('-')[0]}-{name.split('-')[1]}.dist-info/METADATA", "Metadata-Version: 2.1\n")
        if size:
            z.writestr("pad.bin", os.urandom(size))
    return path


def test_bundle_check(tmp_path):
    required = {"megatron_core": "0.19.2", "omegaconf": "2.3.1"}
    _wheel(tmp_path, "megatron_core-0.19.2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl")
    _wheel(tmp_path, "omegaconf-2.3.1-py3-none-any.whl")
    report = check_bundle(tmp_path, required)
    assert report.ok and report.present and len(report.wheels) == 2, report.problems

    assert not check_bundle(tmp_path, required, limit_bytes=100).ok  # over the size limit
    assert "missing" in " ".join(check_bundle(tmp_path, {**required, "hydra_core": "1.3.8"}).problems)

    _wheel(tmp_path, "omegaconf-2.3.0-py3-none-any.whl")  # two versions: pip would refuse the whole install
    assert any("2 versions" in p for p in check_bundle(tmp_path, required).problems)
    (tmp_path / "omegaconf-2.3.0-py3-none-any.whl").unlink()

    _wheel(tmp_path, "numpy-2.0.0-cp311-cp311-manylinux_2_17_x86_64.whl")  # wrong Python
    _wheel(tmp_path, "psutil-6.0.0-cp312-cp312-macosx_11_0_arm64.whl")  # wrong platform
    (tmp_path / "broken-1.0-py3-none-any.whl").write_text("not a zip")
    problems = " ".join(check_bundle(tmp_path, required).problems)
    assert "not for CPython 3.12" in problems and "not for x86-64 Linux" in problems
    assert "not a readable zip" in problems

    missing = check_bundle(tmp_path / "nope", required)
    assert not missing.present and "bundle missing" in missing.problems[0]
    assert 'carry: [".whl"]' in missing.problems[0]


def test_the_bundle_list_pins_megatron_core_019():
    wheels = required_wheels()
    assert wheels["megatron_core"].startswith("0.19.")
    # pytest-timeout: the box has pytest but not it; the pytest stage's per-test limit needs it
    assert {"hydra_core", "omegaconf", "antlr4_python3_runtime", "pytest_timeout"} <= set(wheels)


@pytest.mark.slow
def test_the_real_bundle_passes_the_dry_run(tmp_path, capsys):
    """tools/gpu_wheels.sh downloads the bundle from PyPI (as a developer runs it) into a temp folder; the dry run
    accepts it."""
    (tmp_path / "keep.txt").write_text("not a wheel")
    env = {**os.environ, "JUSTRL_WHEELS_DIR": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "tools" / "gpu_wheels.sh")], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (tmp_path / "keep.txt").exists()  # the script removes earlier wheels only
    assert dry_run(tmp_path) == 0
    out = capsys.readouterr().out
    assert "bundle ok" in out and "megatron_core-0.19" in out


def test_budget_search_finds_the_largest_fitting_budget():
    threshold = 50_000
    trials = []

    def fits(n):
        trials.append(n)
        return n <= threshold

    best, log = search_budget(fits, 16_384)
    assert best == threshold // 1024 * 1024 == 49_152  # coarse: 1,024-token steps
    assert [n for n, _ in log] == trials and all(n % 1024 == 0 for n in trials)
    assert trials[:3] == [16_384, 20_480, 25_600]  # upward by 1.25 first
    assert len(trials) <= 10  # then bisection to 1,024, not to 128
    assert search_budget(fits, 80_000)[0] == 49_152  # a start that does not fit searches downward
    assert search_budget(lambda n: False, 4096)[0] == 0
    assert search_budget(fits, 1024, limit=10_000)[0] == 9_216  # never beyond the limit
    assert search_budget(fits, 16_384, multiple=128)[0] == 49_920  # finer steps where asked


def test_budget_search_stops_before_a_try_that_would_pass_the_deadline():
    now = [0.0]

    def fits(n):  # each try takes 10 s on this clock
        now[0] += 10.0
        return n <= 10**6

    best, log = search_budget(fits, 1024, deadline=35.0, clock=lambda: now[0])
    # tries start at 0, 10, 20; one starting at 30 would end at 40, past the deadline
    assert len(log) == 3 and best == log[-1][0] and now[0] == 30.0


def test_markdown_table():
    report = {"date": "2026-11-23", "commit": "abc", "device": "NVIDIA H100 80GB HBM3", "stages": [
        {"stage": "train", "ok": True, "seconds": 80, "tokens": 16384, "recompute": "full",
         "forward_only": {"tokens_per_s_per_gpu": 60000.0, "mfu": 0.41},
         "update": {"tokens_per_s_per_gpu": 15000.0, "mfu": 0.35},
         "peak_allocated_gib": 36.2, "predicted_peak_gib": 38.0},
        {"stage": "pytest", "ok": False, "seconds": 3, "error": "exited 1 | x"}]}
    text = markdown(report)
    assert "| train | yes | 80 |" in text and "MFU 41.0%" in text and "peak 36.2 GiB vs plan 38.0 GiB" in text
    assert "| pytest | NO |" in text and "exited 1 / x" in text
    text = markdown({**report, "plan": {"second_call": "bash tools/gpu_check.sh --stages budget"},
                     "stages": [{"stage": "budget", "status": "running", "recompute": "full", "plan_budget": 141_312,
                                 "step": 1024, "largest_fitting": 142_336, "trials": [{}, {}]}]})
    assert "| budget | running |" in text and "largest fitting 142336 tokens/micro-batch" in text
    assert "Not in this call: `bash tools/gpu_check.sh --stages budget`" in text


def test_pytest_log_cut_off_names_the_running_test():
    log = "\n".join([
        "$ python -m pytest tests/gpu -m gpu -v -rA --durations=0",
        "timeout: 120.0s",
        "collecting ... collected 3 items",
        "",
        "tests/gpu/test_gpu_attention.py::test_fused_rms_norm_on_cuda_matches_the_reference PASSED [ 33%]",
        "tests/gpu/test_gpu_step.py::test_fp32_step_on_cuda_matches_cpu[qwen] "])
    seen = read_pytest_log(log)
    assert seen["summary"] == "" and seen["counts"] == {}
    assert seen["last_test_started"] == "tests/gpu/test_gpu_step.py::test_fp32_step_on_cuda_matches_cpu[qwen]"
    full = log + "PASSED [ 66%]\n" + "\n".join([
        "=========================== short test summary info ============================",
        "SKIPPED [1] tests/gpu/test_gpu_te.py:14: needs transformer-engine",
        "FAILED tests/gpu/test_gpu_step.py::test_bf16 - AssertionError: x",
        "============================== slowest durations ===============================",
        "41.02s setup    tests/gpu/test_gpu_step.py::test_fp32_step_on_cuda_matches_cpu[qwen]",
        "============= 1 failed, 2 passed, 1 skipped, 1 error in 81.20s (0:01:21) =============="])
    seen = read_pytest_log(full)
    assert seen["counts"] == {"failed": 1, "passed": 2, "skipped": 1, "errors": 1}
    assert seen["skip_reasons"] == {"needs transformer-engine": 1}
    assert seen["last_test_started"] == "tests/gpu/test_gpu_step.py::test_fp32_step_on_cuda_matches_cpu[qwen]"


# --- the driver: process groups, partial records, the report after every stage ----------------------------------------

def _stat(pid: int) -> str | None:
    """The process' state letter, None once it is gone (a zombie, 'Z', is gone as far as the GPU is concerned)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2]


def _alive(pid: int) -> bool:
    return _stat(pid) not in (None, "Z")


def test_after_a_stage_its_whole_process_group_is_killed():
    """A stage that exits normally but leaves a worker behind (as a torchrun or vLLM child can): the worker dies
    before the next stage starts."""
    spawn = "import subprocess; print(subprocess.Popen(['sleep', '300']).pid)"
    leader = subprocess.Popen([sys.executable, "-c", spawn],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    worker = int(leader.stdout.readline())
    os.waitid(os.P_PID, leader.pid, os.WEXITED | os.WNOWAIT)  # the leader is done; its worker lives on
    assert _alive(worker)
    assert gpu_check._kill_group(leader.pid, leader.pid) == 1
    assert not _alive(worker)
    assert leader.wait() == 0
    leader.stdout.close()


STAGE_THAT_HANGS = """
import json, os, subprocess, sys, time
result = sys.argv[sys.argv.index("--result") + 1]
worker = subprocess.Popen(["sleep", "300"])
for i in range(1000):  # a partial record after every "try", as the budget stage writes them
    with open(result + ".tmp", "w") as f:
        json.dump({"tries": i + 1, "worker": worker.pid}, f)
    os.replace(result + ".tmp", result)
    time.sleep(0.3)
"""


def test_a_stage_past_its_cap_keeps_its_partial_record(tmp_path):
    seen = []
    t0 = time.monotonic()
    record = gpu_check._run_stage("hangs", 3, tmp_path, seen.append, cmd=[sys.executable, "-c", STAGE_THAT_HANGS])
    assert time.monotonic() - t0 < 15
    assert record["ok"] is False and record["error"] == "timed out after 3 s (partial record kept)"
    assert record["tries"] >= 1 and record["killed_leftover_processes"] >= 1
    assert not _alive(record["worker"])
    # the driver saw the partial records while the stage ran (and rewrote the report with each)
    assert seen and all(p["status"] == "running" for p in seen) and seen[-1]["tries"] <= record["tries"]
    assert not (tmp_path / ".hangs.json").exists()


def test_the_report_is_written_before_and_after_every_stage(tmp_path, monkeypatch):
    """gpu_check.json/.md exist while a stage runs (a call killed at its limit still brings back the stages before
    it), and a stage that no longer fits the call is named, with the command of a second call."""
    looked, now = [], [0.0]

    def fake_stage(name, cap, out_dir, on_progress, cmd=None):  # each stage takes its whole cap
        now[0] += cap
        report = json.loads((out_dir / "gpu_check.json").read_text())
        looked.append({s["stage"]: s["status"] for s in report["stages"]})
        on_progress({"stage": name, "status": "running", "tries": 1})
        partial = json.loads((out_dir / "gpu_check.json").read_text())
        assert next(s for s in partial["stages"] if s["stage"] == name)["tries"] == 1
        return {"stage": name, "status": "done", "ok": True, "seconds": 1.0}

    monkeypatch.setattr(gpu_check, "_run_stage", fake_stage)
    monkeypatch.setattr(gpu_check, "TOTAL_CAP_S", STAGES["probe"][0] + STAGES["train"][0] + 10)
    rc = gpu_check.run_stages(["probe", "train", "pytest", "budget"], tmp_path, clock=lambda: now[0])
    assert rc == 1
    assert looked == [{"probe": "running", "train": "pending", "pytest": "pending", "budget": "pending"},
                      {"probe": "done", "train": "running", "pytest": "pending", "budget": "pending"}]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["status"] for s in report["stages"]] == ["done", "done", "not run", "not run"]
    assert report["plan"]["second_call"] == "bash tools/gpu_check.sh --stages pytest,budget"
    assert report["complete"] and not report["ok"]
    md = (tmp_path / "gpu_check.md").read_text()
    assert "Not in this call: `bash tools/gpu_check.sh --stages pytest,budget`" in md


def test_a_stage_run_alone_or_last_may_use_the_rest_of_the_call(tmp_path, monkeypatch):
    """`--stages pytest` has the whole call (not pytest's 210 s); in a call of several stages only the last one may
    run past its own cap, into what the stages before it left."""
    caps, now = [], [0.0]

    def fake_stage(name, cap, out_dir, on_progress, cmd=None):
        caps.append((name, round(cap)))
        now[0] += 5  # each stage finishes early
        return {"stage": name, "status": "done", "ok": True, "seconds": 5.0}

    monkeypatch.setattr(gpu_check, "_run_stage", fake_stage)
    assert gpu_check.run_stages(["pytest"], tmp_path, clock=lambda: now[0]) == 0
    assert caps == [("pytest", TOTAL_CAP_S)]
    caps.clear()
    assert gpu_check.run_stages(["probe", "train", "pytest"], tmp_path, clock=lambda: now[0]) == 0
    assert caps == [("probe", STAGES["probe"][0]), ("train", STAGES["train"][0]), ("pytest", TOTAL_CAP_S - 10)]


def test_out_of_memory_is_recognised_however_cuda_libraries_report_it():
    import torch

    from justrl_megatron.bench.gpu_check import is_out_of_memory, runs_in_memory

    ooms = [torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
            RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
            RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, NCCL version 2.21.5\n"
                         "Last error:\nCuda failure 'out of memory'"),
            RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
            RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED")]
    for exc in ooms:
        assert is_out_of_memory(exc), exc

        def update(exc=exc):
            raise exc
        assert runs_in_memory(update) is False
    assert runs_in_memory(lambda: None) is True
    for other in (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), ValueError("out of memory?")):
        assert not is_out_of_memory(other)

        def broken(other=other):
            raise other
        with pytest.raises(type(other)):  # a bug is not "does not fit"
            runs_in_memory(broken)


def test_the_train_stage_measures_under_full_recompute_when_the_plan_runs_out_of_memory(monkeypatch):
    """The plan picks recompute=none for the 16K sample; if that does not fit after all (cuBLAS saying so with a
    RuntimeError), the stage says the plan was wrong and still measures the update under full recompute."""
    import torch

    from justrl_megatron.bench import train as bench_train_mod

    phase = {"time_s": 1.0, "tokens_per_s_per_device": 16384.0, "tflops_per_device": 100.0, "mfu": 0.1}
    ran = []

    def fake_bench_train(**kw):
        ran.append(kw["recompute"])
        if kw["recompute"] != "full":
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
        return {"transformer_impl": "local", "tokens_per_step": 16384, "device": "H100", "peak_tflops": 989.0,
                "logprob": phase, "update": phase, "gpu_peak_allocated_gib": 40.0}

    class Props:
        total_memory = gpu_check.H100_80GB_BYTES

    monkeypatch.setattr(gpu_check, "_require_cuda", lambda: None)
    monkeypatch.setattr(bench_train_mod, "bench_train", fake_bench_train)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    seen = []
    record = gpu_check.stage_train(seen.append, 170, Path("."))
    assert ran == ["none", "full"]
    assert record["recompute"] == "full" and not record["ok"] and "ran out of memory" in record["plan_oom"]
    assert record["update"]["tokens_per_s_per_gpu"] == 16384.0 and record["peak_over_prediction"] is None
    assert seen[-1]["plan_oom"] == record["plan_oom"]


# --- the rehearsal of the GPU box on the CPU --------------------------------------------------------------------------

BOX_LACKS = ("vllm", "transformer_engine", "wandb", "datasets", "trl", "math_verify", "reasoning_gym")
BOX_SITECUSTOMIZE = f"""
# The GPU box has none of these: every finder answers "not found" for them, so `import vllm` raises
# ModuleNotFoundError and importlib.util.find_spec("vllm") is None there as on the box. Every Python started with
# this folder on PYTHONPATH gets it (pytest, torchrun workers, subprocesses).
import sys

BOX_LACKS = frozenset({BOX_LACKS!r})


class _AsOnTheBox:
    def __init__(self, inner):
        self._inner = inner

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BOX_LACKS:
            return None
        find = getattr(self._inner, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, attr):
        return getattr(self._inner, attr)


sys.meta_path[:] = [_AsOnTheBox(f) for f in sys.meta_path]
"""


@pytest.fixture(scope="module")
def box_env(tmp_path_factory):
    site = tmp_path_factory.mktemp("box_site")
    (site / "sitecustomize.py").write_text(BOX_SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("OUT", None)
    check = subprocess.run([sys.executable, "-c", f"""
import importlib, importlib.util
for name in {BOX_LACKS!r}:
    assert importlib.util.find_spec(name) is None, name
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        continue
    raise SystemExit(name + " imported")
assert importlib.util.find_spec("torch") is not None
"""], env=env, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr  # the blocker blocks, and only what the box lacks
    return env


def _box_run(env, out, stages):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "justrl_megatron.bench.gpu_check", "--stages", stages,
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    print(f"gpu_check --stages {stages}: {time.monotonic() - t0:.1f} s")
    return proc, json.loads((out / "gpu_check.json").read_text())


def test_box_rehearsal_pytest_stage(box_env, tmp_path):
    """The kit's pytest stage collects tests/gpu only, imports nothing the box lacks, and passes with every GPU test
    skipped for want of CUDA; pytest.log holds the per-test timeout, every test's line and the durations."""
    proc, report = _box_run(box_env, tmp_path, "pytest")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    [stage] = report["stages"]
    assert stage["stage"] == "pytest" and stage["status"] == "done" and stage["ok"], stage
    assert report["complete"] and report["ok"] and (tmp_path / "gpu_check.md").exists()
    counts = stage["counts"]
    assert counts.get("skipped", 0) > 0 and set(counts) == {"skipped"}, stage  # no error, failure or deselection
    assert stage["skip_reasons"] == {"needs CUDA": counts["skipped"]}
    log = (tmp_path / "pytest.log").read_text()
    assert "tests/gpu" in log.splitlines()[0] and " tests " not in log.splitlines()[0]
    assert f"timeout: {stage['per_test_timeout_s']:.1f}s" in log  # pytest-timeout is on, as from the carried wheel
    assert log.count("tests/gpu/test_gpu_") >= counts["skipped"] and "slowest durations" in log


def test_box_rehearsal_probe_stage(box_env, tmp_path):
    """The probe runs where the box's modules are missing: it reports the versions (megatron-core found), asks compat
    about CUDA, and fails for the one reason this machine has, no CUDA device, with the report written."""
    proc, report = _box_run(box_env, tmp_path, "probe")
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    [stage] = report["stages"]
    assert stage["status"] == "done" and stage["ok"] is False
    assert stage["error"].startswith("no CUDA device visible to torch") and "Traceback" not in proc.stdout
    assert stage["cuda_available"] is False and stage["python"] == ".".join(map(str, sys.version_info[:3]))
    assert stage["megatron_core"][0].isdigit() and stage["torch"]
    assert stage["machine"]["gpu"] is None and stage["machine"]["git_commit"] == report["commit"]
    assert "| probe | NO |" in (tmp_path / "gpu_check.md").read_text()
