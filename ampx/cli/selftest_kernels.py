"""`ampx selftest`'s kernel part: the native kernels against the pure-torch reference.

One job: run every kernel of the contract (`ampx._reference`) through both backends on the
same random lists — float32, float16 and bfloat16, sizes from 1 to a few thousand elements,
inf, -inf and NaN placed at the first, a middle and the last element of one tensor — and
report every difference. Results must be identical bit for bit (NaN at the same positions;
norms to 1e-6 relative, as their summation order may differ).

The kernels are called through `ampx._ext`, the dispatcher training uses, so a build whose
CUDA kernels are never routed to is caught. On CUDA, `compare_batching` adds the cases the
launch packing must get right, sized from the extension's own `cuda_limits()`: tensors that
end just before, on and after a chunk edge, more tensors and more blocks than one launch
takes (a tensor carried over between launches, flags raised in a later launch), unaligned
views (the scalar path), a side stream, CUDA graph capture and, memory permitting, a tensor
of more than 2**31 elements.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch

from .. import _reference
from ..options.values import dtype_name

__all__ = ["PLACEMENTS", "batching_sizes", "compare_backends", "compare_batching",
           "native_for"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SIZES = (1, 7, 1000, 4099)
PLACEMENTS = ("none", "inf@first", "-inf@middle", "nan@last", "inf+nan")
"""Where non-finite values go in the list's third tensor."""


def _same(a: torch.Tensor, b: torch.Tensor, rtol: float = 0.0) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    a, b = a[~nan_a], b[~nan_b]
    if rtol == 0.0:
        return torch.equal(a, b)
    finite = torch.isfinite(a) & torch.isfinite(b)
    if not torch.equal(a[~finite], b[~finite]):
        return False
    return bool(torch.allclose(a[finite], b[finite], rtol=rtol, atol=0.0))


def _tensors(dtype: torch.dtype, placement: str, device: torch.device,
             generator: torch.Generator) -> list[torch.Tensor]:
    tensors = [torch.randn(n, generator=generator).mul_(100).to(dtype).to(device)
               for n in _SIZES]
    target = tensors[2]
    values = {"inf@first": [(0, math.inf)], "-inf@middle": [(target.numel() // 2, -math.inf)],
              "nan@last": [(target.numel() - 1, math.nan)],
              "inf+nan": [(3, math.inf), (target.numel() - 2, math.nan)]}.get(placement, [])
    for index, value in values:
        target[index] = value
    return tensors


def _flags(device: torch.device, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.tensor([1 / 1024.0], device=device), torch.zeros(1, device=device),
            torch.zeros(count, device=device))


def _case_unscale(native: Any, src: list[torch.Tensor]) -> list[tuple[str, bool]]:
    out = []
    for impl in (_reference, native):
        grads = [t.clone() for t in src]
        inv, found, per = _flags(src[0].device, len(src))
        impl.unscale_(grads, inv, found, per)
        out.append((grads, found, per))
    (g1, f1, p1), (g2, f2, p2) = out
    return [("unscale_", all(_same(a, b) for a, b in zip(g1, g2)) and _same(f1, f2)
             and _same(p1, p2))]


def _case_unscale_into(native: Any, src: list[torch.Tensor]) -> list[tuple[str, bool]]:
    results = []
    for accumulate in (False, True):
        out = []
        for impl in (_reference, native):
            dst = [torch.ones(t.shape, dtype=torch.float32, device=t.device) for t in src]
            inv, found, per = _flags(src[0].device, len(src))
            impl.unscale_into_(src, dst, inv, found, per, accumulate)
            out.append((dst, found, per))
        (d1, f1, p1), (d2, f2, p2) = out
        results.append((f"unscale_into_(accumulate={accumulate})",
                        all(_same(a, b) for a, b in zip(d1, d2)) and _same(f1, f2)
                        and _same(p1, p2)))
    return results


def _case_l2norm(native: Any, src: list[torch.Tensor]) -> list[tuple[str, bool]]:
    total_ref, norms_ref = _reference.l2norm(src, True)
    total, norms = native.l2norm(list(src), True)
    return [("l2norm", _same(total_ref, total, 1e-6) and _same(norms_ref, norms, 1e-6))]


def _case_copy(native: Any, src: list[torch.Tensor]) -> list[tuple[str, bool]]:
    results = []
    for dst_dtype in _DTYPES:
        dsts = []
        for impl in (_reference, native):
            dst = [torch.empty(t.shape, dtype=dst_dtype, device=t.device) for t in src]
            impl.copy_(src, dst)
            dsts.append(dst)
        name = f"copy_(to {str(dst_dtype).replace('torch.', '')})"
        results.append((name, all(_same(a, b) for a, b in zip(*dsts))))
    return results


def _update_scale_cases(native: Any, device: torch.device) -> list[tuple[str, bool]]:
    results = []
    for found_inf in (0.0, 1.0):
        for growth, hysteresis in ((0, 1), (1999, 1), (5, 2), (0, 3)):
            states = []
            for impl in (_reference, native):
                state = (torch.tensor([65536.0], device=device),
                         torch.tensor([growth], dtype=torch.int32, device=device),
                         torch.tensor([hysteresis], dtype=torch.int32, device=device))
                impl.update_scale_(*state, torch.tensor([found_inf], device=device), 2.0, 0.5,
                                   2000, 2, 1.0, 2.0**24)
                states.append(state)
            same = all(_same(a, b) for a, b in zip(*states))
            results.append((f"update_scale_(found_inf={found_inf:g})", same))
    return results


Case = Callable[[Any, list[torch.Tensor]], list[tuple[str, bool]]]
_CASES: Sequence[Case] = (_case_unscale, _case_unscale_into, _case_l2norm, _case_copy)


def compare_backends(native: Any, device: torch.device, seed: int = 0) -> dict[str, Any]:
    """Run every kernel through `native` and the reference on the same inputs.

    Args:
        native: An object with the contract's functions (the loaded extension module).
        device: Where the tensors live.
        seed: Seed of the random lists.

    Returns:
        {"cases": number of comparisons, "mismatches": ["l2norm[bf16, nan@last]", ...]}.
    """
    generator = torch.Generator().manual_seed(seed)
    cases, mismatches = 0, []
    for dtype in _DTYPES:
        for placement in PLACEMENTS:
            src = _tensors(dtype, placement, device, generator)
            where = f"{str(dtype).replace('torch.', '')}, {placement}"
            for case in _CASES:
                for name, same in _run(case, native, src):
                    cases += 1
                    if not same:
                        mismatches.append(f"{name}[{where}]")
    for name, same in _update_scale_cases(native, device):
        cases += 1
        if not same:
            mismatches.append(name)
    return {"cases": cases, "mismatches": mismatches}


def _run(case: Case, native: Any, src: list[torch.Tensor]) -> list[tuple[str, bool]]:
    try:
        return case(native, src)
    except Exception as exc:  # a kernel that raises where the reference did not is a mismatch
        return [(f"{case.__name__.removeprefix('_case_')} raised {type(exc).__name__}: "
                 f"{str(exc).splitlines()[0] if str(exc) else ''}", False)]


def _lists(limits: dict[str, int]) -> dict[str, list[int]]:
    """Tensor sizes for each launch-packing case (see `batching_sizes`)."""
    chunk, tensors, blocks = limits["chunk"], limits["max_tensors"], limits["max_blocks"]
    pack = max(limits.get("pack_bytes", 16) // 2, 1)  # elements of a half-precision pack
    return {
        "chunk edges": [chunk - 1, chunk, chunk + 1, 3 * chunk + pack + 1, pack - 1, 1],
        "more tensors than a launch": [1 + (i * 37) % (2 * pack + 3) for i in range(tensors)]
        + [0, chunk + 3, 5, 2 * chunk],
        "more blocks than a launch, carried over": [(blocks - 2) * chunk + 7, 3 * chunk + 1,
                                                    (blocks + 1) * chunk, 9],
    }


def batching_sizes(limits: dict[str, int]) -> dict[str, list[int]]:
    """The tensor sizes of each `compare_batching` case for the given kernel limits."""
    return _lists(limits)


def _spread_nonfinite(tensors: list[torch.Tensor], launch_edge: int) -> None:
    """inf in the last tensor (a later launch) and NaN just past `launch_edge` elements."""
    tensors[-1].view(-1)[-1] = math.inf
    seen = 0
    for t in tensors:
        if seen <= launch_edge < seen + t.numel():
            t.view(-1)[launch_edge - seen] = math.nan
            return
        seen += t.numel()


def _compare_list(backend: Any, src: list[torch.Tensor], where: str) -> tuple[int, list[str]]:
    cases, mismatches = 0, list[str]()
    for case in _CASES:
        for name, same in _run(case, backend, src):
            cases += 1
            if not same:
                mismatches.append(f"{name}[{where}]")
    return cases, mismatches


def _unaligned(sizes: list[int], dtype: torch.dtype, device: torch.device,
               generator: torch.Generator) -> list[torch.Tensor]:
    """Contiguous views one element into their storage: the kernels' scalar path."""
    return [torch.randn(n + 1, generator=generator).mul_(100).to(dtype).to(device)[1:]
            for n in sizes]


def _unaligned_in_place(backend: Any, src: list[torch.Tensor]) -> bool:
    """unscale_ on the unaligned views themselves (the list cases unscale aligned clones)."""
    out = []
    for impl in (_reference, backend):
        grads = [t.new_empty(t.numel() + 1)[1:].copy_(t) for t in src]
        inv, found, per = _flags(src[0].device, len(src))
        impl.unscale_(grads, inv, found, per)
        out.append((grads, found, per))
    (g1, f1, p1), (g2, f2, p2) = out
    return all(_same(a, b) for a, b in zip(g1, g2)) and _same(f1, f2) and _same(p1, p2)


def _graph_case(backend: Any, device: torch.device, generator: torch.Generator) -> bool:
    """unscale_ and l2norm captured in a CUDA graph and replayed match the reference."""
    src = [torch.randn(n, generator=generator).to(device) for n in (5, 70001, 3)]
    src[1][17] = math.inf
    grads = [t.clone() for t in src]
    inv, found, per = _flags(device, len(src))
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch requires
        backend.unscale_([t.clone() for t in src], inv, found.clone(), per.clone())
        backend.l2norm(grads, True)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.unscale_(grads, inv, found, per)
        total, norms = backend.l2norm(grads, True)
    graph.replay()
    ref = [t.clone() for t in src]
    inv2, found2, per2 = _flags(device, len(src))
    _reference.unscale_(ref, inv2, found2, per2)
    total2, norms2 = _reference.l2norm(ref, True)
    return (all(_same(a, b) for a, b in zip(grads, ref)) and _same(found, found2)
            and _same(per, per2) and _same(total, total2, 1e-6) and _same(norms, norms2, 1e-6))


def compare_batching(backend: Any, device: torch.device, limits: dict[str, int], *,
                     seed: int = 1, huge: Optional[bool] = None) -> dict[str, Any]:
    """The launch-packing cases (module docstring) through `backend` against the reference.

    Args:
        backend: The contract's functions (`ampx._ext` in the selftest).
        device: Where the tensors live.
        limits: `chunk`, `max_tensors`, `max_blocks` (and `pack_bytes`) of the kernels.
        seed: Seed of the random values.
        huge: Include a tensor of more than 2**31 elements (default: on CUDA devices with
            at least 40 GB free).

    Returns:
        {"cases": number of comparisons, "mismatches": [...]} as `compare_backends`.
    """
    generator = torch.Generator().manual_seed(seed)
    cases, mismatches = 0, list[str]()
    launch_edge = limits["max_blocks"] * limits["chunk"]
    for name, sizes in _lists(limits).items():
        for dtype in _DTYPES:
            src = [torch.randn(n, generator=generator).mul_(100).to(dtype).to(device)
                   for n in sizes]
            _spread_nonfinite(src, launch_edge if "blocks" in name else limits["chunk"])
            count, bad = _compare_list(backend, src, f"{name}, {_short(dtype)}")
            cases, mismatches = cases + count, mismatches + bad
    for dtype in (torch.float16, torch.float32):
        src = _unaligned([limits["chunk"] + 3, 17], dtype, device, generator)
        _spread_nonfinite(src, limits["chunk"] + 1)
        count, bad = _compare_list(backend, src, f"unaligned views, {_short(dtype)}")
        cases, mismatches = cases + count + 1, mismatches + bad
        if not _run_bool(functools.partial(_unaligned_in_place, backend, src)):
            mismatches.append(f"unscale_[unaligned views in place, {_short(dtype)}]")
    if device.type == "cuda":
        src = [torch.randn(n, generator=generator).to(device) for n in (3, limits["chunk"] + 1)]
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))  # src was written on this one
        with torch.cuda.stream(side):
            count, bad = _compare_list(backend, src, "side stream")
            side.synchronize()
        cases, mismatches = cases + count + 1, mismatches + bad  # + 1: the graph case
        if not _run_bool(lambda: _graph_case(backend, device, generator)):
            mismatches.append("CUDA graph capture")
        if huge is None:
            huge = torch.cuda.mem_get_info(device)[0] > 40 * 2**30
    if huge:
        cases += 1
        if not _run_bool(lambda: _huge_case(backend, device)):
            mismatches.append("unscale_/l2norm on 2**31 + 9 fp16 elements")
    return {"cases": cases, "mismatches": mismatches}


def _huge_case(backend: Any, device: torch.device) -> bool:
    """More than 2**31 elements in one tensor: 64-bit indexing in every kernel."""
    n = 2**31 + 9
    grads = torch.ones(n, dtype=torch.float16, device=device)
    grads[-1] = math.inf
    inv, found, per = _flags(device, 1)
    backend.unscale_([grads], inv, found, per)
    ok = bool(found.item() == 1.0 and per.item() == 1.0 and grads[-2].item() == 1 / 1024.0
              and grads[0].item() == 1 / 1024.0)
    grads[-1] = 1 / 1024.0
    total, _ = backend.l2norm([grads], True)
    expected = math.sqrt(n) / 1024.0
    return ok and abs(total.item() - expected) <= 1e-6 * expected


def _run_bool(check: Callable[[], bool]) -> bool:
    try:
        return check()
    except Exception:  # a kernel that raises is a mismatch
        return False


def _short(dtype: torch.dtype) -> str:
    return dtype_name(dtype)


def native_for(device: torch.device) -> tuple[Optional[Any], Optional[str]]:
    """`ampx._ext` if it routes `device`'s tensors to native kernels, else (None, why not).

    The comparison then runs through the dispatcher itself, as training does.
    """
    from .. import _ext

    module = _ext._native_module()
    if module is None:
        return None, f"native kernels not loaded ({_ext.IMPORT_ERROR})"
    if device.type not in ("cpu", "cuda"):
        return None, f"no native kernels for {device.type}"
    if device.type == "cuda" and not _ext.describe().get("cuda_kernels"):
        return None, ("the loaded extension has no CUDA kernels (build them with `ampx "
                      "build-ext --require-cuda`)")
    if _ext._impl(device) is not module:
        problem = _ext.describe()["cuda_unusable"].get(str(device), "the dispatcher does "
                                                      "not route it to the extension")
        return None, f"native kernels not used on {device}: {problem}"
    return _ext, None
