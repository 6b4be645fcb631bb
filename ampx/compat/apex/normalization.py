"""`apex.normalization` for legacy scripts: FusedLayerNorm, FusedRMSNorm, the Mixed forms and
apex's function names (`FusedLayerNormAffineFunction.apply`, `fused_layer_norm_affine`, ...).

ampx implementations of apex's normalization modules with apex's signatures, parameter names
(`weight`, `bias`, so state dicts load both ways) and its fused kernels' dtype contract, built
on torch's `layer_norm`: the statistics are computed in float32 whatever the input dtype (as
apex's CUDA kernels do); `FusedLayerNorm` and `FusedRMSNorm` return the input's dtype,
`MixedFusedLayerNorm` and `MixedFusedRMSNorm` return the parameters' dtype (apex's "mixed"
kernels, used by Megatron with half activations and float32 parameters). They run on every
device. `memory_efficient` (which tensors apex's kernel saved for backward) is accepted and
changes nothing.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import missing_name

__all__ = ["FusedLayerNorm", "FusedLayerNormAffineFunction",
           "FusedLayerNormAffineMixedDtypesFunction", "FusedLayerNormFunction", "FusedRMSNorm",
           "FusedRMSNormAffineFunction",
           "FusedRMSNormAffineMixedDtypesFunction", "FusedRMSNormFunction",
           "MixedFusedLayerNorm", "MixedFusedRMSNorm", "fused_layer_norm",
           "fused_layer_norm_affine", "fused_rms_norm", "fused_rms_norm_affine",
           "mixed_dtype_fused_layer_norm_affine", "mixed_dtype_fused_rms_norm_affine"]

_MISSING = {
    "InstanceNorm3dNVFuser": "torch.nn.InstanceNorm3d",
}

Shape = int | Sequence[int] | torch.Size


def __getattr__(name: str) -> Any:
    missing_name("apex.normalization", name, _MISSING)


def _shape(normalized_shape: Shape) -> torch.Size:
    if isinstance(normalized_shape, numbers.Integral):
        return torch.Size((int(normalized_shape),))
    return torch.Size(tuple(normalized_shape))  # type: ignore[arg-type]


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None or t.dtype in (torch.float32, torch.float64):
        return t
    return t.float()


def layer_norm(x: torch.Tensor, shape: torch.Size, weight: torch.Tensor | None,
               bias: torch.Tensor | None, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """Layer norm with float32 statistics, returned in `out_dtype` (autograd flows through)."""
    out = F.layer_norm(_f32(x), shape, _f32(weight), _f32(bias), eps)  # type: ignore[arg-type]
    return out.to(out_dtype)


def rms_norm(x: torch.Tensor, shape: torch.Size, weight: torch.Tensor | None, eps: float,
             out_dtype: torch.dtype) -> torch.Tensor:
    """RMS norm: ``x / sqrt(mean(x**2) + eps) * weight`` in float32, returned in `out_dtype`."""
    xf = _f32(x)
    if xf is None:  # never: x is a tensor
        raise TypeError("rms_norm: input must be a tensor")
    dims = tuple(range(-len(shape), 0))
    out = xf * torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + eps)
    w = _f32(weight)
    if w is not None:
        out = out * w
    return out.to(out_dtype)


class _TrailingNorm(nn.Module):
    """What both norms share: apex's constructor arguments, parameters and repr.

    `bias` says whether the affine form has a bias (layer norm) or only a weight (RMS norm).
    """

    def __init__(self, normalized_shape: Shape, eps: float, elementwise_affine: bool,
                 memory_efficient: bool, *, bias: bool) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape))
        else:
            self.register_parameter("weight", None)
        if elementwise_affine and bias:
            self.bias: nn.Parameter | None = nn.Parameter(torch.empty(self.normalized_shape))
        elif bias:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Weight to ones, bias (if any) to zeros, when affine."""
        if self.elementwise_affine:
            nn.init.ones_(self.weight)
            bias = getattr(self, "bias", None)
            if bias is not None:
                nn.init.zeros_(bias)

    def extra_repr(self) -> str:
        """apex's repr: shape, eps and elementwise_affine."""
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


class FusedLayerNorm(_TrailingNorm):
    """Layer normalization over the last ``len(normalized_shape)`` dimensions (apex's API).

    Args:
        normalized_shape: The trailing shape to normalize over (an int for the last dim).
        eps: Added to the variance.
        elementwise_affine: Learnable `weight` (ones) and `bias` (zeros) of that shape.
        memory_efficient: Accepted; no effect.

    The output has the input's dtype; statistics are float32.
    """

    def __init__(self, normalized_shape: Shape, eps: float = 1e-5,
                 elementwise_affine: bool = True, memory_efficient: bool = False) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, memory_efficient, bias=True)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize `input`; the result has `input`'s dtype."""
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps,
                          input.dtype)


class FusedRMSNorm(_TrailingNorm):
    """RMS normalization ``x / RMS[x] * weight`` over the trailing shape (apex's API).

    Args:
        normalized_shape: The trailing shape to normalize over (an int for the last dim).
        eps: Added to the mean square before the square root.
        elementwise_affine: A learnable `weight` (ones) of that shape.
        memory_efficient: Accepted; no effect.

    The output has the input's dtype; statistics are float32.
    """

    def __init__(self, normalized_shape: Shape, eps: float = 1e-5,
                 elementwise_affine: bool = True, memory_efficient: bool = False) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, memory_efficient, bias=False)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize `input`; the result has `input`'s dtype."""
        return rms_norm(input, self.normalized_shape, self.weight, self.eps, input.dtype)


def _mixed_affine(kind: str, kwargs: dict[str, Any]) -> None:
    """apex's Mixed* layers: `elementwise_affine` warns, and False is refused."""
    if "elementwise_affine" in kwargs:
        warnings.warn(f"{kind} does not support `elementwise_affine` argument", UserWarning,
                      stacklevel=3)
        if not kwargs.pop("elementwise_affine"):
            raise RuntimeError(f"{kind} does not support `elementwise_affine = False`")
    if kwargs:
        raise TypeError(f"{kind}() got unexpected keyword arguments: {sorted(kwargs)}")


class MixedFusedLayerNorm(FusedLayerNorm):
    """`FusedLayerNorm` whose output has the parameters' dtype (apex's mixed-dtype kernel).

    Args:
        normalized_shape: The trailing shape to normalize over.
        eps: Added to the variance.
        memory_efficient: Accepted; no effect.
        **kwargs: Only `elementwise_affine`, which warns (and must be True), as in apex.
    """

    def __init__(self, normalized_shape: Shape, eps: float = 1e-5, *,
                 memory_efficient: bool = False, **kwargs: Any) -> None:
        _mixed_affine("MixedFusedLayerNorm", kwargs)
        super().__init__(normalized_shape, eps=eps, elementwise_affine=True,
                         memory_efficient=memory_efficient)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize `input`; the result has the parameters' dtype."""
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps,
                          self.weight.dtype)


class MixedFusedRMSNorm(FusedRMSNorm):
    """`FusedRMSNorm` whose output has the parameters' dtype (apex's mixed-dtype kernel).

    Args:
        normalized_shape: The trailing shape to normalize over.
        eps: Added to the mean square.
        memory_efficient: Accepted; no effect.
        **kwargs: Only `elementwise_affine`, which warns (and must be True), as in apex.
    """

    def __init__(self, normalized_shape: Shape, eps: float = 1e-5, *,
                 memory_efficient: bool = False, **kwargs: Any) -> None:
        _mixed_affine("MixedFusedRMSNorm", kwargs)
        super().__init__(normalized_shape, eps=eps, elementwise_affine=True,
                         memory_efficient=memory_efficient)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize `input`; the result has the parameters' dtype."""
        return rms_norm(input, self.normalized_shape, self.weight, self.eps, self.weight.dtype)


# -- apex's autograd-function and functional names (fused_layer_norm.py) ---------------------------
# NVIDIA's BERT and Megatron-style code call `FusedLayerNormAffineFunction.apply(x, weight, bias,
# shape, eps)` directly. Here `apply` runs the same float32-statistics computation as the
# modules (autograd flows through torch's ops); the Mixed forms return the weight's dtype.

class FusedLayerNormAffineFunction:
    """apex's ``FusedLayerNormAffineFunction``: ``apply(input, weight, bias, shape, eps)``."""

    @staticmethod
    def apply(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
              normalized_shape: Shape, eps: float, memory_efficient: bool = False
              ) -> torch.Tensor:
        return layer_norm(input, _shape(normalized_shape), weight, bias, eps, input.dtype)


class FusedLayerNormAffineMixedDtypesFunction:
    """apex's mixed form: as `FusedLayerNormAffineFunction`, output in the weight's dtype."""

    @staticmethod
    def apply(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
              normalized_shape: Shape, eps: float, memory_efficient: bool = False
              ) -> torch.Tensor:
        return layer_norm(input, _shape(normalized_shape), weight, bias, eps, weight.dtype)


class FusedLayerNormFunction:
    """apex's ``FusedLayerNormFunction``: ``apply(input, shape, eps)`` (no affine)."""

    @staticmethod
    def apply(input: torch.Tensor, normalized_shape: Shape, eps: float,
              memory_efficient: bool = False) -> torch.Tensor:
        return layer_norm(input, _shape(normalized_shape), None, None, eps, input.dtype)


class FusedRMSNormAffineFunction:
    """apex's ``FusedRMSNormAffineFunction``: ``apply(input, weight, shape, eps)``."""

    @staticmethod
    def apply(input: torch.Tensor, weight: torch.Tensor, normalized_shape: Shape, eps: float,
              memory_efficient: bool = False) -> torch.Tensor:
        return rms_norm(input, _shape(normalized_shape), weight, eps, input.dtype)


class FusedRMSNormAffineMixedDtypesFunction:
    """apex's mixed form: as `FusedRMSNormAffineFunction`, output in the weight's dtype."""

    @staticmethod
    def apply(input: torch.Tensor, weight: torch.Tensor, normalized_shape: Shape, eps: float,
              memory_efficient: bool = False) -> torch.Tensor:
        return rms_norm(input, _shape(normalized_shape), weight, eps, weight.dtype)


class FusedRMSNormFunction:
    """apex's ``FusedRMSNormFunction``: ``apply(input, shape, eps)`` (no affine)."""

    @staticmethod
    def apply(input: torch.Tensor, normalized_shape: Shape, eps: float,
              memory_efficient: bool = False) -> torch.Tensor:
        return rms_norm(input, _shape(normalized_shape), None, eps, input.dtype)


def fused_layer_norm_affine(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                            normalized_shape: Shape, eps: float = 1e-6,
                            memory_efficient: bool = False) -> torch.Tensor:
    """apex's functional affine layer norm (output in the input's dtype)."""
    return FusedLayerNormAffineFunction.apply(input, weight, bias, normalized_shape, eps)


def mixed_dtype_fused_layer_norm_affine(input: torch.Tensor, weight: torch.Tensor,
                                        bias: torch.Tensor, normalized_shape: Shape,
                                        eps: float = 1e-6, memory_efficient: bool = False
                                        ) -> torch.Tensor:
    """apex's functional mixed layer norm (output in the weight's dtype)."""
    return FusedLayerNormAffineMixedDtypesFunction.apply(input, weight, bias, normalized_shape,
                                                         eps)


def fused_layer_norm(input: torch.Tensor, normalized_shape: Shape, eps: float = 1e-6,
                     memory_efficient: bool = False) -> torch.Tensor:
    """apex's functional layer norm without affine parameters."""
    return FusedLayerNormFunction.apply(input, normalized_shape, eps)


def fused_rms_norm_affine(input: torch.Tensor, weight: torch.Tensor, normalized_shape: Shape,
                          eps: float = 1e-6, memory_efficient: bool = False) -> torch.Tensor:
    """apex's functional affine RMS norm (output in the input's dtype)."""
    return FusedRMSNormAffineFunction.apply(input, weight, normalized_shape, eps)


def mixed_dtype_fused_rms_norm_affine(input: torch.Tensor, weight: torch.Tensor,
                                      normalized_shape: Shape, eps: float = 1e-6,
                                      memory_efficient: bool = False) -> torch.Tensor:
    """apex's functional mixed RMS norm (output in the weight's dtype)."""
    return FusedRMSNormAffineMixedDtypesFunction.apply(input, weight, normalized_shape, eps)


def fused_rms_norm(input: torch.Tensor, normalized_shape: Shape, eps: float = 1e-6,
                   memory_efficient: bool = False) -> torch.Tensor:
    """apex's functional RMS norm without a weight."""
    return FusedRMSNormFunction.apply(input, normalized_shape, eps)
