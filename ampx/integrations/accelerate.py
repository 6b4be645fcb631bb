"""ampx with HF Accelerate: `prepare` initializes, then hands everything to `accelerator.prepare`.

::

    from ampx.integrations.accelerate import prepare

    accelerator = Accelerator()  # mixed_precision="no": ampx does the mixed precision
    model, optimizer, scheduler, loader = prepare(accelerator, model, optimizer, scheduler,
                                                  loader, opt_level="O2", dtype="bf16")
    ...
    with ampx.scale_loss(loss, optimizer) as scaled:
        accelerator.backward(scaled)
    optimizer.step()
    scheduler.step()  # not stepped after a step ampx skipped

What `prepare` adds to `accelerator.prepare`:

- `ampx.initialize(models, optimizers, ...)` first (apex's order: initialize, then the DDP
  wrap that `accelerator.prepare` does when it runs distributed);
- each `AcceleratedOptimizer` reports ampx's skipped steps as `step_was_skipped`, so
  `accelerator.optimizer_step_was_skipped` is True after a skip and the prepared scheduler
  does not step on it (Accelerate's own rule for GradScaler skips);
- the session is registered for checkpointing: `accelerator.save_state`/`load_state` carry
  the loss scalers;
- Accelerate's own `mixed_precision` (autocast, GradScaler) is refused: the two mechanisms
  would both cast and scale.

The wrapped optimizer is accepted everywhere ampx takes one (`scale_loss`, `master_params`,
`step_was_skipped`, `last_overflow`). Clip with
`accelerator.clip_grad_norm_(ampx.master_params(optimizer), max_norm)`.

An Accelerator that other code creates and drives (the transformers 5 `Trainer`, which calls
`accelerator.prepare(model, optimizer)`, `accelerator.backward(loss)` and
`accelerator.clip_grad_norm_(model.parameters(), ...)` itself) gets the same through
`attach(accelerator, opt_level=..., dtype=...)`: from then on its `prepare` is ampx's
`prepare`, its `backward` runs inside `scale_loss`, and its `clip_grad_norm_` clips the masters.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn

from .. import frontend
from ..scaling.protocol import amp_state_of, master_params
from ..session import Amp

__all__ = ["AmpxAccelerator", "AmpxAcceleratedOptimizer", "attach", "prepare"]


class AmpxAcceleratedOptimizer(AcceleratedOptimizer):
    """An `AcceleratedOptimizer` whose `step_was_skipped` is ampx's (the class `prepare` sets)."""

    @property
    def step_was_skipped(self) -> bool:
        """Whether ampx skipped the last step for inf/NaN gradients."""
        state = amp_state_of(self.optimizer)
        return bool(state is not None and state.last_step_skipped)


def prepare(accelerator: Any, *objects: Any, opt_level: str = "O1", dtype: Any = None,
            **apex_kwargs: Any) -> Any:
    """`ampx.initialize` the models and optimizers among `objects`, then `accelerator.prepare`.

    Args:
        accelerator: An `accelerate.Accelerator` made with ``mixed_precision="no"``.
        *objects: What `accelerator.prepare` takes (models, optimizers, schedulers, loaders),
            in any order.
        opt_level: As `ampx.initialize`.
        dtype: "fp16"/"bf16"; None: `ampx.initialize`'s default.
        **apex_kwargs: Any other `ampx.initialize` option.

    Returns:
        What `accelerator.prepare(*objects)` returns (one object alone, else a tuple).

    Raises:
        ValueError: When the accelerator runs its own mixed precision, or when `objects`
            holds no model. Nothing was initialized then.
    """
    return _prepare(accelerator, objects, {}, opt_level, dtype, apex_kwargs)


def _prepare(accelerator: Any, objects: tuple[Any, ...], accelerate_kwargs: dict[str, Any],
             opt_level: str, dtype: Any, apex_kwargs: dict[str, Any]) -> Any:
    _refuse_own_mixed_precision(accelerator)
    models = [o for o in objects if isinstance(o, nn.Module)]
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    if not models:
        raise ValueError("ampx.integrations.accelerate.prepare: no torch.nn.Module among the "
                         "objects; pass the model(s) with their optimizer(s).")
    if dtype is not None:
        apex_kwargs["dtype"] = dtype
    apex_kwargs.setdefault("verbosity", 0)
    frontend.initialize(models, optimizers, opt_level=opt_level, **apex_kwargs)
    session = frontend.default_session()
    accelerator.register_for_checkpointing(session)
    # the Accelerator's own prepare, also when `attach` made `accelerator.prepare` this function
    prepared = Accelerator.prepare(accelerator, *objects, **accelerate_kwargs)
    for obj in prepared if isinstance(prepared, tuple) else (prepared,):
        if type(obj) is AcceleratedOptimizer:  # only the class Accelerate made here
            obj.__class__ = AmpxAcceleratedOptimizer
    return prepared


def _refuse_own_mixed_precision(accelerator: Any) -> None:
    if accelerator.mixed_precision != "no" or getattr(accelerator, "scaler", None) is not None:
        raise ValueError(
            f"ampx.integrations.accelerate.prepare: the Accelerator runs its own mixed "
            f"precision (mixed_precision={accelerator.mixed_precision!r}); with ampx both "
            "would cast and scale. Create it with Accelerator(mixed_precision='no') and let "
            "ampx's opt_level/dtype choose the precision (or use Accelerate's alone).")


class AmpxAccelerator(Accelerator):
    """An `Accelerator` that runs ampx in the calls other code makes on it (the class `attach`
    sets; `_ampx_options` holds `attach`'s options)."""

    _ampx_options: dict[str, Any]

    def prepare(self, *objects: Any, **kwargs: Any) -> Any:
        """`ampx.integrations.accelerate.prepare` when a model comes with its optimizer(s).

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
        options = dict(self._ampx_options)
        return _prepare(self, objects, kwargs, options.pop("opt_level"), options.pop("dtype"),
                        options)

    def _ampx_optimizers(self) -> list[Any]:
        return [o for o in self._optimizers if amp_state_of(o.optimizer) is not None]

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Accelerate's backward on the scaled loss, inside `scale_loss` of every optimizer
        prepared with ampx (none yet: Accelerate's backward alone)."""
        optimizers = self._ampx_optimizers()
        if not optimizers:
            return super().backward(loss, **kwargs)
        with frontend.scale_loss(loss, optimizers) as scaled:
            super().backward(scaled, **kwargs)
        return None

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2,
                        **kwargs: Any) -> Any:
        """Clip; when every parameter given belongs to a model prepared with ampx, clip the
        ampx optimizers' masters instead (the unscaled fp32 gradients at O2)."""
        params = list(parameters)
        owned = {id(p) for model in self._models for p in model.parameters()}
        optimizers = self._ampx_optimizers()
        if optimizers and params and all(id(p) in owned for p in params):
            params = [p for opt in optimizers for p in master_params(opt)]
        return super().clip_grad_norm_(params, max_norm, norm_type, **kwargs)


def attach(accelerator: Any, *, opt_level: str = "O1", dtype: Any = None,
           **apex_kwargs: Any) -> Any:
    """Make `accelerator` (created elsewhere, e.g. by the transformers 5 Trainer) run ampx.

    Its class becomes `AmpxAccelerator`: `prepare(model, optimizer, ...)` initializes them with
    these options first (as `prepare` above), `backward` scales the loss, `clip_grad_norm_` on
    the model's parameters clips the masters, and `optimizer_step_was_skipped` reports ampx's
    skipped steps.

    Args:
        accelerator: A plain `accelerate.Accelerator` with ``mixed_precision="no"``, before it
            prepared any model.
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
