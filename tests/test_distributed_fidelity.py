"""Legacy scripts on real ranks (issue 23): ranks that start apart end bitwise equal.

One launch of two gloo CPU workers (this file run as a script) covers every case; the tests
check its results:

- O1/O2/O3 x fp16/bf16, each rank seeded differently (``seed + rank``) or loading a checkpoint
  on rank 0 only, wrapped after initialize in torch's DDP, apex's DDP (``delay_allreduce``
  True and False), or sharded with FSDP2 (before initialize, as torch requires): after 5 steps
  both ranks hold bitwise equal parameters, masters and optimizer state. At O2 this needs
  the masters to follow DDP's broadcast (ampx makes them before the wrap).
- apex's ``SyncBatchNorm`` and a torch ``BatchNorm2d``/``SyncBatchNorm`` converted with
  ``convert_syncbn_model``, under apex's DDP on CPU: outputs, gradients and running statistics
  equal one process normalizing the concatenated batch.
- ``apex.parallel.distributed.flat_dist_call`` (broadcast and averaging all-reduce) and
  ``Reducer``.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

import pytest
import torch
from _two_ranks import WORLD, finish, launch
from test_distributed import _canon, _digest
from torch import nn

STEPS = 5
LEVELS = [(lv, dt) for lv in ("O1", "O2", "O3") for dt in ("fp16", "bf16")]
WRAPS = ["torch-ddp", "apex-ddp-delay", "apex-ddp", "fsdp2"]
STARTS = ["seed+rank", "rank0-load"]
CASES = [(lv, dt, w, s) for lv, dt in LEVELS for w in WRAPS for s in STARTS]


def _name(case: tuple) -> str:
    return "-".join(case)


# -- the worker ------------------------------------------------------------------------------------

def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _batch(rank: int, step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(n, 6, generator=gen), torch.randn(n, 3, generator=gen)


def _case(rank: int, level: str, dtype: str, wrap: str, start: str) -> dict[str, Any]:
    import ampx
    from ampx.compat.apex import parallel as apex_parallel

    model = _model(seed=rank if start == "seed+rank" else 7)
    if wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        fully_shard(model)  # FSDP2 first: torch's optimizers must see the sharded parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    amp = ampx.Amp(opt_level=level, dtype=dtype, verbosity=0,
                   loss_scale="dynamic" if level == "O3" and dtype == "fp16" else None)
    model, opt = amp.initialize(model, opt)
    if start == "rank0-load":  # after initialize, before the wrap (apex's resume recipe)
        checkpoint = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(3))
                      for k, v in _model(seed=11).state_dict().items()}
        if wrap == "fsdp2":  # FSDP2's way: rank 0 holds the full checkpoint, the rest nothing
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
            )
            given = {k: v.clone() for k, v in checkpoint.items()} if rank == 0 else {}
            set_model_state_dict(model, given, options=StateDictOptions(  # (rewrites `given`)
                full_state_dict=True, broadcast_from_rank0=True))
        elif rank == 0:
            model.load_state_dict(checkpoint)
    if wrap == "torch-ddp":
        net: nn.Module = nn.parallel.DistributedDataParallel(model)
    elif wrap.startswith("apex-ddp"):
        net = apex_parallel.DistributedDataParallel(model, delay_allreduce=wrap.endswith("delay"))
    else:
        net = model
    loaded = None
    if level == "O2" and start == "rank0-load":  # what the masters start from
        amp_state = opt._ampx
        amp_state.use_masters()
        full = [m.full_tensor() if hasattr(m, "full_tensor") else m
                for m in ampx.master_params(opt)]
        half = torch.float16 if dtype == "fp16" else torch.bfloat16
        # DDP broadcasts rank 0's half weights, and FSDP2's broadcast_from_rank0 writes into
        # the half shards: every rank's masters follow those (apex's precision)
        want = [checkpoint[k].to(half).float() for k in ("0.weight", "0.bias", "2.weight",
                                                          "2.bias")]
        loaded = all(torch.equal(a.detach(), b) for a, b in zip(full, want))
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _batch(rank, step)
        with amp.scale_loss((net(x).float() - y).pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    out = {"params": _digest(list(model.parameters())),
           "masters": _digest(list(ampx.master_params(opt))),
           "optimizer": _canon(opt.state_dict()), "amp": _canon(amp.state_dict()),
           "loaded": loaded, "model_dtype": str(next(model.parameters()).dtype)}
    amp.restore()
    return out


def _bn_models(kind: str, seed: int = 0) -> nn.Module:
    from ampx.compat.apex import parallel as apex_parallel

    torch.manual_seed(seed)
    if kind == "apex":
        bns: list[nn.Module] = [apex_parallel.SyncBatchNorm(4), apex_parallel.SyncBatchNorm(4)]
    else:  # torch's layers, through apex's converter in the worker
        bns = [nn.BatchNorm2d(4), nn.SyncBatchNorm(4)]
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), bns[0], nn.ReLU(),
                          nn.Conv2d(4, 4, 3, padding=1), bns[1])
    with torch.no_grad():
        for bn in (model[1], model[4]):
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    return model


def _bn_inputs(n: int = 3) -> torch.Tensor:
    return torch.randn(WORLD * n, 3, 5, 5, generator=torch.Generator().manual_seed(9))


def _syncbn_case(rank: int, kind: str) -> dict[str, Any]:
    from ampx.compat.apex import parallel as apex_parallel

    model = apex_parallel.convert_syncbn_model(_bn_models(kind))
    net = apex_parallel.DistributedDataParallel(model)
    x = _bn_inputs()
    n = x.shape[0] // WORLD
    out = net(x[rank * n:(rank + 1) * n])
    out.pow(2).mean().backward()
    return {"out": out.detach().tolist(),
            "grads": [p.grad.tolist() for p in model.parameters()],
            "stats": [model[i].running_mean.tolist() + model[i].running_var.tolist()
                      for i in (1, 4)],
            "types": sorted({type(m).__module__ for m in model.modules()
                             if "BatchNorm" in type(m).__name__})}


def _flat_dist_call_case(rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    from ampx.compat.apex.parallel import Reducer, flat_dist_call

    tensors = [torch.full((3,), float(rank + 1)), torch.full((2,), float(10 * (rank + 1))),
               torch.full((2,), float(rank + 1), dtype=torch.float16)]
    flat_dist_call(tensors, dist.all_reduce)  # averages, per dtype group
    broadcast = [torch.full((4,), float(rank)), torch.full((1,), float(rank + 5))]
    flat_dist_call(broadcast, dist.broadcast, (0,))
    model = _model(seed=rank)
    reducer = Reducer(model)  # broadcasts rank 0's parameters
    model(torch.ones(2, 6) * (rank + 1)).sum().backward()
    reducer.reduce()
    return {"all_reduce": [t.tolist() for t in tensors],
            "broadcast": [t.tolist() for t in broadcast],
            "reducer_params": _digest(list(model.parameters())),
            "reducer_grads": _digest([p.grad for p in model.parameters()])}


def _worker(rank: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=90))
    results: dict[str, Any] = {"cases": {}, "errors": {}}
    for case in CASES:
        try:
            results["cases"][_name(case)] = _case(rank, *case)
        except Exception as exc:  # reported per case (every rank raises alike, or both hang)
            results["errors"][_name(case)] = f"{type(exc).__name__}: {exc}"
    for kind in ("apex", "torch"):
        results[f"syncbn-{kind}"] = _syncbn_case(rank, kind)
    results["flat_dist_call"] = _flat_dist_call_case(rank)
    finish(rank, results, out_dir)


# -- the tests -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    return launch(__file__, tmp_path_factory.mktemp("fidelity"))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_name)
def test_ranks_that_start_apart_stay_bitwise_equal(results: list, case: tuple) -> None:
    name = _name(case)
    assert name not in results[0]["errors"], results[0]["errors"][name]
    rank0, rank1 = (r["cases"][name] for r in results)
    assert rank0["params"] == rank1["params"]
    assert rank0["masters"] == rank1["masters"]
    assert rank0["optimizer"] == rank1["optimizer"] and rank0["amp"] == rank1["amp"]
    level, dtype = case[0], case[1]
    half = "torch.float16" if dtype == "fp16" else "torch.bfloat16"
    assert rank0["model_dtype"] == ("torch.float32" if level == "O1" else half)
    if level == "O2" and case[3] == "rank0-load":
        assert rank0["loaded"] and rank1["loaded"]  # the masters start from the checkpoint


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["apex", "torch"])
def test_syncbn_gives_the_statistics_of_the_concatenated_batch(results: list, kind: str) -> None:
    from ampx.compat.apex import parallel as apex_parallel

    model = _bn_models(kind)
    for bn in (model[1], model[4]):  # the single process: plain batchnorm on the whole batch
        bn.__class__ = nn.BatchNorm2d
    out = model(_bn_inputs())
    out.pow(2).mean().backward()
    n = out.shape[0] // WORLD
    ranks = [r[f"syncbn-{kind}"] for r in results]
    assert ranks[0]["types"] == [apex_parallel.__name__]  # every layer converted
    torch.testing.assert_close(torch.tensor(ranks[0]["out"] + ranks[1]["out"]), out.detach(),
                               rtol=1e-5, atol=1e-5)
    for rank in ranks:  # DDP averages the per-rank gradients of the mean over half the batch
        for got, param in zip(rank["grads"], model.parameters()):
            torch.testing.assert_close(torch.tensor(got), param.grad, rtol=1e-4, atol=1e-6)
        stats = [model[i].running_mean.tolist() + model[i].running_var.tolist() for i in (1, 4)]
        torch.testing.assert_close(torch.tensor(rank["stats"]), torch.tensor(stats),
                                   rtol=1e-5, atol=1e-6)
    assert n * WORLD == out.shape[0]


@pytest.mark.slow
def test_flat_dist_call_and_reducer(results: list) -> None:
    rank0, rank1 = (r["flat_dist_call"] for r in results)
    assert rank0["all_reduce"] == rank1["all_reduce"] == [[1.5] * 3, [15.0] * 2, [1.5] * 2]
    assert rank0["broadcast"] == rank1["broadcast"] == [[0.0] * 4, [5.0]]
    assert rank0["reducer_params"] == rank1["reducer_params"]
    assert rank0["reducer_grads"] == rank1["reducer_grads"]


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
