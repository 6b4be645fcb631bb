"""The kernel contract in pure torch: the specification ``ampx._C`` must match.

Every function here takes Python lists of tensors on one device, accepts any mix of
float32, float16 and bfloat16 (grouped by dtype before each torch call), never
synchronises with the host (no ``.item()``, no Python branch on a tensor's value), and
propagates non-finite values instead of skipping them. Arguments are checked with
the same messages and exception types as the C++ checks in ``ampx/csrc/ampx.cpp``.

Numerics, which the native kernels reproduce bit for bit (NaN payloads aside):

* ``unscale_`` / ``unscale_into_``: ``float32(x) * inv_scale`` rounded to float32, then
  (``accumulate``) ``float32(dst) + that`` rounded to float32, then rounded to the
  output dtype with round-to-nearest-even. Only inputs are checked for inf/NaN.
* ``copy_``: one rounding from the source value to the destination dtype.
* ``update_scale_``: float32 arithmetic, with the Python float factors and bounds
  rounded to float32 first.
* ``l2norm``: squares and sums in float64, rounded to float32 once, so it agrees with
  the native kernel to float32 rounding (not bitwise: the summation order differs).

Selection between this module and the extension happens in :mod:`ampx._ext`; other
modules call that, never this one directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import torch

from ._reference_compensated import compensated_adam_, compensated_sgd_

__all__ = ["compensated_adam_", "compensated_sgd_", "copy_", "l2norm", "unscale_",
           "unscale_into_", "update_scale_"]

Tensors = Sequence[torch.Tensor]

_F32 = torch.float32
_KERNEL_DTYPES = (_F32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------
# Argument checks (same order and text as ampx/csrc/ampx.cpp)
# ---------------------------------------------------------------------------


def _check_element(
    api: str, name: str, i: int, t: torch.Tensor, ref: torch.device, ref_label: str
) -> None:
    if t.dtype not in _KERNEL_DTYPES:
        raise TypeError(
            f"ampx.{api}: {name}[{i}] has dtype {t.dtype}; "
            "expected torch.float32, torch.float16 or torch.bfloat16"
        )
    if t.device != ref:
        raise ValueError(
            f"ampx.{api}: {name}[{i}] is on {t.device} but {ref_label} is on {ref}; "
            "all tensors must be on one device"
        )
    if not t.is_contiguous():
        raise ValueError(
            f"ampx.{api}: {name}[{i}] is not contiguous; ampx kernels need contiguous tensors"
        )


def _check_list(api: str, name: str, tensors: Tensors) -> None:
    ref = tensors[0].device
    label = f"{name}[0]"
    for i, t in enumerate(tensors):
        _check_element(api, name, i, t, ref, label)


def _check_lengths(api: str, src: Tensors, dst: Tensors) -> None:
    if len(src) != len(dst):
        raise ValueError(
            f"ampx.{api}: src has {len(src)} tensors but dst has {len(dst)}; "
            "pass lists of equal length"
        )


def _check_pair(api: str, src: Tensors, dst: Tensors) -> None:
    ref = src[0].device
    for i, (s, d) in enumerate(zip(src, dst)):
        _check_element(api, "src", i, s, ref, "src[0]")
        _check_element(api, "dst", i, d, ref, "src[0]")
        if d.numel() != s.numel():
            raise ValueError(
                f"ampx.{api}: dst[{i}] has {d.numel()} elements but src[{i}] has {s.numel()}"
            )


def _check_scalar(
    api: str, name: str, t: torch.Tensor, dtype: torch.dtype, ref: torch.device, ref_label: str
) -> None:
    if t.dtype != dtype:
        raise TypeError(f"ampx.{api}: {name} must be a {dtype} tensor; got {t.dtype}")
    if t.numel() != 1:
        raise ValueError(f"ampx.{api}: {name} must have 1 element; got {t.numel()}")
    if t.device != ref:
        raise ValueError(
            f"ampx.{api}: {name} is on {t.device} but {ref_label} is on {ref}; "
            "all tensors must be on one device"
        )


def _check_flags(
    api: str,
    list_name: str,
    n: int,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    per_tensor: Optional[torch.Tensor],
    ref: torch.device,
) -> None:
    label = f"{list_name}[0]"
    _check_scalar(api, "inv_scale", inv_scale, torch.float32, ref, label)
    _check_scalar(api, "found_inf", found_inf, torch.float32, ref, label)
    if per_tensor is not None:
        if per_tensor.dtype != torch.float32:
            raise TypeError(
                f"ampx.{api}: per_tensor must be a torch.float32 tensor; got {per_tensor.dtype}"
            )
        if per_tensor.numel() != n:
            raise ValueError(
                f"ampx.{api}: per_tensor must have {n} elements (one per tensor in "
                f"{list_name}); got {per_tensor.numel()}"
            )
        if per_tensor.device != ref:
            raise ValueError(
                f"ampx.{api}: per_tensor is on {per_tensor.device} but {label} is on {ref}; "
                "all tensors must be on one device"
            )
        if not per_tensor.is_contiguous():
            raise ValueError(
                f"ampx.{api}: per_tensor is not contiguous; ampx kernels need contiguous tensors"
            )


def _by_dtype(tensors: Tensors) -> dict[torch.dtype, list[int]]:
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


# ---------------------------------------------------------------------------
# Contract
# ---------------------------------------------------------------------------


def _unscale_unchecked(
    grads: Tensors,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    per_tensor: Optional[torch.Tensor],
) -> None:
    if per_tensor is None:
        for idx in _by_dtype(grads).values():
            torch._amp_foreach_non_finite_check_and_unscale_(
                [grads[i] for i in idx], found_inf, inv_scale
            )
        return
    # Per-tensor flags: one flag slot per tensor, then merge without a host sync.
    hits = torch.zeros(len(grads), dtype=torch.float32, device=found_inf.device)
    for i, g in enumerate(grads):
        torch._amp_foreach_non_finite_check_and_unscale_([g], hits[i], inv_scale)
    per_tensor.masked_fill_(hits > 0, 1.0)
    found_inf.masked_fill_(hits.amax() > 0, 1.0)


def unscale_(
    grads: Tensors,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    per_tensor: Optional[torch.Tensor] = None,
) -> None:
    """Multiply every gradient by ``inv_scale`` in place and flag non-finite values.

    Args:
        grads: Tensors to unscale in place (float32/float16/bfloat16, contiguous, one
            device).
        inv_scale: float32 tensor with one element: the factor.
        found_inf: float32 tensor with one element; set to 1.0 when any input value is
            inf or NaN, never cleared.
        per_tensor: Optional float32 tensor with ``len(grads)`` elements; element ``i``
            is set to 1.0 when ``grads[i]`` held a non-finite value, never cleared.

    Raises:
        TypeError: A tensor has an unsupported dtype.
        ValueError: Tensors are on several devices, not contiguous, or the bookkeeping
            tensors have the wrong size.
    """
    if not grads:
        return
    _check_list("unscale_", "grads", grads)
    _check_flags(
        "unscale_", "grads", len(grads), inv_scale, found_inf, per_tensor, grads[0].device
    )
    _unscale_unchecked(grads, inv_scale, found_inf, per_tensor)


def unscale_into_(
    src: Tensors,
    dst: Tensors,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    per_tensor: Optional[torch.Tensor] = None,
    accumulate: bool = False,
) -> None:
    """Write ``src * inv_scale`` (or add it, with ``accumulate``) into ``dst``.

    ``dst[i] = float32(src[i]) * inv_scale`` or, with ``accumulate``,
    ``dst[i] = float32(dst[i]) + float32(src[i]) * inv_scale``, rounded to
    ``dst[i].dtype``. Only ``src`` is checked for non-finite values. This is the O2
    master-gradient path (fp16/bf16 model grads into fp32 master grads) and the
    multi-loss accumulation path.

    Args:
        src: Scaled gradients (read only).
        dst: Outputs, element-wise the same numel as ``src``.
        inv_scale: float32 tensor with one element.
        found_inf: float32 tensor with one element; set to 1.0 on inf/NaN in ``src``.
        per_tensor: Optional float32 tensor with ``len(src)`` elements of flags.
        accumulate: Add into ``dst`` instead of overwriting it.

    Raises:
        TypeError: A tensor has an unsupported dtype.
        ValueError: Lengths or sizes differ, tensors are on several devices or not
            contiguous, or the bookkeeping tensors have the wrong size.
    """
    _check_lengths("unscale_into_", src, dst)
    if not src:
        return
    _check_pair("unscale_into_", src, dst)
    _check_flags(
        "unscale_into_", "src", len(src), inv_scale, found_inf, per_tensor, src[0].device
    )
    # detached aliases (same storage and version counter): autograd records nothing, even
    # outside no_grad with inputs that require grad (gradients of a create_graph backward)
    flat_src = [s.detach().view(-1) for s in src]
    flat_dst = [d.detach().view(-1) for d in dst]
    # Stage float32(src) in float32 buffers: the fp32 destinations themselves when
    # overwriting, fresh buffers otherwise. Widening to float32 is exact.
    staged = [
        d if (not accumulate and d.dtype == torch.float32) else s.new_empty(s.shape, dtype=_F32)
        for s, d in zip(flat_src, flat_dst)
    ]
    for idx in _by_dtype(flat_src).values():
        torch._foreach_copy_([staged[i] for i in idx], [flat_src[i] for i in idx])
    _unscale_unchecked(staged, inv_scale, found_inf, per_tensor)
    for dtype, idx in _by_dtype(flat_dst).items():
        outs = [flat_dst[i] for i in idx]
        vals = [staged[i] for i in idx]
        if accumulate:
            if dtype == torch.float32:
                torch._foreach_add_(outs, vals)
            else:
                wide = [o.float() for o in outs]
                torch._foreach_add_(wide, vals)
                torch._foreach_copy_(outs, wide)
        elif dtype != torch.float32:
            torch._foreach_copy_(outs, vals)


def l2norm(
    tensors: Tensors, per_tensor: bool = False
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Return the L2 norm of all tensors together, and optionally of each tensor.

    Computed in float64 and rounded to float32 once. inf inputs give an inf norm, NaN
    inputs a NaN norm; an empty list or empty tensors give 0.

    Args:
        tensors: Tensors to measure (float32/float16/bfloat16, contiguous, one device).
        per_tensor: Also return the per-tensor norms.

    Returns:
        A float32 0-dim tensor with the total norm, or ``(total, norms)`` with
        ``norms`` float32 of shape ``[len(tensors)]`` when ``per_tensor`` is true.

    Raises:
        TypeError: A tensor has an unsupported dtype.
        ValueError: Tensors are on several devices or not contiguous.
    """
    if not tensors:
        total = torch.zeros((), dtype=torch.float32)
        return (total, torch.zeros(0, dtype=torch.float32)) if per_tensor else total
    _check_list("l2norm", "tensors", tensors)
    norms64 = torch.stack(torch._foreach_norm(list(tensors), 2, dtype=torch.float64))
    total = torch.linalg.vector_norm(norms64).to(torch.float32)
    if per_tensor:
        return total, norms64.to(torch.float32)
    return total


def copy_(src: Tensors, dst: Tensors) -> None:
    """Copy ``src[i]`` into ``dst[i]`` for every ``i``, converting the dtype.

    Args:
        src: Source tensors (e.g. float32 master weights).
        dst: Destinations (e.g. float16/bfloat16 model parameters), element-wise the
            same numel as ``src``.

    Raises:
        TypeError: A tensor has an unsupported dtype.
        ValueError: Lengths or sizes differ, or tensors are on several devices or not
            contiguous.
    """
    _check_lengths("copy_", src, dst)
    if not src:
        return
    _check_pair("copy_", src, dst)
    # Detached aliases (same storage and version counter), as the native kernel writes:
    # autograd records nothing and no `torch.no_grad()` is needed (whose `with` an interrupt
    # can leave with grad mode off). torch runs step hooks outside the optimizer's no_grad,
    # and O2's masters require grad: a recorded copy made one node per tensor, each saving
    # the whole list (quadratic: 10k parameters took GBs and seconds).
    flat_src = [s.detach().view(-1) for s in src]
    flat_dst = [d.detach().view(-1) for d in dst]
    groups: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    for i, (s, d) in enumerate(zip(flat_src, flat_dst)):
        groups.setdefault((s.dtype, d.dtype), []).append(i)
    for idx in groups.values():
        torch._foreach_copy_([flat_dst[i] for i in idx], [flat_src[i] for i in idx])


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def copy_plain(src: list[torch.Tensor], dst: list[torch.Tensor]) -> bool:
    """`copy_` of the usual lists in one pass, or False having touched nothing.

    The reference's `ampx._C.copy_plain` (O2's master -> model copy of every step): every
    item exactly a `torch.Tensor` or `Parameter` of a kernel dtype, all on one device, each
    pair of one shape (or of one size, both contiguous), no inference tensor written;
    anything else goes `ampx._ext.copy_`'s general way, which raises the contract's errors.
    Pairs of one shape correspond element by element in any layout, as the general path
    stages them. One check and two detached aliases per pair, then one foreach copy per
    dtype pair (each destination's version counter moves once).
    """
    n = len(src)
    if n == 0 or len(dst) != n:
        return False
    device = src[0].device
    on_cpu = device.type == "cpu"
    plain, kinds = _PLAIN_TYPES, _KERNEL_DTYPES
    flat_src: list[torch.Tensor] = []
    flat_dst: list[torch.Tensor] = []
    pairs: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    for i, (s, d) in enumerate(zip(src, dst)):
        if type(s) not in plain or type(d) not in plain or d.is_inference():
            return False
        key = (s.dtype, d.dtype)
        if key not in pairs:
            if key[0] not in kinds or key[1] not in kinds:
                return False
            pairs[key] = []
        if not (s.is_cpu and d.is_cpu if on_cpu else s.device == device == d.device):
            return False
        if s.shape != d.shape:
            if s.numel() != d.numel() or not (s.is_contiguous() and d.is_contiguous()):
                return False
            s, d = s.view(-1), d.view(-1)
        # detached aliases, as in `copy_`: autograd records nothing
        flat_src.append(s.detach())
        flat_dst.append(d.detach())
        pairs[key].append(i)
    if len(pairs) == 1:
        torch._foreach_copy_(flat_dst, flat_src)
        return True
    for idx in pairs.values():
        torch._foreach_copy_([flat_dst[i] for i in idx], [flat_src[i] for i in idx])
    return True


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth: float,
    backoff: float,
    interval: int,
    hysteresis: int,
    min_scale: float,
    max_scale: float,
) -> None:
    """Update the dynamic loss scale on its device (apex's rule plus hysteresis).

    On overflow (``found_inf > 0``) the growth tracker resets and the scale backs off
    (clamped to ``[min_scale, max_scale]``) once the hysteresis tracker is at or below
    1, otherwise the hysteresis tracker counts down. Without overflow the growth
    tracker counts up; at ``interval`` the scale grows (if the grown value is finite,
    capped at ``max_scale``), and both trackers reset.

    Args:
        scale: float32 tensor with one element, updated in place.
        growth_tracker: int32 tensor with one element, updated in place.
        hysteresis_tracker: int32 tensor with one element, updated in place.
        found_inf: float32 tensor with one element.
        growth: Growth factor.
        backoff: Backoff factor.
        interval: Unskipped steps between growths.
        hysteresis: Overflows tolerated before a backoff.
        min_scale: Lower bound after a backoff.
        max_scale: Upper bound.

    Raises:
        TypeError: A tensor has the wrong dtype.
        ValueError: A tensor has more than one element or is on another device.
    """
    api = "update_scale_"
    ref = scale.device
    _check_scalar(api, "scale", scale, torch.float32, ref, "scale")
    _check_scalar(api, "growth_tracker", growth_tracker, torch.int32, ref, "scale")
    _check_scalar(api, "hysteresis_tracker", hysteresis_tracker, torch.int32, ref, "scale")
    _check_scalar(api, "found_inf", found_inf, torch.float32, ref, "scale")
    new_scale, new_growth, new_tracker = _next_scale(
        scale, growth_tracker, hysteresis_tracker, found_inf > 0,
        (growth, backoff, interval, hysteresis, min_scale, max_scale))
    scale.copy_(new_scale)
    growth_tracker.copy_(new_growth)
    hysteresis_tracker.copy_(new_tracker)


def _next_scale(
    scale: torch.Tensor, growth_tracker: torch.Tensor, tracker: torch.Tensor,
    found: torch.Tensor, rule: tuple[float, float, int, int, float, float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rule of `update_scale_` as fresh tensors (scale, growth tracker, hysteresis)."""
    growth, backoff, interval, hysteresis, min_scale, max_scale = rule
    # Overflow branch.
    backed_off = (scale * backoff).clamp_(min_scale, max_scale)
    exhausted = tracker <= 1
    scale_if_inf = torch.where(exhausted, backed_off, scale)
    tracker_if_inf = torch.where(exhausted, tracker, tracker - 1)
    # Clean-step branch.
    counted = growth_tracker + 1
    due = counted >= interval
    grown = scale * growth
    scale_if_ok = torch.where(due & torch.isfinite(grown), grown.clamp(max=max_scale), scale)
    growth_if_ok = torch.where(due, torch.zeros_like(counted), counted)
    tracker_if_ok = torch.where(due, torch.full_like(tracker, hysteresis), tracker)
    return (torch.where(found, scale_if_inf, scale_if_ok),
            torch.where(found, torch.zeros_like(counted), growth_if_ok),
            torch.where(found, tracker_if_inf, tracker_if_ok))
