"""Model handling for O0/O2/O3 (and cast_model_outputs): casts, hooks, fp32 state dicts.

Nothing here reassigns `model.forward` (apex did, which broke DataParallel replicas and
`copy.deepcopy`); inputs and outputs are cast by forward hooks, which travel with the module.
Hooks hold only dtypes and weak references, so a deep copy of the model (an EMA copy) is an
independent model that computes with its own weights.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .casting import cast_tree

__all__ = ["MasterMap", "ModelCast", "cast_model", "check_models", "device_types_of"]

logger = logging.getLogger("ampx")

_PARALLEL_WRAPPERS = (nn.DataParallel, nn.parallel.DistributedDataParallel)


def check_models(models: Any) -> tuple[list[nn.Module], bool]:
    """Normalise `models` to a list; returns (models, was_list).

    Raises:
        TypeError: For anything but a module or a list of modules (apex's message).
        RuntimeError: For a model already wrapped in DataParallel/DistributedDataParallel.
    """
    if isinstance(models, nn.Module):
        out, was_list = [models], False
    elif isinstance(models, list) and all(isinstance(m, nn.Module) for m in models):
        out, was_list = list(models), True
    else:
        raise TypeError(
            "models must be either a single model or a list of models. "
            f"ampx.initialize got {type(models).__name__}."
        )
    for model in out:
        if isinstance(model, _PARALLEL_WRAPPERS):
            raise RuntimeError(
                f"Incoming model is an instance of {type(model).__module__}."
                f"{type(model).__name__}. Parallel wrappers should only be applied to the "
                "model(s) AFTER the model(s) have been returned from ampx.initialize."
            )
    return out, was_list


def device_types_of(models: list[nn.Module]) -> frozenset[str]:
    """Device types holding the models' floating parameters and buffers (default {"cpu"})."""
    types = {t.device.type for m in models for t in _floating_tensors(m)}
    return frozenset(types or {"cpu"})


def _floating_tensors(model: nn.Module) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = [p for p in model.parameters() if p.is_floating_point()]
    tensors += [b for b in model.buffers() if b.is_floating_point()]
    return tensors


class MasterMap:
    """model (half) parameter -> fp32 master, for the O2 split.

    Referenced weakly from module hooks, so copying a model never copies the optimizer's masters.
    """

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}

    def add(self, model_param: nn.Parameter, master: nn.Parameter) -> None:
        """Record that `master` is the fp32 copy behind `model_param`."""
        self._by_id[id(model_param)] = (model_param, master)

    def master_of(self, model_param: torch.Tensor) -> nn.Parameter | None:
        """The master of `model_param`, or None."""
        entry = self._by_id.get(id(model_param))
        return entry[1] if entry is not None and entry[0] is model_param else None

    def pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """Every (model_param, master) pair."""
        return list(self._by_id.values())

    def __len__(self) -> int:
        return len(self._by_id)


class InputCast:
    """Forward pre-hook: cast floating inputs (args and kwargs) to `dtype`."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return (cast_tree(args, self.dtype, _always), cast_tree(kwargs, self.dtype, _always))


class OutputCast:
    """Forward hook: cast floating outputs to `dtype`."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return cast_tree(output, self.dtype, _always)


def _always(tensor: torch.Tensor) -> bool:
    return True


class Fp32StateDict:
    """State-dict hook: half entries of a module come out as float32.

    Split (O2) parameters come out as their fp32 masters, so saving `model.state_dict()` loses
    no precision and loading it back restores the masters exactly.
    """

    def __init__(self, masters: MasterMap | None) -> None:
        self._masters = weakref.ref(masters) if masters is not None else None

    def __call__(self, module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
        masters = self._masters() if self._masters is not None else None
        for name, param in module._parameters.items():
            key = prefix + name
            value = state.get(key)
            if value is None or not value.is_floating_point() or value.dtype == torch.float32:
                continue
            master = masters.master_of(param) if masters is not None and param is not None else None
            state[key] = master.detach() if master is not None else value.float()
        for name in module._buffers:
            key = prefix + name
            value = state.get(key)
            if value is not None and value.dtype in (torch.float16, torch.bfloat16):
                state[key] = value.float()


class LoadIntoMasters:
    """Load-state-dict pre-hook: values loaded into split parameters also reach their masters.

    Without it, `model.load_state_dict` after `initialize` would update only the half copy and
    the next optimizer step would bring the stale master back.
    """

    def __init__(self, masters: MasterMap) -> None:
        self._masters = weakref.ref(masters)

    def __call__(self, module: nn.Module, state: dict, prefix: str, *args: Any) -> None:
        masters = self._masters()
        if masters is None:
            return
        with torch.no_grad():
            for name, param in module._parameters.items():
                master = masters.master_of(param) if param is not None else None
                value = state.get(prefix + name)
                if (master is not None and isinstance(value, torch.Tensor)
                        and value.shape == master.shape):
                    master.copy_(value)


@dataclass
class ModelCast:
    """What `cast_model` did to one model (hook handles, the master map, an undo log)."""

    model: nn.Module
    masters: MasterMap = field(default_factory=MasterMap)
    handles: list[Any] = field(default_factory=list)
    undo_log: list[Callable[[], None]] = field(default_factory=list)

    def remove_hooks(self) -> None:
        """Remove the input/output/state-dict hooks (the casts themselves stay)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def undo(self) -> None:
        """Remove the hooks and put back every parameter, buffer and gradient as it was.

        Used when `initialize` fails after the model was cast, so the user's model is
        exactly as it was handed in (the same Parameter objects holding the same data).
        """
        self.remove_hooks()
        with torch.no_grad():
            while self.undo_log:
                self.undo_log.pop()()
        self.masters = MasterMap()


def _is_kept_batchnorm(module: nn.Module, keep_batchnorm_fp32: bool | None) -> bool:
    # apex's convert_network keeps only affine batchnorm in fp32.
    return bool(keep_batchnorm_fp32) and isinstance(module, nn.modules.batchnorm._BatchNorm) \
        and module.affine


def cast_model(
    model: nn.Module,
    dtype: torch.dtype | None,
    *,
    keep_batchnorm_fp32: bool | None,
    split_params: set[int],
    cast_outputs: torch.dtype | None,
) -> ModelCast:
    """Cast a model's floating parameters and buffers and install input/output hooks.

    Args:
        model: The model (changed in place).
        dtype: Target dtype, or None to leave the weights alone (O1 with cast_model_outputs).
        keep_batchnorm_fp32: Leave affine batchnorm modules in float32.
        split_params: ids of parameters that an optimizer holds and that need fp32 masters
            (O2): these are replaced in the model by new half parameters, and the original
            fp32 objects stay in the optimizer as the masters.
        cast_outputs: Dtype of the forward outputs (None: no output cast).

    Returns:
        The `ModelCast` record, with the master map filled for split parameters.
    """
    record = ModelCast(model)
    try:
        if dtype is not None:
            _cast_weights(model, dtype, keep_batchnorm_fp32, split_params, record)
            record.handles.append(
                model.register_forward_pre_hook(InputCast(dtype), with_kwargs=True))
            if dtype != torch.float32:
                hook = Fp32StateDict(record.masters if len(record.masters) else None)
                for module in model.modules():
                    record.handles.append(module._register_state_dict_hook(hook))
                if len(record.masters):
                    loader = LoadIntoMasters(record.masters)
                    for module in model.modules():
                        record.handles.append(module._register_load_state_dict_pre_hook(
                            loader, with_module=True))
        if cast_outputs is not None:
            record.handles.append(model.register_forward_hook(OutputCast(cast_outputs)))
    except BaseException:
        record.undo()
        raise
    return record


def _cast_weights(model: nn.Module, dtype: torch.dtype, keep_bn: bool | None,
                  split_params: set[int], record: ModelCast) -> None:
    masters, undo = record.masters, record.undo_log
    replaced: dict[int, nn.Parameter] = {}  # keeps tied weights tied
    done: set[int] = set()
    with torch.no_grad():
        for module in model.modules():
            if _is_kept_batchnorm(module, keep_bn):
                continue
            if isinstance(module, nn.RNNBase):  # undone last: after the params are back
                undo.append(module._init_flat_weights)
            for name, param in list(module._parameters.items()):
                if param is None or not param.is_floating_point():
                    continue
                if id(param) in replaced:
                    undo.append(functools.partial(setattr, module, name, param))
                    setattr(module, name, replaced[id(param)])
                    continue
                if id(param) in done or param.dtype == dtype:
                    continue
                if id(param) in split_params:
                    half = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
                    replaced[id(param)] = half
                    masters.add(half, param)
                    undo.append(functools.partial(setattr, module, name, param))
                    setattr(module, name, half)
                else:
                    undo.append(functools.partial(_set_data, param, param.data, param.grad))
                    param.data = param.data.to(dtype)
                    if param.grad is not None:
                        param.grad = param.grad.to(dtype)
                    done.add(id(param))
            for name, buf in list(module._buffers.items()):
                if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                    undo.append(functools.partial(module._buffers.__setitem__, name, buf))
                    module._buffers[name] = buf.to(dtype)
            if isinstance(module, nn.RNNBase):
                module._init_flat_weights()


def _set_data(param: nn.Parameter, data: torch.Tensor, grad: torch.Tensor | None) -> None:
    param.data = data
    param.grad = grad
