"""Gradient accumulation under DDP's `no_sync` with a plain `scale_loss` per micro-batch
(issue 39, item 10: timm's train.py, apex path).

Two gloo ranks seeded differently (DDP broadcasts rank 0's weights) run O1 fp16 and bf16,
with torch's SGD and apex's FusedAdam, wrapped in torch's DDP or apex's (and O3 bf16, SGD,
torch's DDP): each update is two
micro-batches, the first under `net.no_sync()` when the wrapper has one (timm's test), each
with its own non-delayed `scale_loss`, then `step()`. After every update both ranks hold
bitwise the same weights, equal to one process trained on the concatenated batches (rank 0
computes that run too). Before the fix, the last micro-batch's `scale_loss` set the
accumulated gradient aside, so it never reached the all-reduce and the ranks drifted apart.
"""

from __future__ import annotations

import contextlib
import sys
from datetime import timedelta
from typing import Any

import pytest
import torch
from _two_ranks import WORLD, finish, launch
from torch import nn

UPDATES = 3
CASES = [("O1", wrap, dtype, opt) for wrap in ("torch-ddp", "apex-ddp")
         for dtype in ("fp16", "bf16") for opt in ("sgd", "fused-adam")]
CASES.append(("O3", "torch-ddp", "bf16", "sgd"))  # bf16 parameters: their gradients fold too


def _name(case: tuple) -> str:
    return "-".join(case)


# -- the worker ------------------------------------------------------------------------------------

def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _batch(rank: int, update: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * update + 10 * micro + rank)
    return torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    from ampx.compat.apex.optimizers import FusedAdam
    return FusedAdam(model.parameters(), lr=1e-2)


def _train(rank: int, level: str, dtype: str, opt_kind: str, wrap: str | None
           ) -> tuple[list, bool]:
    """Train UPDATES updates; `wrap` None: one process on both ranks' batches concatenated."""
    import ampx
    from ampx.compat.apex import parallel as apex_parallel

    model = _model(seed=rank)
    amp = ampx.Amp(opt_level=level, dtype=dtype, init_scale=2.0**8, verbosity=0,
                   sync_overflow=wrap is not None)  # (the single run is rank 0's alone)
    model, opt = amp.initialize(model, _optimizer(opt_kind, model))
    net: nn.Module = model
    if wrap == "torch-ddp":
        net = nn.parallel.DistributedDataParallel(model)
    elif wrap == "apex-ddp":
        net = apex_parallel.DistributedDataParallel(model)
    has_no_sync = hasattr(net, "no_sync")
    for update in range(UPDATES):
        opt.zero_grad()
        for micro in range(2):
            if wrap is None:
                parts = [_batch(r, update, micro) for r in range(WORLD)]
                x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            else:
                x, y = _batch(rank, update, micro)
            # timm: `if has_no_sync and not need_update: with model.no_sync(): ...`
            sync = net.no_sync() if micro == 0 and has_no_sync and wrap else \
                contextlib.nullcontext()
            with sync:
                loss = (net(x).float() - y).pow(2).mean()
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
        opt.step()
        assert not amp.step_was_skipped(opt)
    params = [p.detach().float().reshape(-1).tolist() for p in model.parameters()]
    amp.restore()
    return params, has_no_sync


def _worker(rank: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=90))
    results: dict[str, Any] = {"cases": {}, "single": {}, "errors": {}}
    for case in CASES:
        level, wrap, dtype, opt_kind = case
        try:
            params, has_no_sync = _train(rank, level, dtype, opt_kind, wrap)
            results["cases"][_name(case)] = {"params": params, "no_sync": has_no_sync}
        except Exception as exc:  # noqa: BLE001 - reported by the test
            results["errors"][_name(case)] = repr(exc)
        key = f"{level}-{dtype}-{opt_kind}"
        if rank == 0 and key not in results["single"]:  # the single process (rank 0's weights)
            results["single"][key] = _train(0, level, dtype, opt_kind, None)[0]
    finish(rank, results, out_dir)


# -- the tests -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    return launch(__file__, tmp_path_factory.mktemp("accumulation"))


@pytest.mark.slow
@pytest.mark.kernel_backend
@pytest.mark.parametrize("case", CASES, ids=_name)
def test_no_sync_accumulation_reaches_the_all_reduce(results: list, case: tuple) -> None:
    name = _name(case)
    assert name not in results[0]["errors"], results[0]["errors"][name]
    assert name not in results[1]["errors"], results[1]["errors"][name]
    rank0, rank1 = (r["cases"][name] for r in results)
    level, wrap, dtype, opt_kind = case
    assert rank0["no_sync"] == (wrap == "torch-ddp")  # apex's class has none, as in apex
    assert rank0["params"] == rank1["params"]  # bitwise
    single = results[0]["single"][f"{level}-{dtype}-{opt_kind}"]
    for got, want in zip(rank0["params"], single):
        # the same training up to the order of the gradients' sums (half-precision matmuls)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0,
                                   atol=1e-3 if dtype == "fp16" else 1e-2)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
