"""`Amp`: one mixed-precision session (its options, loss scalers, and what it initialized).

The session wires the pieces together and holds no algorithm: options come from
`ampx.options.levels`, `initialize`'s transaction from `ampx.initializer` (functions given
everything they use), O1's patching from `ampx.o1.patch`, scaling from
`ampx.scaling.scaler`, the scaled-backward protocol from `ampx.scaling.protocol` and
`ampx.scaling.scaled_pass` (the `scale_loss` block), checkpoints from
`ampx.scaling.checkpoint`. The module-level functions on a default session are in
`ampx.frontend`.

The session offers one hook to what is layered above it: `add_extension` registers an
`OptimizerExtension`, which every session then adds to the optimizers it initializes, inside
`initialize`'s transaction (apex's private optimizer names, `ampx.compat.apex.shell`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from . import distributed, initializer, telemetry
from .model import ModelCast
from .o1 import patch
from .options.levels import DEFAULTS, Properties, brief, resolve_properties
from .options.values import HALF_DTYPES, dtype_name, parse_bool
from .overflow.report import OverflowReport
from .overflow.watch import OverflowWatch, check_module_names
from .registry import SESSIONS, OptimizerExtension
from .scaling import checkpoint
from .scaling.masters import optimizer_params
from .scaling.protocol import OptimizerAmpState, SessionHooks, amp_state_of, unwrap
from .scaling.scaled_pass import ScaleLossBlock
from .scaling.scaler import LossScaler

if TYPE_CHECKING:  # loaded with the numerics monitor, only by sessions that watch numerics
    from .overflow.numerics_report import NumericsReport

__all__ = ["Amp", "add_extension"]

logger = logging.getLogger("ampx")


def add_extension(extension: OptimizerExtension) -> None:
    """Have every later `initialize` add `extension` to its optimizers (once; idempotent).

    The extension's `check` runs with initialize's input checks, its `attach` inside the
    transaction (rolled back with it), and the module-level `ampx.restore()` calls its
    `detach_all`.
    """
    if not any(e is extension for e in SESSIONS.extensions):
        SESSIONS.extensions.append(extension)


class Amp:
    """One mixed-precision session: options, loss scalers, and what it initialized.

    Several `Amp` objects can coexist, each with its own loss scalers (for example two O2
    models with separate scale trajectories). The module-level functions (`ampx.initialize`,
    apex's API) instead share one list of scalers, as apex did: see `initialize`. O1's
    function patching is process-wide: the newest O1 session takes the patches over from the
    previous one (the older session's models then run under the newer session's casts).

    Args:
        opt_level: "O0", "O1", "O2" or "O3" (apex's table, see docs/opt-levels.md).
        sync_overflow: All-reduce the overflow flag across ranks when torch.distributed runs
            with several ranks, so all ranks skip the same steps.
        process_group: The group for that all-reduce (default: the world).
        **overrides: Any other field of `ampx.Properties` (`dtype`, `loss_scale`,
            `num_losses`, `init_scale`, `skip_non_finite`, `device_types`, ...), with the
            defaults and meanings of `Properties`.

    Raises:
        UnknownOptionError: For a keyword `Properties` doesn't have (all are listed).
        OptionError: For options that don't fit.

    Example::

        amp = ampx.Amp(opt_level="O2", dtype="bf16")
        model, optimizer = amp.initialize(model, optimizer)
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
    """

    def __init__(self, opt_level: str = DEFAULTS.opt_level.value, *, sync_overflow: bool = True,
                 process_group: Any = None, **overrides: Any) -> None:
        self.requested: dict[str, Any] = {"opt_level": opt_level, **overrides}
        forced = SESSIONS.forced
        self.forced: dict[str, Any] = forced.jsonable()  # for messages and telemetry
        self.properties: Properties = resolve_properties(**forced.apply(self.requested))
        self._dtype_note = forced.dtype_note(self.requested)  # logged at initialize
        # a bool (or apex's "True"/"False" strings): "no" must not read as True
        sync = parse_bool("sync_overflow", sync_overflow)
        self.sync_overflow = True if sync is None else sync
        self.process_group = process_group
        props = self.properties
        self.scalers: list[LossScaler] = [
            # verbosity=0 silences the skipped-step lines, as apex's did
            LossScaler(props.scale, **props.scaler_options(), loss_id=i,
                       log_level=logging.INFO if props.verbosity else logging.DEBUG)
            for i in range(props.num_losses)
        ]
        self.models: list[torch.nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self._model_casts: list[ModelCast] = []
        self._o1: patch.O1Patches | None = None
        self.overflow_watch: OverflowWatch | None = None  # provenance, once initialized
        self._telemetry: telemetry.Telemetry | None = None  # the writer, chosen at initialize
        self._initialized = False

    @classmethod
    def from_args(cls, args: Any, **overrides: Any) -> Amp:
        """Build a session from the flags `ampx.add_args(parser)` added (argparse or config).

        Args:
            args: The parsed arguments (see `ampx.options.flags.amp_kwargs_from_args`).
            **overrides: `Amp` keyword arguments that replace the flags' values.

        Raises:
            ValueError: When `--opt-level` is combined with fairseq's own precision flags.
            OptionError: For options that don't fit.

        Example::

            parser = argparse.ArgumentParser()
            ampx.add_args(parser)
            amp = ampx.Amp.from_args(parser.parse_args())
        """
        from .options.flags import amp_kwargs_from_args

        kwargs = amp_kwargs_from_args(args)
        kwargs.update(overrides)
        return cls(**kwargs)

    # -- configuration views (`Properties` decides) ------------------------------------------------
    @property
    def enabled(self) -> bool:
        """False when the session is a pass-through."""
        return self.properties.enabled

    @property
    def skips_non_finite(self) -> bool:
        """Whether steps with non-finite gradients are skipped (`Properties.skip_non_finite`)."""
        return bool(self.properties.skip_non_finite)

    @property
    def scales_gradients(self) -> bool:
        """False on apex's short-circuit path (`Properties.scales_gradients`)."""
        return self.properties.scales_gradients

    # -- initialize ---------------------------------------------------------------------------
    def initialize(self, models: Any, optimizers: Any = None) -> Any:
        """Prepare models and optimizers for this session; returns them in apex's shapes.

        Returns the very same optimizer objects (same class, same state, LR schedulers keep
        working). A single model/optimizer comes back single, a list comes back a list;
        without optimizers only the model(s) are returned, unless `optimizers` was a list.

        Raises:
            TypeError: For models/optimizers of the wrong type.
            RuntimeError: For a model wrapped in (Distributed)DataParallel, an optimizer
                already initialized, or a second `initialize` of this `Amp`.
            OptionError: For options that don't fit, and for inputs `initialize` refuses
                (the same model twice, a meta-device model, an optimizer holding none of
                the models' parameters; see `ampx.initializer.check_inputs`).
        Nothing is changed when it raises, whatever it raises (KeyboardInterrupt included).
        """
        if self._initialized:
            raise RuntimeError(
                "Amp.initialize: this Amp object was already initialized; create a new "
                "ampx.Amp(...) (or call ampx.initialize again) for other models."
            )
        props = self.properties
        if not props.enabled:
            self._initialized = True
            return models if optimizers is None else (models, optimizers)
        extensions = list(SESSIONS.extensions)
        inputs = initializer.check_inputs(models, optimizers, extensions=extensions,
                                          casts_model=props.cast_model_type is not None)
        self._check_param_dtypes(inputs.models)
        check_module_names(inputs.models, props.keep_fp32, "keep_fp32")
        self._log_properties()
        prepared = initializer.prepare(inputs, props, self.scalers, owner=self,
                                       hooks=self._hooks(), extensions=extensions)
        self.models, self.optimizers = inputs.models, inputs.optimizers
        self._model_casts, self._o1 = prepared.casts, prepared.o1
        if props.scales_gradients:
            self.overflow_watch = OverflowWatch.attach(
                self.models, self.optimizers, props, loss_scale=self.scalers[0].loss_scale)
        self._initialized = True
        tel = self._telemetry = telemetry.sink()
        if tel is not None:
            tel.emit("init", opt_level=props.opt_level.value, dtype=dtype_name(props.dtype),
                     loss_scale=props.scale, properties=props.as_dict(),
                     requested=_jsonable(self.requested), forced=_jsonable(self.forced))
        return inputs.returned()

    def _check_param_dtypes(self, models: list[torch.nn.Module]) -> None:
        for model in models:
            for name, param in model.named_parameters():
                if param.dtype in HALF_DTYPES:
                    logger.warning(
                        "ampx.initialize: parameter %s is already %s. You do not need to call "
                        ".half() on your model before initialize; ampx accepts it, but fp32 "
                        "master weights are then made from half-precision values.",
                        name, param.dtype,
                    )
                    return

    def _log_properties(self) -> None:
        props = self.properties
        if self._dtype_note is not None and distributed.rank() == 0:
            logger.warning(self._dtype_note)  # at any verbosity: the script's logs say otherwise
        if props.verbosity == 0 or distributed.rank() != 0:
            return
        logger.info("Selected optimization level %s:  %s", props.opt_level.value,
                    brief(props.opt_level, props.dtype))
        for key, value in props.as_dict().items():
            logger.info("%-22s : %s", key, value)
        replaced = {k: (self.requested.get(k), v) for k, v in self.forced.items()
                    if self.requested.get(k) != v}
        for key, (old, new) in replaced.items():
            logger.info("ampx run overrides %s: script passed %r, using %r", key, old, new)

    # -- scale_loss ---------------------------------------------------------------------------
    def scale_loss(
        self,
        loss: torch.Tensor,
        optimizers: Any,
        loss_id: int = 0,
        model: Any = None,
        delay_unscale: bool = False,
        delay_overflow_check: bool = False,
    ) -> ScaleLossBlock:
        """A context manager yielding the scaled loss; on exit it unscales and checks.

        Call `.backward()` on the yielded tensor inside the block. On exit, this pass's
        gradients are unscaled (into the fp32 masters at O2, adding onto gradients of earlier
        passes), inf/NaN are flagged on the device, and the loss scale is updated there. The
        next `optimizer.step()` reads the flag once (the only host sync of a step) and is
        skipped if the gradients were not finite.

        Args:
            loss: The loss tensor.
            optimizers: The optimizer, or a list of every optimizer whose parameters get
                gradients from this backward.
            loss_id: Which loss scaler to use (`num_losses` made them).
            model: Accepted for apex compatibility; unused.
            delay_unscale: Leave the gradients scaled (apex's accumulation optimisation); the
                next `scale_loss` without it unscales everything. Don't step in between.
            delay_overflow_check: Don't update the scale or skip steps for this pass (apex).

        Raises (on entering the block):
            TypeError: If an optimizer never went through `initialize`.
            IndexError: For a `loss_id` without a scaler.
        """
        return ScaleLossBlock(self, loss, optimizers, loss_id, delay_unscale,
                              delay_overflow_check)

    def _hooks(self) -> SessionHooks:
        """What this session hands each optimizer's state at attach."""
        return SessionHooks(scales=self.scales_gradients, skips=self.skips_non_finite,
                            master_weights=bool(self.properties.master_weights),
                            per_tensor=self.scales_gradients, on_overflow=self._report_overflow,
                            on_skip=self._on_skip, on_step=self.record_step,
                            compensation=self.properties.compensation)

    def _report_overflow(self, loss_ids: Any) -> None:
        if self.overflow_watch is None:  # else _on_skip logs, with the provenance
            for loss_id in loss_ids:
                self.scalers[loss_id].report_overflow()

    def _on_skip(self, optimizer: Any, state: OptimizerAmpState) -> None:
        if self.overflow_watch is not None:
            self.overflow_watch.on_skip(
                optimizer, state.overflow_flags, step=state.steps,
                loss_ids=sorted(state.loss_ids), scalers=self.scalers,
                process_group=self.process_group,
                distributed=self.sync_overflow and distributed.is_multi_rank(self.process_group))

    def last_overflow(self, optimizer: torch.optim.Optimizer) -> OverflowReport | None:
        """Where the inf/NaN of `optimizer`'s latest skipped step came from (None: no skip)."""
        self._state_of(optimizer)
        watch = self.overflow_watch
        return watch.last(unwrap(optimizer)) if watch is not None else None

    def numerics_report(self) -> NumericsReport:
        """The per-module numerics report of the steps so far (``numerics="report"``).

        Raises:
            RuntimeError: When the session was not initialized with ``numerics="report"``.
        """
        watch = self.overflow_watch
        if watch is None or watch.numerics is None:
            raise RuntimeError(
                "ampx.numerics_report: this session watches no numerics; initialize with "
                'numerics="report" (or run the script under `ampx run --numerics`).')
        return watch.numerics.report()

    def _state_of(self, optimizer: Any) -> OptimizerAmpState:
        state = amp_state_of(optimizer)
        if state is None:
            raise TypeError(
                "scale_loss() needs an optimizer passed through ampx.initialize(); got "
                f"{type(optimizer).__module__}.{type(optimizer).__name__}"
            )
        if state.owner is not self:
            raise ValueError(
                "ampx.scale_loss: this optimizer was initialized by another Amp session; use "
                "that session's scale_loss (or ampx.scale_loss, which finds it)."
            )
        return state

    def synchronize_found_inf(self, found_inf: torch.Tensor) -> None:
        """All-reduce an overflow flag across ranks (MAX) when running distributed."""
        if self.sync_overflow and distributed.is_multi_rank(self.process_group):
            distributed.reduce_found_inf_(found_inf, self.process_group)

    # -- results and telemetry ------------------------------------------------------------------
    def step_was_skipped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the last `optimizer.step()` was skipped (no host sync)."""
        return self._state_of(optimizer).last_step_skipped

    def loss_scale(self, loss_id: int = 0) -> float:
        """The current scale of a loss as a float (one host sync)."""
        return self.scalers[loss_id].loss_scale()

    def record_step(self, optimizer: torch.optim.Optimizer, state: OptimizerAmpState) -> None:
        """Called after every step of an initialized optimizer (telemetry, when enabled)."""
        tel = self._telemetry
        watch = self.overflow_watch
        if tel is None:  # (the writer is chosen at initialize: AMPX_TELEMETRY is read there)
            if watch is not None:
                watch.step_done()
            return
        now = time.perf_counter()
        report = watch.step_done() if watch is not None else None
        if tel is not None:
            loss = state.last_loss
            loss_ids = sorted(state.loss_ids) or [0]
            params = next(iter(optimizer_params(optimizer)), None)
            tel.step(
                optimizer=self.optimizers.index(optimizer) if optimizer in self.optimizers else 0,
                step_time_s=now - state.last_step_end,
                loss=float(loss.item()) if loss is not None else None,
                loss_scale=self.scalers[loss_ids[0]].loss_scale(),
                skipped=state.last_step_skipped,
                device=params.device if params is not None else None,
                overflow=report.as_dict() if report is not None else None,
            )
        state.last_step_end = now

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self, destination: dict | None = None) -> dict[str, Any]:
        """`{"loss_scaler0": {...}, ...}`: apex's keys, each entry extended with ampx's state.

        O2 master weights are saved by `model.state_dict()` itself (its split parameters come
        out as their fp32 masters), so the usual model + optimizer + amp checkpoint resumes
        without losing precision.
        """
        out: dict[str, Any] = OrderedDict() if destination is None else destination
        for i, scaler in enumerate(self.scalers):
            out[f"loss_scaler{i}"] = scaler.state_dict()
        if self.overflow_watch is not None:  # only with on_overflow other than "skip"
            self.overflow_watch.add_state(out)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load `state_dict()` output or an apex checkpoint's amp entry.

        Every entry is validated before any is applied: a malformed checkpoint changes nothing.
        Entries are matched by the number in their key (apex used the iteration order).

        Raises:
            CheckpointError: Naming the offending key.
        """
        checked = None
        if self.overflow_watch is not None and isinstance(state_dict, Mapping):
            try:
                state_dict, checked = self.overflow_watch.split_state(state_dict)
            except ValueError as exc:
                raise checkpoint.CheckpointError(str(exc)) from None
        checkpoint.load(self.scalers, state_dict, stacklevel=4)
        if checked is not None and self.overflow_watch is not None:
            self.overflow_watch.load_checked(checked)

    # -- teardown ---------------------------------------------------------------------------------
    @property
    def owns_patches(self) -> bool:
        """True while this session's O1 patches are the installed ones."""
        return self._o1 is not None and patch.active() is self._o1

    def restore(self) -> None:
        """Remove everything this session installed: its O1 patches (if it still owns them)
        and every hook on its models (input/output casts, state-dict hooks, the forward
        detector, fp32 fallbacks): initialize/restore cycles on one model leave nothing behind.

        The casts and the optimizers' state stay: an O2/O3 model stays a half model (a
        fallback module float32), whose `state_dict()` saves its own values, not the masters.
        """
        self.remove_patches()
        if self.overflow_watch is not None:  # the detector's and the fp32 fallbacks' hooks
            self.overflow_watch.remove()
        for cast in self._model_casts:
            cast.remove_hooks()

    def remove_patches(self) -> None:
        """Remove this session's O1 patches if it still owns them (its models keep their hooks)."""
        if self._o1 is not None and patch.active() is self._o1:
            patch.deactivate()
        self._o1 = None

    def remove_detector(self) -> None:
        """Take the forward overflow detector's hooks off this session's models (if any)."""
        if self.overflow_watch is not None:
            self.overflow_watch.remove_detector()


def _optimizer_list(optimizers: Any) -> list[Any]:
    if optimizers is None:
        return []
    if isinstance(optimizers, (list, tuple)):
        return list(optimizers)
    return [optimizers]


def _jsonable(options: Mapping[str, Any]) -> dict[str, Any]:
    return {k: dtype_name(v) if isinstance(v, torch.dtype) else v for k, v in options.items()}
