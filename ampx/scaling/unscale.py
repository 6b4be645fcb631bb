"""The compute phase of the unscale transition: new gradients in fresh buffers, nothing committed.

`plan` lists, for one optimizer, what the pass's exit has to produce: for every parameter the
optimizer steps, its new gradient is this pass's scaled gradient times `1/scale`, added onto
the gradient of earlier passes when there is one (the stash), written into the fp32 master at
O2. `run` computes all of it into buffers nobody else holds (`torch.empty_like` keeps each
gradient's layout, so channels_last and transposed parameters get gradients of their own
layout; accumulation works on clones of the earlier gradients) and flags inf/NaN. Only then
does `ampx.scaling.protocol` assign the results to `.grad`: a failing kernel, or an interrupt,
leaves every gradient, master gradient and the stash as they were. The one exception needs no
buffer: at a static scale of exactly 1 (bf16's default) a gradient that is neither
accumulated nor cast is checked in place, multiplied by 1, which changes no value, so a
failure there leaves it as it was too.

Sparse gradients (`nn.Embedding(sparse=True)`) are unscaled through their values and checked
like dense ones; the result is a sparse gradient of the same indices. One that stays fp16 (no
fp32 master) is coalesced first (into a new tensor: nothing changes before the commit), as
torch's GradScaler does: an index repeated in an uncoalesced gradient overflows only once its
values are summed.

Per-tensor overflow flags: `run(..., per_tensor=True)` returns one float32 flag per entry of
`UnscaleWork.flag_params` (1.0 where that parameter's new gradient had inf/NaN), filled by the
same kernel calls at the cost of one small tensor; without it no flag tensor is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import _ext
from .masters import ParamCache

__all__ = ["UnscaleWork", "fold", "foldable", "plan", "run", "run_clean", "take_foldable"]


@dataclass(eq=False)
class UnscaleWork:
    """What one optimizer's unscale produces, before it is committed.

    Attributes:
        assign: (parameter, source, earlier gradient) for every gradient to write; source is
            this pass's scaled gradient (None: the earlier gradient is put back as it is).
        clear: Half model parameters whose gradient is released (it went into a master).
        results: After `run`: the new gradient of each `assign` entry.
        flag_params: After `run`: the parameters in per-tensor flag order.
    """

    assign: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]
    clear: list[torch.Tensor]
    results: list[torch.Tensor | None] = field(default_factory=list)
    flag_params: list[torch.Tensor] = field(default_factory=list)


def plan(cache: ParamCache, stash: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> UnscaleWork:
    """List this pass's work for one optimizer (reads only; no tensor is written)."""
    assign: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
    clear: list[torch.Tensor] = []
    for model_param, master in cache.pairs:
        grad = model_param.grad
        if grad is not None:
            assign.append((master, grad, master.grad))
            clear.append(model_param)
    if not stash:  # the usual pass (nothing accumulated before it): one comprehension
        assign += [(param, grad, None) for param in cache.others
                   if (grad := param.grad) is not None]
        return UnscaleWork(assign, clear)
    seen = set()
    for param in cache.others:
        stashed = stash.get(id(param))
        earlier = stashed[1] if stashed is not None else None
        seen.add(id(param))
        if param.grad is not None or earlier is not None:
            assign.append((param, param.grad, earlier))
    for key, (param, grad) in stash.items():  # params that left this optimizer's groups
        if key not in seen:
            assign.append((param, None, grad))
    return UnscaleWork(assign, clear)


def _fresh(target: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    like = target if target.dtype != src.dtype and target.shape == src.shape else src
    return torch.empty_like(like, dtype=target.dtype)


def _checkable_in_place(target: torch.Tensor, src: torch.Tensor) -> bool:
    # A gradient multiplied by exactly 1 keeps every value, so it can be checked where it is:
    # a plain dense tensor of the target's dtype, outside autograd and inference mode.
    return (type(src) is torch.Tensor and src.dtype == target.dtype and not src.requires_grad
            and not src.is_inference())


_STRIDED = torch.strided
_Lists = dict[str, tuple[list[torch.Tensor], list[torch.Tensor], list[int]]]
_Sparse = list[tuple[int, torch.Tensor, torch.Tensor]]


def _classify(work: UnscaleWork, unit_scale: bool
              ) -> tuple[_Lists, list[torch.Tensor | None], _Sparse, list[int]]:
    """Sort `work`'s entries by kernel call; allocate the buffers of the fresh ones.

    Also returns the indices of dense new gradients going onto sparse earlier ones (added
    after the kernels)."""
    # kind -> (sources, destinations, indices into work.assign); kinds: fresh buffer,
    # accumulation onto a clone of the earlier gradient, checked in place
    lists: _Lists = {
        kind: ([], [], []) for kind in ("fresh", "accumulate", "in_place")}
    results: list[torch.Tensor | None] = []
    sparse: _Sparse = []
    mixed: list[int] = []
    plain = torch.Tensor
    for i, (target, src, earlier) in enumerate(work.assign):
        if src is None:
            results.append(earlier)
            continue
        if (earlier is None and unit_scale and type(src) is plain and src.layout is _STRIDED
                and src.dtype == target.dtype and not src.requires_grad
                and not src.is_inference()):
            # the clean path at a unit scale (bf16's default): checked in place, no buffer
            # (`_checkable_in_place`, inlined: this loop runs once per parameter)
            srcs, dsts, index = lists["in_place"]
            srcs.append(src)
            dsts.append(src)
            index.append(i)
            results.append(src)
            continue
        if src.is_sparse:
            if target.dtype == torch.float16:
                # as torch's GradScaler: duplicate indices are summed by the optimizer, and
                # fp16 sums can overflow where every single value is finite (an fp32 master
                # gradient sums in fp32: nothing to coalesce)
                src = src.coalesce()
            values = src._values()
            out = torch.empty(values.shape, dtype=target.dtype, device=values.device)
            lists["fresh"][0].append(values)
            lists["fresh"][1].append(out)
            lists["fresh"][2].append(i)
            sparse.append((i, src, out))
            results.append(None)
            continue
        accumulate = earlier is not None and not earlier.is_sparse
        if earlier is not None and not accumulate:
            mixed.append(i)  # a dense new gradient onto a sparse earlier one
        if accumulate:
            kind, dst = "accumulate", earlier.clone()  # type: ignore[union-attr]
        elif unit_scale and earlier is None and _checkable_in_place(target, src):
            kind, dst = "in_place", src
        else:
            kind, dst = "fresh", _fresh(target, src)
        srcs, dsts, index = lists[kind]
        srcs.append(src)
        dsts.append(dst)
        index.append(i)
        results.append(dst)
    return lists, results, sparse, mixed


def run(work: UnscaleWork, inv_scale: torch.Tensor, found_inf: torch.Tensor,
        per_tensor: bool = False, unit_scale: bool = False) -> torch.Tensor | None:
    """Compute every new gradient of `work` into fresh buffers; flag inf/NaN in `found_inf`.

    `found_inf` must be a tensor this pass owns (it is written). Returns the per-tensor flags
    when asked for. With `unit_scale` (the caller knows `inv_scale` is exactly 1.0, a static
    scale of 1: bf16's default) a gradient that is not accumulated and needs no dtype change
    is its own new gradient: it is only checked, in place (multiplied by 1, which changes no
    value: nothing is lost if the pass fails), and no buffer is allocated for it.
    """
    lists, results, sparse, mixed = _classify(work, unit_scale)
    order = [i for kind in lists.values() for i in kind[2]]
    flags = torch.zeros(len(order), dtype=torch.float32, device=found_inf.device) \
        if per_tensor else None
    start = 0
    for kind, (srcs, dsts, _) in lists.items():
        if not srcs:  # one kernel call per kind that has work, none for the others
            continue
        part = flags[start:start + len(srcs)] if flags is not None else None
        if kind == "in_place":
            _ext.unscale_(srcs, inv_scale, found_inf, part)
        else:
            _ext.unscale_into_(srcs, dsts, inv_scale, found_inf, part,
                               accumulate=kind == "accumulate")
        start += len(srcs)
    for i, grad, out in sparse:
        new = torch.sparse_coo_tensor(grad._indices(), out, grad.shape, dtype=out.dtype,
                                      device=out.device, check_invariants=False)
        earlier = work.assign[i][2]
        results[i] = new if earlier is None else earlier + new
    for i in mixed:
        results[i] = work.assign[i][2] + results[i]  # type: ignore[operator]
    work.results = results
    work.flag_params = [work.assign[i][0] for i in order]
    return flags


def run_clean(cache: ParamCache, stash: dict[int, tuple[torch.Tensor, torch.Tensor]],
              inv_scale: torch.Tensor, per_tensor: bool, unit_scale: bool,
              found_inf: torch.Tensor | None = None
              ) -> tuple[UnscaleWork, torch.Tensor | None, torch.Tensor] | None:
    """`plan` + `run` in one native call when the pass is clean, else None (nothing written).

    Clean: nothing accumulated (no stash, no master gradient yet) and every gradient a
    contiguous plain tensor on the scaler's device: the usual pass. The same rules and
    kernels as `run`, so the results are bitwise the same; `work.assign` lists only the
    entries that got a fresh buffer (one checked in place already is its `.grad`).

    Returns:
        (work, per-tensor flags or None, found_inf: the given one, or a new one).
    """
    if stash:
        return None
    out = _ext.unscale_pass(cache.sources, cache.targets, inv_scale, unit_scale, per_tensor,
                            found_inf)
    if out is None:
        return None
    found, flags, assign, results, clear, flag_params = out
    return UnscaleWork(assign, clear, results, flag_params), flags, found


# -- folding: earlier gradients back into `.grad` at a pass's scale ---------------------------

_FOLDABLE = (torch.float32, torch.float64, torch.bfloat16)

_Entries = dict[int, tuple[torch.Tensor, torch.Tensor]]


def foldable(grad: torch.Tensor) -> bool:
    """A gradient that keeps every value when multiplied by a scale and unscaled (dense,
    plain, of fp32's exponent range: fp32, fp64, bf16): an fp16 one could overflow where the
    stash's would not."""
    return (type(grad) is torch.Tensor and grad.layout is torch.strided
            and grad.dtype in _FOLDABLE)


def take_foldable(stash: dict[int, tuple[torch.Tensor, torch.Tensor | None]]) -> _Entries:
    """Move the foldable entries of `stash` (param id -> (param, grad)) into the result."""
    out = {key: (param, grad) for key, (param, grad) in stash.items()
           if grad is not None and foldable(grad)}
    for key in out:
        del stash[key]
    return out


def fold(entries: _Entries, scale: torch.Tensor, found: torch.Tensor | None
         ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(param, earlier gradient times `scale`) for each entry, in new tensors (no sync).

    After an overflow (`found` set: the step skips anyway) they fold as 0, so the pass checks
    its own gradients only, as apex's stash did.
    """
    factor = scale.reshape(())
    if found is not None:
        factor = factor * (found.reshape(()).to(factor.device) == 0)
    out = []
    for param, grad in entries.values():
        value = grad * factor.to(grad.device)
        if found is not None:
            value.nan_to_num_(0.0, 0.0, 0.0)  # (inf * 0; finite values are unchanged)
        out.append((param, value))
    return out
