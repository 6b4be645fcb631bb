"""Shared fixtures: every test leaves torch's namespace and ampx's global state as it found them."""

from __future__ import annotations

import os
import sys
import threading
import types

import pytest
import torch
from _shared import NAMESPACE_NAMES, snapshot

import ampx
from ampx import frontend
from ampx.o1 import patch


def pytest_report_header(config: pytest.Config) -> list[str]:
    from ampx import _ext

    return [
        f"ampx {ampx.__version__}, torch {torch.__version__}",
        f"ampx kernels: BACKEND={_ext.BACKEND} IMPORT_ERROR={_ext.IMPORT_ERROR!r} "
        f"(AMPX_DISABLE_EXT={os.environ.get('AMPX_DISABLE_EXT', '')!r})",
    ]


_MISSING = object()
_CACHES = {"__slotnames__"}  # copyreg caches it on the class at the first pickle

# Importing dynamo replaces torch.manual_seed (it wraps it once per process): do it before any
# snapshot so the pristine check below sees only what tests and ampx change.
import torch._dynamo  # noqa: E402,F401

_namespaces = snapshot


def _global_torch_state() -> dict[str, object]:
    return {
        "default dtype": torch.get_default_dtype(),
        "grad enabled": torch.is_grad_enabled(),
        "cpu autocast": torch.is_autocast_enabled("cpu"),
    }


def _hooks() -> dict[str, object]:
    """The interpreter's error hooks (pytest sets its own once, at configure).

    torch.distributed's init_process_group prefixes sys.excepthook with "[rank0]:" and
    destroy_process_group leaves it: a test that keeps it breaks pytest's own error report.
    """
    return {"sys.excepthook": sys.excepthook, "threading.excepthook": threading.excepthook,
            "sys.unraisablehook": sys.unraisablehook}


def _restore_hooks(before: dict[str, object]) -> list[str]:
    """Put back every hook changed since `before` (so the run goes on reporting normally)."""
    changed = [name for name, hook in _hooks().items() if hook is not before[name]]
    for name in changed:
        module, attr = name.split(".")
        setattr(sys if module == "sys" else threading, attr, before[name])
    return changed


@pytest.fixture(autouse=True, scope="module")
def _pristine_hooks_per_module():
    """The hooks again around each module: a module-scoped fixture may set one for all tests."""
    before = _hooks()
    yield
    changed = _restore_hooks(before)
    assert not changed, f"a module fixture left a global hook installed: {changed}"


@pytest.fixture(autouse=True)
def _pristine_torch():
    """Fail any test after which torch is not exactly as it was (after ampx.restore()).

    Runs outside `_clean_ampx_state` (autouse fixtures set up in definition order and tear down
    in reverse), so it sees torch after the session was restored: an attribute that restore
    did not put back, or one a test replaced and never undid, fails the test that left it.
    """
    before = _namespaces()
    state = _global_torch_state()
    hooks = _hooks()
    yield
    changed_hooks = _restore_hooks(hooks)
    assert not changed_hooks, f"test left a global hook installed: {changed_hooks}"
    ampx.restore()
    after = _namespaces()
    names = NAMESPACE_NAMES
    changed = [
        f"{ns}.{key}"
        for ns, old, new in zip(names, before, after)
        for key in sorted(set(old) | set(new))
        if old.get(key, _MISSING) is not new.get(key, _MISSING)
        and key not in _CACHES
        and not (key not in old and isinstance(new[key], types.ModuleType))  # lazy submodule
    ]
    assert not changed, f"test left torch changed: {changed[:10]}"
    assert _global_torch_state() == state, "test left torch's global state changed"


@pytest.fixture(autouse=True)
def _clean_ampx_state():
    """Restore O1 patches, forced options and user registrations after each test."""
    registry = dict(patch.PATCHES.user)
    yield
    ampx.restore()
    frontend.set_forced_options(None)
    patch.PATCHES.user.clear()
    patch.PATCHES.user.update(registry)


@pytest.fixture
def namespaces():
    """Snapshot of torch's patched namespaces, to compare after restore()."""
    return _namespaces


@pytest.fixture(params=["reference", "native"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each kernel backend in turn (native skips when the extension is not active)."""
    from ampx import _ext, _reference

    if request.param == "reference":
        monkeypatch.setattr(_ext, "_impl", lambda device: _reference)
    elif _ext._native_module() is None:
        pytest.skip(f"native kernels not active: {_ext.IMPORT_ERROR}")
    return request.param


@pytest.fixture(params=[torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def half_dtype(request: pytest.FixtureRequest) -> torch.dtype:
    """Both half-precision dtypes."""
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread is faster and immune to OpenMP spinning on a busy box.

    Tests that measure threading set their own count (tests/kernels/test_kernels.py).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
