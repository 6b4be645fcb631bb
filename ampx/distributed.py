"""torch.distributed: overflow agreement across ranks, DTensor helpers, rank-0-only logging.

With DDP, gradients are all-reduced during backward, so every rank sees the same inf/NaN. Where
they are not (FSDP2's sharded gradients, sharded optimizers, gradients reduced by hand after
`scale_loss`, or a rank-local loss), ranks could disagree on whether to skip a step and drift
apart. ampx therefore all-reduces its overflow flag (MAX) before it is acted on whenever a
process group with more than one rank is initialized, unless the session was created with
`sync_overflow=False`.

Gradient accumulation under DDP's `no_sync`: a plain `scale_loss` per micro-batch works where
the optimizer steps the model's own fp32 or bf16 parameters (O1, O3 bf16): each pass starts by
folding the earlier, unscaled gradients back into `.grad` at its own scale, so the last pass's
backward all-reduces the accumulated sum. At O2 the earlier passes' gradients live in the fp32
masters, which DDP never sees (and fp16 ones are stashed): keep them scaled in the model
(`scale_loss(..., delay_unscale=True)` for every pass but the last, which is what
`ampx.compat.fairseq.optimizer.AmpOptimizer` does).

Once ampx sees a multi-rank run it adds `RankZeroFilter` to the "ampx" logger: ranks other than
0 then only log errors, so a skipped step is reported once, not once per rank.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from .registry import SESSIONS

__all__ = ["RankZeroFilter", "aggregate_dtensor_norm", "install_log_filter", "is_dtensor",
           "is_multi_rank", "local", "rank", "reduce_found_inf_"]



class RankZeroFilter(logging.Filter):
    """A logging filter that lets ranks other than 0 through only at `level` and above.

    The rank is read when a record is logged, so the filter can be installed before
    `init_process_group`; in a single process it lets everything through.

    Args:
        level: The lowest level logged on every rank.

    Example::

        logging.getLogger("my_trainer").addFilter(ampx.distributed.RankZeroFilter())
    """

    def __init__(self, level: int = logging.ERROR) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        """True when the record is logged (rank 0, or at least `level`)."""
        return record.levelno >= self.level or rank() == 0


def install_log_filter(level: int = logging.ERROR) -> RankZeroFilter:
    """Add (once) a `RankZeroFilter` to the "ampx" logger; returns it.

    ampx calls this itself as soon as it sees a multi-rank run. Remove it with
    `logging.getLogger("ampx").removeFilter(...)` to get every rank's messages.
    """
    if SESSIONS.log_filter is None:  # once: a filter the user removed stays removed
        SESSIONS.log_filter = RankZeroFilter(level)
        logging.getLogger("ampx").addFilter(SESSIONS.log_filter)
    return SESSIONS.log_filter


def is_multi_rank(group: Any = None) -> bool:
    """True when torch.distributed is initialized with more than one rank in `group`."""
    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    if multi and SESSIONS.log_filter is None:
        install_log_filter()
    return multi


def rank() -> int:
    """This process's global rank (0 when not distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    if SESSIONS.log_filter is None and dist.get_world_size() > 1:
        install_log_filter()
    return dist.get_rank()


def reduce_found_inf_(found_inf: torch.Tensor, group: Any = None) -> None:
    """All-reduce an overflow flag with MAX, in place, so every rank takes the same decision.

    The flag is moved to the backend's device when needed (NCCL needs CUDA tensors).
    """
    backend = dist.get_backend(group)
    if backend == "nccl" and found_inf.device.type != "cuda":
        staged = found_inf.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(staged, op=dist.ReduceOp.MAX, group=group)
        found_inf.copy_(staged)
    else:
        held = _references(found_inf)
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
        if backend == "gloo":
            _wait_until_released(found_inf, held)


def _wait_until_released(tensor: torch.Tensor, held: int, timeout: float = 5.0) -> None:
    """Wait (GIL released) until gloo's worker thread has dropped its reference to `tensor`.

    gloo destroys a finished work, and the tensors it holds, on its worker thread after
    `wait()` has returned. When that thread drops the last reference to ampx's per-step flag
    it frees the flag's Python object and needs the GIL; if the interpreter is exiting by
    then (the flag of the last step, on a loaded machine), the thread is killed inside C++
    and the process aborts (SIGABRT, "terminate called without an active exception") after
    the script has finished. Returning only once the count is back keeps that last
    reference in Python. The worker lets go microseconds after `wait()` returns.
    """
    deadline = time.monotonic() + timeout
    while _references(tensor) > held and time.monotonic() < deadline:
        time.sleep(0.0001)


def _references(tensor: torch.Tensor) -> int:
    """C++ references to `tensor` (``Tensor._use_count``; 0 where torch lacks it)."""
    count = getattr(tensor, "_use_count", None)
    return int(count()) if count is not None else 0


# -- DTensor (FSDP2) helpers ------------------------------------------------------------------

# A tensor is a DTensor only once something imported torch.distributed.tensor (about 1.5 s and
# sympy): looked up then, never imported here.
_DTENSOR: list[type] = []


def _dtensor_type() -> type | None:
    if not _DTENSOR:
        cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
        if cls is None:
            return None
        _DTENSOR.append(cls)
    return _DTENSOR[0]


def is_dtensor(tensor: torch.Tensor) -> bool:
    """True for a `torch.distributed.tensor.DTensor` (FSDP2 parameters and gradients)."""
    cls = _dtensor_type()
    return cls is not None and isinstance(tensor, cls)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view), or the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def aggregate_dtensor_norm(norm: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum squared norms over the mesh when the gradients are DTensor shards (FSDP2).

    Raises:
        ValueError: For shards over several or multi-dimensional meshes.
    """
    sharded = [g for g in grads if is_dtensor(g)
               and any(p.is_shard() for p in g.placements)]  # type: ignore[attr-defined]
    meshes = {id(g.device_mesh): g.device_mesh for g in sharded}  # type: ignore[attr-defined]
    if not meshes:
        return norm
    if len(meshes) > 1 or next(iter(meshes.values())).ndim != 1:
        raise ValueError(
            "AmpOptimizer.clip_grad_norm: gradients are sharded over several or multi-"
            "dimensional device meshes; pass aggregate_norm_fn to combine the norms."
        )
    mesh = next(iter(meshes.values()))
    squared = (norm.float() ** 2).reshape(1)
    dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return squared.sqrt().reshape(())
