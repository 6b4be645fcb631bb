"""Overflow agreement across ranks of torch.distributed.

With DDP, gradients are all-reduced during backward, so every rank sees the same inf/NaN. Where
they are not (gradient accumulation under `no_sync`, FSDP2's sharded gradients, sharded
optimizers, or a rank-local loss), ranks could disagree on whether to skip a step and drift
apart. ampx therefore all-reduces its overflow flag (MAX) before it is acted on whenever a
process group with more than one rank is initialized, unless the session was created with
`sync_overflow=False`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["is_multi_rank", "reduce_found_inf_", "rank"]


def is_multi_rank(group: Any = None) -> bool:
    """True when torch.distributed is initialized with more than one rank in `group`."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rank() -> int:
    """This process's global rank (0 when not distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


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
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
