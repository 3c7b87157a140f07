"""The CPU install is what README promises: everything imports, and no CUDA wheel came along."""

import subprocess
import sys


def test_stack_imports():
    code = "import justrl_megatron, megatron.core, vllm, transformers, datasets, hydra, wandb, pynvml; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_no_cuda_wheels():
    listing = subprocess.run([sys.executable, "-m", "pip", "list"], capture_output=True, text=True, check=True).stdout
    nvidia = [line.split()[0] for line in listing.splitlines() if "nvidia" in line.lower()]
    assert nvidia == ["nvidia-ml-py"]
    names = {line.split()[0].lower() for line in listing.splitlines()[2:] if line.strip()}
    assert not names & {"torchvision", "torchaudio", "torchcodec", "transformer-engine", "transformer_engine"}
    import torch

    assert torch.__version__.startswith("2.13.0") and not torch.version.cuda
