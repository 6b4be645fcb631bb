"""apex's per-optimizer private names (`_amp_stash` and its methods) as views of ampx's state.

apex's `initialize` bound `optimizer._amp_stash` and five methods on every optimizer, and
published scripts reach into them because apex gave them no public way: NVIDIA's BERT resume
calls `_lazy_init_maybe_master_weights()`, sets `_amp_stash.lazy_init_called = True` and copies
saved masters into `amp.master_params(optimizer)`; custom `scale_loss` loops call
`_prepare_amp_backward()` / `_post_amp_backward(scaler)`; name-mapping code zips
`_amp_stash.all_fp16_params` with `_amp_stash.all_fp32_from_fp16_params`.

`attach(optimizer)` binds the same names as instance attributes of an optimizer that went
through ampx's initialize (its class, `step` and `state_dict()` are untouched; the names are
never pickled, because torch pickles only an optimizer's defaults, state and groups).
`detach(optimizer)` and `detach_all()` (called by `ampx.restore()`) remove them. `PRIVATES`
does all three as the session's `OptimizerExtension` (`ampx.compat.apex.shell` registers
it), so every session's `initialize` binds the names inside its transaction. Every value is
computed from ampx's own per-optimizer state when it is read, so none is a second copy of the
truth: `all_fp32_from_fp16_params` holds the very master `Parameter` objects the optimizer steps.

The first section, "adapter", is the only code that reads ampx's optimizer internals; the rest
is written against it. docs/migrating-from-apex.md lists every name and what it does.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ... import _ext
from ...options.values import HALF_DTYPES
from ...scaling.journal import Journal
from ...scaling.protocol import OptimizerAmpState, Stage, amp_state_of
from ...scaling.scaled_pass import ScaledPass
from ...scaling.scaler import LossScaler

__all__ = ["METHOD_NAMES", "PRIVATES", "AmpStash", "ApexPrivates", "attach", "detach",
           "detach_all", "is_attached"]

logger = logging.getLogger("ampx")

METHOD_NAMES = ("_lazy_init_maybe_master_weights", "_master_params_to_model_params",
                "_prepare_amp_backward", "_post_amp_backward", "_amp_lazy_init")


# the optimizers carrying the names, so that `restore()` removes them all
_ATTACHED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


# -- adapter: the only code that reads ampx.scaling.protocol's internals --------------------

def _state(optimizer: torch.optim.Optimizer) -> OptimizerAmpState:
    state = amp_state_of(optimizer)
    if state is None:
        raise RuntimeError(
            f"{type(optimizer).__name__} has apex's private names but no ampx state; pass "
            "it through amp.initialize (the names are bound there)."
        )
    return state


def _master_weights(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's session keeps fp32 master weights (O2, or master_weights=True)."""
    return _state(optimizer).policy.master_weights


def _pairs(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(half model parameter, fp32 master) for each master this optimizer steps, in group order."""
    return list(_state(optimizer).cache(optimizer).pairs)


def _non_masters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters the optimizer steps that are not masters of a half model parameter."""
    return list(_state(optimizer).cache(optimizer).others)


def _copy_masters_to_model(optimizer: torch.optim.Optimizer) -> None:
    """Copy every master of this optimizer into its half model parameter, now.

    (`step()` does it after each step.)
    """
    cache = _state(optimizer).cache(optimizer)
    if cache.pairs:
        with torch.no_grad():
            _ext.copy_(cache.masters, cache.models)


def _grads_scaled(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a `delay_unscale` backward left scaled gradients that wait for unscaling."""
    return _state(optimizer).stage is Stage.SCALED


def _set_grads_scaled(optimizer: torch.optim.Optimizer, value: bool) -> None:
    """True: the backward just run keeps its gradients scaled (apex's delay_unscale).

    False is accepted when nothing is scaled (after `_post_amp_backward`, as scripts write it).
    """
    state = _state(optimizer)
    if value and state.stage is Stage.SCALING:
        _ext.assign(tuple(state.commit_delayed()))
    elif value and state.stage is not Stage.SCALED:
        raise RuntimeError(
            "_amp_stash.params_have_scaled_gradients = True: no backward pass is open; call "
            "optimizer._prepare_amp_backward() and backward() first."
        )
    elif not value and state.stage in (Stage.SCALING, Stage.SCALED):
        raise RuntimeError(
            "_amp_stash.params_have_scaled_gradients = False: the gradients are still scaled; "
            "call optimizer._post_amp_backward(scaler) after the last backward to unscale them."
        )


def _stashed_grad(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.Tensor | None:
    """The gradient moved aside for `param` by the last prepare, if any."""
    entry = _state(optimizer).stash.get(id(param))
    return entry[1] if entry is not None and entry[0] is param else None


def _next_step_skips(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the next `step()` will be skipped for non-finite gradients (one host sync)."""
    state = _state(optimizer)
    found = state.found_inf
    return bool(state.stage is Stage.UNSCALED and state.policy.skips and found is not None
                and found.item())


def _prepare(optimizer: torch.optim.Optimizer) -> None:
    """What `scale_loss` does before the backward: move earlier gradients aside.

    After a `delay_unscale` pass (gradients still scaled) nothing moves, as in apex's
    `scale_loss`, which skipped the prepare then.
    """
    state = _state(optimizer)
    if state.stage is not Stage.SCALED:
        state.begin_backward(optimizer)


def _post(optimizer: torch.optim.Optimizer, scaler: LossScaler) -> None:
    """What `scale_loss` does after the backward, for this optimizer and loss scaler.

    Unscales this pass's gradients (into the masters at O2, onto stashed earlier gradients
    elsewhere), flags non-finite values, updates the scale and, on overflow, makes the next
    `step()` a skipped one. All of it or nothing (the protocol's transaction).
    """
    state = _state(optimizer)
    if state.stage is Stage.SCALED:
        state.begin_backward(optimizer)  # records the scaled gradients, as scale_loss does
    if state.stage is not Stage.SCALING:
        raise RuntimeError("_post_amp_backward: call optimizer._prepare_amp_backward() "
                           "before the backward.")
    session: Any = state.owner  # the Amp that attached it (opaque to the protocol)
    sync = session.synchronize_found_inf
    # apex's call does not get the loss: telemetry keeps the last one scale_loss recorded
    loss = state.last_loss if state.last_loss is not None else torch.zeros(())
    ScaledPass([optimizer], [state], scaler, sync).end(loss, loss_id=scaler.loss_id)


def _session_scaler(optimizer: torch.optim.Optimizer, scaler: Any) -> LossScaler:
    """`scaler` checked against the optimizer's session (None: the session's first scaler)."""
    session: Any = _state(optimizer).owner
    scalers = session.scalers
    if scaler is None:
        return scalers[0]
    if not any(scaler is mine for mine in scalers):
        raise ValueError(
            "_post_amp_backward(scaler): scaler must be one of the loss scalers of the session "
            "this optimizer was initialized with (amp._amp_state.loss_scalers[i]); got "
            f"{type(scaler).__module__}.{type(scaler).__name__}."
        )
    return scaler


# -- the stash ----------------------------------------------------------------------------------

def _grad_stash(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]
                ) -> list[torch.Tensor | None]:
    return [_stashed_grad(optimizer, p) for p in params]


def _only(mode: str, name: str) -> AttributeError:
    return AttributeError(f"'_amp_stash' has no attribute {name!r} {mode} (as in apex)")


class AmpStash:
    """apex's `optimizer._amp_stash`, every attribute read from ampx's state when accessed.

    List attributes are new lists on each read, holding the live tensors (writing into a
    master's `.data` writes the real master; rebinding a list element changes nothing).
    With master weights (O2) the stash has apex's O2 names (`fp16_groups`,
    `all_fp32_from_fp32_params`, ...); without, apex's other names (`all_fp32_params`,
    `all_fp32_grad_stash`). Other attributes a script sets are kept, as on apex's plain object.

    Attributes:
        lazy_init_called: Always True: ampx makes the masters at initialize (they follow the
            model until first used, see `MasterMap`). Writing a bool is accepted (NVIDIA's
            BERT resume writes True) and changes nothing.
        already_patched: Whether the next `step()` will be skipped for non-finite gradients
            (apex patched `step` to skip it). Read-only; reading syncs with the device once.
        params_have_scaled_gradients: Whether a `delay_unscale` backward left scaled gradients.
            Write True right after a backward to leave its gradients scaled (what apex's
            `scale_loss(delay_unscale=True)` did); False is accepted once they are unscaled.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer_ref = weakref.ref(optimizer)

    @property
    def _opt(self) -> torch.optim.Optimizer:
        optimizer = self._optimizer_ref()
        if optimizer is None:
            raise RuntimeError("_amp_stash: its optimizer no longer exists.")
        return optimizer

    @property
    def lazy_init_called(self) -> bool:
        return True

    @lazy_init_called.setter
    def lazy_init_called(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"_amp_stash.lazy_init_called must be a bool; got {value!r}.")
        logger.debug("_amp_stash.lazy_init_called=%s accepted (masters exist since initialize)",
                     value)

    @property
    def already_patched(self) -> bool:
        return _next_step_skips(self._opt)

    @property
    def params_have_scaled_gradients(self) -> bool:
        return _grads_scaled(self._opt)

    @params_have_scaled_gradients.setter
    def params_have_scaled_gradients(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(
                f"_amp_stash.params_have_scaled_gradients must be a bool; got {value!r}.")
        _set_grads_scaled(self._opt, value)

    # -- parameter lists (apex's names for both modes) ----------------------------------------
    @property
    def all_fp16_params(self) -> list[torch.Tensor]:
        """O2: the half model parameters behind the masters; otherwise the half parameters."""
        if _master_weights(self._opt):
            return [model for model, _ in _pairs(self._opt)]
        return [p for p in _non_masters(self._opt) if p.dtype in HALF_DTYPES]

    @property
    def all_fp16_grad_stash(self) -> list[torch.Tensor | None]:
        return _grad_stash(self._opt, self.all_fp16_params)

    @property
    def all_fp32_from_fp16_params(self) -> list[torch.Tensor]:
        """The fp32 masters, aligned with `all_fp16_params` (O2 only)."""
        if not _master_weights(self._opt):
            raise _only("without master weights", "all_fp32_from_fp16_params")
        return [master for _, master in _pairs(self._opt)]

    @property
    def all_fp32_from_fp32_params(self) -> list[torch.Tensor]:
        """The parameters stepped directly (fp32 batchnorm, ...; O2 only)."""
        if not _master_weights(self._opt):
            raise _only("without master weights", "all_fp32_from_fp32_params")
        return _non_masters(self._opt)

    @property
    def all_fp32_from_fp32_grad_stash(self) -> list[torch.Tensor | None]:
        return _grad_stash(self._opt, self.all_fp32_from_fp32_params)

    @property
    def all_fp32_params(self) -> list[torch.Tensor]:
        """Without master weights: the parameters that are not half."""
        if _master_weights(self._opt):
            raise _only("with master weights", "all_fp32_params")
        return [p for p in _non_masters(self._opt) if p.dtype not in HALF_DTYPES]

    @property
    def all_fp32_grad_stash(self) -> list[torch.Tensor | None]:
        return _grad_stash(self._opt, self.all_fp32_params)

    # -- per group (O2) -------------------------------------------------------------------------
    def _groups(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]]:
        optimizer = self._opt
        if not _master_weights(optimizer):
            raise _only("without master weights", "fp16_groups")
        model_of = {id(master): model for model, master in _pairs(optimizer)}
        groups = []
        for group in optimizer.param_groups:
            fp16: list[torch.Tensor] = []
            masters: list[torch.Tensor] = []
            fp32: list[torch.Tensor] = []
            for param in group["params"]:
                model = model_of.get(id(param))
                if model is None:
                    fp32.append(param)
                else:
                    fp16.append(model)
                    masters.append(param)
            groups.append((fp16, masters, fp32))
        return groups

    @property
    def fp16_groups(self) -> list[list[torch.Tensor]]:
        return [g[0] for g in self._groups()]

    @property
    def fp32_from_fp16_groups(self) -> list[list[torch.Tensor]]:
        return [g[1] for g in self._groups()]

    @property
    def fp32_from_fp32_groups(self) -> list[list[torch.Tensor]]:
        return [g[2] for g in self._groups()]


# -- the methods ----------------------------------------------------------------------------------

def _lazy_init_maybe_master_weights(optimizer: torch.optim.Optimizer) -> None:
    """apex: make the masters. ampx made them at initialize; groups added since get theirs.

    As in apex this is the point where the masters are fixed: they take what was written into
    the model since initialize and then stop following it, so masters copied in right after
    (NVIDIA's BERT resume) survive a DDP wrap that follows. With master weights, the
    gradients of the masters and of the fp32 parameters are then set to None, as apex's lazy
    init did. The optimizer state is already keyed by (and of the
    dtype of) the parameters it steps, so apex's state-dict round trip is not needed.
    """
    if _master_weights(optimizer):
        _state(optimizer).use_masters()
        for _, master in _pairs(optimizer):
            master.grad = None
        for param in _non_masters(optimizer):
            param.grad = None
    else:
        _non_masters(optimizer)  # adopts new groups


def _amp_lazy_init(optimizer: torch.optim.Optimizer) -> None:
    """apex: run the lazy init once. Here: give groups added since initialize their masters."""
    _non_masters(optimizer)


def _post_amp_backward(optimizer: torch.optim.Optimizer, scaler: Any = None) -> None:
    """scale_loss's exit for this optimizer: unscale, flag overflow, update the scale.

    Args:
        optimizer: The optimizer (bound).
        scaler: One of the session's loss scalers (`amp._amp_state.loss_scalers[i]`); None
            means the first. apex's `scale_loss` called `update_scale()` on it afterwards;
            ampx's scalers update here, and an overflow makes the next `step()` skip.

    Raises:
        ValueError: For a scaler that is not one of the session's.
    """
    _post(optimizer, _session_scaler(optimizer, scaler))


class _PrivateMethod:
    """A private method bound to an optimizer by weak reference (no reference cycle)."""

    def __init__(self, name: str, func: Callable[..., None],
                 optimizer: torch.optim.Optimizer) -> None:
        self.__func__ = func
        self.__name__ = name
        self.__doc__ = func.__doc__
        self._optimizer_ref = weakref.ref(optimizer)

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        optimizer = self._optimizer_ref()
        if optimizer is None:
            raise RuntimeError(f"{self.__name__}: its optimizer no longer exists.")
        self.__func__(optimizer, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<ampx apex-compatible method {self.__name__}>"


_METHODS: dict[str, Callable[..., None]] = {
    "_lazy_init_maybe_master_weights": _lazy_init_maybe_master_weights,
    "_master_params_to_model_params": _copy_masters_to_model,
    "_prepare_amp_backward": _prepare,
    "_post_amp_backward": _post_amp_backward,
    "_amp_lazy_init": _amp_lazy_init,
}


# -- attach / detach ------------------------------------------------------------------------------

def attach(optimizer: torch.optim.Optimizer) -> None:
    """Bind `_amp_stash` and apex's private methods on an optimizer initialize just prepared.

    `_master_params_to_model_params` is bound only with master weights, as in apex. All or
    nothing: if binding is interrupted, the names bound so far are removed.

    Raises:
        RuntimeError: If the optimizer has no ampx state, or already has one of the names.
    """
    _state(optimizer)
    names: dict[str, object] = {"_amp_stash": AmpStash(optimizer)}
    for name, func in _METHODS.items():
        if name != "_master_params_to_model_params" or _master_weights(optimizer):
            names[name] = _PrivateMethod(name, func, optimizer)
    clash = [name for name in names if name in vars(optimizer)]
    if clash:
        raise RuntimeError(f"Incoming optimizer already has {clash[0]} defined.")
    try:
        for name, value in names.items():
            setattr(optimizer, name, value)
        _ATTACHED.add(optimizer)
    except BaseException:
        detach(optimizer)
        raise


def is_attached(optimizer: Any) -> bool:
    """Whether `optimizer` carries the private names bound by `attach`."""
    return isinstance(vars(optimizer).get("_amp_stash"), AmpStash)


def detach(optimizer: torch.optim.Optimizer) -> None:
    """Remove the names `attach` bound (names a script rebound to its own objects stay)."""
    attrs = vars(optimizer)
    if isinstance(attrs.get("_amp_stash"), AmpStash):
        del attrs["_amp_stash"]
    for name in METHOD_NAMES:
        if isinstance(attrs.get(name), _PrivateMethod):
            del attrs[name]
    _ATTACHED.discard(optimizer)


def detach_all() -> None:
    """Remove the names from every optimizer that has them (`ampx.restore()`)."""
    for optimizer in list(_ATTACHED):
        detach(optimizer)


class ApexPrivates:
    """The names above as the session's `OptimizerExtension` (`ampx.session.add_extension`)."""

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        """apex's refusals of an optimizer that already carries the names (before any change).

        Raises:
            RuntimeError: With apex's messages.
        """
        if hasattr(optimizer, "_amp_stash"):
            raise RuntimeError(
                "A given optimizer should only be passed through amp.initialize once.")
        for name in METHOD_NAMES:
            if hasattr(optimizer, name):
                raise RuntimeError(f"Incoming optimizer already has {name} defined.")

    def attach(self, optimizer: torch.optim.Optimizer, journal: Journal) -> None:
        """Bind the names inside initialize's transaction; its rollback removes them."""
        attach(optimizer)
        journal.record(lambda: detach(optimizer))

    def detach_all(self) -> None:
        """Remove the names from every optimizer (`ampx.restore()`)."""
        detach_all()


PRIVATES = ApexPrivates()
