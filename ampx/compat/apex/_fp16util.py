"""apex's fp16util helpers: half-precision model conversion and manual master parameters.

The functions of apex.fp16_utils that predate amp: convert a network to half while keeping
batchnorm in float32 (`network_to_half`, `BN_convert_float`, `convert_network`, `FP16Model`),
and keep float32 master copies by hand (`prep_param_lists`, `model_grads_to_master_grads`,
`master_params_to_model_params`). Same names, arguments and results as apex.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = [
    "BN_convert_float", "FP16Model", "clip_grad_norm", "convert_module", "convert_network",
    "master_params_to_model_params", "model_grads_to_master_grads", "network_to_half",
    "prep_param_lists", "to_python_float", "tofp16",
]

clip_grad_norm = torch.nn.utils.clip_grad_norm_


class tofp16(nn.Module):  # apex's name
    """A module whose forward is ``input.half()``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input.half()``."""
        return input.half()


def BN_convert_float(module: nn.Module) -> nn.Module:  # apex's name
    """Convert every batchnorm layer in `module` back to float32; returns `module`."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


def network_to_half(network: nn.Module) -> nn.Module:
    """``nn.Sequential(tofp16(), BN_convert_float(network.half()))``: batchnorm-safe fp16."""
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Convert `module`'s own floating parameters, their gradients and buffers to `dtype`."""
    for param in module.parameters(recurse=False):
        if param.dtype.is_floating_point:
            param.data = param.data.to(dtype=dtype)
        if param.grad is not None and param.grad.dtype.is_floating_point:
            param.grad.data = param.grad.data.to(dtype=dtype)
    for buf in module.buffers(recurse=False):
        if buf.dtype.is_floating_point:
            buf.data = buf.data.to(dtype=dtype)


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Convert every module but affine batchnorm layers to `dtype`; returns `network`."""
    for module in network.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine is True:
            continue
        convert_module(module, dtype)
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
    return network


class FP16Model(nn.Module):
    """A network converted by `convert_network(network, torch.half)`; inputs are cast to half.

    Args:
        network: The model to convert (in place).
    """

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        self.network = convert_network(network, dtype=torch.half)

    def forward(self, *inputs: torch.Tensor) -> Any:
        """The network on the inputs cast to half."""
        return self.network(*(t.half() for t in inputs))


def prep_param_lists(model: nn.Module, flat_master: bool = False
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Float32 master copies of `model`'s trainable parameters.

    Args:
        model: The model.
        flat_master: One flat master tensor (all parameters must share a dtype).

    Returns:
        ``(model_params, master_params)``; with `flat_master`, `master_params` has one element
        (an `nn.Parameter` whose `.grad` is allocated, zero).
    """
    model_params: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        dtypes = {p.dtype for p in model_params}
        if len(dtypes) > 1:
            raise TypeError("prep_param_lists: model likely contains a mixture of parameters of "
                            f"different types ({sorted(map(str, dtypes))}). Use "
                            "flat_master=False, or use FP16_Optimizer.")
        flat = _flatten_dense_tensors([p.detach() for p in model_params]).float()
        master = nn.Parameter(flat)
        master.grad = torch.zeros_like(master)
        return model_params, [master]
    masters = [p.detach().clone().float().requires_grad_(True) for p in model_params]
    return model_params, masters


def model_grads_to_master_grads(model_params: Sequence[torch.Tensor],
                                master_params: Sequence[torch.Tensor],
                                flat_master: bool = False) -> None:
    """Copy the model gradients into the masters' `.grad` (None where the model has none)."""
    with torch.no_grad():
        if flat_master:
            grads = [p.grad for p in model_params]
            if any(g is None for g in grads):
                raise ValueError("model_grads_to_master_grads(flat_master=True): every model "
                                 "parameter needs a gradient")
            master_params[0].grad.copy_(_flatten_dense_tensors(grads))  # type: ignore[union-attr]
            return
        for model, master in zip(model_params, master_params):
            if model.grad is None:
                master.grad = None
                continue
            if master.grad is None:
                master.grad = torch.empty_like(master)
            master.grad.copy_(model.grad)


def master_params_to_model_params(model_params: Sequence[torch.Tensor],
                                  master_params: Sequence[torch.Tensor],
                                  flat_master: bool = False) -> None:
    """Copy the masters' values into the model parameters."""
    with torch.no_grad():
        if flat_master:
            pieces = _unflatten_dense_tensors(master_params[0].detach(), model_params)
            for model, master in zip(model_params, pieces):
                model.copy_(master)
            return
        for model, master in zip(model_params, master_params):
            model.copy_(master)


def to_python_float(t: Any) -> float:
    """``t.item()`` (or ``t[0]`` for objects without `item`)."""
    if hasattr(t, "item"):
        return t.item()
    return t[0]
