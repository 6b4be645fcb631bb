"""`Amp`, the object API, and the apex-style module functions built on a default instance.

This module wires the pieces together and holds no algorithm: options come from
`opt_levels`, model casts from `model`, patching from `patch`, scaling from `scaler` and
gradient handling from `optimizer`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from . import checkpoint, distributed, patch, telemetry
from .checkpoint import CheckpointError
from .masters import optimizer_params, recast_state
from .model import MasterMap, ModelCast, cast_model, check_models, device_types_of
from .opt_levels import BRIEFS, OptionError, OptLevel, Properties, resolve_properties
from .optimizer import OptimizerAmpState, Policy, amp_state_of, master_params
from .scaled_pass import ScaledPass
from .scaler import LossScaler
from .stepping import attach, check_optimizers

__all__ = [
    "Amp",
    "CheckpointError",
    "deinitialize",
    "forced_options",
    "initialize",
    "load_state_dict",
    "master_params",
    "restore",
    "scale_loss",
    "set_forced_options",
    "state_dict",
    "step_was_skipped",
]

logger = logging.getLogger("ampx")

_FORCEABLE = ("opt_level", "dtype", "loss_scale", "keep_batchnorm_fp32", "master_weights",
              "min_loss_scale", "max_loss_scale", "enabled")
# Options that only make sense for one opt level: a forced level drops the script's values.
_LEVEL_SPECIFIC = ("cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
                   "master_weights")
_FORCED: dict[str, Any] = {}


def set_forced_options(options: Mapping[str, Any] | None) -> None:
    """Make every later `initialize` use these options instead of the caller's (`ampx run`).

    Args:
        options: initialize keyword values (keys: opt_level, dtype, loss_scale,
            keep_batchnorm_fp32, master_weights, min_loss_scale, max_loss_scale, enabled);
            None or {} clears them.

    Raises:
        ValueError: For a key that cannot be forced.
    """
    options = dict(options or {})
    unknown = sorted(set(options) - set(_FORCEABLE))
    if unknown:
        raise ValueError(f"ampx.set_forced_options: cannot force {unknown}; "
                         f"forceable options are {list(_FORCEABLE)}.")
    _FORCED.clear()
    _FORCED.update(options)


def forced_options() -> dict[str, Any]:
    """The options `ampx run` forces on every `initialize` (a copy)."""
    return dict(_FORCED)


class Amp:
    """One mixed-precision session: options, loss scalers, and what it initialized.

    Several `Amp` objects can coexist (for example two O2 models with separate scalers). O1's
    function patching is process-wide: the newest O1 session takes the patches over from the
    previous one (the older session's models then run under the newer session's casts).

    Args:
        opt_level: "O0", "O1", "O2" or "O3" (apex's table, see docs/opt-levels.md).
        enabled: False makes the session a pass-through.
        dtype: torch.float16 (apex's, the default) or torch.bfloat16 (or "fp16"/"bf16").
        cast_model_type: Override of the level's model dtype.
        patch_torch_functions: Override (O1 only).
        keep_batchnorm_fp32: Override.
        master_weights: Override.
        loss_scale: "dynamic" or a number (bf16 default: static 1.0, non-finite steps skipped).
        cast_model_outputs: Dtype of the model's outputs.
        num_losses: Number of loss scalers (`loss_id` picks one).
        verbosity: 0 silences the info log; 2 logs every O1 cast.
        min_loss_scale: Floor of the dynamic scale.
        max_loss_scale: Ceiling of the dynamic scale.
        init_scale: Initial dynamic scale.
        growth_factor: Growth multiplier of the dynamic scale.
        backoff_factor: Backoff multiplier of the dynamic scale.
        growth_interval: Clean steps between growths.
        hysteresis: Overflows tolerated before backing off.
        skip_non_finite: Skip steps whose gradients are not finite (default: with a dynamic
            scale, and with bf16 at O1-O3).
        allow_banned: Run banned functions in float32 instead of raising (O1).
        device_types: Device types whose tensors O1 casts (default: the models' devices).
        sync_overflow: All-reduce the overflow flag across ranks when torch.distributed runs
            with several ranks, so all ranks skip the same steps.
        process_group: The group for that all-reduce (default: the world).

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

    def __init__(
        self,
        opt_level: str = "O1",
        *,
        enabled: bool = True,
        dtype: Any = None,
        cast_model_type: Any = None,
        patch_torch_functions: Any = None,
        keep_batchnorm_fp32: Any = None,
        master_weights: Any = None,
        loss_scale: Any = None,
        cast_model_outputs: torch.dtype | None = None,
        num_losses: int = 1,
        verbosity: int = 1,
        min_loss_scale: float | None = None,
        max_loss_scale: float = 2.0**24,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        skip_non_finite: bool | None = None,
        allow_banned: bool = False,
        device_types: Any = None,
        sync_overflow: bool = True,
        process_group: Any = None,
    ) -> None:
        requested = dict(
            opt_level=opt_level, enabled=enabled, dtype=dtype, cast_model_type=cast_model_type,
            patch_torch_functions=patch_torch_functions, keep_batchnorm_fp32=keep_batchnorm_fp32,
            master_weights=master_weights, loss_scale=loss_scale,
            cast_model_outputs=cast_model_outputs, num_losses=num_losses, verbosity=verbosity,
            min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale, init_scale=init_scale,
            growth_factor=growth_factor, backoff_factor=backoff_factor,
            growth_interval=growth_interval, hysteresis=hysteresis,
            skip_non_finite=skip_non_finite, allow_banned=allow_banned,
        )
        self.requested = requested
        self.forced = forced_options()
        options = _apply_forced(requested, self.forced)
        self.properties: Properties = resolve_properties(**options)
        if device_types is not None:
            if isinstance(device_types, str):
                device_types = [device_types]
            device_types = frozenset(str(t) for t in device_types)
        self._device_types: frozenset[str] | None = device_types
        self.sync_overflow = sync_overflow
        self.process_group = process_group
        props = self.properties
        self.scalers: list[LossScaler] = [
            LossScaler(
                props.loss_scale, init_scale=props.init_scale, growth_factor=props.growth_factor,
                backoff_factor=props.backoff_factor, growth_interval=props.growth_interval,
                hysteresis=props.hysteresis, min_loss_scale=props.min_loss_scale,
                max_loss_scale=props.max_loss_scale, loss_id=i,
            )
            for i in range(props.num_losses)
        ]
        self.models: list[torch.nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self._model_casts: list[ModelCast] = []
        self._o1: patch.O1Patches | None = None
        self._initialized = False

    @classmethod
    def from_args(cls, args: Any, **overrides: Any) -> Amp:
        """Build a session from the flags `ampx.add_args(parser)` added (argparse or config).

        Args:
            args: The parsed arguments (see `ampx.compat.options.amp_kwargs_from_args`).
            **overrides: `Amp` keyword arguments that replace the flags' values.

        Raises:
            ValueError: When `--opt-level` is combined with fairseq's own precision flags.
            OptionError: For options that don't fit.

        Example::

            parser = argparse.ArgumentParser()
            ampx.add_args(parser)
            amp = ampx.Amp.from_args(parser.parse_args())
        """
        from .compat.options import amp_kwargs_from_args

        kwargs = amp_kwargs_from_args(args)
        kwargs.update(overrides)
        return cls(**kwargs)

    # -- configuration views -------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """False when the session is a pass-through."""
        return self.properties.enabled

    @property
    def skips_non_finite(self) -> bool:
        """Whether steps with non-finite gradients are skipped."""
        props = self.properties
        if not props.enabled:
            return False
        if self.requested.get("skip_non_finite") is not None:
            return props.skip_non_finite
        if props.dynamic:
            return True
        return props.dtype == torch.bfloat16 and props.opt_level is not OptLevel.O0

    @property
    def scales_gradients(self) -> bool:
        """False on apex's short-circuit path (no masters, static scale 1.0, no inf check)."""
        props = self.properties
        return props.enabled and (
            props.master_weights or props.dynamic or props.loss_scale != 1.0
            or self.skips_non_finite
        )

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
            OptionError: For options that don't fit.
        Nothing is changed when it raises.
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

        model_list, models_was_list = check_models(models)
        opt_list, opts_was_list = check_optimizers(optimizers)
        self._check_param_dtypes(model_list)
        device_types = self._device_types or device_types_of(model_list)

        self._log_properties()
        split: set[int] = set()
        if props.master_weights and props.cast_model_type not in (None, torch.float32):
            split = {id(p) for opt in opt_list for p in optimizer_params(opt)
                     if p.is_floating_point()}
        casts: list[ModelCast] = []
        try:
            outputs = props.cast_model_outputs
            if props.cast_model_type is not None and outputs is None:
                outputs = torch.float32
            for model in model_list:
                casts.append(cast_model(
                    model, props.cast_model_type, keep_batchnorm_fp32=props.keep_batchnorm_fp32,
                    split_params=split, cast_outputs=outputs,
                ))
            masters = MasterMap()
            for record in casts:
                for model_param, master in record.masters.pairs():
                    masters.add(model_param, master)
            for opt in opt_list:
                if props.cast_model_type is not None and not props.master_weights:
                    recast_state(opt)
                attach(opt, self, masters, self._policy())
            device = _first_device(opt_list, model_list)
            for scaler in self.scalers:
                scaler.to_(device)
            if props.patch_torch_functions:
                self._o1 = patch.activate(patch.CastConfig(
                    dtype=props.dtype, device_types=device_types,
                    allow_banned=props.allow_banned, verbose=props.verbosity == 2,
                ))
        except BaseException:
            for record in casts:
                record.undo()  # weights, buffers and hooks as handed in
            for opt in opt_list:
                state = amp_state_of(opt)
                if state is not None:
                    state.detach()
                    del opt._ampx  # type: ignore[attr-defined]
            raise
        self.models, self.optimizers, self._model_casts = model_list, opt_list, casts
        self._initialized = True
        tel = telemetry.sink()
        if tel is not None:
            tel.emit("init", opt_level=props.opt_level.value, dtype=_dtype_name(props.dtype),
                     loss_scale=props.loss_scale, properties=props.as_dict(),
                     requested=_jsonable(self.requested), forced=_jsonable(self.forced))
        models_out = model_list if models_was_list else model_list[0]
        if opts_was_list:
            return models_out, opt_list
        if not opt_list:
            return models_out
        return models_out, opt_list[0]

    def _check_param_dtypes(self, models: list[torch.nn.Module]) -> None:
        for model in models:
            for name, param in model.named_parameters():
                if param.dtype in (torch.float16, torch.bfloat16):
                    logger.warning(
                        "ampx.initialize: parameter %s is already %s. You do not need to call "
                        ".half() on your model before initialize; ampx accepts it, but fp32 "
                        "master weights are then made from half-precision values.",
                        name, param.dtype,
                    )
                    return

    def _log_properties(self) -> None:
        props = self.properties
        if props.verbosity == 0 or distributed.rank() != 0:
            return
        logger.info("Selected optimization level %s:  %s", props.opt_level.value,
                    BRIEFS[props.opt_level])
        for key, value in props.as_dict().items():
            logger.info("%-22s : %s", key, value)
        replaced = {k: (self.requested.get(k), v) for k, v in self.forced.items()
                    if self.requested.get(k) != v}
        for key, (old, new) in replaced.items():
            logger.info("ampx run overrides %s: script passed %r, using %r", key, old, new)

    # -- scale_loss ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def scale_loss(
        self,
        loss: torch.Tensor,
        optimizers: Any,
        loss_id: int = 0,
        model: Any = None,
        delay_unscale: bool = False,
        delay_overflow_check: bool = False,
    ) -> Iterator[torch.Tensor]:
        """Yield the scaled loss; on exit unscale the gradients and check them.

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

        Raises:
            TypeError: If an optimizer never went through `initialize`.
            IndexError: For a `loss_id` without a scaler.
        """
        if not self.properties.enabled:
            yield loss
            return
        opts = _optimizer_list(optimizers)
        states = [self._state_of(opt) for opt in opts]
        if not 0 <= loss_id < len(self.scalers):
            raise IndexError(
                f"ampx.scale_loss: loss_id={loss_id} but num_losses={len(self.scalers)}; pass "
                "num_losses=N to initialize to get N loss scalers."
            )
        if not self.scales_gradients:  # apex's short-circuit (O0, O3 with fp16)
            yield from _short_circuit(loss, states)
            return

        scaled = ScaledPass(opts, states, self.scalers[loss_id], self.synchronize_found_inf)
        scaled.begin()
        try:
            yield self.scalers[loss_id].scale_loss_value(loss)
        except BaseException:
            scaled.abort()
            patch.clear_cache()
            raise
        try:
            scaled.end(loss.detach(), loss_id=loss_id, delay_unscale=delay_unscale,
                       check=not delay_overflow_check)
        finally:
            patch.clear_cache()

    def _policy(self) -> Policy:
        """What this session hands each optimizer's state at attach."""
        return Policy(scales=self.scales_gradients, skips=self.skips_non_finite,
                      master_weights=bool(self.properties.master_weights),
                      on_overflow=self._report_overflow, on_step=self.record_step)

    def _report_overflow(self, loss_ids: Any) -> None:
        for loss_id in loss_ids:
            self.scalers[loss_id].report_overflow()

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
        tel = telemetry.sink()
        now = time.perf_counter()
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
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load `state_dict()` output or an apex checkpoint's amp entry.

        Every entry is validated before any is applied: a malformed checkpoint changes nothing.
        Entries are matched by the number in their key (apex used the iteration order).

        Raises:
            CheckpointError: Naming the offending key.
        """
        checkpoint.load(self.scalers, state_dict, stacklevel=4)

    # -- teardown ---------------------------------------------------------------------------------
    @property
    def owns_patches(self) -> bool:
        """True while this session's O1 patches are the installed ones."""
        return self._o1 is not None and patch.active() is self._o1

    def restore(self) -> None:
        """Remove this session's O1 patches (if it still owns them)."""
        if self._o1 is not None and patch.active() is self._o1:
            patch.deactivate()
        self._o1 = None


def _short_circuit(loss: torch.Tensor, states: list[OptimizerAmpState]) -> Iterator[torch.Tensor]:
    try:
        yield loss.float()
    finally:
        patch.clear_cache()
    for state in states:
        state.last_loss = loss.detach()


def _apply_forced(requested: dict[str, Any], forced: dict[str, Any]) -> dict[str, Any]:
    options = dict(requested)
    if not forced:
        return options
    if "opt_level" in forced and forced["opt_level"] != requested.get("opt_level"):
        for key in _LEVEL_SPECIFIC:
            if key not in forced:
                options[key] = None
    options.update(forced)
    return options


def _optimizer_list(optimizers: Any) -> list[Any]:
    if optimizers is None:
        return []
    if isinstance(optimizers, (list, tuple)):
        return list(optimizers)
    return [optimizers]


def _first_device(optimizers: list[torch.optim.Optimizer],
                  models: list[torch.nn.Module]) -> torch.device:
    for opt in optimizers:
        for param in optimizer_params(opt):
            return param.device
    for model in models:
        for param in model.parameters():
            return param.device
    return torch.device("cpu")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _jsonable(options: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _dtype_name(v) if isinstance(v, torch.dtype) else v for k, v in options.items()}


# -- the apex-style module functions (a default session) -----------------------------------------

_DEFAULT: Amp | None = None


def default_session() -> Amp | None:
    """The session made by the latest module-level `initialize` (None before, or after restore)."""
    return _DEFAULT


def initialize(
    models: Any,
    optimizers: Any = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: Any = None,
    patch_torch_functions: Any = None,
    keep_batchnorm_fp32: Any = None,
    master_weights: Any = None,
    loss_scale: Any = None,
    cast_model_outputs: torch.dtype | None = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
    **options: Any,
) -> Any:
    """apex's `amp.initialize`: same arguments, same return shapes, same option errors.

    Extra keyword options (`dtype`, `init_scale`, `growth_factor`, `backoff_factor`,
    `growth_interval`, `hysteresis`, `skip_non_finite`, `allow_banned`, `device_types`,
    `sync_overflow`, `process_group`) are those of `Amp`.

    Calling it again starts a new default session: the previous one's O1 patches are
    replaced (by the new O1 patches, or removed when the new level is not O1; no stacked
    wrappers), and the models and optimizers it returned keep working with their own scalers.

    Example::

        model, optimizer = ampx.initialize(model, optimizer, opt_level="O2", dtype="bf16")
        with ampx.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()

    Raises:
        OptionError: (a ValueError and a RuntimeError) for options that don't fit.
        TypeError: For models/optimizers of the wrong type.
        RuntimeError: For a DataParallel-wrapped model or an optimizer passed twice.
    """
    global _DEFAULT
    amp = Amp(
        opt_level, enabled=enabled, cast_model_type=cast_model_type,
        patch_torch_functions=patch_torch_functions, keep_batchnorm_fp32=keep_batchnorm_fp32,
        master_weights=master_weights, loss_scale=loss_scale,
        cast_model_outputs=cast_model_outputs, num_losses=num_losses, verbosity=verbosity,
        min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale, **options,
    )
    result = amp.initialize(models, optimizers)
    previous, _DEFAULT = _DEFAULT, amp
    if previous is not None and not amp.properties.patch_torch_functions and previous.owns_patches:
        # A new default session replaces the old one cleanly: its O1 casts must not leak
        # into a model initialized at another level (an O2 bf16 model under O1 fp16 casts).
        logger.info("ampx.initialize: removing the previous session's O1 function patches; "
                    "its models now run without O1 casts.")
        previous.restore()
    return result


def _session_for(optimizers: Any) -> Amp:
    for opt in _optimizer_list(optimizers):
        state = amp_state_of(opt)
        if state is not None and isinstance(state.owner, Amp):
            return state.owner
    if _DEFAULT is None:
        raise RuntimeError(
            "Invoked 'with amp.scale_loss`, but internal Amp state has not been initialized.  "
            "model, optimizer = amp.initialize(model, optimizer, opt_level=...) must be called "
            "before `with amp.scale_loss`."
        )
    return _DEFAULT


def scale_loss(
    loss: torch.Tensor,
    optimizers: Any,
    loss_id: int = 0,
    model: Any = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> contextlib.AbstractContextManager[torch.Tensor]:
    """apex's `amp.scale_loss`; the session is found from the optimizers (see `Amp.scale_loss`).

    Example::

        with ampx.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
    """
    return _session_for(optimizers).scale_loss(
        loss, optimizers, loss_id=loss_id, model=model, delay_unscale=delay_unscale,
        delay_overflow_check=delay_overflow_check,
    )


def _require_default(api: str) -> Amp:
    if _DEFAULT is None:
        raise RuntimeError(f"ampx.{api}: call ampx.initialize(...) first.")
    return _DEFAULT


def state_dict(destination: dict | None = None) -> dict[str, Any]:
    """apex's `amp.state_dict()` for the default session (see `Amp.state_dict`)."""
    return _require_default("state_dict").state_dict(destination)


def load_state_dict(state_dict: Mapping[str, Any]) -> None:
    """apex's `amp.load_state_dict()` for the default session (see `Amp.load_state_dict`)."""
    _require_default("load_state_dict").load_state_dict(state_dict)


def step_was_skipped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the last `optimizer.step()` was skipped for non-finite gradients (no sync).

    Example::

        optimizer.step()
        if not ampx.step_was_skipped(optimizer):
            scheduler.step()
    """
    state = amp_state_of(optimizer)
    if state is None:
        raise TypeError(
            "step_was_skipped() needs an optimizer passed through ampx.initialize(); got "
            f"{type(optimizer).__module__}.{type(optimizer).__name__}"
        )
    return state.last_step_skipped


def restore() -> None:
    """Undo O1's patching: torch, torch.Tensor and torch.nn.functional get their original objects.

    Models and optimizers keep their casts and hooks; the default session is forgotten.
    """
    global _DEFAULT
    patch.deactivate()
    _DEFAULT = None


deinitialize = restore

__all__ += ["OptionError", "default_session"]
