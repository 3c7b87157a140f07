"""Run a function on a library module as soon as it is first imported, before any other module can use it.

    after_import("megatron.core.jit", lambda jit: jit.disable_jit_fuser())

For a library setting that takes effect only at import time (a decorator applied while other modules load) or a
class that is costly to import where it is not needed: the hook costs nothing until the module is imported, and the
module is found and executed as usual (the path finder's spec), the function running right after its body. A module
already imported gets the function at once.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Callable

_AFTER: dict[str, list[Callable]] = {}


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Finds the hooked modules as the path finder would, and runs their functions after their body."""

    def find_spec(self, name, path, target=None):
        if name not in _AFTER:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_hooks(module):
            exec_module(module)
            for fn in _AFTER.pop(name, []):
                fn(module)

        spec.loader.exec_module = exec_then_hooks
        return spec


_FINDER = _AfterImportFinder()


def after_import(name: str, fn: Callable) -> None:
    """Call `fn(module)` once module `name` has been imported: now if it has been, else right after its import."""
    if name in sys.modules:
        fn(sys.modules[name])
        return
    _AFTER.setdefault(name, []).append(fn)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
