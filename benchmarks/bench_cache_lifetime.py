"""What the weight-cast cache's lifetime costs O1: training steps and evaluation forwards.

Issue 39 item 5 bounded O1's weight-cast cache to one forward of an initialized model plus
its backward (two hooks on each model: `ampx.o1.patch.forward_starts` / `forward_ends`).
Before, only `scale_loss` emptied it: an evaluation loop reused the first forward's casts for
good (and so served stale casts after writes the version counter cannot see). Three
configurations of each of `bench_step.py`'s models, each its own deep copy, session and
AdamW optimizer, measured interleaved round by round in one process (O1's patches installed
only for an O1 configuration's turn, as in `bench_step.py`):

- `autocast`: torch.autocast around each forward (bf16: no GradScaler);
- `O1`: ampx O1 as it is;
- `O1 old`: the same with the two hooks taken off its model (the lifetime before the change).

Two loops: `train` (zero_grad + forward + loss + backward through `scale_loss` + step) and
`eval` (a `torch.no_grad()` forward of the model in eval mode). The table gives medians with
spreads (25th-75th percentile), the medians of the per-round ratios, and the weight casts
one iteration makes (the cache's misses: deterministic where the times are not). Run::

    python benchmarks/bench_cache_lifetime.py [--reps 15] [--models mlp encoder conv]

and quote the load averages it prints.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_step import MODELS  # noqa: E402

import ampx  # noqa: E402
from ampx.o1 import patch  # noqa: E402

CONFIGS = ("autocast", "O1", "O1 old")


def _without_lifetime_hooks(model: torch.nn.Module) -> None:
    for hooks in (model._forward_pre_hooks, model._forward_hooks):
        for key in [k for k, h in hooks.items()
                    if h in (patch.forward_starts, patch.forward_ends)]:
            del hooks[key]


class Config:
    """One configuration: model copy, optimizer, session (O1) and its cast config."""

    def __init__(self, name: str, base: torch.nn.Module, dtype: torch.dtype) -> None:
        self.name, self.dtype = name, dtype
        self.model = copy.deepcopy(base)
        self.opt: Any = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.amp: ampx.Amp | None = None
        self.o1: patch.CastConfig | None = None
        if name != "autocast":
            self.amp = ampx.Amp("O1", dtype=dtype, verbosity=0)
            self.model, self.opt = self.amp.initialize(self.model, self.opt)
            active = patch.active()
            assert active is not None
            self.o1 = active.config
            patch.deactivate()  # installed only for this configuration's turn
            if name == "O1 old":
                _without_lifetime_hooks(self.model)

    def train(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        if self.amp is None:
            with torch.autocast("cpu", dtype=self.dtype):
                out = self.model(x)
            F.mse_loss(out.float(), y).backward()
        else:
            loss = F.mse_loss(self.model(x).float(), y)
            with self.amp.scale_loss(loss, self.opt) as scaled:
                scaled.backward()
        self.opt.step()

    def eval(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.model.eval()
        with torch.no_grad():
            if self.amp is None:
                with torch.autocast("cpu", dtype=self.dtype):
                    self.model(x)
            else:
                self.model(x)

    def turn(self, loop: str, x: torch.Tensor, y: torch.Tensor, inner: int) -> float:
        """One warm-up and `inner` timed iterations of `loop`; seconds per iteration."""
        if self.o1 is not None:
            patch.activate(self.o1)
        try:
            run = getattr(self, loop)
            run(x, y)
            start = time.perf_counter()
            for _ in range(inner):
                run(x, y)
            return (time.perf_counter() - start) / inner
        finally:
            if self.o1 is not None:
                patch.deactivate()


def casts_per_forward(config: Config, loop: str, x: torch.Tensor, y: torch.Tensor) -> int:
    """Weight casts made by the second of two iterations (deterministic, unlike the times)."""
    assert config.o1 is not None
    patch.activate(config.o1)
    try:
        run = getattr(config, loop)
        run(x, y)
        active = patch.active()
        assert active is not None
        before = active.cache.misses
        run(x, y)
        return active.cache.misses - before
    finally:
        patch.deactivate()


def _spread(values: list[float], scale: float, fmt: str) -> str:
    q = statistics.quantiles(values, n=4)
    return f"{q[1] * scale:{fmt}} ({q[0] * scale:{fmt}}-{q[2] * scale:{fmt}})"


def measure(key: str, loop: str, dtype: torch.dtype, reps: int, inner: int) -> str:
    label, build, x_shape, y_shape = MODELS[key]
    torch.manual_seed(0)
    base = build()
    x, y = torch.randn(x_shape), torch.randn(y_shape)
    configs = [Config(name, base, dtype) for name in CONFIGS]
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for rep in range(reps + 1):  # the first round is warm-up
        for config in configs if rep % 2 == 0 else configs[::-1]:
            elapsed = config.turn(loop, x, y, inner)
            if rep:
                times[config.name].append(elapsed)
    casts = {c.name: casts_per_forward(c, loop, x, y) for c in configs if c.o1 is not None}
    for config in configs:
        if config.amp is not None:
            config.amp.restore()

    def ratio(a: str, b: str) -> str:
        return _spread([p / q for p, q in zip(times[a], times[b])], 1.0, ".3f")

    return (f"| {label} | {loop} | " + " | ".join(_spread(times[n], 1e3, ".3f") for n in CONFIGS)
            + f" | {ratio('O1', 'autocast')} | {ratio('O1 old', 'autocast')} | "
            f"{ratio('O1', 'O1 old')} | {casts['O1']} / {casts['O1 old']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15, help="timed interleaved rounds")
    parser.add_argument("--inner", type=int, default=0,
                        help="iterations per turn (0: 10 for the MLP, 2 otherwise)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--loops", nargs="+", choices=("train", "eval"),
                        default=["train", "eval"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from ampx import _ext

    print(f"torch {torch.__version__}, ampx kernels {_ext.BACKEND}, {args.threads} threads, "
          f"bf16; load average before: {os.getloadavg()}")
    print("| model | loop | autocast ms | O1 ms | O1 old ms | O1/autocast | O1 old/autocast "
          "| O1/O1 old | weight casts per iteration, O1 / O1 old |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for key in args.models:
        inner = args.inner or (10 if key == "mlp" else 2)
        for loop in args.loops:
            print(measure(key, loop, torch.bfloat16, args.reps, inner), flush=True)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
