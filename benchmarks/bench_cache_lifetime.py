"""Evaluation forwards under O1 against autocast: the cost of the weight-cast cache's lifetime.

Issue 39 item 5 bounded O1's weight-cast cache to one forward of an initialized model (plus
its backward): an evaluation loop now casts every weight once per forward, as autocast does
with one autocast region per forward, where the cache used to serve the first forward's casts
to every later one (and so served stale casts after writes the version counter cannot see).
This measures that loop on `bench_step.py`'s three models: `torch.no_grad()` forwards of the
model in eval mode, autocast (one region per forward) against ampx O1, interleaved round by
round in one process (O1's patches installed only for its turn, as in `bench_step.py`). The
table gives the median forward time, its spread (25th-75th percentile) and the median of the
per-round O1/autocast ratios. Training steps are `bench_step.py`'s. To compare two checkouts,
run this file from each (it imports the ampx of the checkout it lives in), alternating::

    python benchmarks/bench_cache_lifetime.py [--reps 20] [--inner 20] [--dtype bf16]

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

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_step import MODELS  # noqa: E402

import ampx  # noqa: E402
from ampx.o1 import patch  # noqa: E402


def _turn(model: torch.nn.Module, x: torch.Tensor, inner: int, dtype: torch.dtype,
          o1: patch.CastConfig | None) -> float:
    """One warm-up and `inner` timed no_grad forwards; seconds per forward."""
    if o1 is not None:
        patch.activate(o1)
    try:
        times = []
        for i in range(inner + 1):
            start = time.perf_counter()
            with torch.no_grad():
                if o1 is None:
                    with torch.autocast("cpu", dtype=dtype):
                        model(x)
                else:
                    model(x)
            if i:
                times.append(time.perf_counter() - start)
        return sum(times) / inner
    finally:
        if o1 is not None:
            patch.deactivate()


def measure(key: str, dtype: torch.dtype, reps: int, inner: int) -> str:
    label, build, x_shape, _ = MODELS[key]
    torch.manual_seed(0)
    base = build().eval()
    x = torch.randn(x_shape)
    auto = copy.deepcopy(base)
    amp = ampx.Amp("O1", dtype=dtype, verbosity=0)
    o1_model = amp.initialize(copy.deepcopy(base))
    active = patch.active()
    assert active is not None
    config = active.config
    patch.deactivate()
    times: dict[str, list[float]] = {"autocast": [], "O1": []}
    for rep in range(reps + 1):  # the first round is warm-up
        order = [("autocast", auto, None), ("O1", o1_model, config)]
        for name, model, o1 in order if rep % 2 == 0 else order[::-1]:
            elapsed = _turn(model, x, inner, dtype, o1)
            if rep:
                times[name].append(elapsed)
    patch.activate(config)
    amp.restore()
    ratios = [a / b for a, b in zip(times["O1"], times["autocast"])]

    def spread(values: list[float], scale: float, fmt: str) -> str:
        q = statistics.quantiles(values, n=4)
        return f"{q[1] * scale:{fmt}} ({q[0] * scale:{fmt}}-{q[2] * scale:{fmt}})"

    return (f"| {label} | {spread(times['autocast'], 1e3, '.3f')} | "
            f"{spread(times['O1'], 1e3, '.3f')} | {spread(ratios, 1.0, '.3f')} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--inner", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    from ampx import _ext

    print(f"ampx {Path(ampx.__file__).parent}, kernels {_ext.BACKEND}, torch {torch.__version__}"
          f", {args.threads} threads, {args.dtype}; load {os.getloadavg()}")
    print("| model | autocast ms | ampx O1 ms | O1/autocast |")
    print("| --- | --- | --- | --- |")
    for key in args.models:
        print(measure(key, dtype, args.reps, args.inner), flush=True)
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
