"""Compensated half weights (``compensation="kahan"`` at O3): half-precision weights at
(nearly) float32 accuracy, for the optimizer the user already has.

Each half parameter ``w`` gets a compensation ``c`` of the same dtype, kept in the optimizer's
own state (``optimizer.state[p]["compensation"]``, so ``optimizer.state_dict()`` carries it):
together they hold ``x = float32(w) + float32(c)``, and every step updates ``x`` in float32
and writes ``w = half(x)``, ``c = half(x - float32(w))`` back (``ampx._reference_compensated``
has the exact math). At initialize ``c`` is the residual of the float32 weight the model had
before the cast (zeros for a model already in half); a weight written between initialize and
the first step (DDP's broadcast from rank 0, a ``load_state_dict``) gets ``c = 0`` then, so
every rank holds the same pair (as O2's masters follow the broadcast).

Two paths, chosen per step, both behind ampx's step hooks (``ampx.scaling.stepping`` calls
`before_step` from its pre-hook and `after_step` from its post-hook):

- fused: exactly ``torch.optim.SGD``, ``Adam`` and ``AdamW`` (for-loop, foreach or fused
  flags; not ``amsgrad``, ``capturable`` or ``differentiable``) whose parameters are all
  contiguous half tensors. The optimizer's own ``step`` runs on a stand-in without parameters
  (it still evaluates a closure); ampx's post-hook then runs the compensated kernels
  (``compensated_sgd_`` / ``compensated_adam_``, one call per group, device and dtype) and
  keeps torch's state format (``step`` tensor, ``exp_avg``, ``exp_avg_sq``,
  ``momentum_buffer`` in the parameter's dtype), reading ``lr`` from ``param_groups`` each
  step (LR schedulers work). No float32 weight is ever made.
- general: every other optimizer. The optimizer's own ``step`` runs on a copy of it whose
  parameters are float32 tensors ``x`` (with float32 gradients and float32 copies of the
  half state); the post-hook rounds them back into ``(w, c)`` and the state's floating
  tensors (but ``step``) into the parameter's dtype, as torch's ``load_state_dict`` casts
  them (so a resumed run is the same run). A closure (LBFGS's line
  search) is wrapped: each call runs the half model at ``half(x)`` (the parameters' data
  swapped for the call, the weights themselves untouched) and hands its gradients to ``x``.

Transactions: nothing real is written before the post-hook, so an exception or interrupt in
the closure, in the optimizer's own step or in a hook leaves weights, compensations and state
as they were. The post-hook prepares everything (new state, checks) before its first write;
its writes roll forward (an interrupt there finishes them, then is re-raised).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .. import _ext, _reference

__all__ = ["KEY", "after_step", "before_step", "fused_path", "install", "originals"]

logger = logging.getLogger("ampx")

KEY = "compensation"  # the entry of optimizer.state[p]
_HALF = (torch.float16, torch.bfloat16)
_F32 = torch.float32

# optimizer -> the work its post-hook commits; parameters written since initialize are
# watched until the first step (optimizer -> {id(param): (param, version)})
_PENDING: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = weakref.WeakKeyDictionary()
_WATCH: weakref.WeakKeyDictionary[torch.optim.Optimizer, dict[int, tuple[torch.Tensor, int]]] = \
    weakref.WeakKeyDictionary()


def _kernels() -> Any:
    """The module with ``compensated_sgd_`` / ``compensated_adam_`` (``ampx._ext``: native,
    or the reference under AMPX_DISABLE_EXT=1); tests replace it to inject faults."""
    return _ext


def _params(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


# -- initialize ---------------------------------------------------------------------------------

def originals(models: Iterable[torch.nn.Module]) -> dict[int, torch.Tensor]:
    """Before the cast: each float32 parameter's value (an alias; the cast replaces the data)."""
    return {id(p): p.detach() for model in models for p in model.parameters()
            if p.dtype == _F32}


def install(optimizer: torch.optim.Optimizer, before: dict[int, torch.Tensor],
            handles: list[Any]) -> None:
    """After the cast: a compensation for each half parameter, in the optimizer's state.

    Called inside initialize's transaction (its snapshot of the optimizer's state undoes this).
    The removable load hook goes into ``handles`` (the optimizer state's, removed at detach).
    """
    watch = {}
    for p in _params(optimizer):
        if p.dtype not in _HALF:
            continue
        x32 = before.get(id(p))
        with torch.no_grad():
            if x32 is not None and x32.shape == p.shape:
                comp = torch.sub(x32, p.detach().to(_F32)).to(p.dtype)
            else:
                comp = torch.zeros_like(p, memory_format=torch.contiguous_format)
        optimizer.state[p][KEY] = comp
        watch[id(p)] = (p, p._version)
    _WATCH[optimizer] = watch
    handles.append(optimizer.register_load_state_dict_post_hook(_loaded))


def _loaded(optimizer: torch.optim.Optimizer) -> None:
    """A loaded state brings its own compensations: stop watching the weights."""
    _WATCH.pop(optimizer, None)


def _follow(optimizer: torch.optim.Optimizer) -> None:
    """First step: weights written since initialize (DDP's broadcast, a load) get c = 0."""
    watch = _WATCH.pop(optimizer, None)
    for p, version in (watch or {}).values():
        comp = optimizer.state.get(p, {}).get(KEY)
        if p._version != version and comp is not None:
            comp.zero_()


def _comp(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor | None:
    state = optimizer.state.get(p)
    return None if state is None else state.get(KEY)


# -- the step -----------------------------------------------------------------------------------

def before_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict,
                standin: Callable[[torch.optim.Optimizer], torch.optim.Optimizer]
                ) -> tuple[tuple, dict]:
    """The pre-hook's part (a step that is not skipped): what the optimizer's own step gets.

    Args:
        optimizer: The real optimizer.
        args, kwargs: The step's arguments (``args[0]`` is the optimizer).
        standin: ``stepping._standin`` (a copy without parameters).
    """
    _PENDING.pop(optimizer, None)
    if _WATCH.get(optimizer) is not None:
        _follow(optimizer)
    if fused_path(optimizer):
        _PENDING[optimizer] = _fused_commit
        return (standin(optimizer), *args[1:]), kwargs
    work = _General(optimizer)
    _PENDING[optimizer] = work.commit
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    if closure is not None:
        wrapped = work.wrap(closure)
        if len(args) > 1:
            return (work.shell, wrapped, *args[2:]), kwargs
        return (work.shell,), dict(kwargs, closure=wrapped)
    return (work.shell, *args[1:]), kwargs


def after_step(optimizer: torch.optim.Optimizer) -> None:
    """The post-hook's part: commit what `before_step` prepared (nothing after a skip)."""
    commit = _PENDING.pop(optimizer, None)
    if commit is not None:
        commit(optimizer)


_FUSED_TYPES = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def fused_path(optimizer: torch.optim.Optimizer) -> bool:
    """Whether this optimizer steps on the compensated kernels (else the general path)."""
    if type(optimizer) not in _FUSED_TYPES:
        return False
    for group in optimizer.param_groups:
        if group.get("differentiable") or group.get("amsgrad") or group.get("capturable"):
            return False
        for p in group["params"]:
            if p.dtype not in _HALF or not p.is_contiguous() or _comp(optimizer, p) is None:
                return False
    return True


def _fused_commit(optimizer: torch.optim.Optimizer) -> None:
    """Run the compensated kernels on every parameter with a gradient (torch's state format)."""
    calls: list[Callable[[Any], None]] = []
    fresh: list[tuple[dict, str, torch.Tensor]] = []  # new state, inserted at the first write
    bumps: list[torch.Tensor] = []
    sgd = isinstance(optimizer, torch.optim.SGD)
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        if any(p.grad.is_sparse for p in params):
            raise RuntimeError(f"{type(optimizer).__name__}.step: compensated half weights "
                               "take dense gradients only.")
        prepare = _prepare_sgd if sgd else _prepare_adam
        prepare(optimizer, group, params, calls, fresh, bumps)
    kernels = _kernels()
    for state, key, value in fresh:  # from here on: roll forward
        state[key] = value
    done = 0
    try:
        for bump in bumps:
            bump.add_(1)
        for call in calls:
            call(kernels)
            done += 1
    except BaseException as exc:
        # a kernel that raised wrote nothing (it checks first): redo it on the reference;
        # an interrupt lands between two calls (a native call is not interrupted)
        logger.error("ampx: a compensated step was interrupted; finishing it")
        for call in calls[done + (0 if isinstance(exc, Exception) else 1):]:
            call(_reference)
        raise


def _split(params: list[torch.Tensor], key: list[Any], *lists: list[Any]
           ) -> dict[Any, list[list[Any]]]:
    """(params, *lists) split into one set of lists per (device, dtype, key[i]): a call each."""
    out: dict[Any, list[list[Any]]] = {}
    for i, p in enumerate(params):
        columns = out.setdefault((p.device, p.dtype, key[i]), [[] for _ in range(1 + len(lists))])
        for column, items in zip(columns, (params, *lists)):
            column.append(items[i])
    return out


def _grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    grads: list[torch.Tensor] = [p.grad for p in params]  # type: ignore[misc]
    return [g if g.is_contiguous() else g.contiguous() for g in grads]


def _prepare_sgd(optimizer: torch.optim.Optimizer, group: dict, params: list[torch.Tensor],
                 calls: list, fresh: list, bumps: list) -> None:
    momentum = float(group["momentum"])
    comps = [_comp(optimizer, p) for p in params]
    grads = _grads(params)
    bufs: list[torch.Tensor | None] = []
    first: list[bool] = []
    for p in params:
        buf = optimizer.state[p].get("momentum_buffer") if momentum else None
        if momentum and buf is None:  # torch's first step clones the gradient: any buffer
            buf = torch.empty_like(p, memory_format=torch.contiguous_format)
            fresh.append((optimizer.state[p], "momentum_buffer", buf))
        bufs.append(buf)
        first.append(momentum != 0 and optimizer.state[p].get("momentum_buffer") is None)
    hyper = dict(lr=float(group["lr"]), weight_decay=float(group["weight_decay"]),
                 momentum=momentum, dampening=float(group["dampening"]),
                 nesterov=bool(group["nesterov"]), maximize=bool(group["maximize"]))
    for (_, _, is_first), (ps, cs, gs, bs) in _split(params, first, comps, grads, bufs).items():
        calls.append(functools.partial(_sgd_call, (ps, cs, gs, bs if momentum else []),
                                       dict(hyper, first=is_first)))


def _prepare_adam(optimizer: torch.optim.Optimizer, group: dict, params: list[torch.Tensor],
                  calls: list, fresh: list, bumps: list) -> None:
    from torch.optim.optimizer import _get_scalar_dtype

    comps = [_comp(optimizer, p) for p in params]
    grads = _grads(params)
    m, v, steps = [], [], []
    fused = bool(group.get("fused"))
    for p in params:
        state = optimizer.state[p]
        if "step" not in state:
            step = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=p.device)
                    if fused else torch.tensor(0.0, dtype=_get_scalar_dtype()))
            for key, value in (("step", step), ("exp_avg", torch.zeros_like(p)),
                               ("exp_avg_sq", torch.zeros_like(p))):
                fresh.append((state, key, value))
            m.append(fresh[-2][2])
            v.append(fresh[-1][2])
            steps.append(1.0)
            bumps.append(step)
        else:
            m.append(state["exp_avg"])
            v.append(state["exp_avg_sq"])
            steps.append(float(state["step"]) + 1.0)
            bumps.append(state["step"])
    beta1, beta2 = (float(b) for b in group["betas"])
    lr = float(group["lr"])
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=float(group["eps"]),
                 weight_decay=float(group["weight_decay"]),
                 decoupled=bool(group.get("decoupled_weight_decay")) or
                 isinstance(optimizer, torch.optim.AdamW),
                 maximize=bool(group["maximize"]))
    for (_, _, t), lists in _split(params, steps, comps, grads, m, v).items():
        # the bias corrections in double, as torch's for-loop Adam computes them
        corrections = dict(step_size=lr / (1 - beta1 ** t), bias2_sqrt=(1 - beta2 ** t) ** 0.5)
        calls.append(functools.partial(_adam_call, lists, dict(hyper, **corrections)))


def _sgd_call(lists: tuple, hyper: dict[str, Any], kernels: Any) -> None:
    kernels.compensated_sgd_(*lists, **hyper)


def _adam_call(lists: list, hyper: dict[str, Any], kernels: Any) -> None:
    kernels.compensated_adam_(*lists, **hyper)


class _General:
    """The general path: the optimizer's own step on float32 copies, rounded back after."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (param, float32 proxy)
        proxy_of: dict[int, torch.Tensor] = {}
        shell = object.__new__(type(optimizer))  # no __init__: nothing runs
        vars(shell).update(vars(optimizer))
        groups = []
        for group in optimizer.param_groups:
            proxies = []
            for p in group["params"]:
                proxy = proxy_of.get(id(p))
                if proxy is None:
                    proxy = proxy_of[id(p)] = self._proxy(optimizer, p)
                    self.pairs.append((p, proxy))
                proxies.append(proxy)
            groups.append(dict(group, params=proxies))
        shell.param_groups = groups
        for name, value in vars(optimizer).items():  # a cached parameter list (LBFGS's)
            for group, new in zip(optimizer.param_groups, groups):
                if value is group["params"]:
                    setattr(shell, name, new["params"])
        state: defaultdict[Any, Any] = defaultdict(dict)
        for key, entry in optimizer.state.items():
            state[proxy_of.get(id(key), key)] = {
                name: _copied(value, _F32 if name != "step" else None)
                for name, value in entry.items() if name != KEY}
        shell.state = state
        self.shell = shell

    @staticmethod
    def _proxy(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            comp = _comp(optimizer, p)
            x = p.detach().to(_F32)
            x = torch.add(x, comp.to(_F32)) if comp is not None else x.clone()
        proxy = x.requires_grad_(p.requires_grad)
        if p.grad is not None:
            proxy.grad = p.grad.detach().to(_F32)
        return proxy

    def wrap(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """The closure the copy's step calls: the half model at half(x), gradients to x."""
        pairs = self.pairs

        def evaluate() -> Any:
            saved = [(p, p.data) for p, _ in pairs]
            try:
                with torch.no_grad():
                    for p, proxy in pairs:
                        p.data = proxy.detach().to(p.dtype)
                result = closure()
            finally:
                for p, data in saved:
                    p.data = data
            for p, proxy in pairs:
                proxy.grad = None if p.grad is None else p.grad.detach().to(_F32)
            return result

        return evaluate

    def commit(self, optimizer: torch.optim.Optimizer) -> None:
        """Round the stepped copies back into (w, c) and the state into its dtypes."""
        by_proxy = {id(proxy): p for p, proxy in self.pairs}
        writes = []
        with torch.no_grad():
            for p, proxy in self.pairs:
                x = proxy.detach()
                w = x.to(p.dtype)
                c = torch.sub(x, w.to(_F32)).to(p.dtype) if p.dtype in _HALF else None
                writes.append((p, w, _comp(optimizer, p), c))
        entries = {}
        for key, entry in self.shell.state.items():
            real = by_proxy.get(id(key), key)
            half = real.dtype if isinstance(real, torch.Tensor) and real.dtype in _HALF else None
            # as torch's load_state_dict casts state: floating tensors but `step` in the
            # parameter's dtype (so a resumed run is the same run)
            new = {name: _copied(value, half if name != "step" else None, clone=False)
                   for name, value in entry.items()}
            comp = _comp(optimizer, real) if isinstance(real, torch.Tensor) else None
            if comp is not None:
                new[KEY] = comp
            entries[real] = new
        for p, _, comp, c in writes:  # a half parameter without one (added later) gets it
            if c is not None and comp is None:
                entries.setdefault(p, {})[KEY] = c
        done = 0
        try:
            with torch.no_grad():
                for p, w, comp, c in writes:
                    p.copy_(w)
                    if comp is not None and c is not None:
                        comp.copy_(c)
                    done += 1
            for key, entry in entries.items():
                optimizer.state[key] = entry
        except BaseException:
            logger.error("ampx: a compensated step was interrupted; finishing it")
            with torch.no_grad():
                for p, w, comp, c in writes[done:]:
                    p.copy_(w)
                    if comp is not None and c is not None:
                        comp.copy_(c)
            for key, entry in entries.items():
                optimizer.state[key] = entry
            raise


def _copied(value: Any, dtype: torch.dtype | None, clone: bool = True) -> Any:
    """An optimizer-state value (tensors, lists of them) with its half floating tensors in
    `dtype` (None: kept), copied where the step could change it in place (`clone`)."""
    if isinstance(value, torch.Tensor):
        if dtype is not None and value.is_floating_point() and value.dtype != dtype and (
                dtype == _F32) == (value.dtype in _HALF):
            return value.detach().to(dtype)
        return value.detach().clone() if clone else value
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v, dtype, clone) for v in value)
    if isinstance(value, dict):
        return {k: _copied(v, dtype, clone) for k, v in value.items()}
    return value


# -- memory -------------------------------------------------------------------------------------

MODES = ("O0", "O1", "O2", "O3", "O3+kahan")
STATE_TENSORS = {"sgd-momentum": 1, "adamw": 2}  # optimizer state tensors per parameter
COLUMNS = ("weights", "grads", "masters", "compensation", "optimizer state")


def bytes_per_param(mode: str, optimizer: str) -> dict[str, int]:
    """What one parameter holds at a step (bf16/fp16 runs; the rules, not a measurement).

    O0/O1: float32 weights and gradients. O2: half weights, float32 masters, and the
    masters' float32 gradients (the half gradients are released when they are unscaled),
    float32 state. O3: all half. O3+kahan: O3 and a half compensation. Scalars (Adam's
    ``step``) are left out.

    >>> sum(bytes_per_param("O3+kahan", "adamw").values())
    10
    """
    states = STATE_TENSORS[optimizer]
    if mode in ("O0", "O1"):
        sizes = (4, 4, 0, 0, 4 * states)
    elif mode == "O2":
        sizes = (2, 4, 4, 0, 4 * states)
    elif mode in ("O3", "O3+kahan"):
        sizes = (2, 2, 0, 2 if mode == "O3+kahan" else 0, 2 * states)
    else:
        raise ValueError(f"bytes_per_param: mode {mode!r} is not one of {MODES}")
    return dict(zip(COLUMNS, sizes))


def memory_rows() -> list[list[str]]:
    """The bytes-per-parameter table (header first) of docs/opt-levels.md and `ampx info`."""
    rows = [["mode", *COLUMNS[:4], "SGD-momentum state", "AdamW state", "total SGD-m",
             "total AdamW"]]
    for mode in MODES:
        sgd, adamw = bytes_per_param(mode, "sgd-momentum"), bytes_per_param(mode, "adamw")
        rows.append([mode, *(str(sgd[c]) for c in COLUMNS[:4]), str(sgd[COLUMNS[4]]),
                     str(adamw[COLUMNS[4]]), str(sum(sgd.values())), str(sum(adamw.values()))])
    return rows
