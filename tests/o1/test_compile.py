"""O1 (and O2) under torch.compile: same dtypes as eager O1, no graph breaks, fullgraph.

Small models, few compiles: compiled functions are shared through module-scoped fixtures.
The dtype check compares, op by op, the aten ops eager O1 runs (a dispatch-mode trace) with the
ops of the compiled graph (backend=eager: the same trace of the dynamo graph running;
aot_eager: the forward graph handed to the compiler, with each node's dtype; inductor: the
graph it lowers, against the one it lowers for eager O1's own ops).
"""

from __future__ import annotations

import collections
import copy
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._decomp
import torch._dynamo
import torch._inductor.config
import torch._inductor.exc
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor.compile_fx import compile_fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

import ampx
from ampx.o1 import patch, wrappers
from ampx.o1 import regions as cast_regions
from ampx.o1.regions import LOCAL


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.b(self.norm(F.gelu(self.a(x)))), -1)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)
        self.gn, self.head = nn.GroupNorm(2, 8), nn.Linear(8 * 6 * 6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gn(torch.relu(self.bn(self.conv(x)))).flatten(1))


class Attention(nn.Module):
    """Embedding, nn.MultiheadAttention, a residual, LayerNorm, sdpa, `@` and Tensor.softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mha = nn.Embedding(50, 16), nn.MultiheadAttention(16, 2, batch_first=True)
        self.norm, self.qkv, self.out = nn.LayerNorm(16), nn.Linear(16, 48), nn.Linear(16, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        a, _ = self.mha(x, x, x, need_weights=False)
        x = self.norm(x + a)
        q, k, v = self.qkv(x).chunk(3, -1)
        y = self.out(F.scaled_dot_product_attention(q, k, v))
        return (y @ y.transpose(1, 2)).softmax(-1)


ZOO: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "mlp": (MLP, lambda: torch.randn(4, 16)),
    "conv": (ConvNet, lambda: torch.randn(2, 3, 8, 8)),
    "attention": (Attention, lambda: torch.randint(0, 50, (2, 5))),
}
HALVES = {"fp16": torch.float16, "bf16": torch.bfloat16}

# Ops whose output dtype says nothing about the policy (views, copies, factories).
_IGNORED = {"t", "view", "_unsafe_view", "transpose", "permute", "expand", "reshape", "unsqueeze",
            "squeeze", "clone", "detach", "alias", "_to_copy", "copy", "empty", "zeros", "ones",
            "select", "slice", "split", "split_with_sizes", "unbind", "as_strided", "lift_fresh",
            "lift_fresh_copy", "empty_like", "zeros_like", "fill", "new_empty", "arange",
            "scalar_tensor", "full", "_unsafe_index", "empty_strided"}

# Spellings of one op in eager dispatch and in a functionalized graph.
_SAME_OP = {"_native_batch_norm_legit": "native_batch_norm"}

Trace = collections.Counter


def _key(op: Any, value: Any) -> tuple[str, torch.dtype] | None:
    name = op._schema.name.split("::")[-1].removesuffix("_functional").rstrip("_")
    name = _SAME_OP.get(name, name)
    while isinstance(value, (tuple, list)) and value:
        value = value[0]
    if name in _IGNORED or not isinstance(value, torch.Tensor):
        return None
    return name, value.dtype


class _Recorder(TorchDispatchMode):
    def __init__(self, trace: Trace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        key = _key(func, out)
        if key is not None:
            self.trace[key] += 1
        return out


def _eager_trace(model: Callable[[torch.Tensor], Any], x: torch.Tensor) -> Trace:
    trace: Trace = collections.Counter()
    with _Recorder(trace):
        model(x)
    return trace


def _traced_backend(trace: Trace, kind: str) -> Any:
    """backend=eager that runs the dynamo graph under the recorder, or aot_eager that reads
    the forward graph's node dtypes."""
    if kind == "eager":
        def eager_backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
            def run(*args: Any) -> Any:
                with _Recorder(trace):
                    return gm(*args)
            return run
        return eager_backend

    def forward_compiler(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        for node in gm.graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                key = _key(node.target, node.meta.get("val"))
                if key is not None:
                    trace[key] += 1
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=forward_compiler)


def _o1(half: torch.dtype) -> None:
    patch.activate(patch.CastConfig(dtype=half, device_types=frozenset({"cpu"})))


@pytest.mark.parametrize("kind", ["eager", "aot_eager"])
@pytest.mark.parametrize("half", list(HALVES.values()), ids=list(HALVES))
@pytest.mark.parametrize("name", list(ZOO))
def test_compiled_graph_has_eager_o1_dtypes(name: str, half: torch.dtype, kind: str) -> None:
    make, data = ZOO[name]
    model, x = make(), data()
    _o1(half)
    expected = _eager_trace(model, x)
    assert (("addmm", half) in expected or ("convolution", half) in expected
            or ("mm", half) in expected), expected  # the trace sees O1's casts
    seen: Trace = collections.Counter()
    compiled = torch.compile(model, backend=_traced_backend(seen, kind), fullgraph=True)
    out = compiled(x)
    assert dict(seen) == dict(expected)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)


@pytest.mark.parametrize("name", list(ZOO))
def test_no_graph_breaks(name: str) -> None:
    make, data = ZOO[name]
    _o1(torch.bfloat16 if name == "conv" else torch.float16)
    explained = torch._dynamo.explain(make())(data())
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.skipif(wrappers.native_class() is None, reason="the native extension is not built")
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_native_wrappers_compile_through_their_closures(backend: str) -> None:
    """Dynamo inlines the native wrappers' Python `__call__` (the closure): eager O1's result
    and dtype, one graph, fullgraph. (The tests above run with the native wrappers too
    whenever the extension is built.)"""
    model, x = MLP(), torch.randn(4, 16)
    patch.activate(patch.CastConfig(dtype=torch.bfloat16, device_types=frozenset({"cpu"})),
                   native=True)
    assert type(vars(F)["linear"]) is wrappers.native_class()
    expected = model(x)
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    out = torch.compile(model, backend=backend, fullgraph=True)(x)
    assert out.dtype == expected.dtype == torch.float32  # softmax last: float32
    tol = 0 if backend != "inductor" else 1e-2
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


class _Recorded(Exception):
    """Stops a compile once its graph is recorded (no code generated for the reference)."""


class _PostGrad(CustomGraphPass):
    """Records the graph inductor lowers (after its decompositions and post-grad passes)."""

    def __init__(self, stop: bool = False) -> None:
        self.traces: list[Trace] = []
        self.stop = stop

    def __call__(self, graph: torch.fx.Graph) -> None:
        trace: Trace = collections.Counter()
        casts = set()
        for node in graph.nodes:
            if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                continue
            name = node.target._schema.name.split("::")[-1]
            if name == "copy_":  # running stats written back in or after the graph: no cast
                continue
            value = node.meta.get("val")
            while isinstance(value, (tuple, list)) and value:
                value = value[0]
            dtype = value.dtype if isinstance(value, torch.Tensor) else None
            if name == "convert_element_type":  # one value cast twice to one dtype: one cast
                if (node.args[0], dtype) in casts:
                    continue
                casts.add((node.args[0], dtype))
            trace[name, dtype] += 1
        self.traces.append(trace)
        if self.stop:
            raise _Recorded

    def uuid(self) -> None:  # never served from inductor's caches: the pass must run
        return None


def _eager_o1_graph(model: nn.Module, x: torch.Tensor) -> tuple[torch.fx.GraphModule, list]:
    """Eager O1's aten ops as a graph (make_fx runs the eager wrappers), weights as inputs.

    Training batch norm is spelt as AOT spells it (`_native_batch_norm_legit`), so that
    inductor decomposes both graphs' batch norms alike.
    """
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    names = list(state)

    def run(inp: torch.Tensor, *flat: torch.Tensor) -> Any:
        return functional_call(model, dict(zip(names, flat)), (inp,))

    bn = torch.ops.aten.native_batch_norm.default
    flat = [v.detach().clone().requires_grad_(v.requires_grad) for v in state.values()]
    # Grad mode, as eager ran (matmul folds to mm or not depending on it).
    gm = make_fx(run, decomposition_table={bn: torch._decomp.decomposition_table[bn]})(x, *flat)
    return gm, [x, *flat]


_MATMUL_CONV = ("mm", "addmm", "bmm", "convolution", "_scaled_dot_product_flash_attention_for_cpu",
                "embedding")


@pytest.mark.parametrize("half", list(HALVES.values()), ids=list(HALVES))
@pytest.mark.parametrize("name", list(ZOO))
def test_inductor_compiles_eager_o1_ops(name: str, half: torch.dtype) -> None:
    """The graph inductor lowers for a compiled O1 model, op by op.

    Inductor decomposes softmax, norms and GELU into primitives (amax/exp/sum, var_mean...),
    so its graph cannot be matched with eager's ops one to one. It is compared instead with
    the graph inductor lowers for eager O1's own op sequence (traced by make_fx, casts
    included): the same ops with the same dtypes, and no extra or missing cast. The matmul,
    conv, attention and embedding kernels, which inductor keeps, are also compared with
    eager O1 directly. Forward graph of a training compile; the output matches eager O1.
    """
    make, data = ZOO[name]
    model, x = make(), data()
    _o1(half)
    expected = model(x)
    eager_ops = _eager_trace(model, x)
    graph, inputs = _eager_o1_graph(model, x)
    reference, seen = _PostGrad(stop=True), _PostGrad()
    with torch._inductor.config.patch(compile_threads=1, fx_graph_cache=False):  # no worker pool
        with torch._inductor.config.patch(post_grad_custom_post_pass=reference):
            with pytest.raises(torch._inductor.exc.InductorError, match="_Recorded"):
                compile_fx(graph, inputs)
        with torch._inductor.config.patch(post_grad_custom_post_pass=seen):
            out = torch.compile(model, backend="inductor", fullgraph=True)(x)
    assert len(seen.traces) == len(reference.traces) == 1  # the forward graph
    assert dict(seen.traces[0]) == dict(reference.traces[0])
    kernels = {k: n for k, n in eager_ops.items() if k[0] in _MATMUL_CONV}
    assert {k: n for k, n in seen.traces[0].items() if k[0] in _MATMUL_CONV} == kernels
    assert any(dtype is half for _, dtype in kernels), kernels
    assert out.dtype == expected.dtype
    tol = 4 * torch.finfo(half).eps  # a few roundings of the half dtype (fused kernels)
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


def _train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
           y: torch.Tensor) -> list[float]:
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = F.mse_loss(model(x).float(), y)
        with ampx.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# dynamo reads .grad of a non-leaf output while tracing O2's output-cast hook (torch-internal).
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("half", list(HALVES.values()), ids=list(HALVES))
def test_compiled_training_step_matches_eager(level: str, half: torch.dtype,
                                              backend: str) -> None:
    """Model compiled (forward and backward graphs), scale_loss and step eager: 5 steps."""
    base = MLP()
    eager_model, compiled_model = copy.deepcopy(base), copy.deepcopy(base)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager_model, compiled_model)]
    models, opts = ampx.initialize([eager_model, compiled_model], opts, opt_level=level,
                                   dtype=half, verbosity=0)
    x, y = torch.randn(4, 16), torch.rand(4, 8)
    expected = _train(models[0], opts[0], x, y)
    compiled = torch.compile(models[1], backend=backend, fullgraph=True)
    got = _train(compiled, opts[1], x, y)  # type: ignore[arg-type]
    tol = 1e-2 if half is torch.bfloat16 else 1e-3
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    assert expected[-1] < expected[0]


def _with_region(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Functions, Tensor methods and operators, inside and outside a region (y is half)."""
    a = F.linear(x, w)
    with ampx.disable_casts():
        inside = (F.linear(x, w), torch.mm(x, w), torch.softmax(a, -1), x @ w, x.mm(w),
                  y.softmax(-1), F.softmax(y, -1), F.gelu(y))
    return (a, *inside, x @ w, y.softmax(-1), F.softmax(y, -1), torch.mm(x, w))


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_disable_casts_inside_a_compiled_function(backend: str) -> None:
    """A region in compiled code covers functions, Tensor methods and operators, fullgraph,
    with eager O1's dtypes inside and outside it (backend=eager runs the graph as Python)."""
    _o1(torch.bfloat16)
    x, w, y = torch.randn(3, 4), torch.randn(4, 4), torch.randn(3, 4).bfloat16()
    expected = _with_region(x, w, y)
    half, fp32 = torch.bfloat16, torch.float32
    assert [t.dtype for t in expected] == [half, fp32, fp32, half, fp32, fp32, half, half,
                                           half, half, fp32, fp32, half]
    lowered = _PostGrad()  # inductor: the graph it lowers holds no region op
    with torch._inductor.config.patch(compile_threads=1, post_grad_custom_post_pass=lowered):
        got = torch.compile(_with_region, backend=backend, fullgraph=True)(x, w, y)
    assert [t.dtype for t in got] == [t.dtype for t in expected]
    assert len(lowered.traces) == (backend == "inductor")
    assert not any(name == "disable_casts_region" for t in lowered.traces for name, _ in t)
    tol = 0 if backend != "inductor" else 1e-2
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert LOCAL.depth == 0 and not cast_regions.casts_disabled()
    assert not any(cast_regions._TRACE_DEPTH.values())


class _Region(nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Any:
        return _with_region(x, w, y)


# torch's own: strict export reports the region's depth writes (dropped by dynamo, as for
# every compile: the region leaves the depth as it found it), and a pytree deprecation.
@pytest.mark.filterwarnings("ignore:While compiling, we found certain side effects")
@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non_strict"])
def test_export_of_a_region(strict: bool) -> None:
    """torch.export gives eager O1's dtypes in and out of a region; its pre-dispatch graph
    keeps the region op, which run_decompositions() removes (it decomposes to nothing)."""
    _o1(torch.bfloat16)
    x, w, y = torch.randn(3, 4), torch.randn(4, 4), torch.randn(3, 4).bfloat16()
    expected = [t.dtype for t in _with_region(x, w, y)]
    program = torch.export.export(_Region(), (x, w, y), strict=strict)

    def region_ops(p: Any) -> int:
        return sum("disable_casts_region" in str(n.target) for n in p.graph.nodes)

    assert region_ops(program) == 2
    decomposed = program.run_decompositions()
    assert region_ops(decomposed) == 0
    for p in (program, decomposed):
        assert [t.dtype for t in p.module()(x, w, y)] == expected
    assert not cast_regions.casts_disabled()


def _break_in_region(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    a = x @ w
    with ampx.disable_casts():
        b, c = x @ w, torch.mm(x, w)
        torch._dynamo.graph_break()
        d, e = x.mm(w), F.linear(x, w)
    return a, b, c, d, e, torch.mm(x, w)


# Run as Python after the break, `x @ w` calls its wrapper, which dynamo compiles on its own
# and warns about (once) at the C method the wrapper calls: dynamo's, about a frame it skips.
@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace the builtin")
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_graph_break_inside_a_compiled_region(backend: str) -> None:
    """After a graph break in a region, dynamo runs the rest as Python and compiles the frames
    it calls one by one: the region's own frames run as Python (the eager region), so what
    follows the break is not cast either."""
    _o1(torch.bfloat16)
    x, w = torch.randn(3, 4), torch.randn(4, 4)
    expected = _break_in_region(x, w)
    assert [t.dtype for t in expected] == [torch.bfloat16] + [torch.float32] * 4 + [
        torch.bfloat16]
    got = torch.compile(_break_in_region, backend=backend)(x, w)
    assert [t.dtype for t in got] == [t.dtype for t in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert LOCAL.depth == 0 and not cast_regions.casts_disabled()


def _index_in_region(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    with ampx.disable_casts():
        return x[i] * 2


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_exception_inside_a_compiled_region(backend: str) -> None:
    """The documented limit: backend=eager runs dynamo's graph as Python, so a graph raising
    inside a region leaves the region on in this thread (as torch.no_grad() in such a graph
    leaves grad mode off). aot_eager (and inductor) graphs hold no region op."""
    _o1(torch.bfloat16)
    compiled = torch.compile(_index_in_region, backend=backend, fullgraph=True)
    compiled(torch.randn(3), torch.tensor([1]))
    with pytest.raises(IndexError):
        compiled(torch.randn(3), torch.tensor([10]))  # index out of range, at run time
    left_on = cast_regions.casts_disabled()
    while cast_regions._RUNTIME.stack:  # leave the thread clean for the other tests
        torch.ops.ampx.disable_casts_region(-1)
    assert left_on is (backend == "eager")
    assert not cast_regions.casts_disabled()


def test_region_op_is_in_dynamo_graph_only() -> None:
    """The region op marks the region in dynamo's graph (entry, exit); it decomposes to
    nothing, so AOT's forward graph holds none."""
    _o1(torch.bfloat16)
    counts: dict[str, int] = {}

    def count(name: str) -> Callable[[torch.fx.GraphModule, Any], Any]:
        def compiler(gm: torch.fx.GraphModule, inputs: Any) -> Any:
            counts[name] = sum("disable_casts_region" in str(n.target) for n in gm.graph.nodes)
            return make_boxed_func(gm.forward) if name == "aot" else gm.forward
        return compiler

    aot = aot_autograd(fw_compiler=count("aot"))

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        count("dynamo")(gm, inputs)
        return aot(gm, inputs)

    x, w, y = torch.randn(3, 4), torch.randn(4, 4), torch.randn(3, 4).bfloat16()
    torch.compile(_with_region, backend=backend, fullgraph=True)(x, w, y)
    assert counts == {"dynamo": 2, "aot": 0}


def _region_around(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        with ampx.disable_casts():
            return model(x)
    return run


@pytest.mark.parametrize("kind", ["eager", "aot_eager"])
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_in_a_compiled_region_has_eager_dtypes(name: str, kind: str) -> None:
    """The zoo run in a region of the compiled function: eager's ops in that region, op by op
    (no casts at all), one graph, no break."""
    make, data = ZOO[name]
    model, x = make(), data()
    _o1(torch.float16)
    run = _region_around(model)
    expected = _eager_trace(run, x)
    assert all(dtype is not torch.float16 for _, dtype in expected), expected
    seen: Trace = collections.Counter()
    out = torch.compile(run, backend=_traced_backend(seen, kind), fullgraph=True)(x)
    assert dict(seen) == dict(expected)
    torch.testing.assert_close(out, run(x), rtol=0, atol=0)
    explained = torch._dynamo.explain(run)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


def test_compiled_code_follows_session_changes() -> None:
    """Compiled during a session: fp32 again after restore, recompiled for the next one."""
    model, x = MLP(), torch.randn(4, 16)
    compiled = torch.compile(model.a, backend="aot_eager", fullgraph=True)
    _o1(torch.bfloat16)
    assert compiled(x).dtype == torch.bfloat16
    ampx.restore()
    assert compiled(x).dtype == torch.float32
    _o1(torch.float16)
    assert compiled(x).dtype == torch.float16


def test_inductor_caches_serve_no_graph_across_sessions() -> None:
    """Dynamo's graph of Tensor methods and operators is the same in and out of a session
    (their wrappers run only while AOT traces), and AOTAutograd's cache is keyed on it: ampx
    turns that cache off during a session, so a graph compiled in a session is not served
    to plain code after restore (nor to another session: the same key)."""
    unique = time.time_ns() % 100_003 + 2  # a constant of the graph: no earlier run's entry

    def methods_only(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x @ w, x.mm(w), x.softmax(-1) * unique

    x, w = torch.randn(3, 4), torch.randn(4, 4)
    got = []
    with torch._inductor.config.patch(compile_threads=1, fx_graph_cache=True):
        _o1(torch.bfloat16)
        for _ in range(2):
            compiled = torch.compile(methods_only, backend="inductor", fullgraph=True)
            got.append([t.dtype for t in compiled(x, w)])
            ampx.restore()
    assert got == [[torch.bfloat16, torch.bfloat16, torch.float32], [torch.float32] * 3]


def test_region_around_a_compiled_call_is_per_thread() -> None:
    """The guarded depth is this thread's: another thread calling the same compiled function
    meanwhile gets O1's casts (its own compile), and this thread keeps the region's graph."""
    _o1(torch.bfloat16)
    compiled = torch.compile(_methods_only, backend="aot_eager", fullgraph=True)
    x, w = torch.randn(3, 4), torch.randn(4, 4)
    other: list[tuple[torch.Tensor, ...]] = []
    with ampx.disable_casts():
        inside = compiled(x, w)
        thread = threading.Thread(target=lambda: other.append(compiled(x, w)))
        thread.start()
        thread.join()
        again = compiled(x, w)
    assert [t.dtype for t in inside] == [t.dtype for t in again] == [torch.float32] * 3
    assert [t.dtype for t in other[0]] == [torch.bfloat16, torch.bfloat16, torch.float32]


_POISONING = textwrap.dedent("""
    import torch
    from torch import nn
    import ampx
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    ampx.initialize(nn.Linear(2, 2), opt_level="O1", dtype="bf16", verbosity=0)
    captured = torch.nn.functional.linear  # a module that did `from ... import linear`
    import torch._inductor.compile_fx  # inductor's first import (its tables), in the session
    ampx.restore()
    x = torch.randn(8, 16)
    eager = model(x)
    out = torch.compile(model, backend="inductor")(x)
    print("diff", (out - eager).abs().max().item())
    print("captured", captured(x, model[0].weight).dtype)
    f = torch.compile(lambda a: torch.matmul(a, a), backend="eager", fullgraph=True)
    print("matmul", f(torch.randn(3, 3)).dtype)
""")


def test_no_process_wide_damage_after_restore() -> None:
    """Inductor first imported inside an O1 session; then a plain fp32 model compiles right."""
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}  # no compile-worker pool
    run = subprocess.run([sys.executable, "-c", _POISONING], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines())
    assert float(lines["diff"]) < 1e-5
    assert lines["captured"] == "torch.float32"
    assert lines["matmul"] == "torch.float32"


def _methods_only(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return x @ w, x.mm(w), x.softmax(-1)


def _mixed(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    y = x @ w  # Tensor.__matmul__: lower
    return y, F.linear(x, w), y.softmax(-1)  # F.linear: lower; Tensor.softmax: fp32


@pytest.mark.parametrize("fn", [_mixed, _methods_only], ids=["mixed", "methods_only"])
def test_disable_casts_around_a_compiled_call_covers_everything(
        fn: Callable[..., tuple[torch.Tensor, ...]]) -> None:
    """Entered outside the compiled call, the region is real while tracing: Tensor methods
    and functions are left alone. The region's depth is guarded (read by F.linear in traced
    code, or by the Tensor-method wrappers while dynamo traces), so the same function is
    compiled again for calls outside the region, and the first graph serves calls inside."""
    _o1(torch.bfloat16)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    x, w = torch.randn(3, 4), torch.randn(4, 4)
    with ampx.disable_casts():
        inside = compiled(x, w)
    outside = compiled(x, w)
    with ampx.disable_casts():
        again = compiled(x, w)
    expected = fn(x, w)
    with ampx.disable_casts():
        expected_inside = fn(x, w)
    assert [t.dtype for t in inside] == [t.dtype for t in again] == [torch.float32] * 3
    assert [t.dtype for t in expected_inside] == [torch.float32] * 3
    assert [t.dtype for t in outside] == [t.dtype for t in expected]
    assert [t.dtype for t in expected] == [torch.bfloat16, torch.bfloat16, torch.float32]


def test_dynamo_rules_rebuilt_during_a_session_are_dropped() -> None:
    """torch clears dynamo's rule map at times (init_process_group); rebuilt while patched,
    it would make the originals untraceable after restore."""
    from torch._dynamo import trace_rules

    _o1(torch.bfloat16)
    trace_rules.clear_lru_cache()  # what init_process_group does
    trace_rules.get_torch_obj_rule_map()  # rebuilt with the session's wrappers
    ampx.restore()
    model, x = MLP(), torch.randn(4, 16)
    out = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(out, model(x))
