"""Step-time cost of overflow provenance at O2 on a transformer encoder (ratios, one process).

Three configurations of one O2 session, model and optimizer, interleaved in one process (the
order rotates every round; the median over rounds of each round's median step time is
reported, as a ratio to ``off``, in process CPU time (one thread: steady on a shared machine)
and in wall time):

- ``off``: no per-tensor flags and no provenance bookkeeping (the session's
  ``SessionHooks.per_tensor`` switched off and its ``overflow_watch`` detached);
- ``on``: the default, always-on provenance: the unscale kernels also write one flag per
  gradient, kept until the step; the per-step bookkeeping of the session's watch;
- ``forward``: ``on`` plus the opt-in forward detector (``detect_overflow="forward"``): one
  forward hook per module recording ``abs().max()`` of its output on the device.

Each timed step is a full training step (zero_grad, forward, loss, scaled backward, step)
on clean data: provenance only costs on clean steps what it adds to the hot path.

Usage::

    python benchmarks/bench_overflow.py                       # CPU, bf16
    python benchmarks/bench_overflow.py --dtype fp16 --rounds 7
    AMPX_DISABLE_EXT=1 python benchmarks/bench_overflow.py    # the reference kernels

The script prints ``/proc/loadavg`` next to the numbers. Target (issue 14): ``on`` <= 1.01x.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from ampx.overflow.forward import ForwardDetector  # noqa: E402
from ampx.scaling.protocol import amp_state_of  # noqa: E402

CONFIGS = ("off", "on", "forward")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=6, help="timed steps per configuration per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[nn.Module, Any, ampx.Amp, Callable[[], None]]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=args.d_model, nhead=8,
                                       dim_feedforward=4 * args.d_model, dropout=0.0,
                                       batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=args.layers, enable_nested_tensor=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    amp = ampx.Amp(opt_level="O2", dtype=dtype, loss_scale="dynamic", verbosity=0)
    model, opt = amp.initialize(model, opt)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.seq, args.d_model, generator=g)
    y = torch.randn(args.batch, args.seq, args.d_model, generator=g)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()

    return model, opt, amp, step


class Toggle:
    """Switches one session between the configurations."""

    def __init__(self, model: nn.Module, opt: Any, amp: ampx.Amp) -> None:
        state = amp_state_of(opt)
        assert state is not None and amp.overflow_watch is not None
        self.model, self.state, self.amp = model, state, amp
        self.policy, self.watch = state.policy, amp.overflow_watch
        self.detector: ForwardDetector | None = None

    def set(self, config: str) -> None:
        if self.detector is not None:
            self.detector.remove()
            self.detector = None
        self.state.policy = dataclasses.replace(self.policy, per_tensor=config != "off")
        self.amp.overflow_watch = None if config == "off" else self.watch
        self.watch.detector = None
        if config == "forward":
            self.detector = self.watch.detector = ForwardDetector([self.model])


def time_steps(step: Callable[[], None], n: int) -> tuple[float, float]:
    """Median wall and process-CPU seconds of `n` steps."""
    wall, cpu = [], []
    for _ in range(n):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, opt, amp, step = build(args)
    toggle = Toggle(model, opt, amp)
    for config in CONFIGS:  # warm-up of every path
        toggle.set(config)
        step()
    medians: dict[str, list[tuple[float, float]]] = {c: [] for c in CONFIGS}
    for r in range(args.rounds):
        order = CONFIGS[r % 3:] + CONFIGS[:r % 3]
        for config in order:
            toggle.set(config)
            medians[config].append(time_steps(step, args.steps))
    toggle.set("on")
    skipped = amp_state_of(opt).skipped_steps  # type: ignore[union-attr]
    ampx.restore()
    with open("/proc/loadavg") as f:
        load = f.read().strip()
    def ratio(config: str, which: int) -> float:
        return statistics.median(m[which] / o[which]
                                 for m, o in zip(medians[config], medians["off"]))

    result = {
        "dtype": args.dtype, "backend": _ext.BACKEND, "threads": args.threads,
        "model": f"TransformerEncoder d{args.d_model} x{args.layers}, batch {args.batch}x"
                 f"{args.seq}, AdamW, O2",
        "off_step_ms": statistics.median(m[0] for m in medians["off"]) * 1e3,
        "on_ratio_cpu": ratio("on", 1), "forward_ratio_cpu": ratio("forward", 1),
        "on_ratio_wall": ratio("on", 0), "forward_ratio_wall": ratio("forward", 0),
        "rounds": args.rounds, "steps_per_round": args.steps, "skipped_steps": skipped,
        "loadavg": load,
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>16}: {value:.4f}" if isinstance(value, float) else
                  f"{key:>16}: {value}")
    return result


if __name__ == "__main__":
    main()
