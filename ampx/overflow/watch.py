"""One session's overflow provenance: the reports, the log text, the detector and the policy.

:class:`OverflowWatch` is what a session holds when it was initialized: it names the
parameters of its models (and the O2 masters), optionally runs the forward detector, and on
every skipped step turns the protocol's per-tensor flags into an
:class:`~ampx.overflow.report.OverflowReport` (kept per optimizer for ``ampx.last_overflow``), puts
its top offender into the scaler's log line, and applies the ``on_overflow`` policy
(raising, or moving a module to float32). Clean steps cost it nothing but a counter reset and
clearing the detector's per-step list.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from ..options.values import parse_detect_overflow
from ..scaling.journal import Journal
from .policy import (
    Fp32Fallback,
    OverflowPolicy,
    find_module,
    float_buffers,
    params_with_masters,
)
from .report import OverflowReport, ParamNames

if TYPE_CHECKING:
    from .forward import ForwardDetector
    from .numerics import NumericsMonitor

# The detector, the numerics monitor and the skip's flag reader are imported where first used:
# a session without them and a step that is not skipped never load them (memory every run pays).

__all__ = ["STATE_KEY", "OverflowWatch", "check_module_names", "last_overflow",
           "numerics_report", "with_report"]

logger = logging.getLogger("ampx")

STATE_KEY = "overflow_policy"  # in ampx.state_dict(), only when on_overflow is not "skip"

Pass = tuple[int, Sequence[torch.Tensor], torch.Tensor]  # (loss_id, holders, flags)


def last_overflow(optimizer: Any) -> OverflowReport | None:
    """Where the inf/NaN of `optimizer`'s most recent skipped step came from (None: no skip yet).

    Raises:
        TypeError: For an optimizer that never went through ``ampx.initialize``.

    Example::

        optimizer.step()
        if ampx.step_was_skipped(optimizer):
            print(ampx.last_overflow(optimizer).summary())
    """
    from ..scaling.protocol import amp_state_of, unwrap

    optimizer = unwrap(optimizer)  # a LightningOptimizer / AcceleratedOptimizer
    state = amp_state_of(optimizer)
    if state is None:
        raise TypeError("last_overflow() needs an optimizer passed through ampx.initialize(); "
                        f"got {type(optimizer).__module__}.{type(optimizer).__name__}")
    owner = getattr(state, "owner", None)
    watch = getattr(owner, "overflow_watch", None)
    return watch.last(optimizer) if watch is not None else None


def numerics_report(session: Any = None) -> Any:
    """The numerics report of the default session (or `session`): modules ranked by risk.

    Needs ``ampx.initialize(..., numerics="report")``. The result prints as a table
    (``print(report.table())``) and writes JSON, CSV and a heat map (``report.write(dir)``).

    Raises:
        RuntimeError: No session, or one initialized without ``numerics="report"``.
    """
    from ..registry import SESSIONS

    session = SESSIONS.default if session is None else session
    if session is None:
        raise RuntimeError("ampx.numerics_report: nothing was initialized; call "
                           'ampx.initialize(model, optimizer, numerics="report") first.')
    return session.numerics_report()


def check_module_names(models: Sequence[nn.Module], names: Iterable[str], option: str) -> None:
    """Check that every name is a module of `models` (before initialize changes anything).

    Raises:
        OptionError: Naming `option` and the first unknown module.
    """
    from ..options.values import OptionError

    for name in names:
        try:
            find_module(models, name)
        except KeyError:
            raise OptionError(f"ampx.initialize: {option}: the models have no module {name!r} "
                              "(names as model.named_modules() gives them).") from None


def _initialize_call(props: Any) -> str:
    """The session's initialize call as a script writes it (unclosed), for advice lines."""
    dtype = ', dtype="bf16"' if props.dtype == torch.bfloat16 else ""
    return f'ampx.initialize(model, optimizer, opt_level="{props.opt_level.value}"{dtype}'


E = TypeVar("E", bound=BaseException)


def with_report(exc: E, optimizer: Any) -> E:
    """Attach `optimizer`'s latest :class:`OverflowReport` to `exc` as ``exc.report``.

    For the fairseq wrapper's OverflowError / FloatingPointError. A FloatingPointError also
    gets the report's summary appended to its message. ``exc.report`` is None when the
    optimizer has no report (a session without loss scaling, or nothing skipped yet).
    """
    try:
        report = last_overflow(optimizer)
    except TypeError:
        report = None
    exc.report = report  # type: ignore[attr-defined]
    if report is not None and isinstance(exc, FloatingPointError) and exc.args:
        exc.args = (f"{exc.args[0]}\n{report.summary()}", *exc.args[1:])
    return exc


class OverflowWatch:
    """Overflow provenance for the models and optimizers of one session.

    Args:
        models: The initialized models.
        masters: ``(half model param, fp32 master)`` pairs (O2), for names and fp32-fallback.
        on_overflow: ``"skip"``, ``"raise"`` or ``"fp32-fallback"``.
        patience: See :class:`~ampx.overflow.policy.OverflowPolicy`.
        detect_overflow: None or ``"forward"``.
        casts_patched: O1: the fp32 fallback disables casts instead of swapping weights.
        numerics: ``"report"`` watches every module's numerics (``NumericsMonitor``); the
            fp32 fallback then falls back the module where an overflow starts.
        numerics_every, numerics_shadow_every: The monitor's `every` and `shadow_every`.
        dtype: The session's half dtype (what the numerics are judged against).
        loss_scale: Reads the current loss scale (for the monitor, on watched steps only).
        keep_fp32: Modules to run in float32 from the start (the fallback's mechanism).
    """

    def __init__(self, models: Sequence[nn.Module],
                 masters: Iterable[tuple[nn.Parameter, nn.Parameter]] = (), *,
                 on_overflow: str = "skip", patience: int = 8,
                 detect_overflow: str | None = None, casts_patched: bool = False,
                 numerics: str | None = None,
                 numerics_every: int = 100, numerics_shadow_every: int = 10,
                 dtype: torch.dtype = torch.float16,
                 loss_scale: Callable[[], float] | None = None,
                 keep_fp32: Sequence[str] = (), call: str | None = None) -> None:
        self.policy = OverflowPolicy(on_overflow, patience)
        detect = parse_detect_overflow(detect_overflow)
        self.models = list(models)
        self._pairs = list(masters)
        self._by_id = {id(p): (p, m) for p, m in self._pairs}
        self.names = ParamNames.from_models(self.models, self._pairs)
        self.casts_patched = casts_patched
        self.detector: ForwardDetector | None = None
        if detect == "forward":
            from .forward import ForwardDetector

            self.detector = ForwardDetector(self.models)
        self.fallbacks: dict[str, Fp32Fallback] = {}
        self._last: weakref.WeakKeyDictionary[Any, OverflowReport] = \
            weakref.WeakKeyDictionary()
        self._skipped: OverflowReport | None = None
        self.numerics: NumericsMonitor | None = None
        try:
            for name in keep_fp32:
                self.apply_fallback(name, why="keep_fp32")
            if numerics == "report":
                from .numerics import NumericsMonitor

                self.numerics = NumericsMonitor(
                    self.models, dtype, numerics_every, numerics_shadow_every, loss_scale,
                    **({} if call is None else {"call": call}))
        except BaseException:
            self.remove()
            raise

    @classmethod
    def attach(cls, models: Sequence[nn.Module], optimizers: Sequence[Any], props: Any,
               loss_scale: Callable[[], float] | None = None) -> OverflowWatch:
        """The watch of a session that just initialized `models` and `optimizers`.

        Args:
            models: The models.
            optimizers: Their optimizers (their ampx states hold the O2 master maps).
            props: The session's ``ampx.Properties`` (``on_overflow``, ``overflow_patience``,
                ``detect_overflow``, ``patch_torch_functions``, ``numerics*``, ``keep_fp32``).
            loss_scale: Reads loss 0's current scale (the numerics monitor's).
        """
        from ..scaling.protocol import amp_state_of

        states: list[Any] = [s for s in (amp_state_of(o) for o in optimizers) if s is not None]
        pairs: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
        for state in states:
            for half, master in state.masters.pairs():
                pairs.setdefault(id(half), (half, master))
        return cls(models, list(pairs.values()), on_overflow=props.on_overflow,
                   patience=props.overflow_patience, detect_overflow=props.detect_overflow,
                   casts_patched=bool(props.patch_torch_functions),
                   numerics=props.numerics, numerics_every=props.numerics_every,
                   numerics_shadow_every=props.numerics_shadow_every, dtype=props.dtype,
                   loss_scale=loss_scale, keep_fp32=props.keep_fp32,
                   call=_initialize_call(props))

    # -- per step ---------------------------------------------------------------------------
    def on_skip(self, optimizer: Any, passes: Iterable[Pass], *, step: int,
                loss_ids: Sequence[int], scalers: Sequence[Any],
                process_group: Any = None, distributed: bool = False) -> OverflowReport:
        """Build, log and act on the report of a skipped step (before grads are released).

        Each scaler of `loss_ids` logs its line with the provenance inserted
        (``scaler.report_overflow(where=...)`` returns ``(old, new)`` or None).

        Raises:
            OverflowPersistsError: ``on_overflow="raise"`` and the overflows persisted
                (the report is kept for ``last_overflow`` first).
        """
        from .flags import GradFlags

        flags = GradFlags(self.names)
        for loss_id, holders, tensor in passes:
            flags.record(loss_id, holders, tensor)
        forward = self.detector.first_nonfinite() if self.detector is not None else None
        attribute = True
        if self.numerics is not None:
            # the monitor names where the overflow started when it watched this step; a
            # skip it did not watch is not attributed (the next step is watched instead)
            # (and a watched skip with no forward overflow came from the gradients alone:
            # the scaler's business, no module's)
            watched = self.numerics.flush()  # the same on every rank: steps are counted alike
            origin = self.numerics.first_overflow() if watched else None
            if watched and distributed:
                origin = self.numerics.agree(origin, process_group)
            attribute = origin is not None
            if origin is not None:
                forward = (origin, "inf")
        report = flags.report(step=step, loss_ids=loss_ids, scales={}, forward=forward,
                              process_group=process_group, distributed=distributed)
        where = f" {report.where()}" if report.where() else ""
        scales: dict[int, tuple[float, float]] = {}
        for loss_id in sorted(set(loss_ids)):
            seen = scalers[loss_id].report_overflow(where=where)
            if seen is not None:
                scales[loss_id] = (float(seen[0]), float(seen[1]))
        report = dataclasses.replace(report, scales=scales)
        self._last[optimizer] = report
        self._skipped = report
        at_minimum = any(scalers[i].at_minimum() for i in scales)
        try:
            module = self.policy.observe_skip(report, at_minimum, attribute=attribute)
        except BaseException:
            # The raise ends the step (its telemetry and step_done never run): forget this
            # step's forward records now, or the next skip would name this step's module.
            self._skipped = None
            self.after_step()
            raise
        if module is not None:
            self.apply_fallback(module)
        return report

    def on_clean(self) -> None:
        """A step that was not skipped."""
        self.policy.observe_clean()

    def step_done(self) -> OverflowReport | None:
        """After every step: the report if it was skipped (for telemetry), else None.

        Resets the policy's consecutive-skip count on a clean step and clears the
        forward records (no host sync).
        """
        report = self._skipped
        if (report is None and self.numerics is None and self.detector is None
                and not self.fallbacks and not self.policy.consecutive):
            return None  # the usual clean step: nothing to reset, record or heal
        self._skipped = None
        if report is None:
            self.on_clean()
        if self.numerics is not None:
            self.numerics.step(skipped=report is not None)
        self.after_step()
        return report

    def after_step(self) -> None:
        """Every step's end: forget the forward records; heal interrupted fallbacks."""
        if self.detector is not None:
            self.detector.clear()
        for fallback in self.fallbacks.values():
            fallback.unwind()

    def last(self, optimizer: Any) -> OverflowReport | None:
        """The report of `optimizer`'s most recent skipped step, or None."""
        return self._last.get(optimizer)

    # -- fp32 fallback ----------------------------------------------------------------------
    def apply_fallback(self, name: str, why: str = "on_overflow='fp32-fallback'") -> None:
        """Run module `name` in float32 from now on (logged once).

        Raises:
            KeyError: When no initialized model has that module.
        """
        if name in self.fallbacks:
            return
        module = find_module(self.models, name)
        master_of = None if self.casts_patched else self._master
        with Journal().atomic() as journal:  # all of the fallback, or none of it
            if master_of is not None:
                float_buffers(module, journal)
            fallback = Fp32Fallback(module, disable_casts=self.casts_patched,
                                    cast_back=master_of is not None, master_of=master_of)
            journal.record(fallback.remove)
            journal.setitem(self.fallbacks, name, fallback)
        if name not in self.policy.fallback:
            self.policy.fallback.append(name)
        how = ("O1 casts disabled inside it" if master_of is None else
               f"{params_with_masters(module, master_of)} parameters computed from their fp32 "
               "masters")
        if why == "keep_fp32":
            logger.info("ampx: keep_fp32: %s runs in float32 (%s).", name, how)
            return
        monitor = getattr(self, "numerics", None)  # None while __init__ applies keep_fp32
        if monitor is not None:
            monitor.record_fallback(name, why)
        logger.warning(
            "ampx: %s: %s runs in float32 from now on (%s); "
            "it is recorded in ampx.state_dict() so a resumed run keeps it.", why, name, how)

    def _master(self, param: torch.Tensor) -> torch.Tensor | None:
        """An O2 half parameter's fp32 master (None: no master, or not a model parameter)."""
        pair = self._by_id.get(id(param))
        return pair[1] if pair is not None and pair[0] is param else None

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The policy's state (modules in fp32, counters)."""
        return self.policy.state_dict()

    def add_state(self, out: dict[str, Any]) -> None:
        """Put the policy state into a session state dict (not for ``"skip"``: apex-loadable)."""
        if self.policy.mode != "skip":
            out[STATE_KEY] = self.state_dict()

    def split_state(self, state_dict: Mapping[str, Any]
                    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """``(the other entries, checked policy state or None)``; nothing is applied.

        Raises:
            ValueError: For a malformed policy entry (see :meth:`check_state`).
        """
        rest = {k: v for k, v in state_dict.items() if k != STATE_KEY}
        if STATE_KEY not in state_dict:
            return rest, None
        return rest, self.check_state(state_dict[STATE_KEY])

    def check_state(self, state: Any, key: str = STATE_KEY) -> dict[str, Any]:
        """Validate a saved state against these models (nothing is applied).

        Raises:
            ValueError: Naming `key` and what is wrong (including unknown modules).
        """
        checked = OverflowPolicy.validate_state(state, key)
        for name in checked["fp32_modules"]:
            try:
                find_module(self.models, name)
            except KeyError:
                raise ValueError(f"{key}.fp32_modules: the models have no module {name!r}"
                                 ) from None
        return checked

    def load_checked(self, checked: Mapping[str, Any]) -> None:
        """Apply :meth:`check_state` output: re-create the fp32 fallbacks it lists."""
        self.policy.load_checked(checked)
        for name in checked["fp32_modules"]:
            self.apply_fallback(name)  # idempotent

    def remove_detector(self) -> None:
        """Take the forward detector's and the numerics monitor's hooks off the models
        (``restore``; a new session). A report already taken stays readable."""
        if self.detector is not None:
            self.detector.remove()
            self.detector = None
        if self.numerics is not None:
            self.numerics.remove()  # for good: it never arms again

    def remove(self) -> None:
        """Take the detector's, the monitor's and the fallbacks' hooks away (the session ends)."""
        if self.detector is not None:
            self.detector.remove()
        monitor = getattr(self, "numerics", None)
        if monitor is not None:
            monitor.remove()
        for fallback in self.fallbacks.values():
            fallback.remove()
        self.fallbacks.clear()

