"""`scale_loss` exit at a static unit scale: gradients checked in place vs unscaled into copies.

At bf16's default static loss scale of 1, a pass checks the gradients autograd produced where
they are (`ampx.scaling.unscale`); before, it unscaled them into fresh `empty_like` buffers like
every other pass. This benchmark trains the models of `bench_step.py` at O1 bf16 and times only the
exit of `scale_loss` (unscale, check, scale update, commit) under each behaviour (the copies
are forced by making `LossScaler.unit_scale` answer False).

The two behaviours run in separate processes, started in turn (A B A B ...), because they
leave the allocator in different states: alternating them inside one process measured the
allocator switching between the two patterns, which slowed both (0.7 ms -> 2.2 ms per exit on
the encoder). Each process prints the median exit time over `--steps` steps after a warm-up;
the table shows the median over `--runs` processes of each, the median of the pair-by-pair
ratios, and the load average.

Run::

    python benchmarks/bench_exit.py [--runs 5] [--steps 60] [--models encoder mlp conv]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_step import MODELS  # noqa: E402

import ampx  # noqa: E402
from ampx.scaling.scaler import LossScaler  # noqa: E402

_WARMUP = 10


def exit_time(key: str, steps: int, in_place: bool) -> float:
    """Median seconds of the `scale_loss` exit over `steps` O1 bf16 training steps."""
    _, build, x_shape, y_shape = MODELS[key]
    torch.manual_seed(0)
    model = build()
    x, y = torch.randn(x_shape), torch.randn(y_shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if not in_place:
        LossScaler.unit_scale = lambda self: False  # type: ignore[method-assign]
    amp = ampx.Amp("O1", dtype=torch.bfloat16, verbosity=0)
    model, opt = amp.initialize(model, opt)
    times = []
    try:
        for _ in range(steps + _WARMUP):
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x).float(), y)
            block = amp.scale_loss(loss, opt)
            block.__enter__().backward()
            start = time.perf_counter()
            block.__exit__(None, None, None)
            times.append(time.perf_counter() - start)
            opt.step()
    finally:
        amp.restore()
    return statistics.median(times[_WARMUP:])


def _child(key: str, steps: int, in_place: bool, threads: int) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--child", "in_place" if in_place else "copies",
         "--models", key, "--steps", str(steps), "--threads", str(threads)],
        check=True, capture_output=True, text=True)
    return float(out.stdout.split()[-1])


def measure(key: str, runs: int, steps: int, threads: int) -> str:
    """One table row: exit times in place and into copies (median over runs), their ratio."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(runs):
        for in_place in (True, False):
            times[in_place].append(_child(key, steps, in_place, threads))
    ratios = [a / b for a, b in zip(times[True], times[False])]
    return (f"| {MODELS[key][0]} | {statistics.median(times[True]) * 1e3:.3f} | "
            f"{statistics.median(times[False]) * 1e3:.3f} | {statistics.median(ratios):.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="processes per behaviour")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per process")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=["encoder", "conv", "mlp"],
                        choices=list(MODELS))
    parser.add_argument("--child", choices=["in_place", "copies"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        print(exit_time(args.models[0], args.steps, args.child == "in_place"))
        return
    print(f"torch {torch.__version__}, {args.threads} threads, O1 bf16 static scale 1, "
          f"{args.runs} processes per behaviour; load average before: "
          + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    print()
    print("| model | exit ms, checked in place | exit ms, into copies "
          "| in place / copies (min-max) |")
    print("| --- | --- | --- | --- |")
    for key in args.models:
        print(measure(key, args.runs, args.steps, args.threads), flush=True)
    print()
    print("load average after: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))


if __name__ == "__main__":
    main()
