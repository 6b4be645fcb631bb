"""Cost of O1's Python-level patching: a training step under fp32, torch.autocast and ampx O1.

Two models, one bf16 run on CPU (where bf16 matmuls are fast on AMX hardware):

- a 16-layer MLP, 64 wide, batch 8: tiny kernels, so the per-call overhead of the O1
  wrappers dominates;
- a 4-layer transformer encoder (d=512, seq 128, batch 16): realistic kernel sizes.

Each step is forward + backward (no optimizer step, which is identical in every configuration).
The configurations are measured alternately in the same process, after a warmup, and the
median of many repetitions is reported, as a time and as a ratio to torch.autocast.

Run::

    python benchmarks/bench_patching.py [--reps 30] [--dtype bf16] [--per-call-only]

The per-call table compares O1's native (C) wrappers, its Python closures and torch.autocast
on F.linear, x.softmax() and x + y (see `per_call`).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from ampx.o1 import patch, wrappers  # noqa: E402


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


def _per_call_cases(dtype: torch.dtype) -> dict[str, dict[str, Callable[[], Any]]]:
    """Per op: the call under O1/autocast, and the plain call doing the same work by hand.

    F.linear: O1 gets the fp32 parameters (two cache hits per call), the plain call weights
    already cast (requiring grad, as the cache serves them), autocast the fp32 parameters
    (its own cache). x.softmax(): O1 runs it in float32 (the plain call casts by hand),
    autocast's CPU policy in the half dtype (its plain call is the same call). x + y: two fp32
    tensors (promote finds nothing to cast); nothing is cast anywhere.
    """
    x = torch.randn(2, 2).to(dtype)
    w, b = nn.Parameter(torch.randn(2, 2)), nn.Parameter(torch.randn(2))
    cw, cb = w.to(dtype), b.to(dtype)
    h = torch.randn(4, 8).to(dtype)
    f, g = torch.randn(4, 8), torch.randn(4, 8)
    fn = torch.nn.functional
    return {
        "F.linear": {"o1": lambda: fn.linear(x, w, b), "o1 plain": lambda: fn.linear(x, cw, cb),
                     "autocast": lambda: fn.linear(x, w, b),
                     "autocast plain": lambda: fn.linear(x, cw, cb)},
        "x.softmax()": {"o1": lambda: h.softmax(-1), "o1 plain": lambda: h.float().softmax(-1),
                        "autocast": lambda: h.softmax(-1), "autocast plain": lambda: h.softmax(-1)},
        "x + y": {"o1": lambda: f + g, "o1 plain": lambda: f + g,
                  "autocast": lambda: f + g, "autocast plain": lambda: f + g},
    }


def _loop(call: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def per_call(dtype: torch.dtype, rounds: int = 15, calls: int = 20000) -> list[str]:
    """Overhead of one patched call over its plain counterpart, in microseconds.

    Native C wrappers, Python closures and torch.autocast, best of `rounds` rounds of
    `calls` calls each, every configuration measured once per round (interleaved); the plain
    calls are timed in the same round, right next to the wrapped ones. Calls are looked up
    as attributes at call time, so the wrappers of the active session run.
    """
    config = patch.CastConfig(dtype=dtype, device_types=frozenset({"cpu"}))
    cases = _per_call_cases(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2x2 ops: an intra-op pool only adds OpenMP noise
    try:
        best = _per_call_rounds(config, cases, rounds, calls)
    finally:
        torch.set_num_threads(threads)
    engines = [e for e in ("native", "python", "autocast") if (e, "x + y") in best]
    lines = [f"per call (us over the plain call; best of {rounds} x {calls} calls, interleaved, "
             "1 intra-op thread)",
             f"{'op':14} " + " ".join(f"{e:>10}" for e in engines)
             + ("   native - autocast" if "native" in engines else "")]
    for op in cases:
        over = {e: (best[(e, op)] - best[(e, op + ' plain')]) * 1e6 for e in engines}
        line = f"{op:14} " + " ".join(f"{over[e]:+10.2f}" for e in engines)
        if "native" in over:
            line += f"   {over['native'] - over['autocast']:+.2f}"
        lines.append(line)
    return lines


def _per_call_rounds(config: patch.CastConfig, cases: dict[str, dict[str, Callable[[], Any]]],
                     rounds: int, calls: int) -> dict[tuple[str, str], float]:
    engines = ["python", "autocast"]
    if wrappers.native_class() is not None:
        engines.insert(0, "native")
    best: dict[tuple[str, str], float] = collections.defaultdict(lambda: 1e9)
    for _ in range(rounds):
        for engine in engines:
            for op, calls_of in cases.items():
                plain = calls_of["autocast plain" if engine == "autocast" else "o1 plain"]
                wrapped = calls_of["autocast" if engine == "autocast" else "o1"]
                best[(engine, op + " plain")] = min(best[(engine, op + " plain")],
                                                    _loop(plain, calls))
                if engine == "autocast":
                    with torch.autocast("cpu", dtype=config.dtype):
                        elapsed = _loop(wrapped, calls)
                else:
                    patch.activate(config, native=engine == "native")
                    try:
                        elapsed = _loop(wrapped, calls)
                    finally:
                        patch.deactivate()
                best[(engine, op)] = min(best[(engine, op)], elapsed)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--rounds", type=int, default=15, help="per-call rounds")
    parser.add_argument("--per-call-only", action="store_true",
                        help="only the per-call overheads (skip the training steps)")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    torch.manual_seed(0)
    print("load average (1, 5, 15 min): " + ", ".join(f"{v:.2f}" for v in os.getloadavg()))
    if args.per_call_only:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {dtype}")
        print("\n".join(per_call(dtype, args.rounds)))
        print("load average (1, 5, 15 min): " + ", ".join(f"{v:.2f}" for v in os.getloadavg()))
        return
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
    print("\n".join(per_call(dtype, args.rounds)))
    print("load average (1, 5, 15 min): " + ", ".join(f"{v:.2f}" for v in os.getloadavg()))


if __name__ == "__main__":
    main()
