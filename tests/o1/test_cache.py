"""The weight-cast cache: one cast per parameter per forward (plus its backward), never stale."""

from __future__ import annotations

import copy
import multiprocessing
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampx
from ampx.o1 import patch
from ampx.o1.casting import WeightCastCache


def _session(model: nn.Module, half: torch.dtype, optimizer: object = None) -> object:
    out = ampx.initialize(model, optimizer, opt_level="O1", dtype=half, verbosity=0)
    return out


def _cache() -> WeightCastCache:
    active = patch.active()
    assert active is not None
    return active.cache


class Shared(nn.Module):
    """One Linear used twice in a forward (weight tying / a recurrent step)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.relu(self.lin(x)))


def test_weight_used_twice_is_cast_once(half_dtype: torch.dtype) -> None:
    model = Shared()
    _session(model, half_dtype)
    cache = _cache()
    out = model(torch.rand(2, 8))
    assert out.dtype == half_dtype
    assert (cache.misses, cache.hits) == (2, 2)  # weight and bias: cast once, reused once
    out.float().sum().backward()  # no IndexError (apex#1303): both uses reach the fp32 weight
    assert model.lin.weight.grad is not None and model.lin.weight.grad.dtype == torch.float32


def test_inplace_update_forces_a_recast(half_dtype: torch.dtype) -> None:
    lin = nn.Linear(4, 4)
    _session(lin, half_dtype)
    cache = _cache()
    x = torch.rand(2, 4)
    first = F.linear(x, lin.weight, lin.bias)  # (no forward of the model: one cache life)
    with torch.no_grad():
        lin.weight.add_(1.0)
    second = F.linear(x, lin.weight, lin.bias)
    assert cache.misses == 3  # weight, bias, then the updated weight again
    expected = F.linear(x.to(half_dtype), lin.weight.to(half_dtype), lin.bias.to(half_dtype))
    torch.testing.assert_close(second, expected)
    assert not torch.equal(first, second)


def test_load_state_dict_and_optimizer_step_are_never_served_stale(half_dtype: torch.dtype) -> None:
    lin = nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    lin, opt = _session(lin, half_dtype, opt)  # type: ignore[misc]
    x = torch.rand(2, 4)
    with torch.no_grad():  # eval pass fills the cache (apex#796's setting)
        lin(x)
    lin.load_state_dict({"weight": torch.zeros(4, 4), "bias": torch.zeros(4)})
    assert torch.count_nonzero(lin(x)) == 0
    loss = lin(x).float().sum() + 1
    loss.backward()
    opt.step()
    expected = F.linear(x, lin.weight, lin.bias).to(half_dtype)
    torch.testing.assert_close(lin(x), expected)


def test_data_assignment_forces_a_recast(half_dtype: torch.dtype) -> None:
    lin = nn.Linear(4, 4, bias=False)
    _session(lin, half_dtype)
    x = torch.rand(2, 4)
    lin(x)
    lin.weight.data = torch.zeros(4, 4)
    assert torch.count_nonzero(lin(x)) == 0


def test_no_grad_entry_is_not_served_to_a_training_forward(half_dtype: torch.dtype) -> None:
    lin = nn.Linear(4, 4)
    _session(lin, half_dtype)
    x = torch.rand(2, 4)
    with torch.no_grad():
        lin(x)
    lin(x).float().sum().backward()
    assert lin.weight.grad is not None
    with torch.inference_mode():
        lin(x)
    frozen = nn.Linear(4, 4).requires_grad_(False)
    with torch.inference_mode():
        frozen(x)
    xg = torch.rand(2, 4, requires_grad=True)
    frozen(xg).float().sum().backward()  # no "inference tensors cannot be saved" error
    assert xg.grad is not None


def test_cache_is_cleared_when_an_iteration_ends(half_dtype: torch.dtype) -> None:
    lin = nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    lin, opt = _session(lin, half_dtype, opt)  # type: ignore[misc]
    loss = lin(torch.rand(2, 4)).float().sum()
    assert len(_cache()) == 2
    with ampx.scale_loss(loss, opt) as scaled:
        scaled.backward()
    assert len(_cache()) == 0
    opt.step()


def test_deepcopy_has_its_own_entries(half_dtype: torch.dtype) -> None:
    lin = nn.Linear(4, 4)
    _session(lin, half_dtype)
    ema = copy.deepcopy(lin)
    with torch.no_grad():
        ema.weight.zero_()
        ema.bias.zero_()
    x = torch.rand(2, 4)
    assert torch.count_nonzero(lin(x)) > 0
    assert torch.count_nonzero(ema(x)) == 0
    assert torch.count_nonzero(lin(x)) > 0


def test_cache_object_directly() -> None:
    cache = WeightCastCache()
    p = nn.Parameter(torch.rand(3))
    a = cache.bind(torch.float16)(p)
    assert cache.bind(torch.float16)(p) is a and (cache.hits, cache.misses) == (1, 1)
    assert cache.bind(torch.bfloat16)(p).dtype == torch.bfloat16 and len(cache) == 2
    cache.clear()
    assert len(cache) == 0 and cache.bind(torch.float16)(p) is not a


@pytest.mark.parametrize("requires_grad", [True, False])
def test_only_leaves_and_parameters_are_cached(requires_grad: bool) -> None:
    _session(nn.Linear(2, 2), torch.bfloat16)
    cache = _cache()
    leaf = torch.rand(1, 3, requires_grad=requires_grad)
    act = leaf * 2  # a non-leaf when requires_grad; never cached
    assert torch.mul(act, torch.rand(1, 3)).dtype == act.dtype  # nothing cached
    ns_mm = torch.mm(act, torch.rand(3, 1))
    assert ns_mm.dtype == torch.bfloat16 and len(cache) == 0
    torch.mm(leaf, torch.rand(3, 1))
    assert len(cache) == (1 if requires_grad else 0)  # a leaf that requires grad: a weight


def test_write_through_data_between_no_grad_forwards_is_never_served_stale(
        half_dtype: torch.dtype) -> None:
    """EMA swaps / WGAN clipping: `param.data` has its own version counter."""
    lin = nn.Linear(4, 4)
    _session(lin, half_dtype)
    x = torch.rand(2, 4)
    with torch.no_grad():
        first = lin(x)
        lin.weight.data.mul_(0.0)
        lin.bias.data.copy_(torch.zeros(4))
        assert torch.count_nonzero(lin(x)) == 0
        assert torch.count_nonzero(first) > 0


def test_long_lived_data_alias_keeps_the_parameter_out_of_the_cache(
        half_dtype: torch.dtype) -> None:
    lin = nn.Linear(4, 4, bias=False)
    _session(lin, half_dtype)
    cache = _cache()
    alias = lin.weight.data  # held, written later
    x = torch.rand(2, 4)
    with torch.no_grad():
        F.linear(x, lin.weight)  # (outside a forward of the model: no forward ends)
        alias.zero_()
        assert torch.count_nonzero(F.linear(x, lin.weight)) == 0
    assert len(cache) == 0
    del alias  # gone: cached again
    with torch.no_grad():
        F.linear(x, lin.weight)
    assert len(cache) == 1


def test_fake_tensors_are_never_cached() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    _session(nn.Linear(2, 2), torch.bfloat16)
    cache = _cache()
    with FakeTensorMode() as mode:
        lin = nn.Linear(4, 4)
        out = lin(mode.from_tensor(torch.rand(2, 4)))
    assert out.dtype == torch.bfloat16 and len(cache) == 0


def test_parameters_the_lists_do_not_lower_are_never_cast_or_cached(half_dtype: torch.dtype
                                                                     ) -> None:
    """Weights go to the cache before any dtype or device test; a miss still applies them."""
    _session(nn.Linear(2, 2), half_dtype)
    cache = _cache()
    x = torch.rand(2, 3, dtype=torch.float64)
    wide = nn.Parameter(torch.rand(4, 3, dtype=torch.float64))
    assert F.linear(x, wide).dtype == torch.float64  # float64 is never cast
    low = nn.Parameter(torch.rand(4, 3).to(half_dtype))
    assert F.linear(torch.rand(2, 3), low).dtype == half_dtype
    assert len(cache) == 0 and cache.misses == 0
    other = patch.Caster(patch.CastConfig(half_dtype, frozenset({"cuda"})))
    cpu_weight = nn.Parameter(torch.rand(4, 3))
    assert other.half_cast()(cpu_weight) is cpu_weight  # not a device this session casts
    assert len(other.cache) == 0
    ampx.restore()


# -- writes the version counter cannot see (issue 39 item 5) ----------------------------------
#
# The cache's lifetime is one forward of an initialized model plus its backward: it is emptied
# when the forward starts and, without autograd, when it ends. So no write between two forwards
# is served stale, whatever wrote it. Each writer zeroes the weight in place.

def _by_numpy(lin: nn.Linear) -> None:
    lin.weight.detach().numpy()[:] = 0.0


def _by_dlpack(lin: nn.Linear) -> None:
    torch.from_dlpack(lin.weight.detach()).zero_()


def _by_storage_copy(lin: nn.Linear) -> None:
    lin.weight.untyped_storage().copy_(torch.zeros_like(lin.weight).untyped_storage())


def _by_set(lin: nn.Linear) -> None:
    torch.empty(0).set_(lin.weight.untyped_storage(), 0, lin.weight.shape).zero_()


_WRITERS: dict[str, Callable[[nn.Linear], None]] = {
    "numpy": _by_numpy, "dlpack": _by_dlpack, "storage_copy": _by_storage_copy,
    "set_": _by_set, "data_alias": lambda lin: None,  # (the flat tensor below is written)
}


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "grad"])
@pytest.mark.parametrize("write", list(_WRITERS))
def test_writes_the_version_counter_misses_are_never_served_stale(
        write: str, mode: str, half_dtype: torch.dtype) -> None:
    """An evaluation loop (or training forwards) with the weights written between forwards
    through numpy, dlpack, a storage copy, `set_` onto the storage, or a tensor given to
    `param.data` (issue 39's repro): each forward computes with the weights as they are.
    Before, the cache served the first forward's cast for good (it was dropped only at
    `scale_loss`)."""
    lin = nn.Linear(4, 4)
    _session(lin, half_dtype)
    flat = torch.rand(16)
    if write == "data_alias":
        lin.weight.data = flat.view(4, 4)
    x = torch.rand(2, 4)
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
               "grad": torch.enable_grad}[mode]
    with context():
        first = lin(x)
    with torch.no_grad():
        lin.bias.zero_()  # (seen by the version counter)
    _WRITERS[write](lin)
    flat.zero_()
    with context():
        second = lin(x)
    assert torch.count_nonzero(first) > 0
    assert torch.count_nonzero(second) == 0, "a stale cast was served"


def _zero_in_child(weight: torch.Tensor) -> None:  # (runs in a forked process)
    weight.detach().zero_()


def test_a_shared_memory_model_written_by_another_process_is_never_served_stale(
        half_dtype: torch.dtype) -> None:
    """Hogwild: another process trains a `share_memory()` model; this one evaluates it."""
    lin = nn.Linear(4, 4, bias=False).share_memory()
    _session(lin, half_dtype)
    x = torch.rand(2, 4)
    with torch.no_grad():
        assert torch.count_nonzero(lin(x)) > 0
    child = multiprocessing.get_context("fork").Process(target=_zero_in_child,
                                                        args=(lin.weight,))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0
    with torch.no_grad():
        assert torch.count_nonzero(lin(x)) == 0


def test_a_tensor_given_to_data_keeps_the_parameter_uncached_while_it_lives(
        half_dtype: torch.dtype) -> None:
    """`p.data = flat[...]`: writes through `flat` are invisible to `p`'s version counter, so
    `p` is cast afresh at every use (outside a forward of the model too) while `flat` lives."""
    lin = nn.Linear(4, 4, bias=False)
    _session(lin, half_dtype)
    cache = _cache()
    flat = torch.rand(32)
    lin.weight.data = flat[:16].view(4, 4)
    x = torch.rand(2, 4)
    assert torch.count_nonzero(F.linear(x, lin.weight)) > 0
    flat.zero_()
    assert torch.count_nonzero(F.linear(x, lin.weight)) == 0
    assert len(cache) == 0
    del flat  # gone: cached again
    F.linear(x, lin.weight)
    assert len(cache) == 1


def test_cache_lives_one_forward_plus_its_backward(half_dtype: torch.dtype) -> None:
    """A training forward's casts stay for its backward (a weight used twice is cast once),
    until `scale_loss` or the next forward; a forward without autograd lets them go at its end.
    The hooks come off with `restore()`."""
    model = Shared()
    hooks = (dict(model._forward_pre_hooks), dict(model._forward_hooks))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = _session(model, half_dtype, opt)  # type: ignore[misc]
    cache = _cache()
    x = torch.rand(2, 8)
    for step in range(1, 3):
        loss = model(x).float().sum()
        assert (cache.misses, len(cache)) == (2 * step, 2)  # weight and bias, once each
        with ampx.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    model(x)
    model(x)  # the next forward starts afresh
    assert (cache.misses, len(cache)) == (8, 2)
    with torch.no_grad():
        model(x)
    assert (cache.misses, len(cache)) == (10, 0)
    ampx.restore()
    assert (dict(model._forward_pre_hooks), dict(model._forward_hooks)) == hooks


def test_scripting_an_initialized_model_needs_restore(half_dtype: torch.dtype) -> None:
    """TorchScript compiles a module's hooks and cannot compile the cache's lifetime hooks
    (docs/compile.md): after `restore()` they are gone and the model scripts."""
    class Net(nn.Linear):  # (a class of its own: TorchScript compiles a class once)
        pass

    lin = Net(4, 4)
    _session(lin, half_dtype)
    # (the closures are refused first, naming the same ways out)
    with pytest.raises(RuntimeError, match="forward_ends|forward_starts|cannot compile O1"):
        torch.jit.script(lin)
    ampx.restore()
    assert torch.jit.script(lin)(torch.rand(2, 4)).dtype == torch.float32


def test_one_tensor_given_to_data_twice(half_dtype: torch.dtype) -> None:
    """Two live weak references to one tensor are never compared (a tensor's `==`)."""
    lin = nn.Linear(4, 4, bias=False)
    _session(lin, half_dtype)
    value = torch.rand(4, 4)
    lin.weight.data = value
    lin.weight.data = value
    F.linear(torch.rand(2, 4), lin.weight)
    assert len(_cache()) == 0  # `value` lives: writes through it are not seen
