"""Type stub for ``ampx._C``, the optional native kernels (csrc/ampx.cpp).

The contract and its executable specification are in ``ampx/_reference.py``; callers
go through ``ampx._ext``, never this module. All list arguments must be non-aliasing,
contiguous float32/float16/bfloat16 tensors on one device; violations raise
``TypeError`` (dtype) or ``ValueError`` (device, length, size, layout) naming the index.
"""

from typing import Optional

from torch import Tensor

def unscale_(
    grads: list[Tensor],
    inv_scale: Tensor,
    found_inf: Tensor,
    per_tensor: Optional[Tensor] = None,
) -> None: ...
def unscale_into_(
    src: list[Tensor],
    dst: list[Tensor],
    inv_scale: Tensor,
    found_inf: Tensor,
    per_tensor: Optional[Tensor] = None,
    accumulate: bool = False,
) -> None: ...
def l2norm(tensors: list[Tensor], per_tensor: bool = False) -> tuple[Tensor, Tensor]:
    """Return ``(total, norms)``; ``norms`` is empty unless ``per_tensor``."""

def copy_(src: list[Tensor], dst: list[Tensor]) -> None: ...
def update_scale_(
    scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_inf: Tensor,
    growth: float,
    backoff: float,
    interval: int,
    hysteresis: int,
    min_scale: float,
    max_scale: float,
) -> None: ...
def compensated_sgd_(
    params: list[Tensor],
    comps: list[Tensor],
    grads: list[Tensor],
    momentum_bufs: list[Tensor],
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    maximize: bool,
    first: bool,
) -> None:
    """One SGD step on compensated half weights (ampx/_reference_compensated.py)."""

def compensated_adam_(
    params: list[Tensor],
    comps: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    maximize: bool,
    step_size: float,
    bias2_sqrt: float,
) -> None:
    """One Adam/AdamW step on compensated half weights (ampx/_reference_compensated.py)."""

def has_cuda() -> bool:
    """Whether the CUDA kernels were compiled in."""

def cpu_capability() -> str:
    """The instruction set of the CPU kernels: "AVX512", "AVX2" or "DEFAULT"."""
def cuda_archs() -> str:
    """The CUDA architectures compiled in ("80_90p": sm_80, sm_90, PTX 9.0); "" without CUDA."""

def cuda_limits() -> dict[str, int]:
    """chunk, max_tensors, max_blocks, threads, pack_bytes of the CUDA kernels ({} without)."""

def cuda_probe(device: int) -> str:
    """"" when cuda:`device` can run the CUDA kernels, else the CUDA runtime's reason."""
