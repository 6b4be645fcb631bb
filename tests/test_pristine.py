"""The autouse checks in conftest.py (torch and the error hooks left as found, kernel tests
marked, no child process left running), and every wait on a child bounded by a timeout."""

from __future__ import annotations

import ast
import shutil
import time
from pathlib import Path

import pytest
from _shared import KERNEL_CALLS

pytest_plugins = ["pytester"]

LEAKY = '''
import torch

def test_leaves_a_patch():
    torch.matmul = lambda *a: None

def test_clean():
    assert torch.matmul is not None
'''


def test_a_test_that_leaves_torch_patched_fails(pytester: pytest.Pytester) -> None:
    import torch

    original = torch.matmul
    shutil.copy(Path(__file__).with_name("conftest.py"), pytester.path / "conftest.py")
    pytester.makepyfile(test_leaky=LEAKY)
    try:
        result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    finally:
        torch.matmul = original
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*test left torch changed:*torch.matmul*"])


HOOKS = '''
import sys
import threading

import pytest


@pytest.fixture(scope="module")
def rank_prefix():
    sys.excepthook = lambda *args: None  # as torch's init_process_group does, never undone
    yield


def test_leaves_a_thread_hook():
    threading.excepthook = lambda args: None

def test_hooks_are_back():
    assert sys.excepthook is sys.__excepthook__ or sys.excepthook.__module__ != __name__
    assert threading.excepthook.__module__ != __name__

def test_module_fixture_leaves_the_excepthook(rank_prefix):
    pass
'''


def test_a_test_or_module_fixture_that_leaves_a_hook_fails(pytester: pytest.Pytester) -> None:
    import sys
    import threading

    hooks = (sys.excepthook, threading.excepthook)
    shutil.copy(Path(__file__).with_name("conftest.py"), pytester.path / "conftest.py")
    pytester.makepyfile(test_hooks=HOOKS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, errors=2)
    result.stdout.fnmatch_lines(["*test left a global hook installed: ?'threading.excepthook'?"])
    result.stdout.fnmatch_lines(
        ["*a module fixture left a global hook installed: ?'sys.excepthook'?"])
    assert (sys.excepthook, threading.excepthook) == hooks  # the checks put them back


KERNELS = '''
import pytest
import torch

from ampx import _ext


def test_unmarked_kernel_call():
    _ext.l2norm([torch.ones(3)])

def test_reads_the_backend():
    assert _ext.BACKEND in ("native", "reference")

@pytest.mark.kernel_backend
def test_marked_kernel_call():
    _ext.l2norm([torch.ones(3)])

def test_backend_fixture(backend):
    _ext.l2norm([torch.ones(3)])

def test_no_kernels():
    assert torch.ones(3).sum() == 3
'''


def test_a_kernel_call_without_the_kernel_backend_mark_fails(pytester: pytest.Pytester) -> None:
    """The reference-kernel run selects `-m kernel_backend`; an unmarked kernel test would
    silently run on one backend only, so the first run fails it."""
    shutil.copy(Path(__file__).with_name("conftest.py"), pytester.path / "conftest.py")
    pytester.makeini("[pytest]\nmarkers =\n    kernel_backend: runs on both kernel backends\n")
    # a name no test module of the suite has: under xdist the worker may have imported
    # tests/kernels/test_kernels.py already, and pytest refuses a second `test_kernels`
    pytester.makepyfile(test_unmarked_kernel_calls=KERNELS)
    try:
        _check_the_inner_runs(pytester)
    finally:
        KERNEL_CALLS["count"] = 0  # the inner runs' kernel calls are not this test's own


def _check_the_inner_runs(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rs")
    outcomes = result.parseoutcomes()
    assert outcomes["errors"] == 2 and outcomes.get("failed", 0) == 0
    # every call passes; the two unmarked ones error in teardown (backend: two params)
    assert outcomes["passed"] + outcomes.get("skipped", 0) == 6
    result.stdout.fnmatch_lines([
        "*test_unmarked_kernel_call called ampx's kernels * not marked kernel_backend*",
        "*test_reads_the_backend called ampx's kernels * not marked kernel_backend*"],
        consecutive=False)
    selected = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-m", "kernel_backend")
    assert selected.parseoutcomes()["deselected"] == 3


CHILDREN = '''
import os
import subprocess
import sys
import time

CHILD = """
import signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C cannot stop it
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(grandchild.pid, flush=True)
time.sleep(120)
"""

LEFT = []  # kept referenced: only the check may end it

def test_waits_too_briefly_and_leaves_the_child():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    LEFT.append(proc)
    grandchild = proc.stdout.readline().strip()
    with open(os.environ["PIDS"], "w") as f:
        f.write(f"{proc.pid} {grandchild}")
    proc.stdout.close()

def test_waits_for_its_child():
    subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=60)
'''


def test_a_test_that_leaves_a_child_running_fails_and_the_child_is_killed(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import os

    shutil.copy(Path(__file__).with_name("conftest.py"), pytester.path / "conftest.py")
    pytester.makepyfile(test_children=CHILDREN)
    monkeypatch.setenv("PIDS", str(tmp_path / "pids"))
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*test left child processes running (killed):*"])
    for pid in map(int, (tmp_path / "pids").read_text().split()):  # the grandchild too
        for _ in range(2400):  # up to 120 s on a loaded machine: a bound, not a wait
            try:
                os.kill(pid, 0)  # a killed grandchild is reaped by init: gone soon after
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"process {pid} still runs")


_WAITS = {"run", "check_output", "check_call", "call", "communicate", "wait"}


def test_every_wait_on_a_child_process_has_a_timeout() -> None:
    """A child that hangs (or ignores the SIGINT a test sends) fails its test within minutes
    instead of stalling the run: `subprocess.run(...)`, `proc.communicate()` and `proc.wait()`
    in tests/ pass `timeout`."""
    unbounded = []
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in _WAITS):
                continue
            owner = ast.unparse(node.func.value)
            waits_on_a_child = owner == "subprocess" or (
                node.func.attr in {"communicate", "wait"} and "proc" in owner)
            bounded = any(k.arg == "timeout" for k in node.keywords) or (
                node.func.attr == "wait" and node.args)
            if waits_on_a_child and not bounded:
                unbounded.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not unbounded, "waits without a timeout:\n" + "\n".join(unbounded)
