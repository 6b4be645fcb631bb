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
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn

from .. import frontend
from ..scaling.protocol import amp_state_of

__all__ = ["AmpxAcceleratedOptimizer", "prepare"]


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
    if accelerator.mixed_precision != "no" or getattr(accelerator, "scaler", None) is not None:
        raise ValueError(
            f"ampx.integrations.accelerate.prepare: the Accelerator runs its own mixed "
            f"precision (mixed_precision={accelerator.mixed_precision!r}); with ampx both "
            "would cast and scale. Create it with Accelerator(mixed_precision='no') and let "
            "ampx's opt_level/dtype choose the precision (or use Accelerate's alone).")
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
    prepared = accelerator.prepare(*objects)
    for obj in prepared if isinstance(prepared, tuple) else (prepared,):
        if type(obj) is AcceleratedOptimizer:  # only the class Accelerate made here
            obj.__class__ = AmpxAcceleratedOptimizer
    return prepared
