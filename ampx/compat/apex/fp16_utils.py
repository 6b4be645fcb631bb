"""`apex.fp16_utils` for legacy scripts: FP16_Optimizer and the fp16util helpers.

ampx implementations of apex's pre-amp mixed-precision tools, importable as
``ampx.compat.apex.fp16_utils`` and, under the alias, ``apex.fp16_utils``. The optimizer wrapper
lives in `_fp16_optimizer`, the conversion and master-parameter helpers in `_fp16util`; this
module gathers apex's public names, including `FP16_Module` and the `fp32_to_fp16` /
`fp16_to_fp32` helpers of apex's fp16_optimizer module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import missing_name
from ._fp16_optimizer import DynamicLossScaler, FP16_Optimizer, LossScaler
from ._fp16util import (
    BN_convert_float,
    FP16Model,
    clip_grad_norm,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
    tofp16,
)

__all__ = [
    "BN_convert_float", "DynamicLossScaler", "FP16Model", "FP16_Module", "FP16_Optimizer",
    "LossScaler", "clip_grad_norm", "convert_module", "convert_network", "fp16_to_fp32",
    "fp32_to_fp16", "master_params_to_model_params", "model_grads_to_master_grads",
    "network_to_half", "prep_param_lists", "to_python_float", "tofp16",
]

_MISSING = {"Fused_Weight_Norm": "torch.nn.utils.parametrizations.weight_norm"}


def __getattr__(name: str) -> Any:
    missing_name("apex.fp16_utils", name, _MISSING)


def _convert(val: Any, source: torch.dtype, target: torch.dtype) -> Any:
    if isinstance(val, (tuple, list)):
        out = [_convert(v, source, target) for v in val]
        return tuple(out) if isinstance(val, tuple) else out
    if isinstance(val, torch.Tensor) and val.dtype == source:
        return val.to(target)
    return val


def fp32_to_fp16(val: Any) -> Any:
    """Cast float32 tensors in `val` (nested tuples/lists too) to float16."""
    return _convert(val, torch.float32, torch.float16)


def fp16_to_fp32(val: Any) -> Any:
    """Cast float16 tensors in `val` (nested tuples/lists too) to float32."""
    return _convert(val, torch.float16, torch.float32)


class FP16_Module(nn.Module):  # apex's name
    """`module.half()` with float32 inputs cast to half and half outputs cast back to float32.

    Args:
        module: The module to convert (in place).
    """

    module: nn.Module

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.add_module("module", module.half())

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The module on half inputs; outputs back in float32."""
        return fp16_to_fp32(self.module(*fp32_to_fp16(inputs), **kwargs))

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's state dict (no ``module.`` prefix), as apex."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load into the wrapped module."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
