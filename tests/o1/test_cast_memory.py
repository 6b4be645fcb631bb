"""O1's weight-cast cache lets go of its half copies when `scale_loss` begins (before backward).

Backward keeps the casts it needs (saved tensors) and frees each once used; the cache holding
them as well kept every half copy of the weights alive through backward and the unscale.
`benchmarks/bench_memory.py` measures the effect on peak memory.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import ampx
from ampx.o1 import patch
from ampx.scaling import scaled_pass


def _grads(dtype: str, monkeypatch: pytest.MonkeyPatch | None) -> tuple[list[int], list]:
    if monkeypatch is not None:
        monkeypatch.setattr(scaled_pass, "_drop_weight_casts", lambda: None)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    amp = ampx.Amp("O1", dtype=dtype, verbosity=0)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    o1 = patch.active()
    assert o1 is not None
    sizes: list[int] = []
    try:
        loss = model(torch.randn(4, 8)).float().mean()
        sizes.append(len(o1.cache))  # filled by the forward
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
            sizes.append(len(o1.cache))
        return sizes, [p.grad.clone() for p in model.parameters()]
    finally:
        amp.restore()


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_cache_is_empty_once_backward_ran_and_grads_are_unchanged(
        dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes, grads = _grads(dtype, None)
    assert sizes == [4, 0]  # two weights, two biases
    kept_sizes, kept = _grads(dtype, monkeypatch)  # the cache kept until the exit, as before
    assert kept_sizes == [4, 4]
    for got, want in zip(grads, kept):
        assert torch.equal(got, want)


def test_half_weight_copy_is_freed_by_backward() -> None:
    model = nn.Linear(8, 8)
    amp = ampx.Amp("O1", dtype="bf16", verbosity=0)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    o1 = patch.active()
    assert o1 is not None
    try:
        loss = model(torch.randn(4, 8)).float().mean()
        (copy,) = [entry[-1] for table in o1.cache._tables.values() for entry in table.values()
                   if entry[0] is model.weight]
        ref = weakref.ref(copy)
        del copy
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
            gc.collect()
            assert ref() is None  # freed inside the block, before the unscale
    finally:
        amp.restore()
