"""`scale_loss` exit at a static unit scale: gradients checked in place vs unscaled into copies.

At bf16's default static loss scale of 1, a pass checks the gradients autograd produced where
they are (`ampx.unscale`); before, it unscaled them into fresh `empty_like` buffers like every
other pass. This benchmark trains the models of `bench_step.py` at O1 bf16 and alternates the
two behaviours step by step in one process (the fresh path is forced by making
`LossScaler.unit_scale` answer False), timing only the exit of `scale_loss` (unscale, check,
scale update, commit). It prints the median exit time of each, the median of the per-pair
ratios, and the load average.

Run::

    python benchmarks/bench_exit.py [--steps 100] [--models encoder mlp conv]
"""

from __future__ import annotations

import argparse
import os
import statistics
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
from ampx.scaler import LossScaler  # noqa: E402


def measure(key: str, steps: int) -> str:
    """One table row: exit times in place and into copies, and their paired ratio."""
    label, build, x_shape, y_shape = MODELS[key]
    torch.manual_seed(0)
    model = build()
    x, y = torch.randn(x_shape), torch.randn(y_shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    amp = ampx.Amp("O1", dtype=torch.bfloat16, verbosity=0)
    model, opt = amp.initialize(model, opt)
    real = LossScaler.unit_scale
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for i in range(steps * 2 + 10):
            in_place = i % 2 == 0
            LossScaler.unit_scale = real if in_place else (lambda self: False)  # type: ignore
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x).float(), y)
            block = amp.scale_loss(loss, opt)
            block.__enter__().backward()
            start = time.perf_counter()
            block.__exit__(None, None, None)
            if i >= 10:
                times[in_place].append(time.perf_counter() - start)
            opt.step()
    finally:
        LossScaler.unit_scale = real  # type: ignore[method-assign]
        amp.restore()
    ratios = [a / b for a, b in zip(times[True], times[False])]
    return (f"| {label} | {statistics.median(times[True]) * 1e3:.3f} | "
            f"{statistics.median(times[False]) * 1e3:.3f} | {statistics.median(ratios):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="steps per behaviour")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=["encoder", "conv", "mlp"],
                        choices=list(MODELS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, O1 bf16 static scale 1; "
          "load average before: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    print()
    print("| model | exit ms, checked in place | exit ms, into copies | in place / copies |")
    print("| --- | --- | --- | --- |")
    for key in args.models:
        print(measure(key, args.steps), flush=True)
    print()
    print("load average after: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))


if __name__ == "__main__":
    main()
