"""`ampx sweep`'s look at this CPU before it starts: the half dtypes' matmul speed at real shapes.

One job: time the products one training step of the example runs (`ampx.examples.sizes`),
at their real shapes, in float32 and in each half dtype swept, and say whether torch has
native kernels for them here. Without AVX512-BF16/AMX (or AVX512-FP16/AMX-FP16) oneDNN has no
half-precision matmul and torch emulates it: on a 2-core AVX2 machine 10-400x slower than
fp32 depending on the shape, so one small matmul says little (a 256x256 product ran 3x slower
where the example's 1024x512x2048 ran 90x slower). A half-dtype product that would take long
is timed on fewer rows and scaled up (its cost grows linearly with the rows), so the probe
takes a few hundred milliseconds even there. Nothing here decides; `ampx.cli.sweep.plan` does.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional

from ...examples.sizes import Kernel

__all__ = ["Probe", "half_native", "probe"]

_START_FLOPS = 2e7
"""Each product is first timed on the rows that make about this many flops."""
_SCALE_FROM_S = 0.02
"""A run on fewer rows that takes this long is scaled up to the full rows."""
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclasses.dataclass
class Probe:
    """What the probe found.

    Attributes:
        capability: torch's CPU kernel level (`torch.backends.cpu.get_cpu_capability()`).
        native: Per half dtype swept, whether oneDNN has native matmul kernels for it here.
        seconds: Per dtype ("fp32", "bf16", ...), per kernel label, the seconds of one run at
            the full shape (scaled up from fewer rows where `scaled` says so).
        scaled: Kernel labels whose time (in some dtype) was scaled up from fewer rows.
        forward_s: Per dtype, the forward pass's products (counts included), in seconds.
        elapsed_s: How long probing took.
    """

    capability: str
    native: dict[str, bool]
    seconds: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    scaled: list[str] = dataclasses.field(default_factory=list)
    forward_s: dict[str, float] = dataclasses.field(default_factory=dict)
    elapsed_s: float = 0.0

    def slowdown(self, dtype: str) -> Optional[float]:
        """How many times longer the forward pass's products take in `dtype` than in fp32."""
        base, half = self.forward_s.get("fp32"), self.forward_s.get(dtype)
        if not base or half is None:
            return None
        return half / base

    def slowest(self, dtype: str) -> tuple[str, float]:
        """The product that takes longest in `dtype` (label), and its slowdown against fp32."""
        times = self.seconds[dtype]
        label = max(times, key=lambda key: times[key])
        return label, times[label] / max(self.seconds["fp32"][label], 1e-9)

    def emulated(self, dtype: str) -> bool:
        """True when `dtype` has no native matmul here or runs over twice fp32's time."""
        slowdown = self.slowdown(dtype)
        return not self.native.get(dtype, True) or (slowdown is not None and slowdown > 2.0)

    def as_dict(self) -> dict[str, Any]:
        """For sweep.json."""
        return dataclasses.asdict(self)


def half_native(dtype: str) -> bool:
    """Whether oneDNN has native CPU matmul kernels for "bf16" or "fp16" on this machine."""
    import torch

    check = {"bf16": "_is_mkldnn_bf16_supported", "fp16": "_is_mkldnn_fp16_supported"}[dtype]
    try:
        return bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


def _runner(kernel: Kernel, rows: int, dtype: Any) -> Callable[[], Any]:
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    if kernel.kind == "mm":
        k, n = kernel.dims
        a = torch.randn(rows, k, generator=gen).to(dtype)
        b = torch.randn(k, n, generator=gen).to(dtype)
        return lambda: torch.mm(a, b)
    c_in, c_out, hw, stride = kernel.dims
    x = torch.randn(rows, c_in, hw, hw, generator=gen).to(dtype)
    w = torch.randn(c_out, c_in, 3, 3, generator=gen).to(dtype)
    return lambda: F.conv2d(x, w, stride=stride, padding=1)


def _best(run: Callable[[], Any]) -> float:
    """The fastest of a few runs (at least two, until about 20 ms were spent): on a shared
    machine a single run can include another process's time slice."""
    best, spent = math.inf, 0.0
    for rep in range(5):
        start = time.perf_counter()
        run()
        seconds = time.perf_counter() - start
        best, spent = min(best, seconds), spent + seconds
        if rep >= 1 and spent >= 0.02:
            break
    return best


def _time(kernel: Kernel, dtype: Any) -> tuple[float, bool]:
    """Seconds of one run at the full shape; True when scaled up from fewer rows.

    Starts with about 20 MFLOP worth of rows and takes 8 times more rows while a run is
    under 20 ms (too short to scale up: fixed costs and another process's time slice would be
    multiplied with the rows).
    """
    rows = max(1, min(kernel.rows, int(_START_FLOPS * kernel.rows / kernel.flops)))
    _runner(kernel, 1, dtype)()  # warm-up: kernel selection, thread pool
    while True:
        seconds = _best(_runner(kernel, rows, dtype))
        if rows == kernel.rows:
            return seconds, False
        if seconds >= _SCALE_FROM_S:
            return seconds * kernel.rows / rows, True
        rows = min(kernel.rows, rows * 8)


def probe(kernels: Sequence[Kernel], dtypes: Sequence[str]) -> Probe:
    """Time `kernels` (one forward pass) in fp32 and each of `dtypes` on this CPU.

    Args:
        kernels: The products of the example's forward pass at the size to check.
        dtypes: Half dtypes to time ("bf16", "fp16").

    Returns:
        The probe's findings (about 0.1-0.6 s of work; see the module's docstring).
    """
    import torch

    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core's speed: on a busy machine threads stall on each other
    try:
        found = _probe(kernels, dtypes)
    finally:
        torch.set_num_threads(threads)
    found.elapsed_s = time.perf_counter() - started
    return found


def _probe(kernels: Sequence[Kernel], dtypes: Sequence[str]) -> Probe:
    import torch

    found = Probe(capability=torch.backends.cpu.get_cpu_capability(),
                  native={d: half_native(d) for d in dtypes})
    distinct = list({k.label: k for k in kernels}.values())
    for name in ("fp32", *dtypes):
        dtype = getattr(torch, DTYPES[name])
        times: dict[str, float] = {}
        for kernel in distinct:
            times[kernel.label], scaled = _time(kernel, dtype)
            if scaled and kernel.label not in found.scaled:
                found.scaled.append(kernel.label)
        found.seconds[name] = times
        found.forward_s[name] = sum(times[k.label] * k.count for k in kernels)
    return found
