"""Parameter views of one initialized optimizer: its params, its O2 masters and their half twins.

The scaled-backward protocol (`ampx.scaling.protocol`) needs, at every pass, the same few lists:
every parameter the optimizer steps, the (half model parameter, fp32 master) pairs among them, and
the parameters that are not masters. `ParamCache` holds them and is rebuilt only when the
optimizer's parameter groups change. `adopt_new_groups` gives half parameters added with
`add_param_group` after initialize their fp32 masters.

These lists are the public-ish view of the O2 split: `OptimizerAmpState.model_params()` and
`.master_params()` (ampx.scaling.protocol) read them, for example to expose apex's `_amp_stash`
views.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..distributed import local

__all__ = ["MasterMap", "ParamCache", "adopt_new_groups", "build_cache", "install_masters",
           "optimizer_params", "recast_state"]

logger = logging.getLogger("ampx")


class MasterMap:
    """model (half) parameter -> fp32 master, for the O2 split.

    Referenced weakly from module hooks, so copying a model never copies the optimizer's masters.

    Masters follow their model parameters until they are first used (apex made them at that
    point, from the model): `add` and `track` note each model parameter's version counter, and
    `follow` gives every master whose model parameter was written since then (DDP's broadcast
    from rank 0, an in-place init, a copy by hand) the model's value, then stops watching.
    A master that was not followed keeps its full float32 value.

    A model converted after initialize (``model.float()``, ``.half()``, ``.to(dtype)``) is
    followed: `rederive` gives its parameters their masters' values in their new dtype (each
    pair remembers the dtype its model parameter was derived in).
    """

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
        self._watch: dict[int, tuple[nn.Parameter, int]] = {}
        self._dtypes: dict[int, torch.dtype] = {}

    def add(self, model_param: nn.Parameter, master: nn.Parameter) -> None:
        """Record that `master` is the fp32 copy behind `model_param` (watched until `follow`)."""
        self._by_id[id(model_param)] = (model_param, master)
        self._watch[id(model_param)] = (model_param, model_param._version)
        self._dtypes[id(model_param)] = model_param.dtype

    def track(self, model_param: torch.Tensor) -> None:
        """Watch `model_param` again from its current value (its master was just loaded)."""
        if self.master_of(model_param) is not None:
            self._watch[id(model_param)] = (model_param, model_param._version)  # type: ignore[assignment]
            self._dtypes[id(model_param)] = model_param.dtype

    def current(self, model_param: torch.Tensor) -> torch.Tensor | None:
        """The master's value as `follow` would leave it, without fixing anything (None: no
        master). A state dict taken on one rank before DDP's wrap must not stop the follow."""
        master = self.master_of(model_param)
        watched = self._watch.get(id(model_param))
        if master is None or watched is None or watched[0] is not model_param:
            return master
        if self._written(model_param, master, watched[1]):
            return model_param.detach().float()
        return master

    def _written(self, model_param: torch.Tensor, master: torch.Tensor, version: int) -> bool:
        """Whether `model_param` was written since its master was derived into it (a
        conversion to another dtype is not a write)."""
        return model_param._version != version or not _same_value(
            model_param, master, self._dtypes.get(id(model_param), model_param.dtype))

    @property
    def watching(self) -> bool:
        """Whether some master still follows its model parameter."""
        return bool(self._watch)

    def follow(self) -> int:
        """Masters whose model parameter was written since `add`/`track` take its value.

        Called when masters are first used (the first scaled backward or step, a state dict,
        apex's `_lazy_init_maybe_master_weights`); afterwards nothing is watched until a load
        calls `track`. Every rank of a DDP job sees the same broadcast write, so every rank
        makes the same masters from the same half values (apex's precision there).

        Returns:
            How many masters took their model parameter's value.
        """
        if not self._watch:
            return 0
        self.rederive()
        followed = 0
        with torch.no_grad():
            for key, (model_param, version) in list(self._watch.items()):
                master = self.master_of(model_param)
                if master is not None and self._written(model_param, master, version):
                    master.copy_(model_param)
                    followed += 1
                del self._watch[key]
        if followed:
            logger.info("ampx: %d fp32 master(s) took the value written into their model "
                        "parameter after initialize (a DDP broadcast, a copy or an init)",
                        followed)
        return followed

    def rederive(self) -> int:
        """Model parameters converted to another dtype since their master was derived into
        them (``model.float()`` after initialize) take the master's value in that dtype.

        `model.float()` then computes with the masters exactly, not with the half-rounded
        values, and `model.half()` back gives what the model held. A parameter still
        watched and written before the conversion (a DDP broadcast) is a write to follow
        instead: its master takes the value. No collective.

        Returns:
            How many model parameters were converted.
        """
        converted = 0
        with torch.no_grad():
            for key, (model_param, master) in self._by_id.items():
                if model_param.dtype == self._dtypes.get(key, model_param.dtype):
                    continue
                watched = self._watch.get(key)
                if watched is not None and self._written(model_param, master, watched[1]):
                    master.copy_(model_param)
                else:
                    model_param.copy_(master)
                if watched is not None:
                    self._watch[key] = (model_param, model_param._version)
                self._dtypes[key] = model_param.dtype
                converted += 1
        return converted

    def master_of(self, model_param: torch.Tensor) -> nn.Parameter | None:
        """The master of `model_param`, or None."""
        entry = self._by_id.get(id(model_param))
        return entry[1] if entry is not None and entry[0] is model_param else None

    def discard(self, model_param: nn.Parameter) -> None:
        """Forget the master of `model_param` (initialize's undo, the fp32 fallback)."""
        self._by_id.pop(id(model_param), None)
        self._watch.pop(id(model_param), None)
        self._dtypes.pop(id(model_param), None)

    def pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """Every (model_param, master) pair."""
        return list(self._by_id.values())

    def __len__(self) -> int:
        return len(self._by_id)



def _same_value(model_param: torch.Tensor, master: torch.Tensor, derived: torch.dtype) -> bool:
    """Whether the model parameter still holds its master's value as derived in `derived`
    (catches `.data` writes, which bypass the version counter; a conversion since is no
    change). Local shards only: no collective."""
    model_local, master_local = local(model_param), local(master)
    return torch.equal(model_local, master_local.to(derived).to(model_local.dtype))


@dataclass(eq=False)
class ParamCache:
    """The per-pass views of one optimizer's parameters.

    Attributes:
        signature: What the cache was built from (group lists, lengths, end points).
        params: Every parameter of every group, in order.
        pairs: (half model parameter, fp32 master) for the masters this optimizer steps.
        models: The half model parameters of `pairs`.
        masters: The fp32 masters of `pairs`.
        others: The parameters that are not masters (the optimizer steps them directly).
        sources: `models + others` (derived): where this pass's scaled gradients are.
        targets: `masters + others`: what gets the unscaled gradients (aligned with sources).
    """

    signature: tuple
    params: list[torch.Tensor]
    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    models: list[torch.Tensor]
    masters: list[torch.Tensor]
    others: list[torch.Tensor]
    sources: list[torch.Tensor] = field(init=False)
    targets: list[torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        self.sources = self.models + self.others
        self.targets = self.masters + self.others


def optimizer_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every parameter of every group, in order."""
    for group in optimizer.param_groups:
        yield from group["params"]


def signature(optimizer: torch.optim.Optimizer) -> tuple:
    """A cheap fingerprint of the optimizer's groups (changes when params are added/removed)."""
    sig = []
    for group in optimizer.param_groups:
        params = group["params"]
        sig.append((id(params), len(params), id(params[0]) if params else 0,
                    id(params[-1]) if params else 0))
    return tuple(sig)


def build_cache(optimizer: torch.optim.Optimizer, masters: MasterMap,
                previous: ParamCache | None) -> ParamCache:
    """The parameter views of `optimizer` (`previous` when its groups did not change).

    Only the masters held by *this* optimizer are paired with model parameters: with several
    optimizers (a GAN's generator and discriminator) each one unscales, copies and releases
    its own masters only.
    """
    sig = signature(optimizer)
    if previous is not None and previous.signature == sig:
        return previous
    params = list(optimizer_params(optimizer))
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    if len(masters):
        by_master = {id(master): model for model, master in masters.pairs()}
        pairs = [(by_master[id(p)], p) for p in params if id(p) in by_master]
    master_ids = {id(m) for _, m in pairs}
    others = [p for p in params if id(p) not in master_ids]
    return ParamCache(sig, params, pairs, [m for m, _ in pairs], [m for _, m in pairs], others)


def adopt_new_groups(optimizer: torch.optim.Optimizer, masters: MasterMap, seen: int,
                     master_weights: bool) -> int:
    """Give half parameters of groups added after initialize their fp32 masters.

    Runs when the number of groups changed since `seen`; new half parameters are replaced in
    the group by fp32 masters (apex's patched add_param_group did the same).

    Returns:
        The number of groups now seen.
    """
    groups = optimizer.param_groups
    if len(groups) == seen:
        return seen
    if master_weights:
        for group in groups[seen:]:
            params = group["params"]
            for i, param in enumerate(params):
                known = masters.master_of(param)
                if known is not None:
                    params[i] = known
                elif param.is_floating_point() and param.dtype != torch.float32:
                    master = torch.nn.Parameter(param.detach().float(),
                                                requires_grad=param.requires_grad)
                    masters.add(param, master)
                    params[i] = master
    return len(groups)


def install_masters(optimizer: torch.optim.Optimizer, masters: MasterMap) -> None:
    """O2: put each master in place of its model parameter in the optimizer's groups.

    The parameter's optimizer state (loaded before initialize) moves to the master, as apex's
    lazy init did; `recast_state` then makes it float32.
    """
    for group in optimizer.param_groups:
        params = group["params"]
        for i, param in enumerate(params):
            master = masters.master_of(param)
            if master is not None:
                params[i] = master
                if param in optimizer.state:
                    optimizer.state[master] = optimizer.state.pop(param)


def recast_state(optimizer: torch.optim.Optimizer) -> None:
    """Cast existing per-parameter state to each parameter's dtype (O3 casts params in place)."""
    for param, pstate in optimizer.state.items():
        for key, value in list(pstate.items()):
            if (key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point()
                    and value.dtype != param.dtype and value.shape == param.shape):
                pstate[key] = value.to(param.dtype)


def grad_mark(param: torch.Tensor) -> Any:
    """What identifies `param.grad`'s current contents without reading it (no sync).

    Autograd either replaces the gradient or adds into it in place (bumping its version), so a
    changed mark means a backward (or anything else) wrote to it.
    """
    grad = param.grad
    return None if grad is None else (id(grad), grad._version)
