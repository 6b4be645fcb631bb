"""PROVISIONAL stand-in for the kernel dispatcher (helper-1 replaces this file wholesale).

Same signatures as docs/internals.md, pure torch, so the rest of the package can run meanwhile.
"""

from __future__ import annotations

import torch

BACKEND = "reference"
IMPORT_ERROR: str | None = "provisional stand-in"


def describe() -> dict:
    return {"backend": BACKEND, "import_error": IMPORT_ERROR}


def unscale_(grads, inv_scale, found_inf, per_tensor=None):  # type: ignore[no-untyped-def]
    if grads:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def unscale_into_(src, dst, inv_scale, found_inf, per_tensor=None, accumulate=False):  # type: ignore[no-untyped-def]
    for s, d in zip(src, dst):
        f = s.float()
        torch.maximum(found_inf, (~torch.isfinite(f)).any().float().reshape(1), out=found_inf)
        if accumulate:
            d.copy_(d.float() + f * inv_scale)
        else:
            d.copy_(f * inv_scale)


def l2norm(tensors, per_tensor=False):  # type: ignore[no-untyped-def]
    norms = [t.float().norm() for t in tensors]
    total = torch.stack(norms).norm() if norms else torch.zeros(())
    return (total, torch.stack(norms) if norms else torch.zeros(0)) if per_tensor else total


def copy_(src, dst):  # type: ignore[no-untyped-def]
    for s, d in zip(src, dst):
        d.copy_(s)


def update_scale_(scale, gt, ht, found, growth, backoff, interval, hysteresis, mn, mx):  # type: ignore[no-untyped-def]
    bad = found > 0
    gt_next = torch.where(bad, torch.zeros_like(gt), gt + 1)
    grow = (~bad) & (gt_next >= interval)
    backoff_now = bad & (ht <= 1)
    grown = scale * growth
    grown = torch.where(torch.isfinite(grown), torch.clamp(grown, max=mx), scale)
    new = torch.where(backoff_now, torch.clamp(scale * backoff, min=mn, max=mx),
                      torch.where(grow, grown, scale))
    ht_next = torch.where(bad & (ht > 1), ht - 1, torch.where(grow, torch.full_like(ht, hysteresis), ht))
    scale.copy_(new)
    gt.copy_(torch.where(grow, torch.zeros_like(gt), gt_next))
    ht.copy_(ht_next)
