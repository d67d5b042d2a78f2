"""Triton kernels on the CPU through Triton's interpreter (TRITON_INTERPRET=1), for tests and
the benchmarks' CPU smoke runs (triton is a dev dependency: pyproject.toml's `dev` extra).

`interpreted_module(name)` imports a fresh copy of a kernel module with the interpreter on, so a
CPU test process runs the module's @triton.jit kernels on CPU tensors without changing the
module the rest of the process imports (and without the environment variable staying set).

Triton 3.6's interpreter turns a loaded scalar into a one-element array and converts it with
int(array), which numpy 2.4 refuses ("only 0-dimensional arrays can be converted to Python
scalars"): any `range()` over a loaded bound fails. Upstream fixed it (triton-lang/triton#9172,
in 3.7); `fix_scalar_index` applies the same one-line change to 3.6's interpreter for the test
process, and nothing else of it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType
from typing import Any


def fix_scalar_index() -> None:
    """A loaded scalar's __index__ takes its one element (triton-lang/triton#9172)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "scalar_index_fixed", False):
        return

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.scalar_index_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


def interpreted_module(name: str, kernels: tuple[str, ...] = ()) -> ModuleType:
    """A fresh copy of module `name` whose kernels run in Triton's interpreter, and whose
    imports of the modules named in `kernels` (where its @triton.jit functions live) get
    interpreted copies of those too. ImportError where triton is not installed."""
    fix_scalar_index()
    alias = f"{name}__interpreted"
    if alias in sys.modules:
        return sys.modules[alias]
    copies = {dep: _copy(dep) for dep in kernels}
    saved = {dep: sys.modules.get(dep) for dep in kernels}
    try:
        sys.modules.update(copies)  # the copy of `name` imports these while it executes
        return _copy(name)
    finally:
        for dep, module in saved.items():
            if module is None:
                sys.modules.pop(dep, None)
            else:
                sys.modules[dep] = module


def _copy(name: str) -> ModuleType:
    """Module `name` executed again under an alias with the interpreter on."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ImportError(f"no module {name} to interpret")
    alias = f"{name}__interpreted"
    if alias in sys.modules:
        return sys.modules[alias]
    copy = importlib.util.spec_from_file_location(alias, spec.origin)
    if copy is None or copy.loader is None:
        raise ImportError(f"cannot load {spec.origin}")
    module = importlib.util.module_from_spec(copy)
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        sys.modules[alias] = module
        copy.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(alias, None)
        raise
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before
    return module
