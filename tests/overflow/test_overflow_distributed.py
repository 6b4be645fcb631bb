"""Overflow provenance across 2 CPU gloo ranks with DDP: which rank's gradients held the inf.

Run as a script, this file is one worker; the fixture launches two. Each worker trains the
same DDP model under ampx (O1 and O2, fp16); the ranks agree on the skip (all-reduce of the
overflow flag) and `ampx.last_overflow` carries the flags-by-rank table:

- ``after``: an inf put into rank 1's gradient *after* DDP's all-reduce: both ranks skip, and
  both reports say rank 1 held it in ``0.weight`` (rank 0's own gradients were finite);
- ``before``: an inf in rank 0's loss, *before* the all-reduce: the reduction spreads it to
  every rank's gradients, so every rank's unscale flags it and the table says ``(0, 1)``:
  after the all-reduce the origin rank cannot be told from gradients (the forward detector,
  which is rank-local, tells it).
"""

from __future__ import annotations

import math
import sys
from datetime import timedelta
from typing import Any

import pytest
import torch
from _two_ranks import WORLD, finish, launch
from torch import nn


def _case(rank: int, level: str, where: str) -> dict[str, Any]:
    import ampx

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = ampx.Amp(opt_level=level, init_scale=2.0**8, verbosity=0)
    model, opt = amp.initialize(model, opt)
    ddp = nn.parallel.DistributedDataParallel(model)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    loss = (ddp(x).float() - y).pow(2).mean()
    if where == "before" and rank == 0:
        loss = loss * math.inf
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
        if where == "after" and rank == 1:
            model[0].weight.grad.view(-1)[0] = math.inf  # already all-reduced: rank 1 only
    opt.step()
    report = ampx.last_overflow(opt)
    assert report is not None
    out = {"skipped": amp.step_was_skipped(opt), "report": report.as_dict(),
           "params": list(report.params), "where": report.where()}
    amp.restore()
    return out


def _fsdp2_case(rank: int) -> dict[str, Any]:
    """O1 over FSDP2's sharded parameters: an inf in rank 1's shard of 0.weight."""
    import ampx

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError as exc:  # pragma: no cover - older torch
        return {"unsupported": repr(exc)}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    fully_shard(model)
    amp = ampx.Amp(opt_level="O1", init_scale=2.0**8, verbosity=0)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    with amp.scale_loss((model(x).float() - y).pow(2).mean(), opt) as scaled:
        scaled.backward()
        if rank == 1:
            model[0].weight.grad.to_local().view(-1)[0] = math.inf
    opt.step()
    report = ampx.last_overflow(opt)
    assert report is not None
    out = {"skipped": amp.step_was_skipped(opt), "report": report.as_dict()}
    amp.restore()
    return out


def _worker(rank: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=90))
    results = {f"{level}-{where}": _case(rank, level, where)
               for level in ("O1", "O2") for where in ("after", "before")}
    results["fsdp2"] = _fsdp2_case(rank)
    finish(rank, results, out_dir)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    return launch(__file__, tmp_path_factory.mktemp("dist"))


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_inf_on_one_rank_after_the_all_reduce_names_that_rank(results: list, level: str
                                                              ) -> None:
    rank0, rank1 = (r[f"{level}-after"] for r in results)
    assert rank0["skipped"] and rank1["skipped"]  # both ranks skip the same step
    assert rank0["report"]["param_ranks"] == rank1["report"]["param_ranks"] == \
        {"0.weight": [1]}
    assert rank1["report"]["inf_params"] == ["0.weight"]
    assert rank0["report"]["inf_params"] == []  # rank 0's own gradients were finite
    assert rank0["params"] == rank1["params"] == ["0.weight"]
    assert rank0["where"] == "in 0.weight; on rank 1"
    assert (rank0["report"]["rank"], rank1["report"]["rank"]) == (0, 1)


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_inf_before_the_all_reduce_reaches_every_rank(results: list, level: str) -> None:
    rank0, rank1 = (r[f"{level}-before"] for r in results)
    assert rank0["skipped"] and rank1["skipped"]
    table = rank0["report"]["param_ranks"]
    assert table == rank1["report"]["param_ranks"]
    assert set(table) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert all(ranks == [0, 1] for ranks in table.values())
    assert rank0["params"][0] == "2.bias"  # closest to the loss first


@pytest.mark.slow
def test_fsdp2_shards_are_classified_and_attributed(results: list) -> None:
    rank0, rank1 = (r["fsdp2"] for r in results)
    if "unsupported" in rank0:
        pytest.skip(rank0["unsupported"])
    assert rank0["skipped"] and rank1["skipped"]
    assert rank0["report"]["param_ranks"] == rank1["report"]["param_ranks"] == \
        {"0.weight": [1]}
    assert rank1["report"]["inf_params"] == ["0.weight"] and rank0["report"]["inf_params"] == []


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
