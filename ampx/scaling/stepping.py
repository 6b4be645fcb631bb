"""How an initialized optimizer's own `step` and `zero_grad` reach the protocol.

ampx never replaces `step`: it acts through torch's optimizer step hooks, so the optimizer
keeps its identity and class and LR schedulers (created before or after initialize) keep
counting steps.

- The pre-hook asks the state (`OptimizerAmpState.decide_step`) whether this step is skipped.
  A skipped step runs the optimizer's own `step` function on a stand-in: a shallow copy of the
  optimizer whose parameter groups hold no parameters and whose state is a copy
  (`_standin`). Nothing the step does reaches the real optimizer, its parameters or its state,
  whatever the optimizer does first (decoupled weight decay, custom optimizers that don't
  check `p.grad is None`, global counters); if that step raises, nothing changed either.
  Chosen over emptying the real groups for the step (which a raising step leaves emptied,
  and which optimizers that cached their parameter list, like LBFGS, ignore) and over an
  instance-level `step` wrapper (which LR schedulers created before initialize would not
  see). Fused torch optimizers that take the device flag (`_step_supports_amp_scaling`)
  receive it as `optimizer.found_inf` (as `torch.amp.GradScaler` hands it) and skip inside
  their kernel, so their steps never sync with the host.
- `step(closure)`: the optimizer's own step (or the stand-in's) receives a closure whose every
  call runs the user's closure for real, with O1's casts as outside the step, as a checked pass
  after which the decision is updated (`ampx.scaling.closures`): SAM-style optimizers, which
  call it after perturbing the weights, get the gradient at the perturbed point.
- A step reached again from inside a running one (SAM's `super().step()` when the base class's
  `step` is hooked too) is part of it: its hooks pass it through; so do `zero_grad` and
  `scale_loss` called inside the step (the decision's `running`).
- The post-hook commits the step (`after_step`): the O2 master -> model copy and counters.
- Between the two hooks O1's casts are off in the stepping thread only (`regions.start_step`:
  the per-thread flag that `disable_casts()` sets, which every wrapper reads), except inside
  the step's closure calls; other threads keep casting, and nothing about O1's patches
  changes. A step that never reaches its post-hook (it raised) turns the flag back by itself
  as soon as the step's frame is gone.
- `zero_grad` gets a small instance-level handler (the class's method is untouched): it runs
  the optimizer's own `zero_grad`, then `OptimizerAmpState.zero_grad` (at O2 the half model
  gradients and a pending delay_unscale accumulation are released, as apex's O2 zero_grad did).
"""

from __future__ import annotations

import sys
import weakref
from collections import OrderedDict, defaultdict
from typing import Any

import torch

from ..o1 import regions
from . import closures
from .masters import MasterMap
from .protocol import ATTR, OptimizerAmpState, SessionHooks, Stage, amp_state_of

__all__ = ["attach", "check_optimizers", "detach"]

_FUSED_ATTRS = ("grad_scale", "found_inf")


def check_optimizers(optimizers: Any) -> tuple[list[torch.optim.Optimizer], bool]:
    """Normalise `optimizers` to a list; returns (optimizers, was_list).

    Raises:
        TypeError: For anything but an optimizer, a list of them, or None.
        RuntimeError: For an optimizer already passed through initialize (apex's message).
    """
    if optimizers is None:
        return [], False
    if isinstance(optimizers, torch.optim.Optimizer):
        out, was_list = [optimizers], False
    elif isinstance(optimizers, list) and all(
        isinstance(o, torch.optim.Optimizer) for o in optimizers
    ):
        out, was_list = list(optimizers), True
    else:
        raise TypeError(
            "optimizers must be either a single optimizer or a list of optimizers. "
            f"ampx.initialize got {type(optimizers).__name__}."
        )
    if len({id(o) for o in out}) != len(out):
        raise RuntimeError("ampx.initialize: the same optimizer appears twice in the list.")
    for opt in out:
        if amp_state_of(opt) is not None:
            raise RuntimeError(
                "A given optimizer should only be passed through amp.initialize once."
            )
    return out, was_list


def _zero_grad_handler(optimizer: torch.optim.Optimizer, original: Any) -> Any:
    """The instance-level `zero_grad`: the optimizer's own, then the protocol's.

    A plain function (a class with `__call__` costs a slot lookup per call); `original` is
    the instance attribute it replaced, or None.
    """
    ref = weakref.ref(optimizer)

    def zero_grad(set_to_none: bool = True) -> None:
        regions.drop_ended_steps()  # a step of this thread that raised
        optimizer = ref()
        if optimizer is None:
            return
        if original is not None:
            original(set_to_none)
        else:
            type(optimizer).zero_grad(optimizer, set_to_none)
        state = vars(optimizer).get(ATTR)
        if state is not None:
            state.zero_grad(optimizer)

    return zero_grad


class _Detach:
    """A removable handle that puts the optimizer's `zero_grad` back."""

    def __init__(self, optimizer: torch.optim.Optimizer, handler: Any, original: Any) -> None:
        self._ref = weakref.ref(optimizer)
        self._handler = handler
        self._original = original  # the instance attribute the handler replaced, or None

    def remove(self) -> None:
        optimizer = self._ref()
        if optimizer is None or vars(optimizer).get("zero_grad") is not self._handler:
            return
        if self._original is not None:
            optimizer.zero_grad = self._original  # type: ignore[method-assign]
        else:
            del optimizer.zero_grad


def attach(optimizer: torch.optim.Optimizer, owner: object, masters: MasterMap,
           session_hooks: SessionHooks) -> OptimizerAmpState:
    """Give `optimizer` its ampx state, step hooks and zero_grad handler.

    Args:
        optimizer: The optimizer (kept as is: same object, same class).
        owner: The session, stored opaquely (its module functions find it there).
        masters: The O2 model-parameter -> master map.
        session_hooks: What the session decided (skip policy, callbacks).
    """
    state = OptimizerAmpState(owner=owner, policy=session_hooks, masters=masters)
    state._groups_seen = len(optimizer.param_groups)
    original = vars(optimizer).get("zero_grad")
    handler = _zero_grad_handler(optimizer, original)
    state.handles.append(optimizer.register_step_pre_hook(_step_pre_hook))
    post = optimizer.register_step_post_hook(_step_post_hook)
    # ampx's post hook runs first: a user's post hook that raises (registered before
    # initialize) must not leave the half model behind its freshly stepped masters.
    hooks = optimizer._optimizer_step_post_hooks
    if isinstance(hooks, OrderedDict):  # torch keeps an OrderedDict
        hooks.move_to_end(post.id, last=False)
    state.handles.append(post)
    optimizer.zero_grad = handler  # type: ignore[method-assign]
    state.handles.append(_Detach(optimizer, handler, original))
    setattr(optimizer, ATTR, state)
    return state


def detach(optimizer: torch.optim.Optimizer) -> None:
    """Undo `attach` (initialize failed half-way; also used by tests)."""
    state = amp_state_of(optimizer)
    if state is not None:
        state.detach()
        delattr(optimizer, ATTR)


def _standin(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A shallow copy of `optimizer` with no parameters and copied state (for skipped steps)."""
    shell = object.__new__(type(optimizer))  # no __init__/__setstate__: nothing runs
    vars(shell).update(vars(optimizer))
    shell.param_groups = [dict(group, params=[]) for group in optimizer.param_groups]
    shell.state = defaultdict(dict, {k: dict(v) if isinstance(v, dict) else v
                                     for k, v in optimizer.state.items()})
    # A wrapper's inner optimizer (LARC's `optim`, apex's FP16_Optimizer's `optimizer`) is
    # stepped by the wrapper's step: it gets a stand-in too, or the skipped step reaches it.
    for name, value in vars(optimizer).items():
        if isinstance(value, torch.optim.Optimizer) and value is not optimizer:
            setattr(shell, name, _standin(value))
    return shell


def _step_pre_hook(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
    regions.drop_ended_steps()  # an earlier step of this thread that raised
    attrs = vars(optimizer)
    state = attrs.get(ATTR)
    if state is None:
        return None
    running = state._decision
    if running is not None and running.running():
        return None  # a nested step (SAM's `super().step()` of a hooked class): part of it
    if "found_inf" in attrs or "grad_scale" in attrs:  # left over from a fused step that raised
        for name in _FUSED_ATTRS:
            attrs.pop(name, None)
    closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0] is the optimizer
    if closure is not None and state.stage not in (Stage.SCALING, Stage.SCALED):
        closures.check(optimizer, state)  # (decide_step refuses those stages)
    decision = state.decide_step(optimizer, closure)
    frame = decision.frame = sys._getframe(1)  # torch's step wrapper, which runs the hooks
    result = None
    if closure is not None:  # the optimizer's calls run it for real (`closures`)
        live = closures.LiveClosure(closure, optimizer, state, decision, state.policy.scales)
        result = _with_closure(args, kwargs, live)
    if decision.skip:
        args, kwargs = result or (args, kwargs)
        result = (_standin(optimizer), *args[1:]), kwargs
    elif state.policy.compensation:  # O3 compensated half weights (ampx.scaling.compensated)
        args, kwargs = result or (args, kwargs)  # the live closure, when there is one
        from . import compensated  # loaded only by sessions that use it

        result = compensated.before_step(optimizer, args, kwargs, _standin)
    elif decision.flag is not None:
        optimizer.grad_scale = None  # type: ignore[attr-defined]  # already unscaled
        optimizer.found_inf = decision.flag.reshape(())  # type: ignore[attr-defined]
    # Last, so that nothing can raise after it in this hook (a skipped step's stand-in runs
    # casts-off too; the closure's calls cast again).
    regions.start_step(frame, id(optimizer))
    return result


def _with_closure(args: tuple, kwargs: dict, closure: Any) -> tuple[tuple, dict]:
    """`step`'s (args, kwargs) with the closure argument replaced."""
    if len(args) > 1:
        return (args[0], closure, *args[2:]), kwargs
    return args, dict(kwargs, closure=closure)


def _step_post_hook(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    frame = sys._getframe(1)  # torch's step wrapper
    try:
        attrs = vars(optimizer)
        state = attrs.get(ATTR)
        if state is None:
            return
        decision = state._decision
        if decision is not None and decision.frame is not frame:
            return  # a nested step's (the pre-hook let it through): the outer one commits
        if "found_inf" in attrs or "grad_scale" in attrs:
            for name in _FUSED_ATTRS:
                attrs.pop(name, None)
        if state.policy.compensation:
            from . import compensated

            compensated.after_step(optimizer)
        state.after_step(optimizer)
    finally:
        regions.end_step(frame, id(optimizer))
