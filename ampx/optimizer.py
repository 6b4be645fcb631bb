"""Optimizer processing: master weights, gradient stashing, unscaling, skipped steps.

The optimizer handed to `initialize` is returned as the very same object, of the same class:
ampx never replaces `step`, `zero_grad` or `add_param_group`. Its per-optimizer state lives in
one attribute, `optimizer._ampx` (an `OptimizerAmpState`), and it acts through torch's own
optimizer step hooks:

- the pre-hook decides whether the step is skipped (one host sync per step, reading the
  overflow flag accumulated on the device) and, if so, hands the optimizer no gradients, so
  every optimizer kind (foreach, fused, custom) leaves parameters and state untouched;
- the post-hook copies O2 masters to the half model parameters and records telemetry.

LR schedulers created before or after `initialize` keep counting steps, because `step` is
still the optimizer's own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from . import _ext
from .model import MasterMap

if TYPE_CHECKING:
    from .frontend import Amp

__all__ = ["OptimizerAmpState", "amp_state_of", "master_params"]

logger = logging.getLogger("ampx")

_ATTR = "_ampx"
_APEX_ATTRS = ("_amp_stash", "_lazy_init_maybe_master_weights", "_master_params_to_model_params",
               "_prepare_amp_backward", "_post_amp_backward", "_amp_lazy_init")


@dataclass(eq=False)
class OptimizerAmpState:
    """Everything ampx keeps for one optimizer (held as `optimizer._ampx`).

    Attributes:
        session: The `Amp` session the optimizer was initialized with.
        masters: The O2 model-parameter -> fp32 master map (empty without master weights).
        found_inf: Device flag: a non-finite gradient was seen since the last step.
        pending: A `scale_loss` unscaled gradients since the last step.
        scaled_grads_pending: A `scale_loss(delay_unscale=True)` left scaled gradients.
        last_step_skipped: Whether the most recent `step()` was skipped.
        steps: `step()` calls so far.
        skipped_steps: Skipped `step()` calls so far.
    """

    session: Amp
    masters: MasterMap = field(default_factory=MasterMap)
    found_inf: torch.Tensor | None = None
    pending: bool = False
    scaled_grads_pending: bool = False
    last_step_skipped: bool = False
    steps: int = 0
    skipped_steps: int = 0
    loss_ids: set[int] = field(default_factory=set)
    last_loss: torch.Tensor | None = None
    stash: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    handles: list[Any] = field(default_factory=list)
    _step_started: float = 0.0
    _last_step_end: float = field(default_factory=time.perf_counter)
    _skip_now: bool = False
    _groups_seen: int = 0
    _cache: ParamCache | None = None

    def detach(self) -> None:
        """Remove the step hooks (used when initialize fails half-way and by tests)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def amp_state_of(optimizer: Any) -> OptimizerAmpState | None:
    """The ampx state of an optimizer, or None if it never went through initialize."""
    return getattr(optimizer, _ATTR, None)


@dataclass(eq=False)
class ParamCache:
    """The per-step views of one optimizer's parameters, rebuilt only when its groups change.

    Attributes:
        signature: What the cache was built from (group lists, lengths, end points).
        params: Every parameter of every group, in order.
        pairs: (half model parameter, fp32 master) for the masters this optimizer steps.
        models: The half model parameters of `pairs`.
        masters: The fp32 masters of `pairs`.
        others: The parameters that are not masters (the optimizer steps them directly).
        copy_groups: (masters, models) lists per device, for the master->model copy.
    """

    signature: tuple
    params: list[torch.Tensor]
    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    models: list[torch.Tensor]
    masters: list[torch.Tensor]
    others: list[torch.Tensor]
    copy_groups: list[tuple[list[torch.Tensor], list[torch.Tensor]]]


def _signature(optimizer: torch.optim.Optimizer) -> tuple:
    sig = []
    for group in optimizer.param_groups:
        params = group["params"]
        sig.append((id(params), len(params), id(params[0]) if params else 0,
                    id(params[-1]) if params else 0))
    return tuple(sig)


def param_cache(optimizer: torch.optim.Optimizer, state: OptimizerAmpState) -> ParamCache:
    """The cached parameter views of `optimizer` (rebuilt when its param groups changed).

    Only the masters held by *this* optimizer are paired with model parameters: with several
    optimizers (a GAN's generator and discriminator) each one unscales, copies and releases
    its own masters only.
    """
    sig = _signature(optimizer)
    cache = state._cache
    if cache is not None and cache.signature == sig:
        return cache
    params = list(optimizer_params(optimizer))
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    if len(state.masters):
        by_master = {id(master): model for model, master in state.masters.pairs()}
        pairs = [(by_master[id(p)], p) for p in params if id(p) in by_master]
    master_ids = {id(m) for _, m in pairs}
    others = [p for p in params if id(p) not in master_ids]
    models = [m for m, _ in pairs]
    masters = [m for _, m in pairs]
    cache = ParamCache(sig, params, pairs, models, masters, others,
                       _group_pairs(masters, models))
    state._cache = cache
    return cache


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
        for name in _APEX_ATTRS:
            if hasattr(opt, name):
                raise RuntimeError(f"Incoming optimizer already has {name} defined.")
    return out, was_list


def optimizer_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every parameter of every group, in order."""
    for group in optimizer.param_groups:
        yield from group["params"]


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The parameters the optimizer steps: the fp32 masters at O2, valid right after initialize.

    Clip gradients over these (not `model.parameters()`): after `scale_loss` they hold the
    unscaled gradients. Half parameters added with `add_param_group` after initialize get
    their masters here at the latest.
    """
    state = amp_state_of(optimizer)
    if state is not None:
        adopt_new_groups(optimizer, state)
    return optimizer_params(optimizer)


def attach(optimizer: torch.optim.Optimizer, session: Amp, masters: MasterMap) -> None:
    """Give `optimizer` its ampx state and step hooks."""
    state = OptimizerAmpState(session=session, masters=masters)
    state._groups_seen = len(optimizer.param_groups)
    state.handles.append(optimizer.register_step_pre_hook(_step_pre_hook))
    state.handles.append(optimizer.register_step_post_hook(_step_post_hook))
    setattr(optimizer, _ATTR, state)


def recast_state(optimizer: torch.optim.Optimizer) -> None:
    """Cast existing per-parameter state to each parameter's dtype (O3 casts params in place)."""
    for param, pstate in optimizer.state.items():
        for key, value in list(pstate.items()):
            if (key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point()
                    and value.dtype != param.dtype and value.shape == param.shape):
                pstate[key] = value.to(param.dtype)


# -- new parameter groups -------------------------------------------------------------------

def adopt_new_groups(optimizer: torch.optim.Optimizer, state: OptimizerAmpState) -> None:
    """Give half parameters added by `add_param_group` after initialize their fp32 masters.

    Runs when the number of groups changed since the last check; new half parameters are
    replaced in the group by fp32 masters (apex's patched add_param_group did the same).
    """
    groups = optimizer.param_groups
    if len(groups) == state._groups_seen:
        return
    if state.session.properties.master_weights:
        for group in groups[state._groups_seen:]:
            params = group["params"]
            for i, param in enumerate(params):
                known = state.masters.master_of(param)
                if known is not None:
                    params[i] = known
                elif param.is_floating_point() and param.dtype != torch.float32:
                    master = torch.nn.Parameter(param.detach().float(),
                                                requires_grad=param.requires_grad)
                    state.masters.add(param, master)
                    params[i] = master
    state._groups_seen = len(groups)
    state._cache = None


# -- around backward ----------------------------------------------------------------------------

def prepare_backward(optimizer: torch.optim.Optimizer, state: OptimizerAmpState) -> None:
    """Before a scaled backward: move existing gradients aside so backward writes only its own.

    Parameters the optimizer steps directly have their gradient stashed (restored, added to
    this pass's unscaled gradient, by `post_backward`). The half model parameters behind this
    optimizer's masters have their gradient dropped, as apex did: anything there was not
    produced through this optimizer's `scale_loss` (for example a discriminator's backward
    reaching the generator in a GAN), and `zero_grad` only reaches the masters. Skipped while
    scaled gradients from `delay_unscale` wait.
    """
    adopt_new_groups(optimizer, state)
    if state.scaled_grads_pending:
        return
    cache = param_cache(optimizer, state)
    for model_param in cache.models:
        model_param.grad = None
    stash = state.stash
    for param in cache.others:
        grad = param.grad
        if grad is not None:
            stash[id(param)] = (param, grad)
            param.grad = None


def restore_stash(state: OptimizerAmpState) -> None:
    """Put stashed gradients back (used when the backward inside scale_loss raised)."""
    for param, grad in state.stash.values():
        param.grad = grad
    state.stash.clear()


def post_backward(
    optimizer: torch.optim.Optimizer,
    state: OptimizerAmpState,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
) -> None:
    """After a scaled backward: unscale this pass's gradients into the right place.

    - half model params with fp32 masters: `master.grad (+)= model.grad * inv_scale` in one
      pass, then the half gradient is released;
    - other params: unscale in place, or add onto the stashed earlier gradient.
    All non-finite values are flagged in `found_inf` (a float32 [1] device tensor); nothing
    here synchronises with the host.
    """
    cache = param_cache(optimizer, state)
    fresh_src: list[torch.Tensor] = []
    fresh_dst: list[torch.Tensor] = []
    acc_src: list[torch.Tensor] = []
    acc_dst: list[torch.Tensor] = []
    in_place: list[torch.Tensor] = []
    for model_param, master in cache.pairs:
        grad = model_param.grad
        if grad is None:
            continue
        master_grad = master.grad
        if master_grad is None:
            master_grad = torch.empty_like(master)
            master.grad = master_grad
            fresh_src.append(grad)
            fresh_dst.append(master_grad)
        else:
            acc_src.append(grad)
            acc_dst.append(master_grad)
        model_param.grad = None
    stash = state.stash
    for param in cache.others:
        grad = param.grad
        stashed = stash.pop(id(param), None) if stash else None
        if grad is None:
            if stashed is not None:
                param.grad = stashed[1]
            continue
        if stashed is None:
            in_place.append(grad)
        else:
            acc_src.append(grad)
            acc_dst.append(stashed[1])
            param.grad = stashed[1]
    if stash:
        restore_stash(state)  # params that left this optimizer's groups, if any
    # Gradients on another device than the flag (model parallel) get their own flag tensor,
    # merged back after the kernels ran.
    side_flags: list[torch.Tensor] = []
    for src, dst, accumulate in ((fresh_src, fresh_dst, False), (acc_src, acc_dst, True)):
        for (s_group, d_group) in _group_pairs(src, dst):
            _ext.unscale_into_(_local_shards(s_group), _local_shards(d_group),
                               _on(inv_scale, s_group[0]),
                               _found_for(found_inf, s_group[0], side_flags),
                               accumulate=accumulate)
    for group in _group_by_device(in_place):
        _ext.unscale_(_local_shards(group), _on(inv_scale, group[0]),
                      _found_for(found_inf, group[0], side_flags))
    for side in side_flags:
        torch.maximum(found_inf, side.to(found_inf.device), out=found_inf)


def _local_shards(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Kernels get plain tensors: a DTensor gradient (FSDP2) is replaced by its local shard.

    The shard is a view of the DTensor's storage, so in-place results land in the gradient;
    ranks then agree on the overflow flag through `Amp.synchronize_found_inf`.
    """
    return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]


def _found_for(found_inf: torch.Tensor, like: torch.Tensor,
               side_flags: list[torch.Tensor]) -> torch.Tensor:
    if like.device == found_inf.device:
        return found_inf
    side = torch.zeros(1, dtype=torch.float32, device=like.device)
    side_flags.append(side)
    return side


def _on(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.device == like.device else tensor.to(like.device)


def _group_by_device(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    if not tensors:
        return []
    first = tensors[0].device
    if all(t.device == first for t in tensors):
        return [tensors]
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return list(groups.values())


def _group_pairs(src: list[torch.Tensor], dst: list[torch.Tensor]
                 ) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    if not src:
        return []
    first = src[0].device
    if all(s.device == first and d.device == first for s, d in zip(src, dst)):
        return [(src, dst)]
    groups: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for s, d in zip(src, dst):
        pair = groups.setdefault(s.device, ([], []))
        pair[0].append(s)
        pair[1].append(d)
    return list(groups.values())


def note_found_inf(state: OptimizerAmpState, found_inf: torch.Tensor) -> None:
    """Fold one backward's overflow flag into the optimizer's flag for its next step."""
    if state.found_inf is None:
        state.found_inf = found_inf.clone()
    else:
        torch.maximum(state.found_inf, found_inf.to(state.found_inf.device), out=state.found_inf)
    state.pending = True


# -- step hooks ----------------------------------------------------------------------------------

def _step_pre_hook(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """Decide whether this step is skipped.

    .. note:: Reads the device overflow flag with one `.item()`: the only host sync of a
       step, and only when a `scale_loss` that checks for overflow ran since the last step.
    """
    state = amp_state_of(optimizer)
    if state is None:
        return
    state._step_started = time.perf_counter()
    state._skip_now = False
    if state.scaled_grads_pending:
        raise RuntimeError(
            "optimizer.step() was called while gradients are still scaled: the last "
            "scale_loss(..., delay_unscale=True) must be followed by a scale_loss without "
            "delay_unscale before step()."
        )
    closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0] is the optimizer
    if closure is not None and state.session.scales_gradients:
        raise RuntimeError(
            "Currently, Amp does not support closure use with optimizers. "
            "(ampx: step(closure) cannot be combined with loss scaling; run the closure's "
            "loss through ampx.scale_loss and call step() without a closure.)"
        )
    adopt_new_groups(optimizer, state)
    if not state.pending:
        return
    state.pending = False
    found = state.found_inf
    if found is None:  # pending is only set together with found_inf
        return
    session = state.session
    skip = bool(found.item())  # the one host sync of a step
    found.zero_()
    if skip:
        state._skip_now = True
        for param in param_cache(optimizer, state).params:
            param.grad = None
        for loss_id in sorted(state.loss_ids):
            session.scalers[loss_id].report_overflow()
    state.loss_ids.clear()


def _step_post_hook(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """Record the step's result; at O2 copy the masters into the half model parameters."""
    state = amp_state_of(optimizer)
    if state is None:
        return
    skipped = state._skip_now
    state._skip_now = False
    state.last_step_skipped = skipped
    state.steps += 1
    if skipped:
        state.skipped_steps += 1
    cache = param_cache(optimizer, state)
    if cache.pairs:
        if not skipped:
            with torch.no_grad():
                for masters, models in cache.copy_groups:
                    _ext.copy_(masters, models)
        for master in cache.masters:  # as apex: master grads are consumed by the step
            master.grad = None
    state.session.record_step(optimizer, state, skipped)
