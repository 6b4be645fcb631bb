"""Step-time cost of the numerics report (``numerics="report"``), as ratios to report off.

For each model (an MLP, a transformer encoder, a small CNN) one ampx session and optimizer
are switched, in one process, between three configurations, interleaved (the order rotates
every round; each round's median step time, then the median of the per-round ratios):

- ``off``: no monitor (what ``numerics=None`` runs);
- ``unwatched``: a monitor on a step it does not watch (no hook installed; its per-step
  bookkeeping only): what 99 of 100 steps cost at ``numerics_every=100``;
- ``watched``: a monitor watching every step (hooks on every module, the statistics, one
  host copy per step; the fp32 shadow off): ``numerics_every=1``.

The cost at ``numerics_every=100`` is (watched + 99 x unwatched) / 100, printed as
``every100``. ``--shadow`` adds the fp32 shadow to every watched step. Steps are timed by the
process's CPU time (``--clock cpu``, the default: on a shared machine, time spent waiting for
a core is not the monitor's) or by the wall clock (``--clock wall``).

Usage::

    python benchmarks/bench_numerics.py                    # fp16, O1, all three models
    python benchmarks/bench_numerics.py --dtype bf16 --level O2 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import ampx  # noqa: E402
from ampx.overflow.numerics import NumericsMonitor  # noqa: E402

CONFIGS = ("off", "unwatched", "watched")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="fp16")
    p.add_argument("--level", choices=("O1", "O2"), default="O1")
    p.add_argument("--models", default="mlp,encoder,cnn")
    p.add_argument("--steps", type=int, default=5, help="timed steps per configuration per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--shadow", action="store_true", help="fp32 shadow on every watched step")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="time steps by process CPU time (default) or wall time")
    return p.parse_args(argv)


def make(name: str) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        model: nn.Module = nn.Sequential(*[m for _ in range(8)
                                           for m in (nn.Linear(256, 256), nn.ReLU())])
        x = torch.randn(64, 256, generator=g)
    elif name == "encoder":
        layer = nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True)
        model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        x = torch.randn(8, 32, 128, generator=g)
    else:
        model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                              nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
        x = torch.randn(8, 3, 16, 16, generator=g)
    return model, lambda: model(x).float().pow(2).mean()


def bench(name: str, args: argparse.Namespace) -> dict[str, float]:
    model, loss_of = make(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    amp = ampx.Amp(opt_level=args.level, dtype=dtype, verbosity=0, init_scale=2.0**8)
    model, opt = amp.initialize(model, opt)
    watch = amp.overflow_watch
    assert watch is not None
    shadow = 1 if args.shadow else 0
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = loss_of()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()

    def configure(config: str) -> None:
        if watch.numerics is not None:
            watch.numerics.remove()
        watch.numerics = None
        if config == "watched":
            watch.numerics = NumericsMonitor([model], dtype, every=1, shadow_every=shadow)
        elif config == "unwatched":
            watch.numerics = NumericsMonitor([model], dtype, every=10**9)
            watch.numerics.flush()  # its first (armed) step is over: nothing installed

    for config in CONFIGS:
        configure(config)
        step()
    medians: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for r in range(args.rounds):
        for config in CONFIGS[r % 3:] + CONFIGS[:r % 3]:
            configure(config)
            times = []
            for _ in range(args.steps):
                t0 = clock()
                step()
                times.append(clock() - t0)
            medians[config].append(statistics.median(times))
    configure("off")
    ampx.restore()

    def ratio(config: str) -> float:
        return statistics.median(a / b for a, b in zip(medians[config], medians["off"]))

    watched, unwatched = ratio("watched"), ratio("unwatched")
    return {"off_ms": statistics.median(medians["off"]) * 1e3, "unwatched": unwatched,
            "watched": watched, "every100": (watched + 99 * unwatched) / 100}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    results = {name: bench(name, args) for name in args.models.split(",")}
    with open("/proc/loadavg") as f:
        load = f.read().strip()
    print(f"numerics report cost, {args.level} {args.dtype}, step-time ratio to off "
          f"({args.clock} time; median of {args.rounds} rounds x {args.steps} steps; load {load}"
          f"{'; fp32 shadow on every watched step' if args.shadow else ''}):")
    print(f"{'model':>8} {'off ms':>8} {'unwatched':>10} {'every 100':>10} {'every 1':>8}")
    for name, r in results.items():
        print(f"{name:>8} {r['off_ms']:8.2f} {r['unwatched']:10.3f} {r['every100']:10.3f} "
              f"{r['watched']:8.3f}")
    return results


if __name__ == "__main__":
    main()
