"""What the built-in examples share: their options, and the plain torch.autocast loop.

One job: the parts of `convnet.py` and `transformer_lm.py` that are the same, so that the
sweep's `autocast` row trains exactly like the amp rows.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Optional

import torch

__all__ = ["AutocastRecorder", "example_parser", "train_autocast"]


class AutocastRecorder:
    """Telemetry for the examples' plain torch.autocast loop, in ampx's record format.

    ampx writes telemetry from `initialize` and the optimizer's step hooks; the autocast loop
    uses neither, so the examples call this after each step instead. Does nothing when
    AMPX_TELEMETRY is unset.

    Args:
        dtype: The autocast dtype.
        scaler: The loop's GradScaler (its scale is recorded).
        device: The model's device (for the peak-memory reading).
    """

    def __init__(self, dtype: torch.dtype, scaler: torch.amp.GradScaler,
                 device: torch.device) -> None:
        from ampx import telemetry
        from ampx.options.values import dtype_name

        self._sink = telemetry.sink()
        self._scaler = scaler
        self._device = device
        self._last = time.perf_counter()
        if self._sink is not None:
            self._sink.emit(
                "init", opt_level="autocast", dtype=dtype_name(dtype),
                loss_scale="dynamic" if scaler.is_enabled() else 1.0,
                properties={"autocast": True}, requested={}, forced={},
            )

    def step(self, loss: torch.Tensor, *, skipped: bool = False,
             loss_value: Optional[float] = None) -> None:
        """Record one optimizer step (call it after `scaler.update()`)."""
        now = time.perf_counter()
        if self._sink is not None:
            self._sink.step(
                optimizer=0, step_time_s=now - self._last,
                loss=float(loss.detach().float().item()) if loss_value is None else loss_value,
                loss_scale=float(self._scaler.get_scale()) if self._scaler.is_enabled() else 1.0,
                skipped=skipped, device=self._device,
            )
        self._last = now


def train_autocast(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list,
    args: Any,
    compute_loss: Callable[[torch.nn.Module, Any], torch.Tensor],
) -> None:
    """The examples' loop with plain torch.autocast and GradScaler (the sweep's `autocast` row).

    Args:
        model: The fp32 model.
        optimizer: Its optimizer.
        batches: Batches, cycled for `args.steps` steps.
        args: The example's parsed options (`steps`, `dtype`, `log_interval`).
        compute_loss: `(model, batch) -> loss`, run inside the autocast region.
    """
    device = next(model.parameters()).device
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    recorder = AutocastRecorder(dtype, scaler, device)
    for step in range(args.steps):
        with torch.autocast(device.type, dtype=dtype):
            loss = compute_loss(model, batches[step % len(batches)])
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        recorder.step(loss, skipped=scaler.get_scale() < scale)
        if step % args.log_interval == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  scale {scaler.get_scale():g}",
                  flush=True)


def example_parser(doc: str | None, *, steps: int, batch_size: int,
                   lr: float) -> argparse.ArgumentParser:
    """The options every built-in example takes; each script adds its model's own."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--opt-level", default="O1", help="passed to amp.initialize")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--autocast", action="store_true",
                        help="plain torch.autocast + GradScaler instead of amp")
    parser.add_argument("--dtype", default="bf16", choices=["fp16", "bf16"],
                        help="autocast dtype (amp's dtype comes from `ampx run --dtype`)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--save", default=None, help="write a checkpoint here at the end")
    return parser
