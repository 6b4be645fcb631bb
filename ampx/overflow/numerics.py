"""The numerics monitor: how close each module's activations and gradients are to the edge.

:class:`NumericsMonitor` watches a sample of steps (every ``every``-th step, and the step after
a skipped one). On a watched step it puts hooks on the models' modules for one forward and
backward: each module's floating outputs, the gradient arriving at those outputs (at the
current loss scale) and its own parameters' gradients are reduced on the device to a few
numbers (max |x|, how many elements overflow the half dtype, how many fall below its smallest
normal number, how many are zero, the smallest non-zero magnitude; for parameters' gradients
the counts only), by integer reductions over their bits (:mod:`.numerics_stats`). An output
is measured once: the module it feeds, and a parent returning it, reuse its numbers while it
is unchanged. Optionally, every ``shadow_every``-th watched step, a module is re-run in
float32 on its upcast inputs and the relative error of its half output is recorded; the
re-run leaves the run as it was (:func:`_shadow_scope`).
:meth:`NumericsMonitor.step` reads the step's numbers to the host at once (no sync per
tensor) and takes the hooks off; between watched steps no hook is installed, so the models
run exactly as without the monitor.

The ranking and the advice are in :mod:`ampx.overflow.numerics_report`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..o1.regions import disable_casts
from .numerics_stats import (
    PARTS,
    Format,
    decode,
    decode_flush,
    decode_max,
    measure,
    measure_flush,
    measure_max,
    tensor_stats,
)
from .report import ROOT_MODULE

__all__ = ["ModuleSample", "NumericsMonitor", "tensor_stats"]

# what a decoded row holds, in order
_MAX, _OVER, _UNDER, _ZERO, _MINNZ, _NUMEL = range(6)


def _float_tensors(value: Any) -> list[torch.Tensor]:
    """The non-empty floating tensors of a module output (one level into tuples and dicts)."""
    if isinstance(value, torch.Tensor):
        items: Sequence[Any] = (value,)
    elif isinstance(value, (tuple, list)):
        items = value
    elif isinstance(value, dict):
        items = list(value.values())
    else:
        return []
    return [t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point()
            and t.numel() and not t.is_sparse]


@dataclass
class ModuleSample:
    """One module's numbers on one watched step (all host floats; None: not seen)."""

    step: int
    forward: list[float] | None = None      # tensor_stats, outputs merged
    grad: list[float] | None = None         # the gradient arriving at its outputs
    params: list[float] | None = None       # its own parameters' gradients, merged (the
    #                                         counts only: max, overflow, min are NaN)
    inputs: float | None = None             # the largest |x| among its floating inputs
    shadow_error: float | None = None       # relative error of the half output vs fp32
    loss_scale: float = 1.0

    @staticmethod
    def merge(a: list[float] | None, b: list[float]) -> list[float]:
        """Fold two tensor_stats rows (max, sums, min)."""
        if a is None:
            return list(b)
        return [max(a[_MAX], b[_MAX]), a[_OVER] + b[_OVER], a[_UNDER] + b[_UNDER],
                a[_ZERO] + b[_ZERO], min(a[_MINNZ], b[_MINNZ]), a[_NUMEL] + b[_NUMEL]]


@dataclass
class _Seen:
    """A tensor measured on this watched step: a module output (a later module fed it, or a
    parent returning it, reuses its numbers) or an input measured for its max (the next
    module fed it reuses that), while it is unchanged."""

    ref: weakref.ref[torch.Tensor]
    version: int            # its _version when measured: an in-place change is a new tensor
    offset: int             # where its parts start in _Pending.parts (the max pattern first)
    reader: tuple[Format, int]
    grad_users: list[int] | None = None  # modules whose output it is (its gradient hook)


@dataclass
class _Pending:
    """A watched step's numbers, on the device until the step ends (then read at once).

    records: (module index, kind, offset into parts, how to read them): kind "inputs" reads
    one max pattern; "forward", "grad" and "params" read a measure() row.
    """

    parts: list[torch.Tensor | int] = field(default_factory=list)  # int: read already
    records: list[tuple[int, str, int, Any]] = field(default_factory=list)
    shadow: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    outputs: dict[int, _Seen] = field(default_factory=dict)  # by id(tensor)
    inputs: dict[int, _Seen] = field(default_factory=dict)   # measured for their max only
    # shadow steps: where the random generators stood when a module's first call began
    # (kind, devices, states), and the modules shadowed already (once a step each)
    rng: dict[int, tuple[str, list[int], Any]] = field(default_factory=dict)
    shadowed: set[int] = field(default_factory=set)

    def add(self, parts: Sequence[torch.Tensor | int]) -> int:
        self.parts.extend(parts)
        return len(self.parts) - len(parts)

    @staticmethod
    def seen(table: dict[int, _Seen], t: torch.Tensor) -> _Seen | None:
        """t's entry in `table` when t has not changed since it was measured."""
        seen = table.get(id(t))
        if seen is not None and seen.ref() is t and seen.version == t._version:
            return seen
        return None


def _rng_devices(module: nn.Module, args: Any, kwargs: Any) -> tuple[str, list[int]]:
    """The accelerator (type, indices) a module call draws random numbers on: those of its
    floating inputs and its first parameter (the CPU's generator is always included)."""
    found: dict[str, set[int]] = {}
    first = next(module.parameters(), None)
    for t in [*_float_tensors(tuple(args)), *_float_tensors(dict(kwargs or {})),
              *([first] if first is not None else [])]:
        if t.device.type not in ("cpu", "meta"):
            found.setdefault(t.device.type, set()).add(
                t.device.index if t.device.index is not None else 0)
    if not found:
        return "cuda", []
    kind, indices = next(iter(found.items()))
    return kind, sorted(indices)


def _rng_state(kind: str, devices: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    mod = torch.get_device_module(kind) if devices else None
    return torch.get_rng_state(), [mod.get_rng_state(i) for i in devices] if mod else []


@contextlib.contextmanager
def _shadow_scope(module: nn.Module, rng: tuple[str, list[int], Any] | None) -> Iterator[None]:
    """Where the fp32 shadow runs, so that it leaves the run as it was: no gradient, no casts,
    the random generators forked (set back afterwards) and set to where they stood when the
    module's forward began (`rng`: it replays the forward's draws, a dropout's mask included),
    and every hook of the module and its submodules (the user's, ampx's, global ones) off:
    each module is called straight through its ``forward``, as ``nn.Module`` does for a
    module with no hooks (``_compiled_call_impl`` is the seam ``Module.compile`` uses)."""
    kind, devices, state = rng if rng is not None else ("cuda", [], None)
    saved = [(m, m.__dict__.get("_compiled_call_impl")) for m in module.modules()]
    with torch.random.fork_rng(devices=devices, device_type=kind), torch.no_grad(), \
            disable_casts():
        if state is not None:
            torch.set_rng_state(state[0])
            for index, s in zip(devices, state[1]):
                torch.get_device_module(kind).set_rng_state(s, index)
        try:
            for m, _ in saved:
                m._compiled_call_impl = m.forward
            yield
        finally:
            for m, old in saved:
                m._compiled_call_impl = old


def _read(parts: list[Any]) -> list[Any]:
    """0-d tensors (and host numbers, kept) to host numbers. On the CPU, where a read waits
    for nothing, each directly (cheaper than stacking them); elsewhere in one copy per dtype
    (:func:`_read_stacked`)."""
    if all(not isinstance(p, torch.Tensor) or p.device.type == "cpu" for p in parts):
        return [p.item() if isinstance(p, torch.Tensor) else p for p in parts]
    return _read_stacked(parts)


def _read_stacked(parts: list[Any]) -> list[Any]:
    """0-d tensors to host numbers, one stack and copy per dtype (stacking mixed dtypes
    promotes each tensor: slower), on the first one's device; host numbers are kept."""
    values: list[Any] = list(parts)
    groups: dict[torch.dtype, list[int]] = {}
    device = next((p.device for p in parts if isinstance(p, torch.Tensor)), None)
    for i, p in enumerate(parts):
        if isinstance(p, torch.Tensor):
            groups.setdefault(p.dtype, []).append(i)
    for where in groups.values():
        read = torch.stack([parts[i].to(device) for i in where]).tolist()
        for i, v in zip(where, read):
            values[i] = v
    return values


class NumericsMonitor:
    """Samples every module's forward and backward numbers on watched steps.

    Args:
        models: The models to watch (every named module; ``(root)`` for a model itself).
        dtype: The session's half dtype (float16 or bfloat16): the range judged against.
        every: Watch one step in `every` (the first step is watched).
        shadow_every: Re-run each module in float32 on every `shadow_every`-th watched
            step and record its half output's relative error (0: never).
        loss_scale: Reads the loss scale the next backward will use (called when a step is
            armed, so only on watched steps: it may sync with the device). None: 1.0.
        call: The session's initialize call, unclosed, for the report's advice lines.

    Example::

        monitor = NumericsMonitor([model], torch.float16, every=100)
        for step in ...:
            ...  # forward, backward, optimizer.step()
            monitor.step(skipped=ampx.step_was_skipped(optimizer))
        print(monitor.report().table())
    """

    def __init__(self, models: Sequence[nn.Module], dtype: torch.dtype, every: int = 100,
                 shadow_every: int = 10, loss_scale: Callable[[], float] | None = None,
                 call: str = 'ampx.initialize(model, optimizer, opt_level="O1"') -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"NumericsMonitor: dtype must be float16 or bfloat16; got {dtype}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"NumericsMonitor: every must be an int >= 1; got {every!r}")
        if isinstance(shadow_every, bool) or not isinstance(shadow_every, int) \
                or shadow_every < 0:
            raise ValueError(f"NumericsMonitor: shadow_every must be an int >= 0; "
                             f"got {shadow_every!r}")
        self.dtype = dtype
        info = torch.finfo(dtype)
        self.fmax, self.tiny = float(info.max), float(info.tiny)
        self.every = every
        self.shadow_every = shadow_every
        self._read_scale = loss_scale
        self.call = call
        self._scale = 1.0                   # the loss scale of the armed step
        self.models = list(models)
        self.names: list[str] = []
        self.modules: list[nn.Module] = []
        self.leaf: list[bool] = []
        for i, model in enumerate(self.models):
            prefix = f"model{i}." if len(self.models) > 1 else ""
            for name, module in model.named_modules():
                if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
                    continue  # containers: never called
                self.names.append(prefix + name if name else prefix + ROOT_MODULE)
                self.modules.append(module)
                self.leaf.append(next(module.children(), None) is None)
        self.samples: list[list[ModuleSample]] = [[] for _ in self.names]
        self.order: list[int] = []          # module indices in first-execution order
        self.steps = 0                      # steps seen
        self.watched = 0                    # watched steps so far
        self.fallbacks: list[tuple[str, int, str]] = []  # (module, step, why), by the policy
        self._handles: list[Any] = []
        self._pending: _Pending | None = None
        self._seen: set[int] = set()        # modules already in `order`
        self._param_hooked: set[int] = set()  # leaves whose params are hooked this step
        self._in_shadow = False
        self._closed = False
        self._arm()

    # -- arming -----------------------------------------------------------------------------
    @property
    def armed(self) -> bool:
        """Whether the current step is watched (hooks installed)."""
        return self._pending is not None

    def _arm(self) -> None:
        if self._pending is not None or self._closed:
            return
        self._scale = float(self._read_scale()) if self._read_scale is not None else 1.0
        self._pending = _Pending()
        shadow = self._shadow_now()
        try:
            for index, module in enumerate(self.modules):
                if shadow:
                    self._handles.append(module.register_forward_pre_hook(
                        self._rng_hook(index), with_kwargs=True))
                self._handles.append(module.register_forward_hook(
                    self._forward_hook(index), with_kwargs=True))
        except BaseException:
            self._disarm()
            raise

    def _disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._param_hooked.clear()
        self._pending = None

    def _shadow_now(self) -> bool:
        return self.shadow_every > 0 and self.watched % self.shadow_every == 0

    # -- hooks ------------------------------------------------------------------------------
    def _rng_hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            pending = self._pending
            if pending is None or index in pending.rng or not torch.is_grad_enabled():
                return
            kind, devices = _rng_devices(module, args, kwargs)
            pending.rng[index] = (kind, devices, _rng_state(kind, devices))
        return hook

    def _forward_hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            pending = self._pending
            if pending is None or self._in_shadow or not torch.is_grad_enabled():
                return
            outputs = _float_tensors(output)
            for t in outputs:
                seen = pending.seen(pending.outputs, t)
                if seen is None:  # a parent returning its last child's output: measured once
                    parts, f = measure(t, self.tiny)
                    seen = _Seen(weakref.ref(t), t._version, pending.add(parts),
                                 (f, t.numel()))
                    pending.outputs[id(t)] = seen
                pending.records.append((index, "forward", seen.offset, seen.reader))
                if t.requires_grad:
                    if seen.grad_users is None:  # one hook per tensor, for all its modules
                        seen.grad_users = []
                        t.register_hook(self._grad_hook(seen.grad_users))
                    seen.grad_users.append(index)
            # the largest input magnitude (a module fed values near the edge): an output (its
            # own, in place; an earlier module's) or an input fed to another module holds it
            for t in _float_tensors(tuple(args)):
                seen = pending.seen(pending.outputs, t) or pending.seen(pending.inputs, t)
                if seen is None:
                    top, f = measure_max(t, self.tiny)
                    seen = _Seen(weakref.ref(t), t._version, pending.add([top]), (f, 0))
                    pending.inputs[id(t)] = seen
                pending.records.append((index, "inputs", seen.offset, seen.reader[0]))
            if index not in self._param_hooked:
                self._param_hooked.add(index)
                for param in module.parameters(recurse=False):
                    # not a leaf: an O2 fp32 fallback's stand-in for this forward
                    if param.requires_grad and param.is_leaf:
                        self._handles.append(
                            param.register_post_accumulate_grad_hook(self._param_hook(index)))
            if outputs and self._shadow_now() and index not in pending.shadowed:
                pending.shadowed.add(index)
                self._shadow(index, module, args, kwargs, outputs[0])
        return hook

    def _measure(self, kind: str, indices: list[int], grad: torch.Tensor | None) -> None:
        pending = self._pending
        if pending is None or grad is None or grad.is_sparse:
            return
        # a parameter's row is read for its flushed share only: the counts suffice
        parts, f = (measure_flush if kind == "params" else measure)(grad, self.tiny)
        offset = pending.add(parts)
        for index in indices:
            pending.records.append((index, kind, offset, (f, grad.numel())))

    def _grad_hook(self, users: list[int]) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self._measure("grad", users, grad)
        return hook

    def _param_hook(self, index: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            self._measure("params", [index], param.grad)
        return hook

    def _shadow(self, index: int, module: nn.Module, args: Any, kwargs: Any,
                half_out: torch.Tensor) -> None:
        """Re-run `module` (and so its submodules) in float32 on its upcast inputs, once a
        watched step, in :func:`_shadow_scope`; record the relative error."""
        if half_out.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return
        pending = self._pending
        assert pending is not None
        # every parameter and buffer upcast into fresh tensors (BN statistics stay untouched)
        state = {k: v.detach().float().clone() if v.is_floating_point() else v.clone()
                 for k, v in {**dict(module.named_parameters()),
                              **dict(module.named_buffers())}.items()}
        def up(a: Any) -> Any:
            return a.detach().float() if isinstance(a, torch.Tensor) \
                and a.is_floating_point() else a
        inputs = tuple(up(a) for a in args)
        named = {k: up(v) for k, v in (kwargs or {}).items()}
        self._in_shadow = True
        try:
            with _shadow_scope(module, pending.rng.get(index)):
                ref = torch.func.functional_call(module, state, inputs, named)
        except Exception:  # a module that does not run on fp32 inputs: no shadow for it
            return
        finally:
            self._in_shadow = False
        refs = _float_tensors(ref)
        if not refs or refs[0].shape != half_out.shape:
            return
        r = refs[0].float()
        diff = (half_out.detach().float() - r).norm()
        pending.shadow.append((index, diff / r.norm().clamp_min(torch.finfo(torch.float32).tiny)))

    # -- per step ---------------------------------------------------------------------------
    def step(self, skipped: bool = False) -> None:
        """After every optimizer step: read a watched step's numbers (one host copy).

        Arms the next watched step: every `every` steps, and the step after a skipped one
        (so a skip is followed by a step whose numbers say where it started).
        """
        self.flush()
        self.steps += 1
        if skipped or self.steps % self.every == 0:
            self._arm()

    def flush(self) -> bool:
        """Read the armed step's numbers now and take its hooks off; False when not armed.

        The session calls it on a skipped step, before the step ends, to name the origin.
        """
        pending = self._pending
        if pending is None:
            return False
        self._disarm()
        self._collect(pending, self.steps, self._scale)
        self.watched += 1
        return True

    def _collect(self, pending: _Pending, step: int, loss_scale: float) -> None:
        if not pending.records and not pending.shadow:
            return
        values = _read(pending.parts)
        errors = _read([t for _, t in pending.shadow])
        by_module: dict[int, ModuleSample] = {}
        for index, kind, offset, reader in pending.records:
            sample = by_module.get(index)
            if sample is None:
                sample = by_module[index] = ModuleSample(step, loss_scale=loss_scale)
            if kind == "inputs":
                top = decode_max(values[offset], reader)
                sample.inputs = top if sample.inputs is None else max(sample.inputs, top)
                continue
            if kind == "params":
                row = decode_flush(values[offset:offset + 2], reader[1])
            else:
                row = decode(values[offset:offset + PARTS], *reader)
            setattr(sample, kind, ModuleSample.merge(getattr(sample, kind), row))
            if kind == "forward" and index not in self._seen:
                self._seen.add(index)
                self.order.append(index)
        for (index, _), err in zip(pending.shadow, errors):
            sample = by_module.setdefault(index, ModuleSample(step, loss_scale=loss_scale))
            sample.shadow_error = err if sample.shadow_error is None else max(
                sample.shadow_error, err)
        for index, sample in by_module.items():
            self.samples[index].append(sample)

    def first_overflow(self) -> str | None:
        """The first module, in execution order, whose output overflowed on the last watched step.

        Children run before their parent returns, so the first in execution order is where
        the overflow started; every later module only carries it on.
        """
        last = max((s[-1].step for s in self.samples if s), default=None)
        if last is None:
            return None
        for index in self.order:
            samples = self.samples[index]
            if samples and samples[-1].step == last and samples[-1].forward is not None \
                    and samples[-1].forward[_OVER] > 0:
                return self.names[index]
        return None

    def agree(self, origin: str | None, process_group: Any = None) -> str | None:
        """The origin every rank agrees on: the first, in execution order, that any rank saw.

        One MAX all-reduce of a flag per module (on a skipped watched step only), so that the
        fp32 fallback moves the same module on every rank even when one rank's data
        overflowed it.
        """
        import torch.distributed as dist

        device = next((p.device for m in self.models for p in m.parameters()),
                      torch.device("cpu"))
        if dist.get_backend(process_group) == "gloo":
            device = torch.device("cpu")
        flags = torch.zeros(len(self.names), device=device)
        if origin is not None:
            flags[self.names.index(origin)] = 1.0
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=process_group)
        seen = set(torch.nonzero(flags).flatten().tolist())
        order = self.order + [i for i in range(len(self.names)) if i not in self.order]
        return next((self.names[i] for i in order if i in seen), None)

    def record_fallback(self, module: str, why: str) -> None:
        """Note that the fp32 fallback moved `module` to float32 at this step (for the report)."""
        self.fallbacks.append((module, self.steps, why))

    def report(self) -> Any:
        """The :class:`~ampx.overflow.numerics_report.NumericsReport` of the steps so far."""
        from .numerics_report import NumericsReport

        return NumericsReport.from_monitor(self)

    def remove(self) -> None:
        """Take every hook off for good (the session ends, or ``restore``): it never arms
        again, so nothing of it acts on the models afterwards. The samples stay readable."""
        self._closed = True
        self._disarm()
