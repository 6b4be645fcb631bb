"""Same accuracy, on real held-out data: O0, O1 and O2 reach fp32's held-out accuracy.

A small convnet with batchnorm learns scikit-learn's handwritten digits (1,797 real 8x8
images that ship with scikit-learn; a fixed fifth held out, never trained on) with fixed seeds,
in fp32 without ampx and at each opt level; every level must end within one point of fp32's
held-out accuracy. One thread, a few seconds per configuration.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampx

pytest.importorskip("sklearn", reason="the digits ship with scikit-learn ([test] installs it)")

pytestmark = pytest.mark.kernel_backend

STEPS = 240
TOLERANCE = 0.01  # one point of accuracy


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 10),
    )


@functools.cache
def _data() -> tuple[list[tuple[torch.Tensor, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]:
    from ampx.examples.data import digits

    found = digits(batch=64, seed=1, image_size=8)
    return found.train, found.heldout[0]


def _train(opt_level: str | None, dtype: str = "bf16") -> float:
    """Held-out accuracy after `STEPS` steps (`opt_level` None: plain fp32, no ampx)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train, (images, labels) = _data()
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if opt_level is not None:
            model, optimizer = ampx.initialize(model, optimizer, opt_level=opt_level,
                                               dtype=dtype, verbosity=0)
        for step in range(STEPS):
            x, y = train[step % len(train)]
            loss = F.cross_entropy(model(x).float(), y)
            optimizer.zero_grad()
            if opt_level is None:
                loss.backward()
            else:
                with ampx.scale_loss(loss, optimizer) as scaled:
                    scaled.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            predicted = model(images).float().argmax(dim=1)
        return float((predicted == labels).float().mean())
    finally:
        torch.set_num_threads(threads)


@functools.cache
def _fp32() -> float:
    return _train(None)


@pytest.mark.parametrize(("opt_level", "dtype"), [("O0", "bf16"), ("O1", "bf16"),
                                                  ("O2", "bf16"), ("O2", "fp16")])
def test_held_out_accuracy_is_fp32s_within_one_point(opt_level: str, dtype: str) -> None:
    reference = _fp32()
    assert reference > 0.9  # it learned the task: the comparison means something
    accuracy = _train(opt_level, dtype)
    assert abs(accuracy - reference) <= TOLERANCE, (
        f"{opt_level} {dtype}: held-out accuracy {accuracy:.4f} vs fp32 {reference:.4f}")
