"""Per-tensor overflow flags of one optimizer's backward passes, turned into an OverflowReport.

The unscale transition asks :meth:`GradFlags.flags_for` for a float32 flag tensor per kernel
call and passes it as the kernels' ``per_tensor`` argument, so the flags come from the same
fused pass that unscales (no second pass). Nothing here reads a device value on a clean step:
:meth:`GradFlags.clear` just drops the references. Only when a step is skipped does
:meth:`GradFlags.report` copy the flags to the host (one small copy per device), run one
small reduction over the *flagged* gradients to tell inf from NaN (the kernels only say
"non-finite"), and, when distributed, all-reduce a flags-by-rank table (one collective; every
rank takes part, because ranks agree on the skip).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .report import OverflowReport, ParamNames, rank_modules

__all__ = ["GradFlags", "classify_nonfinite"]


@dataclass
class _Pass:
    """One kernel call's flags: `holders[i]` is the param whose `.grad` holds tensor i."""

    loss_id: int
    holders: list[torch.Tensor]
    flags: torch.Tensor


def classify_nonfinite(tensors: Sequence[torch.Tensor | None]) -> list[tuple[bool, bool]]:
    """``(has inf, has NaN)`` for each tensor: one small reduction, one host copy.

    Meant for the few tensors the unscale kernel flagged, on a skipped step only.
    None entries (a gradient that is gone) give ``(False, False)``.

    .. note:: Synchronises with the host once per device.

    >>> classify_nonfinite([torch.tensor([1.0, float("inf")]), torch.tensor([float("nan")])])
    [(True, False), (False, True)]
    """
    # A DTensor gradient (FSDP2) is classified through this rank's shard.
    present = [(i, t.to_local() if hasattr(t, "to_local") else t)
               for i, t in enumerate(tensors) if t is not None]
    out = [(False, False)] * len(tensors)
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, t in present:
        by_device.setdefault(t.device, []).append((i, t))
    for items in by_device.values():
        values = [t._values() if t.is_sparse else t for _, t in items]
        stats = torch.stack([torch.stack((torch.isinf(v).any(), torch.isnan(v).any()))
                             for v in values])
        for (i, _), (inf, nan) in zip(items, stats.tolist()):
            out[i] = (bool(inf), bool(nan))
    return out


class GradFlags:
    """Per-tensor overflow flags since the last step of one optimizer.

    Args:
        names: Parameter names (models' params and O2 masters).
    """

    def __init__(self, names: ParamNames) -> None:
        self.names = names
        self._passes: list[_Pass] = []

    def flags_for(self, loss_id: int, holders: Sequence[torch.Tensor],
                  device: torch.device) -> torch.Tensor:
        """A zeroed float32 flag tensor for one kernel call over `holders`' gradients.

        Args:
            loss_id: The loss whose backward produced the gradients.
            holders: For each tensor of the kernel call, the parameter whose ``.grad`` will
                hold its unscaled values (the fp32 master at O2, else the parameter).
            device: The kernel call's device.
        """
        flags = torch.zeros(len(holders), dtype=torch.float32, device=device)
        self.record(loss_id, holders, flags)
        return flags

    def record(self, loss_id: int, holders: Sequence[torch.Tensor], flags: torch.Tensor) -> None:
        """Keep flags a kernel call already filled (``flags[i]`` is for ``holders[i]``).

        Raises:
            ValueError: When the lengths differ.
        """
        if flags.numel() != len(holders):
            raise ValueError(f"GradFlags.record: {flags.numel()} flags for {len(holders)} "
                             "parameters; pass one flag per parameter")
        self._passes.append(_Pass(loss_id, list(holders), flags.reshape(-1)))

    def _flagged(self) -> list[tuple[int, torch.Tensor]]:
        """``(loss_id, holder)`` for every flagged tensor: one host copy per device."""
        by_device: dict[torch.device, list[_Pass]] = {}
        for p in self._passes:
            by_device.setdefault(p.flags.device, []).append(p)
        out: list[tuple[int, torch.Tensor]] = []
        for passes in by_device.values():
            host = torch.cat([p.flags for p in passes]).tolist()
            pos = 0
            for p in passes:
                for holder, flag in zip(p.holders, host[pos:pos + len(p.holders)]):
                    if flag:
                        out.append((p.loss_id, holder))
                pos += len(p.holders)
        return out

    def report(self, *, step: int, loss_ids: Sequence[int],
               scales: dict[int, tuple[float, float]],
               forward: tuple[str, str] | None = None,
               process_group: dist.ProcessGroup | None = None,
               distributed: bool = False) -> OverflowReport:
        """Build the report of a skipped step (call before its gradients are released).

        Args:
            step: Index of the skipped step.
            loss_ids: Every loss that fed the step.
            scales: ``loss_id -> (before, after)`` of the overflowing losses.
            forward: ``(module, "inf" | "nan")`` from the forward detector, if any.
            process_group: Group for the flags-by-rank table (None: the default group).
            distributed: Gather which ranks flagged which parameter (every rank must call).

        .. note:: Host syncs: one copy of the flags, one classification reduction, and one
           all-reduce when `distributed`. Skipped steps only.
        """
        flagged = self._flagged()
        names = self.names
        by_name: dict[str, tuple[int, torch.Tensor]] = {}
        per_loss: dict[int, dict[str, int]] = {}
        for loss_id, holder in flagged:
            name = names.name_of(holder) or f"<unnamed {tuple(holder.shape)}>"
            order = names.order_of(holder)
            by_name.setdefault(name, (order, holder))
            per_loss.setdefault(loss_id, {})[name] = order
        ranked = sorted(by_name, key=lambda n: (-by_name[n][0], n))
        kinds = classify_nonfinite([by_name[n][1].grad for n in ranked])
        rank = dist.get_rank(process_group) if distributed else None
        return OverflowReport(
            step=step,
            loss_ids=tuple(sorted(set(loss_ids))),
            scales=dict(scales),
            inf_params=tuple(n for n, (inf, _) in zip(ranked, kinds) if inf),
            nan_params=tuple(n for n, (_, nan) in zip(ranked, kinds) if nan),
            unknown_params=tuple(n for n, k in zip(ranked, kinds) if k == (False, False)),
            params_by_loss={lid: tuple(sorted(p, key=lambda n: (-p[n], n)))
                            for lid, p in sorted(per_loss.items())},
            modules=rank_modules([(n, by_name[n][0]) for n in ranked]),
            forward_module=forward[0] if forward else None,
            forward_kind=forward[1] if forward else None,
            rank=rank,
            param_ranks=(_param_ranks(ranked, by_name, names, process_group)
                         if distributed else {}),
        )


def _param_ranks(ranked: list[str], by_name: dict[str, tuple[int, torch.Tensor]],
                 names: ParamNames, group: dist.ProcessGroup | None
                 ) -> dict[str, tuple[int, ...]]:
    """Which ranks flagged which parameter, closest to the loss first.

    A [world, n_params] table, one row set per rank, summed by one all-reduce (skipped steps
    only). Every rank has the same parameters in the same order (DDP, FSDP2), so registration
    indices line up and names flagged on another rank resolve through this rank's table.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend(group) == "nccl" else torch.device("cpu"))
    table = torch.zeros(world, max(len(names), 1), dtype=torch.float32, device=device)
    for name in ranked:
        order = by_name[name][0]
        if order >= 0:
            table[rank, order] = 1.0
    dist.all_reduce(table, group=group)
    hits = table.cpu().t().tolist()
    out: dict[str, tuple[int, ...]] = {}
    for order in range(len(names) - 1, -1, -1):
        ranks = tuple(r for r, hit in enumerate(hits[order]) if hit)
        if ranks:
            out[names.name_at(order)] = ranks
    return out
