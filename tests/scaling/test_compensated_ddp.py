"""compensation="kahan" under DDP: two gloo ranks, seeded differently, end bitwise identical.

Each rank builds its float32 model from its own seed, so the compensations initialize makes
(the residuals of each rank's own float32 weights) differ; DDP's broadcast then writes rank
0's half weights everywhere, and the first step drops the residuals of written weights on
every rank (c = 0), so from there every rank holds the same (w, c) and steps the same
all-reduced gradients. Run as ``python test_compensated_ddp.py RANK STORE OUT`` by the test.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

import pytest
import torch
from _two_ranks import WORLD, finish, launch
from torch import nn


def _digest(tensors: list[torch.Tensor]) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _case(rank: int, opt_name: str) -> dict[str, Any]:
    import ampx

    torch.manual_seed(rank)  # every rank's own float32 weights
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt: Any = (torch.optim.AdamW(model.parameters(), lr=1e-3) if opt_name == "adamw" else
                torch.optim.RMSprop(model.parameters(), lr=1e-3))
    model, opt = ampx.initialize(model, opt, opt_level="O3", dtype="bf16",
                                 compensation="kahan", verbosity=0)
    comps = _digest([opt.state[p]["compensation"] for p in model.parameters()])
    ddp = nn.parallel.DistributedDataParallel(model)
    for step in range(4):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        opt.zero_grad()
        with ampx.scale_loss((ddp(x).float() - y).pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    params = list(model.parameters())
    return {"initial_comps": comps, "params": _digest(params),
            "comps": _digest([opt.state[p]["compensation"] for p in params]),
            "nonzero_comps": sum(int(opt.state[p]["compensation"].count_nonzero())
                                 for p in params)}


def _worker(rank: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=90))
    finish(rank, {name: _case(rank, name) for name in ("adamw", "rmsprop")}, out_dir)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    return launch(__file__, tmp_path_factory.mktemp("dist"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adamw", "rmsprop"])
def test_ranks_seeded_differently_end_identical(results: list, name: str) -> None:
    rank0, rank1 = (r[name] for r in results)
    assert rank0["initial_comps"] != rank1["initial_comps"]  # the control: they did differ
    assert rank0["params"] == rank1["params"]
    assert rank0["comps"] == rank1["comps"]
    assert rank0["nonzero_comps"] > 0  # the steps did compensate


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
