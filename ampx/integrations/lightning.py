"""`AmpxPrecision`: ampx's opt levels as a Lightning precision plugin (Trainer and Fabric).

Trainer::

    trainer = Trainer(plugins=[AmpxPrecision(opt_level="O2", dtype="bf16")])

What the plugin does at each of Lightning's precision hooks:

- `connect` (the Trainer, once the optimizers exist): `ampx.Amp(...).initialize(module,
  optimizers)`, so O2 makes its fp32 masters from the fp32 weights (and keeps batchnorm fp32),
  as the hand-written `initialize` does. Under `strategy="ddp"` the model arrives wrapped in
  DistributedDataParallel, whose buckets were built for the fp32 parameters: it is wrapped
  again (by the strategy, with its own settings) around the initialized module.
- `convert_input`: at O2/O3 the floating tensors of each batch are cast to the half dtype at
  the LightningModule's boundary, so `self.net(x)` inside `training_step` works (the module's
  own forward pre-hook only sees `self(x)`).
- `backward`: `scale_loss` around the module's `backward` (every optimizer of the session in
  manual optimization, where Lightning passes none).
- `optimizer_step`: runs the closure (forward, scaled backward, `on_before_optimizer_step`,
  clipping on the unscaled masters), then `optimizer.step()`, which ampx's step hooks skip on
  an overflow. Lightning counts that step in `global_step` and steps schedulers, exactly as it
  does for a step `torch.amp.GradScaler` skips under ``precision="16-mixed"``.
- `state_dict`/`load_state_dict`: the session's loss-scaler state, saved in the checkpoint.
- `teardown`: nothing; O1's patches stay until `ampx.restore()`, as after `ampx.initialize`.

Fabric has no hook that sees the model and its optimizers together, so initialize through the
plugin before `fabric.setup`::

    precision = AmpxPrecision(opt_level="O2", dtype="bf16")
    fabric = Fabric(plugins=[precision])
    model, optimizer = fabric.setup(*precision.initialize(model, optimizer))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from ..o1.casting import cast_tree
from ..scaling.protocol import master_params, unwrap
from ..session import Amp

__all__ = ["AmpxPrecision"]


def _always(tensor: torch.Tensor) -> bool:
    return True


class AmpxPrecision(Precision):
    """ampx mixed precision for Lightning's Trainer and Fabric.

    Args:
        opt_level: "O0".."O3", as `ampx.initialize`.
        dtype: "fp16"/"bf16" (or a torch dtype).
        **apex_kwargs: Any other `ampx.initialize` option (`loss_scale`, `keep_batchnorm_fp32`,
            `master_weights`, `init_scale`, ...); checked here, when the plugin is made.

    Raises:
        ampx.OptionError: For options `initialize` would refuse.
    """

    def __init__(self, opt_level: str = "O2", dtype: Any = "bf16", **apex_kwargs: Any) -> None:
        self._options = dict(opt_level=opt_level, dtype=dtype, **apex_kwargs)
        self._options.setdefault("verbosity", 0)
        probe = self._new_session()  # validates the options now, not at the first step
        props = probe.properties
        self.dtype = props.dtype
        cast = props.cast_model_type
        self._input_dtype = cast if cast is not None and cast != torch.float32 else None
        # what `trainer.precision` and Lightning's summaries read
        self.precision = "32-true" if not props.enabled or props.opt_level.value == "O0" \
            else ("bf16-mixed" if props.dtype == torch.bfloat16 else "16-mixed")
        self.amp: Amp | None = None  # the session, made when the model meets its optimizers
        self._pending: dict[str, Any] | None = None  # a checkpoint loaded before `connect`

    def _new_session(self) -> Amp:
        options = dict(self._options)
        return Amp(options.pop("opt_level"), **options)

    # -- model and optimizers -------------------------------------------------------------------
    def initialize(self, model: nn.Module, *optimizers: torch.optim.Optimizer) -> Any:
        """`ampx.initialize(model, optimizers)` with the plugin's options (for Fabric).

        Returns:
            `model` alone without optimizers, else `(model, *optimizers)`: the shape
            `fabric.setup(*...)` takes.

        Raises:
            RuntimeError: If this plugin already initialized a model.
        """
        if self.amp is not None:
            raise RuntimeError(
                "AmpxPrecision.initialize: this plugin already initialized a model; make one "
                "AmpxPrecision per model (and per Fabric/Trainer).")
        amp = self._new_session()
        amp.initialize(model, [unwrap(opt) for opt in optimizers] or None)
        self._start(amp)
        return (model, *optimizers) if optimizers else model

    def _start(self, amp: Amp) -> None:
        self.amp = amp
        if self._pending is not None:
            pending, self._pending = self._pending, None
            amp.load_state_dict(pending)

    def connect(self, model: nn.Module, optimizers: list[Any], lr_schedulers: list[Any]
                ) -> tuple[nn.Module, list[Any], list[Any]]:
        """The Trainer's hook: initialize the module with its optimizers (see module doc)."""
        ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        module = model.module if ddp else model
        if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)) or \
                not isinstance(module, pl.LightningModule):
            raise RuntimeError(
                f"AmpxPrecision: the strategy handed a {type(model).__name__} to the precision "
                "plugin; ampx supports Lightning's single-device and 'ddp' strategies "
                "(FSDP/DeepSpeed shard parameters, which ampx's masters cannot follow).")
        if self.amp is not None and self.amp.models:
            raise RuntimeError(
                "AmpxPrecision: this plugin already initialized a model in an earlier fit, and "
                "a model goes through ampx once. For another fit, load the checkpoint into a "
                "fresh model with a new AmpxPrecision (Trainer(...).fit(model, ckpt_path=...)).")
        amp = self._new_session()
        amp.initialize(module, [unwrap(opt) for opt in optimizers] or None)
        self._start(amp)
        if ddp:  # DDP's buckets were built for the fp32 parameters: wrap the new ones
            strategy: Any = module.trainer.strategy  # DDPStrategy (checked by the wrapper)
            strategy.model = module
            strategy.configure_ddp()
            model = strategy.model
        return model, optimizers, lr_schedulers

    def convert_input(self, data: Any) -> Any:
        """At O2/O3, floating tensors of the batch in the model's half dtype."""
        if self.amp is None:  # Fabric without `precision.initialize`: say so before forward
            raise RuntimeError(self._missing("convert_input"))
        if self._input_dtype is None:
            return data
        return cast_tree(data, self._input_dtype, _always)

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Nothing to enter: O1's casts are installed by initialize, O2/O3 cast the weights."""
        yield

    def main_params(self, optimizer: Any) -> Iterator[Any]:
        """What gradient clipping reads: the fp32 masters at O2 (unscaled after backward)."""
        return iter(master_params(optimizer))

    # -- backward and step ----------------------------------------------------------------------
    @staticmethod
    def _missing(api: str) -> str:
        return (f"AmpxPrecision.{api}: no model or optimizer went through ampx yet. With Fabric, "
                "call `model, optimizer = fabric.setup(*precision.initialize(model, optimizer))`"
                "; the Trainer does it itself when fitting starts.")

    def _session(self, api: str) -> Amp:
        if self.amp is None or not self.amp.optimizers:
            raise RuntimeError(self._missing(api))
        return self.amp

    @staticmethod
    def _in_trainer(module: Any) -> bool:
        return isinstance(module, pl.LightningModule) and module._trainer is not None

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        return super().pre_backward(tensor, module) if self._in_trainer(module) else tensor

    def post_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        if self._in_trainer(module):
            return super().post_backward(tensor, module)
        return tensor.detach()

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any = None,
                 *args: Any, **kwargs: Any) -> None:
        """`scale_loss(tensor, optimizer)` around the backward (all optimizers if None)."""
        amp = self._session("backward")
        optimizers = [optimizer] if optimizer is not None else list(amp.optimizers)
        with amp.scale_loss(tensor, optimizers) as scaled:
            if self._in_trainer(model):
                model.backward(scaled, *args, **kwargs)  # the LightningModule's own hook
            else:
                scaled.backward(*args, **kwargs)

    def optimizer_step(self, optimizer: Any, model: Any = None,
                       closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Run the closure, then the step (skipped by ampx on an overflow)."""
        if closure is None:  # Fabric: backward already ran
            return optimizer.step(**kwargs)
        closure_result = closure()
        # automatic optimization with training_step returning None: no backward ran, no step
        # (as Lightning's own mixed precision plugin does)
        skipped_backward = closure_result is None and self._in_trainer(model) \
            and model.automatic_optimization
        if self._in_trainer(model):
            self._after_closure(model, optimizer)  # on_before_optimizer_step and clipping
        if skipped_backward:
            return closure_result
        optimizer.step(**kwargs)
        return closure_result

    # -- checkpoints and teardown ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The session's loss-scaler state (`ampx.Amp.state_dict`)."""
        return dict(self.amp.state_dict()) if self.amp is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load `state_dict()` output; before the session exists it is applied at `connect`."""
        if self.amp is None:
            self._pending = dict(state_dict)
        else:
            self.amp.load_state_dict(state_dict)

    def teardown(self) -> None:
        """Nothing to undo: as after `ampx.initialize`, O1's patches stay installed after the
        fit (validation and prediction run with them); `ampx.restore()` removes them."""
