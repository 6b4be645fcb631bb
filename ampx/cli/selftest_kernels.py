"""`ampx selftest`'s kernel part: the native kernels against the pure-torch reference.

One job: run every kernel of the contract (`ampx._reference`) through both backends on the
same random lists — float32, float16 and bfloat16, sizes from 1 to a few thousand elements,
inf, -inf and NaN placed at the first, a middle and the last element of one tensor — and
report every difference. Results must be identical bit for bit (NaN at the same positions;
norms to 1e-6 relative, as their summation order may differ).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch

from .. import _reference

__all__ = ["PLACEMENTS", "compare_backends", "native_for"]

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


def native_for(device: torch.device) -> tuple[Optional[Any], Optional[str]]:
    """The loaded extension if it has kernels for `device`, else (None, why not)."""
    from .. import _ext

    module = _ext._native_module()
    if module is None:
        return None, f"native kernels not loaded ({_ext.IMPORT_ERROR})"
    if device.type == "cuda" and not _ext.describe().get("cuda_kernels"):
        return None, "the loaded extension has no CUDA kernels"
    if device.type not in ("cpu", "cuda"):
        return None, f"no native kernels for {device.type}"
    return module, None
