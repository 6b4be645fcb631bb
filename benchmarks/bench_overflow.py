"""Step-time cost of overflow provenance at O2 on a transformer encoder (ratios, one process).

Configurations, interleaved in one process on one model and optimizer (rotated order each
round; the median over rounds of each round's median step time is reported as a ratio to
``base``):

- ``base``: the O2 training step (zero_grad, forward, loss, scaled backward, step);
- ``forward``: the same with the opt-in forward detector's hooks on every module
  (``ForwardDetector``, cleared after each step as the session does);
- ``flags``: the cost of always-on provenance: the O2 unscale of this model's gradients with
  per-tensor flags (``GradFlags.flags_for`` + the kernel's ``per_tensor``) minus the same
  unscale without them, measured back to back on the real master gradients, per step, as a
  fraction of the ``base`` step.

Usage::

    python benchmarks/bench_overflow.py                       # CPU, bf16
    python benchmarks/bench_overflow.py --dtype fp16 --rounds 5
    AMPX_DISABLE_EXT=1 python benchmarks/bench_overflow.py    # the reference kernels

Quote ``cat /proc/loadavg`` with the numbers (the script prints it). Target (issue 14):
always-on provenance <= 1% of the O2 step.
"""

from __future__ import annotations

import argparse
import json
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
from ampx import _ext  # noqa: E402
from ampx.forward_check import ForwardDetector  # noqa: E402
from ampx.optimizer import amp_state_of  # noqa: E402
from ampx.overflow import ParamNames  # noqa: E402
from ampx.provenance import GradFlags  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=8, help="timed steps per configuration per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[nn.Module, Any, Callable[[], None]]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=args.d_model, nhead=8,
                                       dim_feedforward=4 * args.d_model, dropout=0.0,
                                       batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=args.layers, enable_nested_tensor=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    model, opt = ampx.initialize(model, opt, opt_level="O2", dtype=dtype,
                                 loss_scale="dynamic", verbosity=0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.seq, args.d_model, generator=g)
    y = torch.randn(args.batch, args.seq, args.d_model, generator=g)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x).float(), y)
        with ampx.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()

    return model, opt, step


def time_steps(step: Callable[[], None], n: int, after: Callable[[], None] | None = None
               ) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        if after is not None:
            after()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def unscale_cost(model: nn.Module, opt: Any, n: int = 50) -> tuple[float, float]:
    """Median seconds of the O2 unscale without and with per-tensor flags (same grads)."""
    state = amp_state_of(opt)
    assert state is not None
    pairs = state.masters.pairs()
    src = [torch.randn_like(m) .to(p.dtype) for p, m in pairs]
    dst = [torch.empty_like(m) for _, m in pairs]
    holders = [m for _, m in pairs]
    tracker = GradFlags(ParamNames.from_models([model], masters=pairs))
    inv, found = torch.tensor([2.0**-16]), torch.zeros(1)
    plain, flagged = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        _ext.unscale_into_(src, dst, inv, found)
        t1 = time.perf_counter()
        flags = tracker.flags_for(0, holders, inv.device)
        _ext.unscale_into_(src, dst, inv, found, flags)
        tracker.clear()
        t2 = time.perf_counter()
        plain.append(t1 - t0)
        flagged.append(t2 - t1)
    return statistics.median(plain), statistics.median(flagged)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, opt, step = build(args)
    for _ in range(3):
        step()
    detector: ForwardDetector | None = None
    per_round: dict[str, list[float]] = {"base": [], "forward": []}
    configs = list(per_round)
    for r in range(args.rounds):
        for name in configs[r % 2:] + configs[:r % 2]:
            if name == "forward":
                detector = ForwardDetector([model])
                per_round[name].append(time_steps(step, args.steps, detector.clear))
                detector.remove()
            else:
                per_round[name].append(time_steps(step, args.steps))
    base = statistics.median(per_round["base"])
    ratios = [f / b for f, b in zip(per_round["forward"], per_round["base"])]
    plain, flagged = unscale_cost(model, opt)
    ampx.restore()
    with open("/proc/loadavg") as f:
        load = f.read().strip()
    result = {
        "dtype": args.dtype, "backend": _ext.BACKEND, "threads": args.threads,
        "model": f"encoder d{args.d_model} x{args.layers}, batch {args.batch}x{args.seq}",
        "base_step_ms": base * 1e3,
        "forward_ratio": statistics.median(ratios),
        "unscale_ms": plain * 1e3, "unscale_with_flags_ms": flagged * 1e3,
        "flags_cost_of_step": (flagged - plain) / base,
        "loadavg": load,
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>22}: {value:.4f}" if isinstance(value, float) else
                  f"{key:>22}: {value}")
    return result


if __name__ == "__main__":
    main()
