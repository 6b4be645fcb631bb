"""`initialize` as one transaction: check what it is handed, prepare it, or change nothing.

`check_inputs` refuses bad models and optimizers before anything is touched. `prepare` casts
the models, recasts optimizer state, attaches the optimizers (and the registered
`OptimizerExtension`s), moves the scalers and installs O1's patches; every change is recorded
in a `Journal` (the one rollback idiom), and on any exception (including KeyboardInterrupt)
the journal is rolled back, so models, optimizers (state, step hooks, attributes) and torch are
exactly as they were handed in. Both take everything they use as arguments: the session
(`ampx.session.Amp.initialize`) calls them and is never called back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .model import ModelCast, cast_model, check_models, device_types_of
from .o1 import patch
from .options.levels import OptionError, Properties
from .registry import OptimizerExtension
from .scaling.journal import Journal
from .scaling.masters import MasterMap, install_masters, optimizer_params, recast_state
from .scaling.protocol import SessionHooks
from .scaling.stepping import attach, check_optimizers

__all__ = ["Inputs", "Prepared", "check_inputs", "prepare"]


@dataclass
class Inputs:
    """The checked models and optimizers, and the shapes they came in."""

    models: list[nn.Module]
    models_was_list: bool
    optimizers: list[torch.optim.Optimizer]
    optimizers_was_list: bool

    def returned(self) -> Any:
        """apex's return shapes: a single model/optimizer single, a list a list."""
        models = self.models if self.models_was_list else self.models[0]
        if self.optimizers_was_list:
            return models, self.optimizers
        if not self.optimizers:
            return models
        return models, self.optimizers[0]


@dataclass
class Prepared:
    """What `prepare` did, for the session to keep."""

    casts: list[ModelCast]
    o1: patch.O1Patches | None


def check_inputs(models: Any, optimizers: Any, *, casts_model: bool,
                 extensions: Sequence[OptimizerExtension] = ()) -> Inputs:
    """Check the models and optimizers handed to `initialize`; touches nothing.

    Each extension's `check` sees every optimizer, right after the optimizers' own checks.

    Raises:
        TypeError: For models/optimizers of the wrong type (apex's messages).
        RuntimeError: For a parallel-wrapped model or an optimizer already initialized.
        OptionError: For the same model twice, models sharing parameters when the model is
            cast, a model on the meta device, an optimizer without parameters or one holding
            none of the models' parameters.
    """
    model_list, models_was_list = check_models(models)
    opt_list, opts_was_list = check_optimizers(optimizers)
    for opt in opt_list:
        for extension in extensions:
            extension.check(opt)
    owner: dict[int, int] = {}
    for i, model in enumerate(model_list):
        _check_materialized(i, model)
        for j, other in enumerate(model_list[:i]):
            if other is model:
                raise OptionError(f"ampx.initialize: models[{j}] and models[{i}] are the same "
                                  "model; pass each model once.")
        for param in model.parameters():
            j = owner.setdefault(id(param), i)
            if j != i and casts_model:
                raise OptionError(
                    f"ampx.initialize: models[{j}] and models[{i}] share parameters; a cast "
                    "model needs parameters of its own (pass the outer model only).")
    for i, opt in enumerate(opt_list):
        params = list(optimizer_params(opt))
        name = f"optimizers[{i}] ({type(opt).__name__})"
        if not params:
            raise OptionError(f"ampx.initialize: {name} holds no parameters.")
        if not any(id(p) in owner for p in params):
            raise OptionError(
                f"ampx.initialize: {name} holds none of the models' parameters: pass the "
                "model(s) it trains, and build the optimizer from their parameters.")
    return Inputs(model_list, models_was_list, opt_list, opts_was_list)


def _check_materialized(index: int, model: nn.Module) -> None:
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta:
            raise OptionError(
                f"ampx.initialize: models[{index}] has {name!r} on the meta device; "
                "materialize the model (e.g. model.to_empty(device=...) and initialize its "
                "weights) before ampx.initialize.")


def prepare(inputs: Inputs, props: Properties, scalers: Sequence[Any], *, owner: object,
            hooks: SessionHooks, extensions: Sequence[OptimizerExtension] = ()) -> Prepared:
    """Cast, attach and patch; all or nothing.

    Args:
        inputs: What `check_inputs` returned.
        props: The session's resolved options.
        scalers: The session's loss scalers (moved to the gradients' device).
        owner: The session, stored opaquely in each optimizer's state (never called here).
        hooks: The session's hooks, handed to each optimizer's state.
        extensions: Added to each optimizer once ampx's state is on it.

    Raises:
        BaseException: Whatever a step raised, after every change was undone.
    """
    journal = Journal()
    casts: list[ModelCast] = []
    with journal.atomic():
        masters = MasterMap()
        split: set[int] = set()
        if props.master_weights and props.cast_model_type not in (None, torch.float32):
            split = {id(p) for opt in inputs.optimizers for p in optimizer_params(opt)
                     if p.is_floating_point()}
        compensated = _compensated() if props.compensation else None
        before = compensated.originals(inputs.models) if compensated else {}
        for model in inputs.models:
            # cast_model undoes itself when it raises; once it returned, its record's undo
            # (hooks, swapped parameters, cast buffers) joins this journal
            casts.append(cast_model(
                model, props.cast_model_type, keep_batchnorm_fp32=props.keep_batchnorm_fp32,
                split_params=split, cast_outputs=props.cast_model_outputs, masters=masters,
                release_casts=bool(props.patch_torch_functions),
            ))
            journal.record(casts[-1].undo)
        for opt in inputs.optimizers:
            journal.record(_optimizer_undo(opt))  # a snapshot: safe before any change
            install_masters(opt, masters)
            if props.cast_model_type is not None:
                recast_state(opt)
            state = attach(opt, owner, masters, hooks)
            if compensated is not None:
                compensated.install(opt, before, state.handles)
            for extension in extensions:
                extension.attach(opt, journal)
        device = _first_device(inputs)
        for scaler in scalers:
            scaler.to_(device)
        o1 = None
        if props.patch_torch_functions:
            o1 = patch.activate(patch.CastConfig(
                dtype=props.dtype,
                device_types=props.device_types or device_types_of(inputs.models),
                allow_banned=props.allow_banned, verbose=props.verbosity == 2,
            ))
    for cast in casts:  # committed: the undo steps would keep the pre-cast weights alive
        cast.journal.forget()
    return Prepared(casts, o1)


def _optimizer_undo(opt: torch.optim.Optimizer) -> Callable[[], None]:
    """Snapshot what `prepare` may change on `opt`; the returned function puts it back."""
    hooks: tuple[dict[int, Any], ...] = (opt._optimizer_step_pre_hooks,
                                         opt._optimizer_step_post_hooks)
    hook_keys = [set(h) for h in hooks]
    state = {p: (s, dict(s)) for p, s in opt.state.items()}  # O2 moves entries to masters
    groups = [list(g["params"]) for g in opt.param_groups]
    attrs = dict(vars(opt))  # attach adds `_ampx` and an instance `zero_grad`

    def undo() -> None:
        for live, keys in zip(hooks, hook_keys):
            for key in [k for k in live if k not in keys]:
                del live[key]
        opt.state.clear()  # the same entry objects, in their order
        for param, (entry, saved) in state.items():
            entry.clear()
            entry.update(saved)
            opt.state[param] = entry
        for group, params in zip(opt.param_groups, groups):
            group["params"][:] = params
        for name in [a for a in vars(opt) if a not in attrs]:
            delattr(opt, name)
        for name, value in attrs.items():
            if vars(opt).get(name) is not value:
                setattr(opt, name, value)

    return undo


def _first_device(inputs: Inputs) -> torch.device:
    for opt in inputs.optimizers:
        for param in optimizer_params(opt):
            return param.device
    for model in inputs.models:
        for param in model.parameters():
            return param.device
    return torch.device("cpu")


def _compensated() -> Any:
    """`ampx.scaling.compensated`, imported only by a session that turns it on (off costs
    nothing: not a module loaded)."""
    from .scaling import compensated

    return compensated
