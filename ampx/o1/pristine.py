"""Torch's compiler imported during an O1 session sees torch's originals, in its thread only.

Dynamo, inductor and the jvp decompositions capture torch functions by identity when their
modules are imported (dynamo's rule map, inductor's extern kernels, TorchScript'd code). O1
does not import them up front (about 70 MiB and seconds); while its patches are installed,
`ImportHook` (first on `sys.meta_path`) executes each of those modules in a *pristine view*:
the importing thread reads the originals from the patched namespaces, every other thread keeps
reading the session's wrappers. Nothing is swapped back into the namespaces, which all threads
share:

- a patched module (`torch`, `torch.nn.functional`, `torch._VF`) gets, while a view is open, a
  subclass of its module type whose `__getattribute__` answers the viewing thread with the
  original (its `__dict__` keeps the wrappers, so the module's own functions are unchanged);
- a patched class attribute (`torch.Tensor.softmax`, `__matmul__`...) becomes, while a view is
  open, a descriptor that binds the original for the viewing thread and the wrapper for others.

Views and session changes exclude each other (`changing_patches`), so a view never sees a
half-installed patch set and a patch set never records a view's descriptor as an original.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import logging
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["ImportHook", "captures_at_import", "changing_patches", "pristine_view", "view_open"]

logger = logging.getLogger("ampx")

# Modules that capture torch functions by identity when imported (with whatever they import).
_CAPTURING = ("torch._dynamo", "torch._inductor", "torch._decomp.decompositions_for_jvp")


def captures_at_import(name: str) -> bool:
    """Whether module `name` belongs to torch's compiler, which captures torch functions."""
    return any(name == root or name.startswith(root + ".") for root in _CAPTURING)


class _Thread(threading.local):
    def __init__(self) -> None:
        self.depth = 0  # pristine views open in this thread (nested imports)


_THREAD = _Thread()
_COND = threading.Condition()


class _Views:
    def __init__(self) -> None:
        self.viewers = 0  # threads with a view open
        self.changer: int | None = None  # the thread changing the patches, if any
        self.undo: list[Callable[[], None]] = []  # closes the open view
        self.modules: dict[int, dict[str, Any]] = {}  # id(module) -> name -> original


_State = _Views()  # guarded by _COND


def view_open() -> bool:
    """Whether any thread has a pristine view open now."""
    return _State.viewers > 0


@contextlib.contextmanager
def changing_patches() -> Iterator[None]:
    """Held while a session installs or removes patches: waits for open views to close."""
    me = threading.get_ident()
    with _COND:
        while (_State.viewers and not _THREAD.depth) or _State.changer not in (None, me):
            _COND.wait()
        outer = _State.changer is None
        _State.changer = me
    try:
        yield
    finally:
        with _COND:
            if outer:
                _State.changer = None
            _COND.notify_all()


@contextlib.contextmanager
def pristine_view(originals: Callable[[], list[tuple[Any, str, Any]]]) -> Iterator[None]:
    """Within: this thread reads each (owner, name)'s original value; other threads do not."""
    me = threading.get_ident()
    with _COND:
        while _State.changer not in (None, me):
            _COND.wait()
        if not _State.viewers:
            try:
                _open(originals())
            except BaseException:
                _close()
                raise
        if not _THREAD.depth:
            _State.viewers += 1
        _THREAD.depth += 1
    try:
        yield
    finally:
        with _COND:
            _THREAD.depth -= 1
            if not _THREAD.depth:
                _State.viewers -= 1
            if not _State.viewers:
                _close()
            _COND.notify_all()


def _open(originals: list[tuple[Any, str, Any]]) -> None:
    for owner, name, original in originals:
        if isinstance(owner, types.ModuleType):
            table = _State.modules.get(id(owner))
            if table is None:
                if not _view_module(owner):
                    continue
                table = _State.modules[id(owner)] = {}
            table[name] = original
        elif isinstance(owner, type) and name in vars(owner):
            current = vars(owner)[name]
            kind = _DataView if hasattr(type(current), "__set__") else _View
            view = kind(current, original)
            setattr(owner, name, view)
            _State.undo.append(functools.partial(_put_back, owner, name, view, current))


def _close() -> None:
    undo, _State.undo = _State.undo, []
    for step in reversed(undo):
        step()
    _State.modules.clear()


def _put_back(owner: type, name: str, view: Any, current: Any) -> None:
    if vars(owner).get(name) is view:
        setattr(owner, name, current)


_VIEWED_TYPES: dict[type, type] = {}


def _view_module(module: types.ModuleType) -> bool:
    base = type(module)
    viewed = _VIEWED_TYPES.get(base)
    if viewed is None:
        viewed = _VIEWED_TYPES[base] = _viewed_type(base)
    try:
        module.__class__ = viewed
    except TypeError:  # a module type of a C extension: left as it is
        return False

    def undo() -> None:
        if type(module) is viewed:
            module.__class__ = base

    _State.undo.append(undo)
    return True


def _viewed_type(base: type) -> type:
    lookup: Any = base.__getattribute__

    def __getattribute__(self: Any, name: str) -> Any:  # noqa: N807
        if _THREAD.depth:
            table = _State.modules.get(id(self))
            if table is not None and name in table:
                return table[name]
        return lookup(self, name)

    return type(base.__name__, (base,), {"__getattribute__": __getattribute__,
                                         "__module__": base.__module__})


class _View:
    """A patched class attribute while a view is open: the original for the viewing thread."""

    __slots__ = ("original", "patched")

    def __init__(self, patched: Any, original: Any) -> None:
        self.patched, self.original = patched, original

    def _value(self) -> Any:
        return self.original if _THREAD.depth else self.patched

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        value = self._value()
        get = getattr(type(value), "__get__", None)
        return value if get is None else get(value, instance, owner)


class _DataView(_View):
    """`_View` of a data descriptor (a property such as `Tensor.data`)."""

    __slots__ = ()

    def __set__(self, instance: Any, value: Any) -> None:
        self._value().__set__(instance, value)

    def __delete__(self, instance: Any) -> None:
        self._value().__delete__(instance)


class ImportHook(importlib.abc.MetaPathFinder):
    """On `sys.meta_path` while O1 patches are installed: torch's compiler modules execute in
    a pristine view, and `imported()` runs (in it) when a thread's outermost one is done."""

    def __init__(self, originals: Callable[[], list[tuple[Any, str, Any]]],
                 imported: Callable[[], None]) -> None:
        self.originals = originals
        self.imported = imported

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if not captures_at_import(name):
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                if hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, self)
                return spec
        return None

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def remove(self) -> None:
        while self in sys.meta_path:
            sys.meta_path.remove(self)


class _Loader(importlib.abc.Loader):
    """The module's own loader, executing it in a pristine view."""

    def __init__(self, loader: Any, hook: ImportHook) -> None:
        self.loader, self.hook = loader, hook

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = self.loader  # the module keeps no trace of this wrapper
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        with pristine_view(self.hook.originals):
            self.loader.exec_module(module)
            if _THREAD.depth == 1:  # this thread's outermost compiler import is done
                try:
                    self.hook.imported()
                except Exception:  # the module itself imported fine: keep it
                    logger.warning("ampx: preparing torch's compiler for O1 failed",
                                   exc_info=True)
