"""The numerics report's fp32 fallback on 2 CPU gloo ranks under DDP, at O1 and O2.

Run as a script, this file is one worker; the fixture launches two. A block's inner Linear
overflows fp16 on rank 1's data only; with ``numerics="report"`` and
``on_overflow="fp32-fallback"`` both ranks must move the same modules to float32 at the same
steps and stay bitwise equal (at O2 the DDP wrapper, made before, keeps reducing the model's
own Parameters), and a resume from the checkpoint must keep the fallbacks on both.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

import pytest
import torch
from _two_ranks import WORLD, finish, launch
from torch import nn

STEPS = 10


class Normed(nn.Module):
    """fc's fp16 output overflows on large inputs; the block's normalised output never does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        with torch.no_grad():
            self.fc.weight.mul_(1e4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h / h.float().norm(dim=-1, keepdim=True).to(h.dtype).clamp_min(1e-3)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), Normed(), nn.Linear(16, 1))


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


    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=90))
    results = {level: _case(rank, level) for level in ("O1", "O2")}
    finish(rank, results, out_dir)


def _case(rank: int, level: str) -> dict[str, Any]:
    import ampx

    options = dict(opt_level=level, dtype="fp16", init_scale=1.0, verbosity=0,
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
    return {"events": events, "params": params, "resumed": after,
            "policy": checkpoint["amp"].get("overflow_policy")}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    return launch(__file__, tmp_path_factory.mktemp("numerics-dist"))


# O1 keeps 1.fc's float32 output; O2 casts it back to fp16, where it overflows again, so the
# next skips go to its parent, whose normalised output fits
FALLBACKS = {"O1": ["1.fc"], "O2": ["1.fc", "1"]}


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_ranks_fall_back_the_same_module_at_the_same_step(results: list, level: str) -> None:
    rank0, rank1 = results[0][level], results[1][level]
    assert rank0["events"] == rank1["events"]
    fallen = ",".join(FALLBACKS[level])
    assert rank0["events"][-1] == f"{STEPS - 1}:ok:{fallen}", rank0["events"]
    skipped = [e for e in rank0["events"] if ":skip:" in e]
    assert len(skipped) <= len(FALLBACKS[level]) * 2 + 1  # overflow_patience per module, + 1
    assert rank0["params"] == rank1["params"]  # bitwise, as JSON floats
    assert rank0["policy"]["fp32_modules"] == FALLBACKS[level] == rank1["policy"]["fp32_modules"]
    # resumed: the fallbacks are back on both ranks before the first step, no skip
    assert rank0["resumed"] == rank1["resumed"] == [f"0:ok:{fallen}", f"1:ok:{fallen}"]


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
