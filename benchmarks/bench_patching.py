"""Cost of O1's Python-level patching: a training step under fp32, torch.autocast and ampx O1.

Two models, one bf16 run on CPU (where bf16 matmuls are fast on AMX hardware):

- a 16-layer MLP, 64 wide, batch 8: tiny kernels, so the per-call overhead of the O1
  wrappers dominates;
- a 4-layer transformer encoder (d=512, seq 128, batch 16): realistic kernel sizes.

Each step is forward + backward (no optimizer step, which is identical in every configuration).
The configurations are measured alternately in the same process, after a warmup, and the
median of many repetitions is reported, as a time and as a ratio to torch.autocast.

Run::

    python benchmarks/bench_patching.py [--reps 30] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from ampx.o1 import patch  # noqa: E402


def mlp() -> nn.Module:
    """16 Linear+ReLU layers, 64 wide."""
    layers: list[nn.Module] = []
    for _ in range(16):
        layers += [nn.Linear(64, 64), nn.ReLU()]
    return nn.Sequential(*layers)


def encoder() -> nn.Module:
    """4 transformer encoder layers, d_model=512, 8 heads (dropout off: deterministic work)."""
    layer = nn.TransformerEncoderLayer(512, 8, dim_feedforward=2048, dropout=0.0,
                                       batch_first=True)
    return nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)


def make_step(model: nn.Module, x: torch.Tensor, mode: str,
              dtype: torch.dtype) -> Callable[[], None]:
    """One forward + backward in `mode` ("fp32", "autocast" or "ampx")."""
    params = list(model.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        ctx = (torch.autocast("cpu", dtype=dtype) if mode == "autocast" else nullcontext())
        with ctx:
            out = model(x)
            loss = out.float().square().mean()
        loss.backward()
        if mode == "ampx":
            patch.clear_cache()  # what scale_loss does at the end of an iteration

    return step


def measure(name: str, model: nn.Module, x: torch.Tensor, dtype: torch.dtype,
            reps: int, inner: int) -> dict[str, float]:
    """Median seconds per step of each mode, the modes interleaved repetition by repetition."""
    modes = ("fp32", "autocast", "ampx")
    steps = {mode: make_step(model, x, mode, dtype) for mode in modes}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    config = patch.CastConfig(dtype=dtype, device_types=frozenset({"cpu"}))
    for rep in range(reps + 2):  # the first two rounds are warmup
        for mode in modes:
            if mode == "ampx":
                patch.activate(config)
            try:
                start = time.perf_counter()
                for _ in range(inner):
                    steps[mode]()
                elapsed = (time.perf_counter() - start) / inner
            finally:
                if mode == "ampx":
                    patch.deactivate()
            if rep >= 2:
                times[mode].append(elapsed)
    return {mode: statistics.median(values) for mode, values in times.items()}


def per_call(dtype: torch.dtype, rounds: int = 7, calls: int = 20000) -> str:
    """Overhead of one patched call over the plain one: `F.linear(x, w, b)` on 2x2 tensors.

    The plain call gets weights already cast (requiring grad, as the cache serves them); O1
    gets the fp32 parameters (two cache hits per call); autocast gets them too (its own
    cache). Best of `rounds` rounds of `calls` calls each, configurations interleaved.
    """
    x = torch.randn(2, 2).to(dtype)
    w, b = nn.Parameter(torch.randn(2, 2)), nn.Parameter(torch.randn(2))
    cw, cb = w.to(dtype), b.to(dtype)
    linear = torch.nn.functional.linear
    config = patch.CastConfig(dtype=dtype, device_types=frozenset({"cpu"}))
    best = {"plain": 1e9, "ampx": 1e9, "autocast": 1e9}
    for _ in range(rounds):
        for mode in best:
            if mode == "ampx":
                patch.activate(config)
            ctx = torch.autocast("cpu", dtype=dtype) if mode == "autocast" else nullcontext()
            call = torch.nn.functional.linear  # the O1 wrapper while activated
            args = (x, cw, cb) if mode == "plain" else (x, w, b)
            try:
                with ctx:
                    start = time.perf_counter()
                    for _ in range(calls):
                        call(*args)
                    best[mode] = min(best[mode], (time.perf_counter() - start) / calls)
            finally:
                if mode == "ampx":
                    patch.deactivate()
    assert torch.nn.functional.linear is linear
    plain = best["plain"]
    return (f"per call, F.linear on 2x2 with two fp32 weights: plain {plain * 1e6:.2f} us; "
            f"O1 +{(best['ampx'] - plain) * 1e6:.2f} us; "
            f"autocast +{(best['autocast'] - plain) * 1e6:.2f} us over the plain call")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    torch.manual_seed(0)
    cases = [
        ("MLP 16x64, batch 8", mlp(), torch.randn(8, 64), 20),
        ("Encoder 4x512, seq 128, batch 16", encoder(), torch.randn(16, 128, 512), 1),
    ]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {dtype}, "
          f"median of {args.reps} (forward + backward per step)")
    header = (f"{'model':34} {'fp32 ms':>9} {'autocast ms':>12} {'ampx O1 ms':>11} "
              f"{'autocast/fp32':>14} {'O1/fp32':>8} {'O1/autocast':>12}")
    print(header)
    print("-" * len(header))
    for name, model, x, inner in cases:
        t = measure(name, model, x, dtype, args.reps, inner)
        print(f"{name:34} {t['fp32'] * 1e3:9.3f} {t['autocast'] * 1e3:12.3f} "
              f"{t['ampx'] * 1e3:11.3f} {t['autocast'] / t['fp32']:14.2f} "
              f"{t['ampx'] / t['fp32']:8.2f} {t['ampx'] / t['autocast']:12.2f}")
    print(per_call(dtype))


if __name__ == "__main__":
    main()
