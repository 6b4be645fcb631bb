"""`ampx selftest`: check this installation on every device present, in well under a minute.

One job: on the CPU and on each CUDA device, (1) compare the native kernels, called through
the dispatcher `ampx._ext`, with the pure-torch reference (`ampx.cli.selftest_kernels`; a GPU
whose tensors do not reach native CUDA kernels fails), (2) train a small model 20 steps at O1 and O2
in each half dtype with one forced overflow, checking that exactly that step is skipped, the
dynamic loss scale backs off, and the loss falls, and (3) time O1 and O2 steps against
torch.autocast (+ GradScaler for fp16) on the same model. It prints a table and a verdict and
exits 1 on any mismatch or failed training check (timings are reported, never judged).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import time
from collections.abc import Iterator
from typing import Any, Callable, Optional

__all__ = ["Check", "main", "run_checks"]

_STEPS = 20
_OVERFLOW_STEP = 10


@dataclasses.dataclass
class Check:
    """One line of the selftest table.

    Attributes:
        device: "cpu", "cuda:0", ...
        check: What was checked ("kernels", "train O1 bf16", "speed bf16").
        status: "pass", "FAIL", "skip" or "info" (timings).
        detail: The numbers, or what went wrong.
    """

    device: str
    check: str
    status: str
    detail: str


def devices() -> list[str]:
    """The devices to check: the CPU and every CUDA device."""
    import torch

    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return found


def kernel_check(device: str, native: Any = None,
                 limits: Optional[dict[str, int]] = None) -> Check:
    """Native vs reference kernels on `device`, through `ampx._ext` as in training.

    A CUDA device whose tensors the dispatcher does not send to native CUDA kernels
    fails (unless AMPX_DISABLE_EXT asks for the reference); on CUDA the launch-batching
    cases sized from the kernels' `cuda_limits()` run too.

    Args:
        device: "cpu", "cuda:0", ...
        native: A stand-in backend for tests (default: `ampx._ext` when it routes
            `device` to the extension).
        limits: Launch limits for the batching cases (default: the extension's, on CUDA).
    """
    import torch

    from .. import _ext
    from .selftest_kernels import compare_backends, compare_batching, native_for

    if native is None:
        native, why_not = native_for(torch.device(device))
        if native is None:
            if device.startswith("cuda") and not _ext._disabled():
                return Check(device, "kernels", "FAIL", f"a GPU is visible but {why_not}")
            return Check(device, "kernels", "skip", f"{why_not}; the reference is in use")
        if device.startswith("cuda") and limits is None:
            module = _ext._native_module()
            limits = dict(getattr(module, "cuda_limits", dict)()) or None
    result = compare_backends(native, torch.device(device))
    what = "3 dtypes, inf/NaN placements"
    if limits:
        batching = compare_batching(native, torch.device(device), limits)
        result = {"cases": result["cases"] + batching["cases"],
                  "mismatches": result["mismatches"] + batching["mismatches"]}
        what += f", launch batching at chunk {limits['chunk']}"
    if result["mismatches"]:
        shown = ", ".join(result["mismatches"][:4])
        more = len(result["mismatches"]) - 4
        return Check(device, "kernels", "FAIL",
                     f"{len(result['mismatches'])}/{result['cases']} differ: {shown}"
                     + (f" (+{more} more)" if more > 0 else ""))
    return Check(device, "kernels", "pass", f"{result['cases']} comparisons identical ({what})")


def _model(device: str, width: int, depth: int) -> Any:
    import torch

    layers: list[torch.nn.Module] = []
    for i in range(depth):
        layers += [torch.nn.Linear(16 if i == 0 else width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 4))
    return torch.nn.Sequential(*layers).to(device)


@dataclasses.dataclass
class _Trained:
    losses: list[float]
    skipped: list[bool]
    scales: list[float]
    finite: bool


def _train(device: str, level: str, dtype: str) -> _Trained:
    import torch

    from ..frontend import Amp

    torch.manual_seed(0)
    model = _model(device, 32, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 16, device=device), torch.randn(64, 4, device=device)
    amp = Amp(level, dtype=dtype, verbosity=0, loss_scale="dynamic" if dtype == "fp16" else None)
    try:
        model, optimizer = amp.initialize(model, optimizer)
        out = _Trained([], [], [], True)
        for step in range(_STEPS):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            if step == _OVERFLOW_STEP:
                loss = loss * float("inf")  # the forced overflow
            optimizer.zero_grad()
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            out.losses.append(float(loss.detach()))
            out.skipped.append(amp.step_was_skipped(optimizer))
            out.scales.append(amp.loss_scale())
        out.finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        return out
    finally:
        amp.restore()


def training_check(device: str, level: str, dtype: str) -> Check:
    """20 steps at `level` in `dtype` with an overflow forced at step 10."""
    name = f"train {level} {dtype}"
    try:
        run = _train(device, level, dtype)
    except Exception as exc:  # a crash is a failed check, reported with its reason
        return Check(device, name, "FAIL", f"raised {type(exc).__name__}: {exc}"[:200])
    problems = []
    skipped = [i for i, s in enumerate(run.skipped) if s]
    if _OVERFLOW_STEP not in skipped:
        problems.append(f"the overflow step {_OVERFLOW_STEP} was not skipped")
    if dtype == "bf16" and skipped != [_OVERFLOW_STEP]:
        problems.append(f"skipped steps {skipped}, expected only {_OVERFLOW_STEP}")
    before, after = run.scales[_OVERFLOW_STEP - 1], run.scales[_OVERFLOW_STEP]
    if dtype == "fp16" and not after <= before / 2:
        problems.append(f"loss scale {before:g} -> {after:g} after the overflow")
    if not run.finite:
        problems.append("parameters became non-finite")
    if not run.losses[-1] < run.losses[0]:
        problems.append(f"loss did not fall ({run.losses[0]:.4f} -> {run.losses[-1]:.4f})")
    if problems:
        return Check(device, name, "FAIL", "; ".join(problems))
    return Check(device, name, "pass",
                 f"loss {run.losses[0]:.3f} -> {run.losses[-1]:.3f}, skipped {skipped}, "
                 f"scale {run.scales[0]:g} -> {run.scales[-1]:g}")


def _stepper(kind: str, device: str, dtype: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """A training step of one configuration, and how to undo its set-up."""
    import torch

    from ..frontend import Amp
    from ..options.values import parse_dtype

    torch.manual_seed(0)
    big = device != "cpu"
    model = _model(device, 1024 if big else 256, 4 if big else 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(256 if big else 64, 16, device=device)
    y = torch.randn(x.shape[0], 4, device=device)
    half = parse_dtype(dtype)
    if kind in ("fp32", "autocast"):
        scaler = torch.amp.GradScaler(device.split(":")[0],
                                      enabled=kind == "autocast" and dtype == "fp16")

        def plain_step() -> None:
            with torch.autocast(device.split(":")[0], dtype=half, enabled=kind == "autocast"):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

        return plain_step, lambda: None
    amp = Amp(kind, dtype=dtype, verbosity=0)
    model, optimizer = amp.initialize(model, optimizer)

    def amp_step() -> None:
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()

    return amp_step, amp.restore


def _time(step: Callable[[], None], device: str, count: int) -> list[float]:
    import torch

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    times = []
    for _ in range(count):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return times


def speed_check(device: str, dtype: str, rounds: int = 2, steps: int = 6) -> Check:
    """Median step times of fp32, autocast, O1 and O2; rounds alternate their order."""
    kinds = ["fp32", "autocast", "O1", "O2"]
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for round_index in range(rounds):
        for kind in kinds if round_index % 2 == 0 else kinds[::-1]:
            step, close = _stepper(kind, device, dtype)
            try:
                _time(step, device, 2)  # warm-up
                times[kind] += _time(step, device, steps)
            finally:
                close()
    median = {kind: statistics.median(values) for kind, values in times.items()}
    ratio = {kind: median[kind] / median["autocast"] for kind in ("O1", "O2")}
    detail = (f"ms/step fp32 {median['fp32'] * 1e3:.2f}, autocast {median['autocast'] * 1e3:.2f}"
              f", O1 {median['O1'] * 1e3:.2f}, O2 {median['O2'] * 1e3:.2f}; "
              f"O1/autocast {ratio['O1']:.2f}, O2/autocast {ratio['O2']:.2f}")
    return Check(device, f"speed {dtype}", "info", detail)


def _guarded(device: str, name: str, check: Callable[[], Check]) -> Check:
    try:
        return check()
    except Exception as exc:  # report a crash as a failed line, then carry on
        return Check(device, name, "FAIL", f"raised {type(exc).__name__}: {exc}"[:200])


def run_checks(on: Optional[list[str]] = None, *, native: Any = None,
               speed: bool = True) -> Iterator[Check]:
    """Every check on every device, one at a time (so progress can be shown).

    Args:
        on: Devices (default: `devices()`).
        native: A stand-in for the native kernels (tests).
        speed: Include the timing lines.
    """
    from ..options.values import DTYPE_CHOICES
    for device in on or devices():
        yield _guarded(device, "kernels", functools.partial(kernel_check, device, native))
        for dtype in DTYPE_CHOICES:
            for level in ("O1", "O2"):
                yield training_check(device, level, dtype)
        if speed:
            for dtype in DTYPE_CHOICES:
                if device == "cpu" and dtype == "fp16":
                    continue  # emulated on most CPUs: a slow number that says nothing
                yield _guarded(device, f"speed {dtype}",
                               functools.partial(speed_check, device, dtype))


def format_report(checks: list[Check]) -> str:
    """The table and the verdict line."""
    from .info import format_columns

    rows = [["device", "check", "status", "detail"]]
    rows += [[c.device, c.check, c.status, c.detail] for c in checks]
    failed = [c for c in checks if c.status == "FAIL"]
    verdict = (f"FAIL: {len(failed)} of {len(checks)} checks failed" if failed else
               f"PASS: {sum(c.status == 'pass' for c in checks)} checks passed"
               + (f", {sum(c.status == 'skip' for c in checks)} skipped"
                  if any(c.status == "skip" for c in checks) else ""))
    return format_columns(rows) + "\n\n" + verdict


def main(as_json: bool = False) -> int:
    """`ampx selftest`: run, print, and return 1 on any failure."""
    import sys

    import torch

    threads = torch.get_num_threads()
    checks = []
    try:
        for check in run_checks():
            checks.append(check)
            print(f"ampx selftest: {check.device} {check.check}: {check.status}",
                  file=sys.stderr, flush=True)
    finally:
        torch.set_num_threads(threads)
    if as_json:
        print(json.dumps([dataclasses.asdict(c) for c in checks], indent=1))
    else:
        print(format_report(checks))
    return 1 if any(c.status == "FAIL" for c in checks) else 0
