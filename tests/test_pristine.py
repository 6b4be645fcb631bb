"""The autouse pristine checks in conftest.py fail a test that leaves torch or a hook changed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

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
