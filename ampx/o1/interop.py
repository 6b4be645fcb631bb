"""O1's wrappers beside torch's other tools: pickling, TorchScript and torch.fx.

A patched function must behave like the function it replaces wherever torch or the standard
library looks at it rather than calls it:

- pickle and deepcopy: a wrapper pickles by reference, as a function does, under the name
  it is installed at (`name_as_installed`; the native wrapper's `reduce_like` falls back to
  the original's own reduction once the session is gone), and copy/deepcopy return it
  itself (functions are atomic for `copy`; wrappers.py gives the native type those methods).
- `torch.jit.script`: the native wrapper is a callable object, which TorchScript calls
  back in Python (a `prim::PythonOp`), so the casts apply at run time; a closure can be
  neither compiled nor called back, so it refuses with a clear error (`mark_scriptable`).
- `torch.fx.symbolic_trace`: tracing passes `Proxy` objects, which carry no dtype to decide a
  cast on, so the wrapper records one `call_patched(name, ...)` node instead of the original
  op: the graph module calls whatever the patched name holds when it runs (the O1 wrapper
  while the session is live, the original after), and so returns what the eager model does.
"""

from __future__ import annotations

import operator
import pickle
import sys
from typing import Any, Callable

import torch
from torch.fx import _symbolic_trace as fx_state

__all__ = ["call_patched", "fx_record", "fx_state", "installed_name", "mark_scriptable",
           "name_as_installed", "reduce_like"]


# -- pickle and deepcopy ----------------------------------------------------------------------

_MISS = object()


def _by_name(module: str, qualname: str) -> Any:
    """What `module.qualname` holds now (the lookup pickle's `find_class` makes), or a miss."""
    owner: Any = sys.modules.get(module)
    for part in qualname.split("."):
        owner = getattr(owner, part, _MISS)
        if owner is _MISS:
            break
    return owner


def installed_name(label: str) -> tuple[str, str] | None:
    """`label` ("torch.nn.functional.gelu") as (module, qualname), or None if no module has it."""
    parts = label.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        if module in sys.modules:
            qualname = ".".join(parts[i:])
            return (module, qualname) if _by_name(module, qualname) is not _MISS else None
    return None


def name_as_installed(wrapper: Any, label: str) -> None:
    """Name `wrapper` where it is installed ("torch.matmul"), so pickle finds it there.

    pickle saves a function by its global name (`__module__`, `__qualname__`) and checks that
    the name holds that very object; the original's name ("torch._C._nn.gelu" for `F.gelu`,
    "_VariableFunctionsClass.matmul" for `torch.matmul`) does not hold the wrapper.
    """
    where = installed_name(label)
    if where is not None:
        wrapper.__module__, wrapper.__qualname__ = where


def reduce_like(original: Callable[..., Any], wrapper: Any, protocol: int) -> Any:
    """The native wrapper's `__reduce_ex__`: pickled by reference, as a function is.

    While its installed name holds it, by that name (unpickling gives what the name holds
    then: the wrapper in this session, the original in a process without O1). Once the
    session is gone, as the original pickles: a method of a class (`torch.matmul`,
    `Tensor.float`) by `getattr(owner, name)`, a function by its global name (inside
    `getitem((original,), 0)`, since pickle would look the wrapper's name up).
    """
    module = getattr(wrapper, "__module__", None)
    qualname = getattr(wrapper, "__qualname__", None)
    if module and qualname and _by_name(module, qualname) is wrapper:
        return qualname
    try:
        reduced = original.__reduce_ex__(protocol)
    except TypeError:  # a Python function: copyreg refuses it, pickle saves it by name
        reduced = None
    if isinstance(reduced, tuple):
        return reduced
    own_module = getattr(original, "__module__", None)
    own_name = getattr(original, "__qualname__", None)
    if own_module and own_name and _by_name(own_module, own_name) is original:
        return operator.getitem, ((original,), 0)
    raise pickle.PicklingError(
        f"ampx: cannot pickle the O1 wrapper of {own_module}.{own_name}: neither "
        f"{module}.{qualname} nor {own_module}.{own_name} holds it or its original")


# -- TorchScript ------------------------------------------------------------------------------

def mark_scriptable(closure: Callable[..., Any], original: Callable[..., Any]) -> None:
    """Make `torch.jit.script` refuse `closure` with a clear error.

    TorchScript compiles a Python function from its source (the closure's would lose the
    casts: `inspect` unwraps it to the original's) or, marked ignored, calls it back, reading
    its parameters from the unwrapped original (a builtin has none; a Python function's
    defaults are lost). The native wrapper, a callable object, is called back correctly.
    """
    name = getattr(original, "__name__", repr(original))

    def refuse() -> Any:
        raise RuntimeError(
            f"ampx: torch.jit.script cannot compile O1's Python wrapper of {name}: TorchScript "
            "can neither compile a closure nor call it back. Build the native extension "
            "(`ampx build-ext`; TorchScript calls its wrappers back, with O1's casts), or "
            "script the model outside O1 (before ampx.initialize or after restore(); the "
            "scripted graph then holds no casts).")

    closure.__prepare_scriptable__ = refuse  # type: ignore[attr-defined]


# -- torch.fx ---------------------------------------------------------------------------------

def _first_proxy(values: Any) -> torch.fx.Proxy | None:
    for v in values:
        if isinstance(v, torch.fx.Proxy):
            return v
        if isinstance(v, (list, tuple)):
            found = _first_proxy(v)
        elif isinstance(v, dict):
            found = _first_proxy(v.values())
        else:
            continue
        if found is not None:
            return found
    return None


_RESOLVED: dict[str, tuple[Any, str]] = {}


def call_patched(label: str, *args: Any, **kwargs: Any) -> Any:
    """Call what the patched name `label` holds now (what a traced O1 call records)."""
    where = _RESOLVED.get(label)
    if where is None:
        found = installed_name(label)
        if found is None:
            raise RuntimeError(f"ampx: {label} no longer names a function")
        module, qualname = found
        owner_qualname, _, attr = qualname.rpartition(".")
        owner = _by_name(module, owner_qualname) if owner_qualname else sys.modules[module]
        where = _RESOLVED[label] = (owner, attr)
    return getattr(where[0], where[1])(*args, **kwargs)


def fx_record(label: str, args: tuple, kwargs: dict) -> Any:
    """Under `symbolic_trace`: a `call_patched` node for a call with a Proxy among its
    arguments (None when there is none, or when `label` is not a name the graph can call)."""
    proxy = _first_proxy(args)
    if proxy is None and kwargs:
        proxy = _first_proxy(kwargs.values())
    if proxy is None or installed_name(label) is None:
        return None
    return proxy.tracer.create_proxy("call_function", call_patched, (label, *args), kwargs,
                                     name=label.rpartition(".")[2])
