"""The autouse pristine-torch check in conftest.py fails a test that leaves torch changed."""

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
