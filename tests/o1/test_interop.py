"""O1 beside torch's other tools: explicit `out=`, pickle and deepcopy, torch.jit, torch.fx.

Every case runs with both wrappers (the native C wrapper and the Python closures, as the
parity tests install them) in fp16 and bf16 (issue 33, items 1, 3, 6 and 7).
"""

import copy
import io
import pickle
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampx.o1 import interop, patch, wrappers
from ampx.o1.lists import owner_object, resolve
from ampx.o1.patch import O1Patches

_CPU = frozenset({"cpu"})


@pytest.fixture(params=["native", "closures"])
def native(request: pytest.FixtureRequest) -> bool:
    if request.param == "native" and wrappers.native_class() is None:
        pytest.skip("the native extension (CastWrapper) is not built")
    return request.param == "native"


@pytest.fixture
def o1(native: bool, half_dtype: torch.dtype) -> Iterator[O1Patches]:
    session = patch.activate(patch.CastConfig(dtype=half_dtype, device_types=_CPU),
                             native=native)
    assert session.native is native
    try:
        yield session
    finally:
        patch.deactivate()


def _closure_calls(body: Callable[[], Any]) -> tuple[Any, int]:
    """`body()` and how many times it entered a Python closure (`ampx_cast`)."""
    count = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_name == "ampx_cast":
            count[0] += 1

    sys.setprofile(profile)
    try:
        out = body()
    finally:
        sys.setprofile(None)
    return out, count[0]


# -- 1. explicit out= ---------------------------------------------------------------------------

def _out_cases(half: torch.dtype) -> dict[str, tuple[Callable[..., Any], tuple, tuple[int, ...]]]:
    """name -> (function, inputs, out shape): one per rule that has out= overloads."""
    a, b = torch.randn(3, 5), torch.randn(5, 4)
    return {
        "matmul": (torch.matmul, (a, b), (3, 4)),
        "mm": (torch.mm, (a, b), (3, 4)),
        "addmm": (torch.addmm, (torch.randn(3, 4), a, b), (3, 4)),
        "bmm": (torch.bmm, (torch.randn(2, 3, 5), torch.randn(2, 5, 4)), (2, 3, 4)),
        "mv": (torch.mv, (a, torch.randn(5)), (3,)),
        "exp": (torch.exp, (torch.randn(3, 4).to(half),), (3, 4)),  # fp32 rule
        "add": (torch.add, (torch.randn(3, 4).to(half), torch.randn(3, 4)), (3, 4)),  # promote
        "cat": (torch.cat, ([torch.randn(2, 4).to(half), torch.randn(1, 4)],), (3, 4)),
    }


@pytest.mark.parametrize("name", ["matmul", "mm", "addmm", "bmm", "mv", "exp", "add", "cat"])
def test_explicit_out_runs_as_written(o1: O1Patches, half_dtype: torch.dtype, name: str) -> None:
    fn, inputs, shape = _out_cases(half_dtype)[name]
    with patch.disable_casts():
        expected = fn(*inputs)
    out = torch.zeros(shape)
    result, closures = _closure_calls(lambda: fn(*inputs, out=out))
    assert result is out and out.dtype == torch.float32
    assert torch.equal(out, expected.float())
    if o1.native:
        assert closures == 0  # the C path saw the keyword itself
    # out=None is the ordinary call: cast as usual.
    cast = fn(*inputs, out=None)
    plain = fn(*inputs)
    assert cast.dtype == plain.dtype and torch.equal(cast, plain)
    if name in ("matmul", "mm", "addmm", "bmm", "mv"):
        assert plain.dtype == half_dtype


def test_out_keyword_in_a_kwargs_dict(o1: O1Patches) -> None:
    a, b = torch.randn(3, 5), torch.randn(5, 4)
    out = torch.zeros(3, 4)
    kwargs = {"".join(["o", "u", "t"]): out}  # a key that is not the interned "out"
    assert torch.matmul(a, b, **kwargs) is out
    with patch.disable_casts():
        assert torch.equal(out, torch.matmul(a, b))


# -- 6. pickle and deepcopy ---------------------------------------------------------------------

def _patched() -> list[tuple[str, Any]]:
    return [(f"{e.owner}.{e.name}", getattr(owner_object(e.owner), e.name)) for e in resolve()]


def test_every_patched_function_pickles_by_reference(o1: O1Patches) -> None:
    patched = _patched()
    assert len(patched) > 100
    for label, fn in patched:
        assert pickle.loads(pickle.dumps(fn)) is fn, label  # by the name it is installed under
        assert copy.deepcopy(fn) is fn and copy.copy(fn) is fn, label
    assert pickle.loads(pickle.dumps(torch.matmul)) is torch.matmul


def test_a_module_holding_a_patched_function_deepcopies_and_pickles(o1: O1Patches) -> None:
    layer = nn.TransformerEncoderLayer(8, 2, activation="gelu", dropout=0.0).eval()
    assert layer.activation is F.gelu  # the wrapper
    twin = copy.deepcopy(layer)
    again = pickle.loads(pickle.dumps(layer))
    assert twin.activation is F.gelu and again.activation is F.gelu
    x = torch.randn(3, 2, 8)
    expected = layer(x)
    for other in (twin, again):
        assert torch.equal(other(x), expected)


def test_after_restore(native: bool) -> None:
    """A wrapper kept past its session: native pickles as the original; closures refuse."""
    patch.activate(patch.CastConfig(dtype=torch.bfloat16, device_types=_CPU), native=native)
    try:
        matmul, gelu, softmax = torch.matmul, F.gelu, F.softmax
    finally:
        patch.deactivate()
    assert matmul is not torch.matmul
    for kept, original in ((matmul, torch.matmul), (gelu, F.gelu), (softmax, F.softmax)):
        assert copy.deepcopy(kept) is kept
        if native:
            assert pickle.loads(pickle.dumps(kept)) is original
        else:
            with pytest.raises(pickle.PicklingError):
                pickle.dumps(kept)


# -- 7. torch.jit ------------------------------------------------------------------------------

def test_jit_trace_records_the_casts_and_skips_the_weight_cache(o1: O1Patches,
                                                                half_dtype: torch.dtype) -> None:
    linear = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    eager = linear(x)  # fills the weight cache first: the case that failed
    assert o1.cache.misses >= 2
    traced = torch.jit.trace(linear, x)
    assert traced(x).dtype == half_dtype and torch.equal(traced(x), eager)
    casts = [n for n in traced.graph.nodes() if n.kind() == "aten::to"]
    assert len(casts) == 3  # input, weight, bias: the casts are ops of the trace
    hits = o1.cache.hits
    linear(x)
    assert o1.cache.hits == hits + 2  # the cache still serves eager calls
    patch.deactivate()
    assert torch.equal(traced(x), eager)  # its casts are part of its graph


def _functional() -> nn.Module:
    """A module calling F.linear, of a class of its own: a failed script leaves its class
    half compiled in TorchScript's compilation unit, and a later script of it would fail."""

    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4))
            self.bias = nn.Parameter(torch.randn(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, self.weight, self.bias)

    return Functional()


def test_jit_script(o1: O1Patches, half_dtype: torch.dtype) -> None:
    model = _functional()
    x = torch.randn(2, 4)
    if not o1.native:
        with pytest.raises(RuntimeError, match="torch.jit.script cannot compile O1's Python"):
            torch.jit.script(model)
        return
    scripted = torch.jit.script(model)  # F.linear is called back in Python: O1 casts it
    assert scripted(x).dtype == half_dtype and torch.equal(scripted(x), model(x))
    with pytest.raises(RuntimeError, match="Python"):
        torch.jit.save(scripted, io.BytesIO())
    patch.deactivate()
    assert scripted(x).dtype == torch.float32 and torch.equal(scripted(x), model(x))


def test_jit_script_outside_o1_saves(native: bool) -> None:
    """The way out the closures' error names: scripted before the session, it saves."""
    scripted = torch.jit.script(_functional())
    patch.activate(patch.CastConfig(dtype=torch.bfloat16, device_types=_CPU), native=native)
    try:
        torch.jit.save(scripted, io.BytesIO())
        assert scripted(torch.randn(2, 4)).dtype == torch.float32  # no casts in its graph
    finally:
        patch.deactivate()


# -- 3. torch.fx -------------------------------------------------------------------------------

class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.matmul(self.proj(x), self.proj.weight)
        y = F.linear(h, self.proj.weight) + F.gelu(x) + x.matmul(self.proj.weight)
        return torch.cat([torch.softmax(y, -1), y.float()], dim=0)


def test_fx_graph_module_returns_what_eager_o1_returns(o1: O1Patches) -> None:
    model = _Mixed()
    x = torch.randn(2, 4)
    graph_module = torch.fx.symbolic_trace(model)
    targets = {n.target for n in graph_module.graph.nodes if n.op == "call_function"}
    assert interop.call_patched in targets
    recorded = [n.args[0] for n in graph_module.graph.nodes if n.target is interop.call_patched]
    assert recorded == ["torch.matmul", "torch.nn.functional.linear",
                        "torch.nn.functional.gelu", "torch.softmax", "torch.cat"]
    expected = model(x)
    assert torch.equal(graph_module(x), expected)
    h = graph_module.proj(x)
    assert h.dtype == o1.config.dtype  # nn.Linear, a leaf module, runs the patched F.linear
    restored = pickle.loads(pickle.dumps(graph_module))
    assert torch.equal(restored(x), expected)
    patch.deactivate()
    assert torch.equal(graph_module(x), model(x))  # the session gone: the originals run
    assert graph_module(x).dtype == torch.float32


def test_fx_inside_disable_casts_records_the_originals(o1: O1Patches) -> None:
    with patch.disable_casts():
        graph_module = torch.fx.symbolic_trace(_Mixed())
    targets = {n.target for n in graph_module.graph.nodes if n.op == "call_function"}
    assert interop.call_patched not in targets
