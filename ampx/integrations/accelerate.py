"""ampx with HF Accelerate: one call, `attach(accelerator, ...)`, and Accelerate's own loop.

::

    from ampx.integrations.accelerate import attach

    accelerator = attach(Accelerator(), opt_level="O2", dtype="bf16")  # the one ampx call
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    for x, y in loader:
        optimizer.zero_grad()
        accelerator.backward(loss_fn(model(x), y))
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()  # held back after a step ampx skipped
    accelerator.save_state("ckpt")  # the loss scalers are in it

`attach` changes the accelerator's class to `AmpxAccelerator`, whose calls are Accelerate's
with ampx inside:

- `prepare(model, optimizer, ...)` runs `ampx.initialize` on the models and optimizers first
  (apex's order: initialize, then the DDP wrap that `prepare` does when it runs distributed),
  registers the session for checkpointing (`save_state`/`load_state` carry the loss scalers)
  and makes each `AcceleratedOptimizer` report ampx's skipped steps as `step_was_skipped`, so
  `accelerator.optimizer_step_was_skipped` is True after a skip and the prepared scheduler does
  not step on it (Accelerate's own rule for GradScaler skips);
- `backward(loss)` runs Accelerate's backward on the scaled loss inside `ampx.scale_loss`;
- `clip_grad_norm_(model.parameters(), ...)` clips the masters (O2's unscaled fp32 gradients);
- Accelerate's own `mixed_precision` (autocast, GradScaler) is refused: both would cast and scale.

Code that creates and drives its Accelerator itself (the transformers 5 `Trainer`) needs no
change: `attach(trainer.accelerator, ...)` before it prepares the model is the same call.

`prepare(accelerator, *objects, opt_level=..., dtype=...)` is the earlier entry point, kept
working: it attaches and prepares in one call, and a loop that still wraps
`accelerator.backward(scaled)` in `ampx.scale_loss` and clips `ampx.master_params(optimizer)`
trains exactly as the loop above (the backward sees the block and does not scale again).
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn

from .. import frontend
from ..scaling.protocol import Stage, amp_state_of, master_params
from ..session import Amp

__all__ = ["STATE_KEY", "AmpxAccelerator", "AmpxAcceleratedOptimizer", "attach", "prepare"]

STATE_KEY = "ampx"  # the session's state in a prepared optimizer's state dict


class AmpxAcceleratedOptimizer(AcceleratedOptimizer):
    """An `AcceleratedOptimizer` whose `step_was_skipped` is ampx's and whose state dict
    carries the session's (the class `prepare` sets).

    Code that checkpoints the optimizer itself rather than through `save_state` (the
    transformers 5 Trainer's ``optimizer.pt``) keeps the loss scale that way: `state_dict()` adds
    the session's `state_dict()` under the key ``"ampx"``, `load_state_dict` loads it back.
    """

    @property
    def step_was_skipped(self) -> bool:
        """Whether ampx skipped the last step for inf/NaN gradients."""
        state = amp_state_of(self.optimizer)
        return bool(state is not None and state.last_step_skipped)

    def _session(self) -> Amp | None:
        state = amp_state_of(self.optimizer)
        owner = None if state is None else state.owner
        return owner if isinstance(owner, Amp) else None

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict plus ``"ampx"``: the session's (loss scalers)."""
        out = super().state_dict()
        session = self._session()
        if session is not None:
            out = {**out, STATE_KEY: session.state_dict()}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the optimizer's state and, when the dict has one, the session's: both or, on
        an error, neither (a dict without ``"ampx"`` leaves the loss scalers as they are)."""
        state_dict = dict(state_dict)
        amp_state = state_dict.pop(STATE_KEY, None)
        session = self._session()
        if amp_state is None or session is None:
            return super().load_state_dict(state_dict)
        before = session.state_dict()
        session.load_state_dict(amp_state)  # checks every entry before it changes any
        try:
            super().load_state_dict(state_dict)
        except BaseException:
            session.load_state_dict(before)
            raise
        return None


class AmpxAccelerator(Accelerator):
    """An `Accelerator` that runs ampx in its own calls (the class `attach` sets;
    `_ampx_options` holds `attach`'s options)."""

    _ampx_options: dict[str, Any]

    def prepare(self, *objects: Any, **kwargs: Any) -> Any:
        """`ampx.initialize` the models with their optimizers, then Accelerate's `prepare`.

        A model alone (an evaluation) and loaders alone are prepared as Accelerate does.

        Raises:
            ValueError: For an optimizer without its model: ampx initializes them together.
        """
        has_model = any(isinstance(o, nn.Module) for o in objects)
        has_opt = any(isinstance(o, torch.optim.Optimizer) for o in objects)
        if has_opt and not has_model:
            raise ValueError(
                "AmpxAccelerator.prepare: an optimizer without its model; ampx initializes "
                "a model with its optimizers, so prepare them in one call.")
        if not (has_model and has_opt):
            return super().prepare(*objects, **kwargs)
        return _prepare(self, objects, kwargs, dict(self._ampx_options))

    def _ampx_optimizers(self) -> list[Any]:
        return [o for o in self._optimizers if amp_state_of(o.optimizer) is not None]

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Accelerate's backward on the scaled loss, inside `scale_loss` of every optimizer
        prepared with ampx. None prepared yet, or the caller's own `scale_loss` block already
        open (the earlier loop, whose `loss` is scaled): Accelerate's backward alone."""
        optimizers = self._ampx_optimizers()
        if not optimizers or any(_state(o).stage is Stage.SCALING for o in optimizers):
            return super().backward(loss, **kwargs)
        with frontend.scale_loss(loss, optimizers) as scaled:
            super().backward(scaled, **kwargs)
        return None

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2,
                        **kwargs: Any) -> Any:
        """Clip; when every parameter given belongs to a model ampx initialized here, clip the
        ampx optimizers' masters instead (the unscaled fp32 gradients at O2)."""
        params = list(parameters)
        optimizers = self._ampx_optimizers()
        owned = {id(p) for opt in optimizers for model in getattr(_state(opt).owner, "models", ())
                 for p in model.parameters()}
        if optimizers and params and all(id(p) in owned for p in params):
            params = [p for opt in optimizers for p in master_params(opt)]
        return super().clip_grad_norm_(params, max_norm, norm_type, **kwargs)


def attach(accelerator: Any, *, opt_level: str = "O1", dtype: Any = None,
           **apex_kwargs: Any) -> Any:
    """Make `accelerator` run ampx in its own calls: the one ampx call of an Accelerate loop.

    Its class becomes `AmpxAccelerator`: `prepare(model, optimizer, ...)` initializes them with
    these options first, `backward` scales the loss, `clip_grad_norm_` on the model's
    parameters clips the masters, `optimizer_step_was_skipped` reports ampx's skipped steps
    (a prepared scheduler holds on them), and `save_state`/`load_state` carry the loss scalers.

    Args:
        accelerator: A plain `accelerate.Accelerator` with ``mixed_precision="no"``, before it
            prepared any model (yours, or the one a transformers 5 `Trainer` created).
        opt_level: As `ampx.initialize`.
        dtype: "fp16"/"bf16"; None: `ampx.initialize`'s default.
        **apex_kwargs: Any other `ampx.initialize` option.

    Returns:
        `accelerator` itself.

    Raises:
        ValueError: When the accelerator runs its own mixed precision, is not a plain
            `Accelerator`, or already prepared a model.
        ampx.OptionError: For options `initialize` would refuse (checked here, not at the
            first `prepare` deep inside the caller's code).
    """
    _refuse_own_mixed_precision(accelerator)
    options = dict(apex_kwargs, opt_level=opt_level, dtype=dtype)
    probe = {k: v for k, v in options.items() if v is not None}
    Amp(probe.pop("opt_level"), **probe)  # validates; the session of `prepare` is the default
    if type(accelerator) is not Accelerator or accelerator._models:
        raise ValueError(
            f"ampx.integrations.accelerate.attach: takes a plain Accelerator before it prepared "
            f"a model (got a {type(accelerator).__name__} with {len(accelerator._models)} "
            "model(s)).")
    accelerator.__class__ = AmpxAccelerator
    accelerator._ampx_options = options
    return accelerator


def prepare(accelerator: Any, *objects: Any, opt_level: str = "O1", dtype: Any = None,
            **apex_kwargs: Any) -> Any:
    """The earlier entry point, kept working: `attach`'s options for this one call, then
    `accelerator.prepare(*objects)`; the accelerator is an `AmpxAccelerator` afterwards.

    Args:
        accelerator: An `accelerate.Accelerator` made with ``mixed_precision="no"``.
        *objects: What `accelerator.prepare` takes (models, optimizers, schedulers, loaders).
        opt_level, dtype, **apex_kwargs: As `attach`.

    Returns:
        What `accelerator.prepare(*objects)` returns (one object alone, else a tuple).

    Raises:
        ValueError: When the accelerator runs its own mixed precision, or when `objects`
            holds no model. Nothing was initialized then.
    """
    _refuse_own_mixed_precision(accelerator)
    if not any(isinstance(o, nn.Module) for o in objects):
        raise ValueError("ampx.integrations.accelerate.prepare: no torch.nn.Module among the "
                         "objects; pass the model(s) with their optimizer(s).")
    options = dict(apex_kwargs, opt_level=opt_level, dtype=dtype)
    prepared = _prepare(accelerator, objects, {}, dict(options))
    if type(accelerator) is Accelerator:
        accelerator.__class__ = AmpxAccelerator
        accelerator._ampx_options = options
    return prepared


def _prepare(accelerator: Any, objects: tuple[Any, ...], accelerate_kwargs: dict[str, Any],
             options: dict[str, Any]) -> Any:
    _refuse_own_mixed_precision(accelerator)
    models = [o for o in objects if isinstance(o, nn.Module)]
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    apex_kwargs = {k: v for k, v in options.items() if v is not None or k != "dtype"}
    apex_kwargs.setdefault("verbosity", 0)
    frontend.initialize(models, optimizers, **apex_kwargs)
    accelerator.register_for_checkpointing(frontend.default_session())
    # the Accelerator's own prepare (`AmpxAccelerator.prepare` is what called this)
    prepared = Accelerator.prepare(accelerator, *objects, **accelerate_kwargs)
    for obj in prepared if isinstance(prepared, tuple) else (prepared,):
        if type(obj) is AcceleratedOptimizer:  # only the class Accelerate made here
            obj.__class__ = AmpxAcceleratedOptimizer
    return prepared


def _state(optimizer: Any) -> Any:
    """The ampx state of a prepared optimizer `_ampx_optimizers` returned (never None)."""
    return amp_state_of(optimizer.optimizer)


def _refuse_own_mixed_precision(accelerator: Any) -> None:
    if accelerator.mixed_precision != "no" or getattr(accelerator, "scaler", None) is not None:
        raise ValueError(
            f"ampx.integrations.accelerate: the Accelerator runs its own mixed precision "
            f"(mixed_precision={accelerator.mixed_precision!r}); with ampx both would cast and "
            "scale. Create it with Accelerator(mixed_precision='no') and let ampx's "
            "opt_level/dtype choose the precision (or use Accelerate's alone).")
