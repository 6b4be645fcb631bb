"""`apex.multi_tensor_apply` as apex had it without its CUDA extension (`amp_C`).

apex's ImageNet example imports ``multi_tensor_applier`` in the same ``try:`` block as amp, so
the module must import. As in an apex built without ``--cuda_ext``, `multi_tensor_applier`
exists with ``available = False``, and calling it raises, naming the replacement: the fused
kernels it launched (`amp_C.*`) are not part of ampx; `torch._foreach_*` functions (or the
optimizers in `ampx.compat.apex.optimizers`) do that work.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MultiTensorApply", "multi_tensor_applier"]


class MultiTensorApply:
    """apex's launcher of `amp_C` multi-tensor kernels; unavailable here (no `amp_C`).

    Args:
        chunk_size: Elements per chunk (kept for apex's signature).
    """

    available = False
    warned = False

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size

    def check_avail(self) -> None:
        """Raise: apex's `amp_C` kernels are not available."""
        raise RuntimeError(
            "apex.multi_tensor_apply.multi_tensor_applier: apex's amp_C CUDA kernels are not "
            "part of ampx; use torch._foreach_* functions (e.g. torch._foreach_mul_) or the "
            "optimizers in apex.optimizers (ampx.compat.apex.optimizers)."
        )

    def __call__(self, op: Any, noop_flag_buffer: Any, tensor_lists: Any, *args: Any) -> Any:
        """Raise (see `check_avail`)."""
        self.check_avail()


multi_tensor_applier = MultiTensorApply(2048 * 32)
