"""Model handling for O0/O2/O3 (and cast_model_outputs): casts, hooks, fp32 state dicts.

Nothing here reassigns `model.forward` (apex did, which broke DataParallel replicas and
`copy.deepcopy`); inputs and outputs are cast by forward hooks, which travel with the module.
Hooks hold dtypes, parameters of their own model (which a copy maps to its own) and weak
references to the session's master map, which a copy or a pickle of the model leaves behind:
a deep copy (an EMA copy) is an independent model that computes with its own weights, and
`torch.save(model)` works. `restore()` takes every hook off (`ModelCast.remove_hooks`).
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
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .distributed import local
from .o1.casting import cast_tree
from .options.values import HALF_DTYPES
from .scaling.journal import Journal
from .scaling.masters import MasterMap

__all__ = ["ModelCast", "cast_model", "check_models", "device_types_of"]

logger = logging.getLogger("ampx")

_COMPUTE_DTYPES = (torch.float32, *HALF_DTYPES)
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


class _MastersRef:
    """A weak reference to a `MasterMap` that pickles and copies as "no masters".

    A copied or unpickled model has its own parameters, which no master belongs to.
    """

    def __init__(self, masters: MasterMap | None) -> None:
        self._masters = weakref.ref(masters) if masters is not None else None

    def masters(self) -> MasterMap | None:
        """The map, while the session that owns it is alive."""
        return self._masters() if self._masters is not None else None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_masters"] = None
        return state


class InputCast(_MastersRef):
    """Forward pre-hook: cast floating inputs (args and kwargs) to the model's dtype.

    That is `dtype` until the model is converted (``model.float()``, ``.half()``,
    ``.to(dtype)``): `follows` is one parameter cast to `dtype` (held strongly, so a copy of
    the model follows its own), and when its dtype changes the inputs follow it and the
    parameters with fp32 masters take their masters' values in the new dtype (one dtype
    check per call otherwise). Batchnorm kept in float32 goes back to float32.
    """

    def __init__(self, dtype: torch.dtype, masters: MasterMap | None = None,
                 follows: torch.Tensor | None = None, kept: torch.Tensor | None = None
                 ) -> None:
        super().__init__(masters)
        self.dtype = dtype
        self.follows = follows
        self.kept = kept  # a parameter of batchnorm kept in float32 (`model.half()` casts it)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        follows, kept = self.follows, self.kept
        if ((follows is not None and follows.dtype != self.dtype)
                or (kept is not None and kept.dtype != torch.float32)):
            self._convert(module, self.dtype if follows is None else follows.dtype)
        return (cast_tree(args, self.dtype, _always), cast_tree(kwargs, self.dtype, _always))

    def _convert(self, model: nn.Module, dtype: torch.dtype) -> None:
        if dtype not in _COMPUTE_DTYPES:  # the unscale and master kernels take no others
            raise TypeError(
                f"ampx: the model was converted to {dtype} after initialize; an initialized "
                "model computes in float16, bfloat16 or float32 (its masters stay float32). "
                "Convert it back with model.float(), model.half() or model.bfloat16().")
        if self.kept is not None and self.kept.dtype != torch.float32:
            _refloat_kept_batchnorm(model, self.kept.dtype)
        if dtype != self.dtype:
            masters = self.masters()
            rederived = masters.rederive() if masters is not None else 0
            logger.info("ampx: the model was converted from %s to %s after initialize: its "
                        "inputs are cast to %s, and %d parameters took their fp32 masters' "
                        "values", self.dtype, dtype, dtype, rederived)
            self.dtype = dtype


class OutputCast:
    """Forward hook: cast floating outputs to `dtype`."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return cast_tree(output, self.dtype, _always)


def _always(tensor: torch.Tensor) -> bool:
    return True


def _refloat_kept_batchnorm(model: nn.Module, dtype: torch.dtype) -> None:
    """Batchnorm kept in float32 and converted to a half dtype since goes back to float32.

    Its parameters have no masters (the optimizer steps them as they are), so the values
    stay rounded: said once, as a warning.
    """
    rounded = []
    with torch.no_grad():  # last to first: `InputCast.kept` (the first) is done last
        for name, module in reversed(list(model.named_modules())):
            if not _is_kept_batchnorm(module, True):
                continue
            for param in reversed(module._parameters.values()):
                if param is not None and param.dtype in HALF_DTYPES:
                    _cast_param(param, torch.float32, lambda undo: None)
                    rounded.append(name)
            for key, buf in list(module._buffers.items()):
                if buf is not None and buf.dtype in HALF_DTYPES:
                    module._buffers[key] = buf.float()
    if rounded:
        logger.warning(
            "ampx: the model was converted to %s after initialize: the batchnorm layers kept "
            "in float32 (%s) are float32 again, but their parameters were rounded to %s (they "
            "have no fp32 masters). Evaluate in float32 without converting the model: it "
            "takes float32 inputs as it is (or convert a copy.deepcopy of it).",
            dtype, ", ".join(sorted(set(rounded))), dtype)


def _shares(value: torch.Tensor, master: torch.Tensor) -> bool:
    """Whether a state-dict entry is the master itself (an inner module's hook put it)."""
    return local(value).data_ptr() == local(master).data_ptr()


class Fp32StateDict(_MastersRef):
    """State-dict post-hook: half entries of a module come out as float32.

    Split (O2) parameters come out as their fp32 masters, whatever dtype the model was
    converted to since (``model.float()``), so saving `model.state_dict()` loses no precision
    and loading it back restores the masters exactly. Each hook covers the module's whole
    subtree (a submodule attached after initialize has no hook of its own); entries an inner
    hook already replaced are skipped, so nested hooks cost a lookup each.
    """

    def __call__(self, module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
        masters = self.masters()
        for name, param in module.named_parameters(prefix=prefix[:-1], remove_duplicate=False):
            value = state.get(name)
            if value is None or not value.is_floating_point():
                continue
            master = masters.master_of(param) if masters is not None else None
            if master is not None:
                if value.dtype != torch.float32 or not _shares(value, master):
                    # before first use a master written over in the model (DDP) saves the
                    # model's value
                    state[name] = masters.current(param).detach()  # type: ignore[union-attr]
            elif value.dtype in HALF_DTYPES:
                state[name] = value.float()
        for name, _ in module.named_buffers(prefix=prefix[:-1], remove_duplicate=False):
            value = state.get(name)
            if value is not None and value.dtype in HALF_DTYPES:
                state[name] = value.float()


class LoadIntoMasters(_MastersRef):
    """Load-state-dict pre-hook: loaded values reach the fp32 masters; `assign=True` works.

    Without it, `model.load_state_dict` after `initialize` would update only the half copy and
    the next optimizer step would bring the stale master back. With `assign=True`, torch would
    put the (float32) checkpoint tensors in place of the cast parameters, breaking forward and
    the optimizer's link: instead, values are copied into the existing parameters (which
    the state dict then hands back to torch), and buffers are assigned in their cast dtype.
    Like `Fp32StateDict`, each hook covers its module's subtree.
    """

    def __call__(self, module: nn.Module, state: dict, prefix: str, local_metadata: Any,
                 *args: Any) -> None:
        masters = self.masters()
        assign = bool(local_metadata.get("assign_to_params_buffers", False))
        with torch.no_grad():
            for key, param in module.named_parameters(prefix=prefix[:-1],
                                                      remove_duplicate=False):
                value = state.get(key)
                if (not isinstance(value, torch.Tensor) or value is param
                        or value.shape != param.shape or not param.is_floating_point()):
                    continue  # (`value is param`: an outer module's hook handled it)
                master = masters.master_of(param) if masters is not None else None
                if master is not None:
                    master.copy_(value)
                if assign:
                    param.copy_(value)
                    state[key] = param
            for key, buf in module.named_buffers(prefix=prefix[:-1], remove_duplicate=False):
                value = state.get(key)
                if (assign and isinstance(value, torch.Tensor)
                        and buf.is_floating_point() and value.dtype != buf.dtype):
                    state[key] = value.to(buf.dtype)


class TrackLoaded(_MastersRef):
    """Load-state-dict post-hook: loaded masters are the truth, not a change to follow.

    torch copies the loaded values into the half parameters after `LoadIntoMasters` set the
    masters; that write must not make the masters follow the (rounded) half values.
    """

    def __call__(self, module: nn.Module, incompatible_keys: Any) -> None:
        masters = self.masters()
        if masters is not None:
            for param in module.parameters():
                masters.track(param)


@dataclass
class ModelCast:
    """What `cast_model` did to one model (hook handles, the master map, its undo journal)."""

    model: nn.Module
    masters: MasterMap = field(default_factory=MasterMap)
    handles: list[Any] = field(default_factory=list)
    journal: Journal = field(default_factory=Journal)

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
        with torch.no_grad():
            self.journal.rollback()  # newest first; the hooks come off last


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
    masters: MasterMap | None = None,
    release_casts: bool = False,
) -> ModelCast:
    """Cast a model's floating parameters and buffers and install input/output hooks.

    Args:
        model: The model (changed in place).
        dtype: Target dtype, or None to leave the weights alone (O1 with cast_model_outputs).
        keep_batchnorm_fp32: Leave affine batchnorm modules in float32.
        split_params: ids of parameters that an optimizer holds and that need fp32 masters
            (O2): these are cast in place like the others (the model keeps its Parameter
            objects) and each gets a new float32 master in the session's master map, which
            `install_masters` puts in the optimizer in place of the parameter.
        cast_outputs: Dtype of the forward outputs (None: no output cast).
        masters: The session's master map (shared by its models and optimizers, so masters
            added later by `add_param_group` are saved and loaded too); a new one if None.
        release_casts: O1: bound the weight-cast cache to one forward of the model (plus
            its backward) with `ampx.o1.patch`'s `forward_starts`/`forward_ends` hooks.

    Returns:
        The `ModelCast` record; split parameters are added to its master map.
    """
    record = ModelCast(model, MasterMap() if masters is None else masters)
    try:
        record.journal.record(record.remove_hooks)  # undone last: the hooks come off
        if dtype is not None:
            _cast_weights(model, dtype, keep_batchnorm_fp32, split_params, record)
            follows, kept = _reference_params(model, dtype, keep_batchnorm_fp32)
            record.handles.append(model.register_forward_pre_hook(
                InputCast(dtype, record.masters, follows, kept), with_kwargs=True))
            if dtype != torch.float32:
                hook = Fp32StateDict(record.masters)
                loader = LoadIntoMasters(record.masters)
                loaded = TrackLoaded(record.masters)
                for module in model.modules():
                    record.handles.append(module.register_state_dict_post_hook(hook))
                    record.handles.append(module.register_load_state_dict_pre_hook(loader))
                    record.handles.append(module.register_load_state_dict_post_hook(loaded))
        if cast_outputs is not None:
            record.handles.append(model.register_forward_hook(OutputCast(cast_outputs)))
        if release_casts:  # first in, last out: the model's own hooks run inside the lifetime
            from .o1 import patch  # (an O1 session has it loaded)

            record.handles.append(model.register_forward_pre_hook(patch.forward_starts,
                                                                  prepend=True))
            record.handles.append(model.register_forward_hook(patch.forward_ends,
                                                              always_call=True))
    except BaseException:
        record.undo()
        raise
    return record


def _reference_params(model: nn.Module, dtype: torch.dtype, keep_bn: bool | None
                      ) -> tuple[nn.Parameter | None, nn.Parameter | None]:
    """One parameter `cast_model` gave `dtype` (the model's dtype, followed) and one of
    batchnorm kept in float32 (None where there is none)."""
    follows = kept = None
    for module in model.modules():
        is_kept = _is_kept_batchnorm(module, keep_bn)
        for param in module._parameters.values():
            if param is None or not param.is_floating_point():
                continue
            if is_kept and kept is None and dtype != torch.float32:
                kept = param
            elif not is_kept and follows is None and param.dtype == dtype:
                follows = param
    return follows, kept


def _cast_weights(model: nn.Module, dtype: torch.dtype, keep_bn: bool | None,
                  split_params: set[int], record: ModelCast) -> None:
    undo = record.journal.record
    replaced: dict[int, nn.Parameter] = {}  # keeps tied weights tied
    done: set[int] = set()
    with torch.no_grad():
        for module in model.modules():
            # kept batchnorm is float32 even in a model that was half before initialize
            kept = _is_kept_batchnorm(module, keep_bn)
            target = torch.float32 if kept else dtype
            if isinstance(module, nn.RNNBase):  # undone last: after the params are back
                undo(module._init_flat_weights)
            for name, param in list(module._parameters.items()):
                if param is None or not param.is_floating_point():
                    continue
                if id(param) in replaced:
                    undo(functools.partial(setattr, module, name, param))
                    setattr(module, name, replaced[id(param)])
                elif id(param) in split_params and not kept:
                    replaced[id(param)] = _split(module, name, param, dtype, record)
                    done.add(id(param))
                elif id(param) not in done and param.dtype != target and (
                        not kept or param.dtype in HALF_DTYPES):
                    _cast_param(param, target, undo)
                    done.add(id(param))
            for name, buf in list(module._buffers.items()):
                if (buf is not None and buf.is_floating_point() and buf.dtype != target
                        and (not kept or buf.dtype in HALF_DTYPES)):
                    record.journal.setitem(module._buffers, name, buf.to(target))
            if isinstance(module, nn.RNNBase):
                module._init_flat_weights()


def _split(module: nn.Module, name: str, param: nn.Parameter, dtype: torch.dtype,
           record: ModelCast) -> nn.Parameter:
    """Cast `param` to `dtype` in place and make its fp32 master (a new Parameter).

    The model keeps its Parameter objects, as apex did: hooks registered on them, DDP's
    reducer and anything else holding them see the half parameter the model computes with.
    The master is a float32 copy of the value before the cast (no rounding); initialize puts
    it in the optimizer in place of `param`. Until the first backward it follows the model
    (`MasterMap.follow`): a write into `param` (DDP's broadcast, an in-place init) replaces it.
    """
    master = nn.Parameter(param.detach().float().clone(), requires_grad=param.requires_grad)
    grad = param.grad
    _cast_param(param, dtype, record.journal.record)  # its undo puts the original gradient back
    param.grad = None  # an earlier gradient belongs to the master now
    master.grad = None if grad is None else grad.detach().float().clone()
    record.masters.add(param, master)
    record.journal.record(functools.partial(record.masters.discard, param))
    return param


def _cast_param(param: nn.Parameter, dtype: torch.dtype,
                undo: Callable[[Callable[[], None]], None]) -> None:
    """Give `param` (and its gradient) `dtype` in place, keeping the Parameter object.

    A tensor subclass with inner tensors (FSDP2's DTensor shards) is cast by swapping contents
    with a cast copy, as `nn.Module._apply` does (``.data =`` would leave its local shard
    float32); anything else gets new ``.data``.
    """
    if is_traceable_wrapper_subclass(param):
        cast = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
        if param.grad is not None:
            cast.grad = param.grad.to(dtype)
        torch.utils.swap_tensors(param, cast)
        undo(functools.partial(torch.utils.swap_tensors, param, cast))
        return
    undo(functools.partial(_set_data, param, param.data, param.grad))
    grad = param.grad
    param.grad = None
    param.data = param.data.to(dtype)
    param.grad = None if grad is None else grad.to(dtype)


def _set_data(param: nn.Parameter, data: torch.Tensor, grad: torch.Tensor | None) -> None:
    param.grad = None
    param.data = data
    param.grad = grad
