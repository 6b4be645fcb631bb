"""The numerics report's fp32 fallback on 2 CPU gloo ranks under DDP (O1).

Run as a script, this file is one worker; the fixture launches two. A Linear overflows fp16 on
rank 1's data only; with ``numerics="report"`` and ``on_overflow="fp32-fallback"`` both ranks
must move the same module to float32 at the same step, stay bitwise equal, and a resume from
the checkpoint must keep the fallback on both.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

import pytest
import torch
from _two_ranks import WORLD, finish, launch
from torch import nn

STEPS = 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Linear(16, 16), nn.LayerNorm(16),
                          nn.Linear(16, 1))
    with torch.no_grad():
        model[1].weight.mul_(1e4)
    return model


def _train(rank: int, model: nn.Module, amp: Any, opt: Any, steps: int) -> list[str]:
    ddp = nn.parallel.DistributedDataParallel(model)
    gen = torch.Generator().manual_seed(100 + rank)
    events = []
    for step in range(steps):
        # rank 1's inputs push layer 1's fp16 output past 65504; rank 0's never do
        x = torch.randn(8, 6, generator=gen) * (100.0 if rank == 1 else 1.0)
        loss = ddp(x).float().mean()
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        events.append(f"{step}:{'skip' if amp.step_was_skipped(opt) else 'ok'}:"
                      f"{','.join(amp.overflow_watch.fallbacks)}")
    return events


def _worker(rank: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    import ampx

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=90))
    options = dict(opt_level="O1", dtype="fp16", init_scale=1.0, verbosity=0,
                   numerics="report", numerics_every=100, on_overflow="fp32-fallback",
                   overflow_patience=2)
    model = _model()
    amp = ampx.Amp(**options)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    events = _train(rank, model, amp, opt, STEPS)
    params = [p.detach().tolist() for p in model.parameters()]
    checkpoint = {"model": model.state_dict(), "amp": amp.state_dict()}
    amp.restore()
    resumed_model = _model()
    resumed = ampx.Amp(**options)
    resumed_model, opt2 = resumed.initialize(
        resumed_model, torch.optim.SGD(resumed_model.parameters(), lr=1e-3))
    resumed_model.load_state_dict(checkpoint["model"])
    resumed.load_state_dict(checkpoint["amp"])
    after = _train(rank, resumed_model, resumed, opt2, 2)
    resumed.restore()
    finish(rank, {"events": events, "params": params, "resumed": after,
                  "policy": checkpoint["amp"].get("overflow_policy")}, out_dir)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    return launch(__file__, tmp_path_factory.mktemp("numerics-dist"))


@pytest.mark.slow
def test_ranks_fall_back_the_same_module_at_the_same_step(results: list) -> None:
    rank0, rank1 = results
    assert rank0["events"] == rank1["events"]
    fallen = [e for e in rank0["events"] if e.endswith(":1")]
    assert fallen, rank0["events"]
    skipped = [e for e in rank0["events"] if ":skip:" in e]
    assert len(skipped) <= 2 + 1  # overflow_patience + 1
    assert rank0["params"] == rank1["params"]  # bitwise, as JSON floats
    assert rank0["policy"]["fp32_modules"] == ["1"] == rank1["policy"]["fp32_modules"]
    # resumed: the fallback is back on both ranks before the first step, no skip
    assert rank0["resumed"] == rank1["resumed"] == ["0:ok:1", "1:ok:1"]


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
