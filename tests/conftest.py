"""Shared fixtures: every test leaves torch's namespace and ampx's global state as it found them."""

from __future__ import annotations

import os

import pytest
import torch

import ampx
from ampx import frontend, patch


def pytest_report_header(config: pytest.Config) -> list[str]:
    from ampx import _ext

    return [
        f"ampx {ampx.__version__}, torch {torch.__version__}",
        f"ampx kernels: BACKEND={_ext.BACKEND} IMPORT_ERROR={_ext.IMPORT_ERROR!r} "
        f"(AMPX_DISABLE_EXT={os.environ.get('AMPX_DISABLE_EXT', '')!r})",
    ]


def _namespaces() -> tuple[dict, ...]:
    return (dict(vars(torch)), dict(vars(torch.Tensor)), dict(vars(torch.nn.functional)),
            dict(vars(torch._VF)))


@pytest.fixture(autouse=True)
def _clean_ampx_state():
    """Restore O1 patches, forced options and user registrations after each test."""
    registry = dict(patch._USER_REGISTRY)
    yield
    ampx.restore()
    frontend.set_forced_options(None)
    patch._USER_REGISTRY.clear()
    patch._USER_REGISTRY.update(registry)


@pytest.fixture
def namespaces():
    """Snapshot of torch's patched namespaces, to compare after restore()."""
    return _namespaces


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

    Tests that measure threading set their own count (tests/test_kernels.py).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
