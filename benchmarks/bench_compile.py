"""torch.compile with ampx: compiled vs eager training-step time for O1 and O2 vs torch.autocast.

One process, CPU, bf16, configurations interleaved round by round after a warmup (the
compiles happen in the warmup). Each step is forward + backward + SGD step; ampx steps use
`scale_loss`. One O1 session stays live for the whole run (re-initializing would drop every
compiled graph): the non-O1 configurations run inside `ampx.disable_casts()`, which compiled
code honours because it is entered outside the compiled call. The O2 session is made first.

Run::

    python benchmarks/bench_compile.py [--reps 15] [--backend inductor]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ampx  # noqa: E402


def model() -> nn.Module:
    """4 blocks of Linear(256) -> GELU -> LayerNorm, then a head."""
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.GELU(), nn.LayerNorm(256)]
    return nn.Sequential(*layers, nn.Linear(256, 16))


def make_step(net: Callable[[torch.Tensor], torch.Tensor], params: list[nn.Parameter],
              amp: ampx.Amp | None, autocast: bool, disabled: bool,
              x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    opt = torch.optim.SGD(params, lr=1e-3)
    if amp is not None:
        opt = amp.optimizers[0]

    def step() -> None:
        off = ampx.disable_casts() if disabled else contextlib.nullcontext()
        cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with off:
            opt.zero_grad()
            with cast:
                loss = F.mse_loss(net(x).float(), y)
            if amp is None:
                loss.backward()
            else:
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            opt.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--inner", type=int, default=5)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    torch.manual_seed(0)
    base, x, y = model(), torch.randn(64, 256), torch.randn(64, 16)
    nets = {name: copy.deepcopy(base) for name in ("fp32", "autocast", "O1", "O2")}
    amp_o2 = ampx.Amp("O2", dtype="bf16", verbosity=0)
    amp_o2.initialize(nets["O2"], torch.optim.SGD(nets["O2"].parameters(), lr=1e-3))
    amp_o1 = ampx.Amp("O1", dtype="bf16", verbosity=0)
    amp_o1.initialize(nets["O1"], torch.optim.SGD(nets["O1"].parameters(), lr=1e-3))
    steps: dict[str, Callable[[], None]] = {}
    for name, net in nets.items():
        amp = {"O1": amp_o1, "O2": amp_o2}.get(name)
        for compiled in (False, True):
            fn = torch.compile(net, backend=args.backend) if compiled else net
            label = f"{name} {'compiled' if compiled else 'eager'}"
            steps[label] = make_step(fn, list(net.parameters()), amp, name == "autocast",
                                     name != "O1", x, y)
    times: dict[str, list[float]] = {label: [] for label in steps}
    for rep in range(args.reps + 2):  # two warmup rounds (they compile)
        for label, step in steps.items():
            start = time.perf_counter()
            for _ in range(args.inner):
                step()
            if rep >= 2:
                times[label].append((time.perf_counter() - start) / args.inner)
    amp_o1.restore()
    amp_o2.restore()
    with open("/proc/loadavg") as f:
        load = f.read().strip()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bf16, backend "
          f"{args.backend}, median of {args.reps} rounds x {args.inner} steps; loadavg {load}")
    ref = statistics.median(times["autocast compiled"])
    print(f"{'config':20} {'ms/step':>8} {'p10-p90 ms':>14} {'/compiled autocast':>19}")
    for label, values in times.items():
        values = sorted(values)
        lo, hi = values[len(values) // 10], values[-1 - len(values) // 10]
        med = statistics.median(values)
        print(f"{label:20} {med * 1e3:8.2f} {lo * 1e3:6.2f}-{hi * 1e3:<7.2f} {med / ref:19.2f}")


if __name__ == "__main__":
    main()
