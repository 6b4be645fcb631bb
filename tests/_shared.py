"""What many tests share: the snapshot of torch's patched namespaces, and the small models.

tests/ is on sys.path (pytest puts the rootdir conftest's folder there), so any test imports
these with `from _shared import ...`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

NAMESPACES = (torch, torch.Tensor, torch.nn.functional, torch._VF, torch.nn.RNNBase)
NAMESPACE_NAMES = ("torch", "torch.Tensor", "torch.nn.functional", "torch._VF",
                   "torch.nn.RNNBase")

# Calls into ampx's kernel dispatcher during the current test (conftest.py counts them; here so
# that a pytester run of a copy of conftest.py inside a test counts into the same place).
KERNEL_CALLS = {"count": 0}


def snapshot() -> list[dict[str, Any]]:
    """The attributes of every namespace O1 patches, as they are now."""
    return [dict(vars(ns)) for ns in NAMESPACES]


def same(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> bool:
    """Whether two snapshots hold the very same objects under the very same names."""
    return all(a.keys() == b.keys() and all(a[k] is b[k] for k in a)
               for a, b in zip(before, after))


def mlp(bn: bool = False) -> nn.Module:
    """Linear(8, 16) [BatchNorm1d] ReLU Linear(16, 4): the scaling tests' model."""
    layers: list[nn.Module] = [nn.Linear(8, 16)]
    if bn:
        layers.append(nn.BatchNorm1d(16))
    layers += [nn.ReLU(), nn.Linear(16, 4)]
    return nn.Sequential(*layers)


def batch(n: int = 32, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (n, 8) and targets (n, 4) for `mlp`, from their own generator."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


@pytest.fixture(autouse=True)
def fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps one process-wide state; each test makes its own Accelerator (a
    module that imports this fixture gets it for every test)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
