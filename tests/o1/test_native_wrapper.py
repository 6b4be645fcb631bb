"""The native (C) O1 wrappers against the Python closures they wrap: same ops, dtypes, values.

Every case runs twice in one process, once with `patch.activate(..., native=True)` and once
with `native=False`, on the same inputs, and compares what reached torch's kernels (aten op
and floating dtypes, recorded by a TorchDispatchMode, which does not make the C wrapper hand
calls to the closure), the results bit for bit, the exceptions and the weight cache's
counters. A profile hook counts the closures' frames, to show which calls the C path handled
itself. Skipped when the extension (or its CastWrapper) is not built.
"""

from __future__ import annotations

import sys
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from test_lists import ENTRIES, _maker, recipe_for  # tests/o1 is on sys.path
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import ampx
from ampx.o1 import lists, patch, wrappers
from ampx.o1.lists import CastRule, ListEntry

pytestmark = pytest.mark.skipif(wrappers.native_class() is None,
                                reason="the native extension (CastWrapper) is not built")

_CPU = frozenset({"cpu"})


class _Ops(TorchDispatchMode):
    """The aten ops that ran, each with the floating dtypes of its tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[torch.dtype | None, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        flat = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        self.ops.append((str(func), tuple(a.dtype if a.is_floating_point() else None
                                          for a in flat if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


def _frames_named(name: str) -> Callable[[], int]:
    """Start counting calls of Python functions called `name`; returns the reader."""
    count = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_name == name:
            count[0] += 1

    sys.setprofile(profile)

    def stop() -> int:
        sys.setprofile(None)
        return count[0]

    return stop


def _closure_frames() -> Callable[[], int]:
    """Start counting entries into the Python closures (`ampx_cast`); returns the reader."""
    return _frames_named("ampx_cast")


class Outcome(NamedTuple):
    out: Any
    ops: list
    error: tuple[type, str] | None
    closure_calls: int


def _run(native: bool, half: torch.dtype, bodies: list[Callable[[], Any]],
         allow_banned: bool = False) -> list[Outcome]:
    """Each body called once in one session (native or closures), from the same seed."""
    patch.activate(patch.CastConfig(dtype=half, device_types=_CPU, allow_banned=allow_banned),
                   native=native)
    active = patch.active()
    assert active is not None and active.native is native
    outcomes = []
    for body in bodies:
        torch.manual_seed(0)
        recorder = _Ops()
        error = None
        out = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stop = _closure_frames()
            try:
                with recorder:
                    out = body()
            except Exception as exc:  # compared between the two wrappers
                error = (type(exc), str(exc))
            finally:
                calls = stop()
        outcomes.append(Outcome(out, recorder.ops, error, calls))
    patch.deactivate()
    return outcomes


def _same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan()))
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    else:
        assert a == b or a is b


def _compare_all(half: torch.dtype, bodies: list[Callable[[], Any]], c_path: list[bool],
                 allow_banned: bool = False) -> list[Outcome]:
    natives = _run(True, half, bodies, allow_banned)
    pythons = _run(False, half, bodies, allow_banned)
    for native, python, c_only in zip(natives, pythons, c_path):
        assert native.error == python.error
        assert native.ops == python.ops  # op for op, same dtypes reach the kernels
        _same(native.out, python.out)
        assert python.closure_calls > 0 or python.error is not None or not python.ops
        if c_only:
            assert native.closure_calls == 0, "the C path handed this call to the closure"
    return natives


def _compare(half: torch.dtype, body: Callable[[], Any], *, c_path: bool = True,
             allow_banned: bool = False) -> Outcome:
    return _compare_all(half, [body], [c_path], allow_banned)[0]


def _dtypes_for(policy: CastRule, half: torch.dtype) -> list[list[torch.dtype]]:
    """Inputs per rule: one call that casts, one that does not (mixed ones for promote)."""
    other = torch.bfloat16 if half == torch.float16 else torch.float16
    f32, f64 = torch.float32, torch.float64
    return {
        CastRule.LOWER: [[f32], [other, f64]],
        CastRule.RNN: [[f32], [other]],
        CastRule.RNN_CHECK: [[f32]],
        CastRule.FP32: [[half], [f32, other]],
        CastRule.PROMOTE: [[half, f32], [other, half], [f32, f64], [f32]],
        CastRule.SEQUENCE_PROMOTE: [[half, f32], [f32, f64], [half]],
        CastRule.INPLACE_MATCH_SELF: [[half, f32], [f32, half], [f64, half]],
        CastRule.INPLACE_FP32_ERROR: [[half], [f32, half]],
        CastRule.BANNED: [[half], [f32]],
    }[policy]


# Calls the closure makes by design: the RNN input check, raising CastError, allow_banned.
def _needs_closure(entry: ListEntry, dtypes: list[torch.dtype]) -> bool:
    if entry.policy in (CastRule.RNN, CastRule.RNN_CHECK):
        return True  # reached through nn.RNN modules, whose check_input is the closure's
    first_half = dtypes[0] in (torch.float16, torch.bfloat16)
    if entry.policy is CastRule.INPLACE_FP32_ERROR and first_half:
        return True
    return entry.policy is CastRule.BANNED and any(
        d in (torch.float16, torch.bfloat16) for d in dtypes)


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: f"{e.owner}.{e.name}")
def test_zoo_entry_matches_the_closure(entry: ListEntry, half_dtype: torch.dtype) -> None:
    recipe = recipe_for(entry)
    assert recipe is not None
    patterns = _dtypes_for(entry.policy, half_dtype)

    def body(dtypes: list[torch.dtype]) -> Callable[[], Any]:
        # Looked up inside the session: the attribute is the session's wrapper.
        return lambda: recipe(getattr(lists.owner_object(entry.owner), entry.name),
                              _maker(dtypes))

    bodies = [body(d) for d in patterns]
    _compare_all(half_dtype, bodies, [not _needs_closure(entry, d) for d in patterns])
    if entry.policy is CastRule.BANNED:
        _compare_all(half_dtype, bodies, [False] * len(bodies), allow_banned=True)


def test_wrappers_are_the_native_type_and_restore_exactly(namespaces: Any) -> None:
    before = namespaces()
    patch.activate(patch.CastConfig(dtype=torch.bfloat16, device_types=_CPU))
    cls = wrappers.native_class()
    linear = vars(F)["linear"]
    assert type(linear) is cls and linear.__wrapped__ is before[2]["linear"]
    assert linear.__name__ == "linear" and linear.__ampx_policy__ is CastRule.LOWER
    assert isinstance(linear._ampx_python, types.FunctionType)
    assert type(vars(torch.Tensor)["softmax"]) is cls
    ampx.restore()
    after = namespaces()
    for old, new in zip(before, after):
        assert all(new[k] is v for k, v in old.items())


def test_tensor_methods_bind_like_functions() -> None:
    patch.activate(patch.CastConfig(dtype=torch.float16, device_types=_CPU))
    x = torch.rand(2, 3)
    assert x.softmax(-1).dtype == torch.float32
    assert torch.Tensor.softmax(x.half(), -1).dtype == torch.float32
    assert (x.half() + x).dtype == torch.float32  # nb_add reaches the wrapper
    y = x.half()
    y += x  # __iadd__: self's dtype
    assert y.dtype == torch.float16
    assert (x @ x.t()).dtype == torch.float16
    bound = x.half().exp_
    with pytest.raises(ampx.CastError, match="in-place"):
        bound()


def test_kwargs_nested_sequences_and_dicts(half_dtype: torch.dtype) -> None:
    w, b = nn.Parameter(torch.rand(3, 4)), nn.Parameter(torch.rand(3))
    ns = types.SimpleNamespace(f=lambda d, xs=(): {k: v * 1 for k, v in d.items()} | {
        "xs": [x * 1 for x in xs]})
    handle = ampx.register_half_function(ns, "f")
    try:
        def body() -> Any:
            x = torch.rand(2, 4)
            return (F.linear(input=x, weight=w, bias=b), F.linear(x, weight=w),
                    torch.cat(tensors=[x.to(half_dtype), x]), torch.cat((x.to(half_dtype), x)),
                    torch.stack([x, x.double()], dim=0),
                    ns.f({"a": x, "b": (x, [x.double()])}, xs=[x, 3]),
                    torch.add(x, other=x.to(half_dtype)), torch.mul(x.to(half_dtype), 2.0))

        out = _compare(half_dtype, body).out
        assert out[0].dtype == half_dtype and out[1].dtype == half_dtype
        assert out[2].dtype == torch.float32 and out[4].dtype == torch.float64
        assert out[5]["a"].dtype == half_dtype and out[5]["b"][1][0].dtype == torch.float64
        assert out[6].dtype == torch.float32 and out[7].dtype == half_dtype
    finally:
        handle.remove()


def test_odd_arguments_fall_back_to_the_closure(half_dtype: torch.dtype) -> None:
    class Sub(torch.Tensor):
        pass

    class Items(list):
        pass

    class Pair(NamedTuple):
        a: torch.Tensor
        b: torch.Tensor

    ns = types.SimpleNamespace(g=lambda p: p.a + p.b)
    handle = ampx.register_half_function(ns, "g")
    try:
        def body() -> Any:
            x = torch.rand(2, 4)
            return (F.linear(x.as_subclass(Sub), torch.rand(3, 4)),
                    ns.g(Pair(x, x)), torch.cat(Items([x, x.half()])))

        native = _compare(half_dtype, body, c_path=False)
        assert native.closure_calls == 3
        assert native.out[0].dtype == half_dtype and native.out[1].dtype == half_dtype
    finally:
        handle.remove()


def test_torch_function_mode_sees_the_closures_casts(half_dtype: torch.dtype) -> None:
    class Names(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                               kwargs: dict | None = None) -> Any:
            self.names.append(getattr(func, "__name__", repr(func)))
            return func(*args, **(kwargs or {}))

    seen = {}
    for native in (True, False):
        patch.activate(patch.CastConfig(dtype=half_dtype, device_types=_CPU), native=native)
        mode = Names()
        with mode:
            out = F.linear(torch.rand(2, 4), nn.Parameter(torch.rand(3, 4)))
        assert out.dtype == half_dtype
        seen[native] = mode.names
        patch.deactivate()
    assert seen[True] == seen[False] and "linear" in seen[True]


def test_weight_cache_hits_misses_and_invalidation(half_dtype: torch.dtype) -> None:
    counts = {}
    for native in (True, False):
        torch.manual_seed(0)
        lin = nn.Linear(4, 4)
        patch.activate(patch.CastConfig(dtype=half_dtype, device_types=_CPU), native=native)
        cache = patch.active().cache  # type: ignore[union-attr]
        x = torch.rand(2, 4)
        outs = [lin(x), lin(x)]  # miss, then hits
        with torch.no_grad():
            lin.weight.add_(1.0)  # the version counter moves: recast
            outs.append(lin(x))  # an entry cast with autograd off...
        outs.append(lin(x))  # ...is not served to a forward that needs gradients
        lin.weight.data.mul_(0.5)  # a .data alias: dropped, not cached while it lives
        outs.append(lin(x))
        patch.clear_cache()
        outs.append(lin(x))
        with torch.inference_mode():
            outs.append(lin(x))
        outs.append(lin(x))
        counts[native] = (cache.hits, cache.misses, len(cache), outs)
        patch.deactivate()
    assert counts[True][:3] == counts[False][:3]
    assert counts[True][0] > 0 and counts[True][1] > 2
    for a, b in zip(counts[True][3], counts[False][3]):
        _same(a, b)
        assert a.requires_grad == b.requires_grad


def test_disable_casts_and_passthrough_after_restore(half_dtype: torch.dtype) -> None:
    patch.activate(patch.CastConfig(dtype=half_dtype, device_types=_CPU), native=True)
    linear, exp_ = F.linear, torch.Tensor.exp_
    x, w = torch.rand(2, 4), torch.rand(3, 4)
    with ampx.disable_casts():
        assert F.linear(x, w).dtype == torch.float32
        assert exp_(x.to(half_dtype)).dtype == half_dtype  # not refused inside the region
        with ampx.disable_casts():
            pass
        assert F.linear(x, w).dtype == torch.float32
    assert F.linear(x, w).dtype == half_dtype
    ampx.restore()
    assert linear(x, w).dtype == torch.float32  # a captured wrapper passes through


def test_two_threads_one_inside_disable_casts(half_dtype: torch.dtype) -> None:
    patch.activate(patch.CastConfig(dtype=half_dtype, device_types=_CPU), native=True)
    w = nn.Parameter(torch.rand(8, 8))
    x = torch.rand(4, 8)
    barrier = threading.Barrier(2)
    seen: dict[str, set[torch.dtype]] = {"off": set(), "on": set()}
    errors: list[BaseException] = []

    def work(name: str) -> None:
        try:
            barrier.wait()
            for _ in range(300):
                if name == "off":
                    with ampx.disable_casts():
                        seen[name].add(F.linear(x, w).dtype)
                else:
                    seen[name].add(F.linear(x, w).dtype)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in seen]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert seen == {"off": {torch.float32}, "on": {half_dtype}}


def test_errors_are_ampx_errors_with_the_closures_messages(half_dtype: torch.dtype) -> None:
    h = torch.rand(2, 3).to(half_dtype)
    messages = {}
    for native in (True, False):
        patch.activate(patch.CastConfig(dtype=half_dtype, device_types=_CPU), native=native)
        got = []
        for call in (lambda: h.clone().exp_(), lambda: torch.Tensor.log_(h.clone()),
                     lambda: F.binary_cross_entropy(h, h), lambda: F.linear(h, "nope")):
            try:
                call()
            except Exception as exc:
                got.append((type(exc), str(exc)))
        messages[native] = got
        patch.deactivate()
    assert messages[True] == messages[False]
    assert [t for t, _ in messages[True][:3]] == [ampx.CastError] * 3
    assert messages[True][3][0] is TypeError


def test_verbose_sessions_keep_the_closures() -> None:
    patch.activate(patch.CastConfig(dtype=torch.float16, device_types=_CPU, verbose=True))
    assert patch.active().native is False  # type: ignore[union-attr]
    assert isinstance(vars(F)["linear"], types.FunctionType)


def test_weight_cache_misses_are_made_natively_as_the_closure_makes_them(
        half_dtype: torch.dtype) -> None:
    """A miss (every weight's first cast of an iteration) never enters the cache's Python
    closure, and leaves the same entries, counters and casts: float64 and other-half
    parameters, and a parameter whose `.data` alias lives (kept out of the table)."""
    other = torch.bfloat16 if half_dtype == torch.float16 else torch.float16
    seen = {}
    for native in (True, False):
        torch.manual_seed(0)
        lin = nn.Linear(4, 4)
        wide = nn.Parameter(torch.rand(4, 4, dtype=torch.float64))
        halfish = nn.Parameter(torch.rand(4, 4).to(other))
        aliased = nn.Parameter(torch.rand(4, 4))
        patch.activate(patch.CastConfig(dtype=half_dtype, device_types=_CPU), native=native)
        cache = patch.active().cache  # type: ignore[union-attr]
        alias = aliased.data  # lives through the forward: `aliased` stays out of the table
        x = torch.rand(2, 4)
        stop = _frames_named("cached_cast")
        outs = [lin(x), lin(x), F.linear(x.double(), wide), F.linear(x, halfish),
                F.linear(x, aliased), F.linear(x, aliased)]
        closure_calls = stop()
        table = cache.table(half_dtype)
        entries = sorted((tuple(e[0].shape), e[1], e[3].dtype) for e in table.values())
        seen[native] = (cache.hits, cache.misses, entries, id(aliased) in table,
                        id(halfish) in table, outs, closure_calls)
        del alias
        patch.deactivate()
    assert seen[True][:5] == seen[False][:5]
    hits, misses, entries, aliased_cached, halfish_cached = seen[True][:5]
    # lin's weight and bias miss then hit; halfish misses once; aliased misses every time;
    # a float64 parameter is no cast (not even a miss)
    assert (hits, misses) == (2, 5)
    assert not aliased_cached and halfish_cached
    assert [e[2] for e in entries] == [half_dtype] * 3
    for a, b in zip(seen[True][5], seen[False][5]):
        _same(a, b)
        assert a.requires_grad == b.requires_grad
    assert seen[True][6] == 0, "a native miss entered the cache's Python closure"
    assert seen[False][6] > 0


def test_the_step_flag_is_read_natively_from_the_update_loop(half_dtype: torch.dtype) -> None:
    """Inside an optimizer step the casts are off; the ops of the optimizer's update loop are
    answered by the native test of the step's cached frame, not by `StepScope.__bool__`
    (once per frame that starts reading, not once per op)."""
    from ampx.o1 import regions

    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    amp = ampx.Amp("O1", dtype=half_dtype, verbosity=0)
    model, opt = amp.initialize(model, opt)
    assert patch.active().native  # type: ignore[union-attr]
    seen: list[torch.dtype] = []

    def probe(optimizer: Any, args: Any, kwargs: Any) -> None:
        seen.append(F.linear(torch.rand(2, 8), torch.rand(8, 8)).dtype)

    opt.register_step_pre_hook(probe)  # after ampx's: casts are off
    try:
        for _ in range(2):
            opt.zero_grad()
            with amp.scale_loss(model(torch.rand(4, 8)).float().sum(), opt) as scaled:
                scaled.backward()
            stop = _frames_named("__bool__")
            opt.step()
            reads = stop()
            before = [p.detach().clone() for p in model.parameters()]
            assert seen[-1] == torch.float32
            # 8 parameters x ~7 patched ops each; a few reads walk (each new reading frame)
            assert reads <= 4, f"StepScope.__bool__ ran {reads} times in one step"
        assert F.linear(torch.rand(2, 8), torch.rand(8, 8)).dtype == half_dtype
        assert not isinstance(regions._CASTS_DISABLED.get(), regions.StepScope)
        assert all(torch.isfinite(p).all() for p in before)
    finally:
        amp.restore()
