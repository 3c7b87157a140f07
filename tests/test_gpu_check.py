"""tools/gpu_check.sh and bench/gpu_check.py on the CPU: the dry run (CI has no .whl and no network), the bundle
check on real (tiny) wheel files, and the token-budget search against a real threshold."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)
from justrl_megatron.bench.gpu_check import (
    ROOT,
    check_bundle,
    dry_run,
    markdown,
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
    for stage in ("probe", "pytest", "train", "budget"):
        assert f"  {stage}" in proc.stdout
    # the 1.5B update on one 80 GB H100 needs full recompute (without it one 16K sample does not fit)
    assert "memory plan: recompute=full, 16384 tokens/micro-batch" in proc.stdout


def test_unknown_arguments_are_refused():
    proc = _run("--bogus")
    assert proc.returncode == 2 and "usage" in proc.stderr


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


def test_the_bundle_list_pins_megatron_core_019():
    wheels = required_wheels()
    assert wheels["megatron_core"].startswith("0.19.")
    assert {"hydra_core", "omegaconf", "antlr4_python3_runtime"} <= set(wheels)


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
    assert best == threshold // 128 * 128 == 49_920
    assert [n for n, _ in log] == trials and all(n % 128 == 0 for n in trials)
    assert trials[:3] == [16_384, 20_480, 25_600]  # upward by 1.25 first
    assert search_budget(fits, 80_000)[0] == 49_920  # a start that does not fit searches downward
    assert search_budget(lambda n: False, 4096)[0] == 0
    assert search_budget(fits, 1024, limit=10_000)[0] == 9_984  # never beyond the limit


def test_budget_search_stops_at_the_deadline_with_the_best_so_far():
    now = [0.0]

    def clock():
        now[0] += 1.0  # one second per look at the clock
        return now[0]

    best, log = search_budget(lambda n: n <= 10**6, 1024, deadline=4.5, clock=clock)
    assert len(log) == 4 and best == log[-1][0]


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
