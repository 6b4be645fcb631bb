"""Throughput of ampx's multi-tensor kernels against torch and against memcpy.

Run ``python benchmarks/bench_kernels.py`` (after ``ampx build-ext`` for the native
column). One run measures, side by side and interleaved, for float32, float16 and
bfloat16 on a workload of ~25M elements in ~200 tensors of mixed sizes:

* ``native``: ``ampx._C`` (the extension), when it is built;
* ``reference``: ``ampx._reference`` (the pure-torch fallback);
* ``torch``: what torch offers for the same job (GradScaler's
  ``_amp_foreach_non_finite_check_and_unscale_``, the two-pass copy-then-unscale for
  ``unscale_into_``, ``_foreach_norm`` + ``vector_norm`` as in ``clip_grad_norm_``,
  ``_foreach_copy_``);
* ``memcpy``: one contiguous ``copy_`` that moves as many bytes as the kernel must
  (B/2 read + B/2 written = B moved), the physical bound on this machine.

Bandwidth counts the bytes a kernel must move (inputs read once, outputs written
once). Each figure is the median of ``--reps`` interleaved repetitions after warmup.
The last columns check the targets in docs/native-kernels.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

try:
    from ampx import _ext, _reference
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ampx import _ext, _reference

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def make_sizes(total: int, count: int, seed: int = 0) -> list[int]:
    """Log-uniform sizes between 1K and ~1M elements, scaled to sum to ``total``."""
    g = torch.Generator().manual_seed(seed)
    logs = torch.empty(count, dtype=torch.float64).uniform_(3.0, 6.2, generator=g)
    raw = torch.pow(10.0, logs)
    sizes = (raw / raw.sum() * total).round().to(torch.int64).clamp_(min=1)
    sizes[0] += total - int(sizes.sum())  # exact total; odd sizes on purpose
    return [int(s) for s in sizes]


def timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


@dataclass
class Row:
    kernel: str
    dtype: str
    moved: int
    times: dict[str, float]
    target: Optional[tuple[str, float]]  # (competitor, minimum native speedup)


STAT: Callable[[list[float]], float] = statistics.median


def measure(
    impls: dict[str, Callable[[], object]], reps: int, warmup: int, sync: Callable[[], None]
) -> dict[str, float]:
    for _ in range(warmup):
        for fn in impls.values():
            fn()
    sync()
    samples: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(reps):
        for name, fn in impls.items():
            samples[name].append(timed(fn, sync))
    return {name: STAT(ts) for name, ts in samples.items()}


def memcpy_impl(nbytes: int, device: torch.device) -> Callable[[], object]:
    half = max(nbytes // 2, 1)
    a = torch.ones(half, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return lambda: b.copy_(a)


def bench_dtype(
    label: str,
    dtype: torch.dtype,
    sizes: list[int],
    native: Optional[ModuleType],
    reps: int,
    warmup: int,
    device: torch.device,
    sync: Callable[[], None],
) -> list[Row]:
    """Measure every kernel for one dtype."""
    f32 = torch.float32
    rows: list[Row] = []
    grads = [torch.randn(n, dtype=dtype, device=device) for n in sizes]
    masters = [torch.randn(n, dtype=f32, device=device) for n in sizes]
    outs32 = [torch.empty(n, dtype=f32, device=device) for n in sizes]
    params = [torch.empty(n, dtype=dtype, device=device) for n in sizes]
    found = torch.zeros(1, device=device)
    # Alternate 0.5 and 2.0 so repeated in-place unscaling keeps values stable.
    invs = [torch.tensor([0.5], device=device), torch.tensor([2.0], device=device)]
    n = sum(sizes)
    es = grads[0].element_size()

    def flip(fn: Callable[[torch.Tensor], object]) -> Callable[[], object]:
        state = {"i": 0}

        def call() -> object:
            state["i"] ^= 1
            return fn(invs[state["i"]])

        return call

    def add(kernel: str, moved: int, impls: dict[str, Callable[[], object]],
            target: Optional[tuple[str, float]]) -> None:
        impls["memcpy"] = memcpy_impl(moved, device)
        rows.append(Row(kernel, label, moved, measure(impls, reps, warmup, sync), target))

    # unscale_ (in place)
    impls: dict[str, Callable[[], object]] = {
        "reference": flip(lambda inv: _reference.unscale_(grads, inv, found)),
        "torch": flip(
            lambda inv: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        ),
    }
    if native is not None:
        impls["native"] = flip(lambda inv: native.unscale_(grads, inv, found))
    add("unscale_", 2 * n * es, impls, ("torch", 1.0))

    # unscale_into_ (dtype -> fp32 masters); torch needs two passes
    def two_pass(inv: torch.Tensor) -> None:
        torch._foreach_copy_(outs32, grads)
        torch._amp_foreach_non_finite_check_and_unscale_(outs32, found, inv)

    impls = {
        "reference": flip(lambda inv: _reference.unscale_into_(grads, outs32, inv, found)),
        "torch": flip(two_pass),
    }
    if native is not None:
        impls["native"] = flip(
            lambda inv: native.unscale_into_(grads, outs32, inv, found, None, False)
        )
    add("unscale_into_", n * es + n * 4, impls, ("torch", 1.5) if dtype != f32 else None)

    # l2norm (total, as clip_grad_norm_ computes it)
    def torch_norm() -> torch.Tensor:
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))

    impls = {"reference": lambda: _reference.l2norm(grads), "torch": torch_norm}
    if native is not None:
        impls["native"] = lambda: native.l2norm(grads, False)
    add("l2norm", n * es, impls, ("torch", 1.0))

    # copy_ (fp32 masters -> dtype params)
    impls = {
        "reference": lambda: _reference.copy_(masters, params),
        "torch": lambda: torch._foreach_copy_(params, masters),
    }
    if native is not None:
        impls["native"] = lambda: native.copy_(masters, params)
    add("copy_", n * 4 + n * es, impls, None)
    return rows


def run(total: int, count: int, reps: int, warmup: int, device: torch.device) -> list[Row]:
    """Measure every kernel for every dtype on one workload."""
    native = _ext._native_module()
    if native is not None and device.type == "cuda" and not native.has_cuda():
        native = None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sizes = make_sizes(total, count)
    rows: list[Row] = []
    for label, dtype in DTYPES.items():
        rows += bench_dtype(label, dtype, sizes, native, reps, warmup, device, sync)
    return rows


def bound_ratio(row: Row) -> float:
    """Native bandwidth over memcpy bandwidth for the same number of bytes moved."""
    return row.times["memcpy"] / row.times["native"]


def print_table(rows: list[Row], have_native: bool) -> bool:
    head = ["kernel", "dtype", "MB", "native", "reference", "torch", "memcpy",
            "nat/torch", "nat/ref", "nat/memcpy", "target"]
    lines = [head]
    all_ok = True
    for r in rows:
        gbs = {k: r.moved / v / 1e9 for k, v in r.times.items()}
        mem_gbs = gbs["memcpy"]
        cells = [r.kernel, r.dtype, f"{r.moved / 1e6:.0f}"]
        cells.append(f"{gbs['native']:.1f}" if "native" in gbs else "-")
        cells += [f"{gbs['reference']:.1f}", f"{gbs['torch']:.1f}", f"{mem_gbs:.1f}"]
        if have_native:
            vs_torch = r.times["torch"] / r.times["native"]
            vs_ref = r.times["reference"] / r.times["native"]
            vs_mem = bound_ratio(r)
            cells += [f"{vs_torch:.2f}x", f"{vs_ref:.2f}x", f"{vs_mem:.2f}"]
            checks = [vs_mem >= 0.7]
            text = [">=0.7 memcpy"]
            if r.target is not None:
                checks.append(vs_torch >= r.target[1])
                text.append(f">={r.target[1]:.1f}x torch")
            ok = all(checks)
            all_ok &= ok
            cells.append(("ok " if ok else "MISS ") + ", ".join(text))
        else:
            cells += ["-", "-", "-", "-"]
        lines.append(cells)
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    for i, row in enumerate(lines):
        print("  ".join(c.rjust(w) if j >= 2 else c.ljust(w) for j, (c, w) in
                        enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    return all_ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=25_000_000, help="total elements")
    parser.add_argument("--tensors", type=int, default=200, help="number of tensors")
    parser.add_argument("--reps", type=int, default=9, help="timed repetitions (median)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--stat", choices=["median", "min"], default="median",
                        help="statistic over repetitions (min: best case on a busy machine)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    global STAT
    STAT = min if args.stat == "min" else statistics.median
    device = torch.device(args.device)
    info = _ext.describe()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}, device {device}")
    print(f"ampx backend: {info['backend']}" + (f" ({info['import_error']})"
                                                if info["import_error"] else ""))
    print(f"workload: {args.numel:,} elements in {args.tensors} tensors; GB/s of bytes moved, "
          f"{args.stat} of {args.reps} interleaved repetitions")
    print()
    rows = run(args.numel, args.tensors, args.reps, args.warmup, device)
    have_native = all("native" in r.times for r in rows)
    ok = print_table(rows, have_native)
    print()
    if have_native:
        print("all targets met" if ok else "some targets missed (see MISS rows)")
    else:
        print("native extension not loaded: run `ampx build-ext` for the native column")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
