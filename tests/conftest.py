"""Shared fixtures: every test leaves torch's namespace and ampx's global state as it found them."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import types
import weakref
from pathlib import Path

import pytest
import torch
from _shared import KERNEL_CALLS, NAMESPACE_NAMES, snapshot

import ampx
from ampx import frontend
from ampx.o1 import patch


def pytest_report_header(config: pytest.Config) -> list[str]:
    from ampx import _ext

    calls = KERNEL_CALLS["count"]  # a pytester run inside a test reports too: not the test's
    header = [
        f"ampx {ampx.__version__}, torch {torch.__version__}",
        f"ampx kernels: BACKEND={_ext.BACKEND} IMPORT_ERROR={_ext.IMPORT_ERROR!r} "
        f"(AMPX_DISABLE_EXT={os.environ.get('AMPX_DISABLE_EXT', '')!r})",
    ]
    KERNEL_CALLS["count"] = calls
    return header


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


# -- which tests run twice: once per kernel backend ----------------------------------------------
#
# The README's test command runs the whole suite on the native kernels, then only the tests
# marked `kernel_backend` again under AMPX_DISABLE_EXT=1 (the pure-torch reference kernels).
# A test is marked when it uses the `backend` fixture, carries the mark itself, or lives under
# one of KERNEL_BACKEND_PATHS (relative to tests/: the files whose tests call ampx's kernels
# in-process) and is not one of CHILD_PROCESS_ONLY (tests there whose training runs only in
# child processes: their kernels are the ones the in-process tests cover on both backends).
# `_kernel_calls_are_marked` below fails any unmarked test that reaches the kernel dispatcher,
# so a new kernel test, or a wrong entry below, cannot silently run on one backend only.
KERNEL_MARK = "kernel_backend"
KERNEL_BACKEND_PATHS = (
    "kernels/", "scaling/", "o1/", "overflow/", "fairseq_compat/", "apex_compat/", "options/",
    "test_initialize.py", "test_object_api.py", "test_model.py", "test_model_dtype.py",
    "test_model_restore.py",
    "cli/test_selftest.py", "cli/test_run_without_initialize.py",
    "integrations/test_accelerate.py", "integrations/test_lightning.py",
    "integrations/test_hf_trainer.py",
)
CHILD_PROCESS_ONLY = (
    "apex_compat/test_apex_alias.py::test_run_does_not_shadow_real_apex_on_sys_path",
    "apex_compat/test_apex_companions.py::test_legacy_script_runs_with_every_companion",
    "apex_compat/test_apex_companions.py::test_two_gloo_ranks_sync_batch_norm_and_ddp",
    "apex_compat/test_apex_l0.py::test_apex_fp16_checkpoint_resumes_under_dtype_bf16",
    "overflow/test_overflow_distributed.py::",  # its module fixture launches the two ranks
    "test_object_api.py::test_package_names_load_lazily_in_a_fresh_process",
    "integrations/test_lightning.py::test_ddp_two_cpu_processes",
    "integrations/test_lightning.py::test_fabric_ddp_",
    "integrations/test_lightning.py::test_importing_ampx_imports_no_framework",
)
_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        try:
            where = Path(item.path).resolve().relative_to(_TESTS).as_posix()
        except ValueError:
            where = ""
        test = f"{where}::{item.name}"
        if "backend" in getattr(item, "fixturenames", ()) or (
                where.startswith(KERNEL_BACKEND_PATHS) and not test.startswith(
                    CHILD_PROCESS_ONLY)):
            item.add_marker(KERNEL_MARK)


def _counted(function):  # type: ignore[no-untyped-def]
    @functools.wraps(function)
    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        KERNEL_CALLS["count"] += 1
        return function(*args, **kwargs)

    counting.__wrapped_by_conftest__ = function  # type: ignore[attr-defined]
    return counting


# Every kernel call and every look at the backend (BACKEND, IMPORT_ERROR, describe(), the
# native module) goes through one of these two; counting them costs a call per kernel launch.
_DISPATCH = ("_impl", "_ensure_loaded")


# -- no test leaves a child process running ------------------------------------------------------
#
# A test that waits on a child (or sends it a signal) has a timeout of its own; when it expires
# and the test fails, the child, or a grandchild that ignores SIGINT, must not go on running
# (holding the run's output open until its own, much longer, timeout): the check below kills
# every child a test started that is still running, with its descendants, and fails the test.
_children: weakref.WeakSet[subprocess.Popen] = weakref.WeakSet()
_popen_init = subprocess.Popen.__init__


def _tracked_init(self: subprocess.Popen, *args: object, **kwargs: object) -> None:
    _popen_init(self, *args, **kwargs)  # type: ignore[arg-type]
    _children.add(self)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc; elsewhere none are found)."""
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = kids.get(todo.pop(), [])
        found += below
        todo += below
    return found


def _kill_left_children() -> list[str]:
    left = [proc for proc in list(_children) if proc.poll() is None]
    for proc in left:
        for pid in [*_descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        proc.wait(timeout=60)
    _children.clear()
    return [str(proc.args)[:200] for proc in left]


def pytest_configure(config: pytest.Config) -> None:
    from ampx import _ext

    subprocess.Popen.__init__ = _tracked_init  # type: ignore[method-assign]

    for name in _DISPATCH:
        setattr(_ext, name, _counted(getattr(_ext, name)))
    # Load the backend now, in the run's own environment: a pytester run inside a test sets
    # HOME elsewhere, and a first load there would miss the per-user build cache for the
    # rest of this process (an xdist worker may run such a test first).
    _ext._ensure_loaded()


def pytest_unconfigure(config: pytest.Config) -> None:
    from ampx import _ext

    subprocess.Popen.__init__ = _popen_init  # type: ignore[method-assign]

    for name in _DISPATCH:
        setattr(_ext, name, getattr(_ext, name).__wrapped_by_conftest__)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread is faster and immune to OpenMP spinning on a busy box.

    Tests that measure threading set their own count (tests/kernels/test_kernels.py).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _kernel_calls_are_marked(request: pytest.FixtureRequest):
    """Fail a test that reached ampx's kernel dispatcher without the `kernel_backend` mark.

    Defined last: it tears down first, before the other fixtures' ampx.restore().
    """
    KERNEL_CALLS["count"] = 0
    yield
    calls = KERNEL_CALLS["count"]
    if calls and request.node.get_closest_marker(KERNEL_MARK) is None:
        pytest.fail(
            f"{request.node.nodeid} called ampx's kernels ({calls} dispatches through "
            "ampx._ext) but is not marked kernel_backend, so the reference-kernel run "
            "(AMPX_DISABLE_EXT=1 pytest -m kernel_backend) would skip it: add "
            "@pytest.mark.kernel_backend, or its file to KERNEL_BACKEND_PATHS in "
            "tests/conftest.py", pytrace=False)


@pytest.fixture(autouse=True)
def _no_child_left():
    """Fail a test that leaves a child process running (killed here, with its descendants)."""
    _children.clear()
    yield
    left = _kill_left_children()
    assert not left, f"test left child processes running (killed): {left}"
