"""The CPU install is what README promises: everything imports, and no CUDA wheel came along.

Inside a GPU image (a CUDA device present) CUDA wheels are expected and vLLM may be absent (the lent GPU box has
none): those checks say so by skipping, while the imports the trainer needs are still asserted."""

import importlib.util
import subprocess
import sys

import pytest

from justrl_megatron import compat


def test_stack_imports():
    modules = ["justrl_megatron", "megatron.core", "transformers", "datasets", "hydra", "wandb", "pynvml", "vllm"]
    if compat.cuda_available() and importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vllm (a GPU image without it; the CPU install must have it)")
    code = f"import {', '.join(modules)}; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.skipif(compat.cuda_available(), reason="a CUDA device is present: CUDA wheels are expected here "
                                                    "(this checks the CPU install)")
def test_no_cuda_wheels():
    listing = subprocess.run([sys.executable, "-m", "pip", "list"], capture_output=True, text=True, check=True).stdout
    nvidia = [line.split()[0] for line in listing.splitlines() if "nvidia" in line.lower()]
    assert nvidia == ["nvidia-ml-py"]
    names = {line.split()[0].lower() for line in listing.splitlines()[2:] if line.strip()}
    assert not names & {"torchvision", "torchaudio", "torchcodec", "transformer-engine", "transformer_engine"}
    import torch

    assert torch.__version__.startswith("2.13.0") and not torch.version.cuda


def test_the_stack_is_compiled_to_bytecode():
    """Every process of the suite imports torch, megatron-core, transformers and vLLM: without their bytecode (uv
    installs none; PYTHONDONTWRITEBYTECODE stops Python from writing it) each start compiles them from source, which
    doubles a test process's start-up (tools/setup_env.sh, step 6)."""
    from pathlib import Path

    missing = {}
    for package in ("torch", "megatron", "transformers", "vllm"):
        spec = importlib.util.find_spec(package)
        if spec is None:
            continue  # vLLM is absent from a GPU image without it (test_stack_imports says so)
        root = Path(next(iter(spec.submodule_search_locations)))
        sources = list(root.rglob("*.py"))
        compiled = [p for p in sources if Path(importlib.util.cache_from_source(str(p))).exists()]
        if len(compiled) < 0.95 * len(sources):
            missing[package] = f"{len(sources) - len(compiled)} of {len(sources)} modules without bytecode"
    assert not missing, f"{missing}: run tools/setup_env.sh (it compiles them)"
