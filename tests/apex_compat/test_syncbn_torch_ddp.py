"""apex's SyncBatchNorm under torch's own DDP on CPU, as SwAV runs it (issue 33, item 5).

SwAV converts its model with ``apex.parallel.convert_syncbn_model(model, process_group=...)``,
optionally runs ``amp.initialize(..., opt_level="O1")``, then wraps it in
``torch.nn.parallel.DistributedDataParallel``. torch's DDP refuses every
``torch.nn.SyncBatchNorm`` off GPUs; apex's layer was not one, so the script ran. One launch of
two gloo workers (this file run as a script), each seeded differently, trains a few steps per
case; the tests check that both ranks end with the batchnorm running statistics and parameters
of one process training on the concatenated batch.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

import pytest
import torch
from _two_ranks import WORLD, finish, launch
from torch import nn

STEPS = 3
PER_RANK = 4
# (case name, ampx opt level or None, dtype, DDP's broadcast_buffers)
CASES = [
    ("fp32", None, "fp32", True),
    ("fp32-own-buffers", None, "fp32", False),  # the statistics agree without DDP's broadcast
    ("O1-fp16", "O1", "fp16", True),
    ("O1-bf16", "O1", "bf16", True),
]


def _model(seed: int) -> nn.Module:
    """A small SwAV-like trunk and projection head, with 2-D and 1-D batchnorm."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _batch(step: int) -> torch.Tensor:
    """The global batch of `step`; rank r trains on its r-th slice."""
    return torch.randn(WORLD * PER_RANK, 3, 6, 6, generator=torch.Generator().manual_seed(step))


def _state(model: nn.Module) -> dict[str, list]:
    return {k: v.float().tolist() for k, v in model.state_dict().items()}


def _train(model: nn.Module, level: str | None, dtype: str, part: slice | None,
           wrap: Any = None) -> nn.Module:
    import ampx

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if level is not None:
        # a start scale no step overflows at: both runs step the same steps
        model, opt = ampx.initialize(model, opt, opt_level=level, dtype=dtype, verbosity=0,
                                     init_scale=2.0**8)
    net = wrap(model) if wrap is not None else model
    for step in range(STEPS):
        x = _batch(step)
        opt.zero_grad()
        loss = net(x if part is None else x[part]).float().pow(2).mean()
        if level is None:
            loss.backward()
        else:
            with ampx.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
    if level is not None:
        ampx.restore()
    return model


def _case(rank: int, level: str | None, dtype: str, broadcast_buffers: bool) -> dict[str, Any]:
    import torch.distributed as dist

    from ampx.compat.apex import parallel as apex_parallel

    model = _model(seed=rank)  # rank 1's start differs: DDP's broadcast makes it rank 0's
    group = dist.new_group(list(range(WORLD)))  # SwAV's syncbn process group
    model = apex_parallel.convert_syncbn_model(model, process_group=group)

    def wrap(module: nn.Module) -> nn.Module:
        return nn.parallel.DistributedDataParallel(module, broadcast_buffers=broadcast_buffers)

    part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    model = _train(model, level, dtype, part, wrap)
    return {"state": _state(model),
            "types": sorted({type(m).__name__ for m in model.modules()
                             if "BatchNorm" in type(m).__name__})}


def _worker(rank: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=90))
    results: dict[str, Any] = {"cases": {}, "errors": {}}
    for name, level, dtype, broadcast_buffers in CASES:
        try:
            results["cases"][name] = _case(rank, level, dtype, broadcast_buffers)
        except Exception as exc:  # reported per case (every rank raises alike)
            results["errors"][name] = f"{type(exc).__name__}: {exc}"
    finish(rank, results, out_dir)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    return launch(__file__, tmp_path_factory.mktemp("syncbn"))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_swav_style_syncbn_trains_under_torch_ddp(results: list, case: tuple) -> None:
    name, level, dtype, _ = case
    assert name not in results[0]["errors"], results[0]["errors"][name]
    rank0, rank1 = (r["cases"][name] for r in results)
    assert rank0["types"] == ["SyncBatchNorm"]  # every batchnorm converted
    # one process, rank 0's start, plain batchnorm over the concatenated batch
    reference = _state(_train(_model(seed=0), level, dtype, None))
    tol = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 2e-2}[dtype]
    for key, expected in reference.items():
        for rank in (rank0, rank1):
            torch.testing.assert_close(torch.tensor(rank["state"][key]),
                                       torch.tensor(expected), rtol=tol, atol=tol, msg=key)
        if "running" in key:  # the statistics agree across ranks up to float rounding
            torch.testing.assert_close(torch.tensor(rank0["state"][key]),
                                       torch.tensor(rank1["state"][key]),
                                       rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_torch_syncbn_forward_runs_on_the_apex_layer(momentum: float | None) -> None:
    """On GPUs the layer's forward is torch's SyncBatchNorm's: every attribute that reads
    exists on it (checked here on its path without a process group)."""
    from ampx.compat.apex import parallel as apex_parallel

    layer, reference = apex_parallel.SyncBatchNorm(3, momentum=momentum), nn.BatchNorm1d(
        3, momentum=momentum)
    assert not isinstance(layer, nn.SyncBatchNorm)  # torch's DDP refuses those on CPU
    for _ in range(2):
        x = torch.randn(5, 3)
        torch.testing.assert_close(nn.SyncBatchNorm.forward(layer, x), reference(x))  # type: ignore[arg-type]
    for name, buf in reference.named_buffers():
        torch.testing.assert_close(layer.get_buffer(name), buf)
    with pytest.raises(ValueError, match="non-zero"):
        nn.SyncBatchNorm.forward(layer, torch.randn(2, 0))  # type: ignore[arg-type]


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
