"""What the built-in examples share: their options, the held-out evaluation, the autocast loop.

One job: the parts of `convnet.py` and `transformer_lm.py` that are the same, so that the
sweep's `autocast` row trains and evaluates exactly like the amp rows. The evaluation runs on
the held-out split every `--eval-every` steps and after the last one, in the precision the
run trains in, and reports `heldout_loss` (and `heldout_accuracy` for a classifier) with
`ampx.log_metric`.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Optional

import torch

__all__ = ["AutocastRecorder", "Evaluator", "example_parser", "train_autocast"]

Metrics = Callable[[torch.nn.Module, Any], "tuple[torch.Tensor, Optional[torch.Tensor], int]"]
"""`(model, batch) -> (summed loss, correct predictions or None, count)` of one held-out batch."""


class Evaluator:
    """The held-out evaluation of a built-in example.

    Args:
        heldout: The held-out batches.
        metrics: See `Metrics`.
        steps: The run's steps (the last one is always evaluated).
        every: Evaluate after every this many steps (0: `steps // 8`, at least 1).
        autocast: The autocast dtype of the sweep's autocast row (None for the amp rows,
            whose model or patched functions already run in their precision).
        eval_mode: Switch the model to eval mode (batchnorm's running statistics). The
            transformer stays in train mode (it has no dropout): in eval mode without grad
            torch's fused encoder fast path would run it in fp32 whatever O1 patched.
    """

    def __init__(self, heldout: list, metrics: Metrics, steps: int, every: int = 0,
                 autocast: Optional[torch.dtype] = None, eval_mode: bool = True) -> None:
        self.heldout, self.metrics, self.steps = heldout, metrics, steps
        self.every = every if every > 0 else max(1, steps // 8)
        self.autocast = autocast
        self.eval_mode = eval_mode
        self.history: list[tuple[int, float, Optional[float]]] = []

    def after(self, model: torch.nn.Module, step: int) -> None:
        """Call after optimizer step `step` (1-based); evaluates when it is due."""
        if step % self.every and step != self.steps:
            return
        import ampx

        loss, accuracy = self.evaluate(model)
        ampx.log_metric("heldout_loss", loss, step=step)
        if accuracy is not None:
            ampx.log_metric("heldout_accuracy", accuracy, step=step)
        self.history.append((step, loss, accuracy))
        shown = f"  accuracy {accuracy:.4f}" if accuracy is not None else ""
        print(f"eval {step:4d}  heldout_loss {loss:.4f}{shown}", flush=True)

    def evaluate(self, model: torch.nn.Module) -> tuple[float, Optional[float]]:
        """Mean held-out loss and accuracy (None when `metrics` gives no count of correct)."""
        was_training = model.training
        model.train(not self.eval_mode and was_training)
        total, correct, count = 0.0, 0.0, 0
        has_correct = True
        device = next(model.parameters()).device
        try:
            with torch.no_grad(), torch.autocast(device.type, dtype=self.autocast or
                                                 torch.bfloat16, enabled=self.autocast is not None):
                for batch in self.heldout:
                    loss_sum, right, n = self.metrics(model, batch)
                    total += float(loss_sum.float().item())
                    count += n
                    if right is None:
                        has_correct = False
                    else:
                        correct += float(right.item())
        finally:
            model.train(was_training)
        return total / max(1, count), (correct / max(1, count) if has_correct else None)


def record_data(described: dict[str, Any]) -> None:
    """Write what the example trains on to telemetry (`meta.data` of sweep.json)."""
    import os

    from ampx import telemetry

    if os.environ.get(telemetry.ENV_VAR):
        writer = telemetry.sink()
        if writer is not None:
            writer.emit("data", **described)


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
    evaluator: Optional[Evaluator] = None,
) -> None:
    """The examples' loop with plain torch.autocast and GradScaler (the sweep's `autocast` row).

    Args:
        model: The fp32 model.
        optimizer: Its optimizer.
        batches: Batches, cycled for `args.steps` steps.
        args: The example's parsed options (`steps`, `dtype`, `log_interval`).
        compute_loss: `(model, batch) -> loss`, run inside the autocast region.
        evaluator: The held-out evaluation (called after every step; it runs when due).
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
        if evaluator is not None:
            evaluator.after(model, step + 1)


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
    parser.add_argument("--eval-every", type=int, default=0, metavar="N",
                        help="evaluate on the held-out split every N steps and after the last "
                             "(default: steps // 8)")
    return parser
