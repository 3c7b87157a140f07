"""compat.py: real megatron-core on CPU. Unit checks of each redirection, then TP2 / TP2+SP / PP2 parity vs TP1."""

import subprocess
import sys

import pytest
import torch

import justrl_megatron.compat as compat
from helpers import rank_verdicts, run_mp


def test_cuda_device_arguments_land_on_cpu():
    assert compat.apply() is True  # no CUDA on this machine: the redirections are active
    assert torch.empty(3, device="cuda").device.type == "cpu"
    assert torch.zeros(2, device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.ones(2, device=torch.cuda.current_device()).device.type == "cpu"
    t = torch.arange(4.0)
    assert t.cuda() is t
    assert t.to("cuda").device.type == "cpu" and t.to("cuda", torch.float64).dtype == torch.float64
    assert torch.empty(4, pin_memory=True).device.type == "cpu"


def test_type_names_and_streams():
    assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(1).type("torch.cuda.DoubleTensor").dtype == torch.float64
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.Event().record()


def test_model_parallel_rng_tracker_is_cpu_and_deterministic():
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", 123)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    with tracker.fork():
        b = torch.rand(3)
    assert torch.equal(before, torch.get_rng_state())  # forking leaves the default generator alone
    assert not torch.equal(a, b)  # the tracked state advances
    tracker.reset()
    tracker.add("model-parallel-rng", 123)
    with tracker.fork():
        assert torch.equal(torch.rand(3), a)  # same seed, same stream
    with pytest.raises(Exception, match="already exists"):
        tracker.add("other", 123)
    tensor_parallel.random.initialize_rng_tracker(force_reset=True)


def test_noop_when_cuda_is_present():
    """With CUDA reported present, apply() must leave torch and megatron untouched."""
    code = (
        "import torch; torch.cuda.is_available = lambda: True\n"
        "orig = torch.cuda.current_device\n"
        "import justrl_megatron.compat as c\n"
        "from megatron.core.tensor_parallel import random as r\n"
        "assert c.apply() is False\n"
        "assert torch.cuda.current_device is orig\n"
        "assert r.CudaRNGStatesTracker.add is not c._cpu_tracker_add\n"
        "assert torch.overrides._get_current_function_mode_stack() == []\n"
        "import megatron.core.jit as j\n"
        "assert j.jit_fuser is torch.compile\n"  # megatron's fusers stay on with CUDA
        "print('untouched')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "untouched" in out.stdout


def test_megatron_fusers_are_off_on_the_cpu_and_the_compiler_is_not_imported():
    """Redirection 7: megatron's torch.compile fusers are its own no-op on the CPU, set before any function is
    decorated, so a process that imports megatron never imports torch's compiler stack."""
    code = (
        "import sys, torch\n"
        "import justrl_megatron.compat\n"
        "import megatron.core.jit as j\n"
        "from megatron.core.transformer.utils import gelu_impl\n"
        "from megatron.core.models.gpt import GPTModel\n"
        "assert j.jit_fuser is j.noop_decorator\n"
        "assert type(gelu_impl).__name__ == 'function', type(gelu_impl)\n"  # not a compiled wrapper
        "assert 'torch._dynamo' not in sys.modules and 'torch._inductor' not in sys.modules\n"
        "print('off')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "off" in out.stdout


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    """One 2-process gloo job (torchrun) runs every layout; each rank writes its measurements."""
    out = tmp_path_factory.mktemp("compat_parity")
    run_mp("compat_parity.py", out, nproc=2, timeout=600)
    return rank_verdicts(out, 2)


@pytest.mark.slow  # a multi-rank or multi-launch fixture: tens of seconds (docs/testing.md)
@pytest.mark.parametrize("layout", ["tp2", "tp2_sp", "pp2"])
def test_layout_matches_tp1(parity, layout):
    last_stage_seen = False
    for rank_verdict in parity:
        v = rank_verdict[layout]
        assert v["grad_diff"] <= 1e-5, v
        assert v["grad_scale"] > 1e-3  # the gradients compared are not trivially zero
        assert v["gnorm"] == pytest.approx(v["ref_gnorm"], rel=1e-6), v
        if layout == "tp2_sp":
            assert v["sequence_parallel"] is True
        if "logit_diff" in v:  # logits live on the last pipeline stage
            last_stage_seen = True
            assert v["n_logits"] == 2
            assert v["logit_diff"] <= 1e-5, v
            assert v["loss_diff"] <= 1e-5, v
    assert last_stage_seen


def test_distributed_optimizer_matches_plain(parity):
    for rank_verdict in parity:
        v = rank_verdict["distopt"]
        assert v["gnorm"] == pytest.approx(v["ref_gnorm"], rel=1e-6)
        assert v["param_diff_after_step"] <= 1e-6
