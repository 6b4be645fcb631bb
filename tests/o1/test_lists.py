"""Every cast-list entry, called with valid inputs under O1, computes in its documented dtype.

The cases are generated from `ampx.o1.lists.resolve()`: each entry needs a calling recipe in
`RECIPES` (keyed by name, or by (owner, name) where the signatures differ), and the test
fails for an entry without one, so a list can't grow untested. What each call computes in is
observed twice: the dtype of the floating tensors that reach torch's implementation (through a
TorchFunctionMode) and, where the result is floating, its dtype.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import ampx
from ampx.o1 import lists, patch
from ampx.o1.lists import CastRule, ListEntry

Make = Callable[..., torch.Tensor]
Recipe = Callable[[Any, Make], Any]


def _long(*values: Any) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


# How to call each listed function: recipe(fn, t) where t(*shape) makes a floating tensor
# (values in (0.1, 0.9), valid for log/acos/erfinv...). Tensor methods are called as
# torch.Tensor.name(self, ...), so one recipe serves torch.name and Tensor.name.
RECIPES: dict[Any, Recipe] = {
    # lower
    "conv1d": lambda f, t: f(t(1, 2, 5), t(3, 2, 3)),
    "conv2d": lambda f, t: f(t(1, 2, 5, 5), t(3, 2, 3, 3)),
    "conv3d": lambda f, t: f(t(1, 2, 4, 4, 4), t(3, 2, 2, 2, 2)),
    "conv_transpose1d": lambda f, t: f(t(1, 2, 5), t(2, 3, 3)),
    "conv_transpose2d": lambda f, t: f(t(1, 2, 5, 5), t(2, 3, 3, 3)),
    "conv_transpose3d": lambda f, t: f(t(1, 2, 4, 4, 4), t(2, 3, 2, 2, 2)),
    "conv_tbc": lambda f, t: f(t(5, 1, 2), t(3, 2, 4), t(4), 1),
    "linear": lambda f, t: f(t(2, 4), t(3, 4), t(3)),
    "bilinear": lambda f, t: f(t(2, 3), t(2, 4), t(5, 3, 4), t(5)),
    "prelu": lambda f, t: f(t(2, 3), t(1)),
    "scaled_dot_product_attention": lambda f, t: f(t(1, 2, 4, 8), t(1, 2, 4, 8), t(1, 2, 4, 8)),
    "addmm": lambda f, t: f(t(2, 3), t(2, 4), t(4, 3)),
    "addmv": lambda f, t: f(t(2), t(2, 3), t(3)),
    "addr": lambda f, t: f(t(2, 3), t(2), t(3)),
    "matmul": lambda f, t: f(t(2, 3), t(3, 4)),
    "mm": lambda f, t: f(t(2, 3), t(3, 4)),
    "mv": lambda f, t: f(t(2, 3), t(3)),
    "bmm": lambda f, t: f(t(2, 2, 3), t(2, 3, 4)),
    "baddbmm": lambda f, t: f(t(2, 2, 4), t(2, 2, 3), t(2, 3, 4)),
    "addbmm": lambda f, t: f(t(2, 4), t(2, 2, 3), t(2, 3, 4)),
    "einsum": lambda f, t: f("ij,jk->ik", t(2, 3), t(3, 4)),
    "chain_matmul": lambda f, t: f(t(2, 3), t(3, 4), t(4, 2)),
    "__matmul__": lambda f, t: f(t(2, 3), t(3, 4)),
    "__rmatmul__": lambda f, t: f(t(3, 4), t(2, 3)),
    # fp32
    "interpolate": lambda f, t: f(t(1, 1, 4), scale_factor=2, mode="linear"),
    "grid_sample": lambda f, t: f(t(1, 1, 4, 4), t(1, 2, 2, 2), align_corners=False),
    "softplus": lambda f, t: f(t(2, 3)),
    "softmin": lambda f, t: f(t(2, 3), -1),
    "softmax": lambda f, t: f(t(2, 3), -1),
    "log_softmax": lambda f, t: f(t(2, 3), -1),
    "cpu": lambda f, t: f(t(2, 3)),
    "gelu": lambda f, t: f(t(2, 3)),
    "layer_norm": lambda f, t: f(t(2, 4), [4]),
    "group_norm": lambda f, t: f(t(2, 4, 3), 2),
    "local_response_norm": lambda f, t: f(t(1, 4, 3), 2),
    "rms_norm": lambda f, t: f(t(2, 4), [4]),
    "normalize": lambda f, t: f(t(2, 3)),
    "cosine_similarity": lambda f, t: f(t(2, 3), t(2, 3)),
    "pairwise_distance": lambda f, t: f(t(2, 3), t(2, 3)),
    "pdist": lambda f, t: f(t(3, 4)),
    "cdist": lambda f, t: f(t(2, 3), t(4, 3)),
    "poisson_nll_loss": lambda f, t: f(t(2, 3), t(2, 3)),
    ("torch", "poisson_nll_loss"): lambda f, t: f(t(2, 3), t(2, 3), True, False, 1e-8, 1),
    "gaussian_nll_loss": lambda f, t: f(t(2, 3), t(2, 3), t(2, 3)),
    "cosine_embedding_loss": lambda f, t: f(t(2, 3), t(2, 3), torch.ones(2)),
    "cross_entropy": lambda f, t: f(t(2, 3), _long(0, 1)),
    "hinge_embedding_loss": lambda f, t: f(t(2, 3), torch.ones(2, 3)),
    "kl_div": lambda f, t: f(t(2, 3), t(2, 3), reduction="batchmean"),
    ("torch", "kl_div"): lambda f, t: f(t(2, 3), t(2, 3)),
    "l1_loss": lambda f, t: f(t(2, 3), t(2, 3)),
    "mse_loss": lambda f, t: f(t(2, 3), t(2, 3)),
    "huber_loss": lambda f, t: f(t(2, 3), t(2, 3)),
    "smooth_l1_loss": lambda f, t: f(t(2, 3), t(2, 3)),
    "soft_margin_loss": lambda f, t: f(t(2, 3), t(2, 3)),
    "margin_ranking_loss": lambda f, t: f(t(2), t(2), torch.ones(2)),
    "multilabel_margin_loss": lambda f, t: f(t(2, 3), torch.tensor([[0, 1, -1], [2, -1, 0]])),
    "multilabel_soft_margin_loss": lambda f, t: f(t(2, 3), torch.ones(2, 3)),
    "multi_margin_loss": lambda f, t: f(t(2, 3), _long(0, 2)),
    "nll_loss": lambda f, t: f(t(2, 3), _long(0, 1)),
    "binary_cross_entropy_with_logits": lambda f, t: f(t(2, 3), t(2, 3)),
    "triplet_margin_loss": lambda f, t: f(t(2, 3), t(2, 3), t(2, 3)),
    "triplet_margin_with_distance_loss": lambda f, t: f(t(2, 3), t(2, 3), t(2, 3)),
    "ctc_loss": lambda f, t: f(t(5, 2, 4), torch.tensor([[1, 2], [1, 1]]), _long(5, 5),
                               _long(2, 2)),
    **{name: (lambda f, t: f(t(2, 3))) for name in (
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log1p", "log2",
        "reciprocal", "rsqrt", "sinh", "tan", "norm", "prod", "std", "sum", "var",
        "nuclear_norm", "std_mean", "var_mean",
    )},
    "frobenius_norm": lambda f, t: f(t(2, 3), [0, 1]),
    "pow": lambda f, t: f(t(2, 3), 2),
    "__pow__": lambda f, t: f(t(2, 3), 2),
    "__rpow__": lambda f, t: f(t(2, 3), 2),
    "cumprod": lambda f, t: f(t(2, 3), 1),
    "cumsum": lambda f, t: f(t(2, 3), 1),
    "logsumexp": lambda f, t: f(t(2, 3), 1),
    "dist": lambda f, t: f(t(2, 3), t(2, 3)),
    "renorm": lambda f, t: f(t(2, 3), 2, 0, 1.0),
    # banned
    "binary_cross_entropy": lambda f, t: f(t(2, 3), t(2, 3)),
    # promote
    "addcdiv": lambda f, t: f(t(2, 3), t(2, 3), t(2, 3)),
    "addcmul": lambda f, t: f(t(2, 3), t(2, 3), t(2, 3)),
    ("torch", "bilinear"): lambda f, t: f(t(2, 3), t(2, 4), t(5, 3, 4), t(5)),
    "cross": lambda f, t: f(t(2, 3), t(2, 3), dim=1),
    "dot": lambda f, t: f(t(3), t(3)),
    "vdot": lambda f, t: f(t(3), t(3)),
    "tensordot": lambda f, t: f(t(2, 3), t(3, 4), dims=1),
    "index_put": lambda f, t: f(t(3), (_long(0, 2),), t(2)),
    "scatter_add": lambda f, t: f(t(3), 0, _long(0, 2), t(2)),
    **{name: (lambda f, t: f(t(2, 3), t(2, 3))) for name in (
        "atan2", "add", "sub", "div", "mul", "eq", "equal", "ge", "gt", "le", "lt", "ne",
        "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
        "__rtruediv__", "__div__", "__rdiv__", "__eq__", "__ne__", "__ge__", "__gt__",
        "__le__", "__lt__",
    )},
    # sequence promote
    **{name: (lambda f, t: f([t(2, 3), t(2, 3)])) for name in (
        "cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack", "column_stack",
    )},
    # RNN entry points, reached through their modules (fn is unused)
    "lstm": lambda f, t: nn.LSTM(4, 3)(t(5, 2, 4)),
    "gru": lambda f, t: nn.GRU(4, 3)(t(5, 2, 4)),
    "rnn_tanh": lambda f, t: nn.RNN(4, 3)(t(5, 2, 4)),
    "rnn_relu": lambda f, t: nn.RNN(4, 3, nonlinearity="relu")(t(5, 2, 4)),
    "lstm_cell": lambda f, t: nn.LSTMCell(4, 3)(t(2, 4)),
    "gru_cell": lambda f, t: nn.GRUCell(4, 3)(t(2, 4)),
    "rnn_tanh_cell": lambda f, t: nn.RNNCell(4, 3)(t(2, 4)),
    "rnn_relu_cell": lambda f, t: nn.RNNCell(4, 3, nonlinearity="relu")(t(2, 4)),
    "check_input": lambda f, t: nn.LSTM(4, 3)(t(5, 2, 4)),
}


def _base_name(name: str) -> str:
    """The out-of-place name whose recipe an in-place entry uses (add_ -> add, __iadd__)."""
    if name.startswith("__i") and name.endswith("__"):
        return "__" + name[3:]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def recipe_for(entry: ListEntry) -> Recipe | None:
    """The calling recipe of an entry (in-place entries use their base function's)."""
    for key in ((entry.owner.split(".")[-1], entry.name), entry.name,
                (entry.owner.split(".")[-1], _base_name(entry.name)), _base_name(entry.name)):
        if key in RECIPES:
            return RECIPES[key]
    return None


ENTRIES = lists.resolve()


def _id(entry: ListEntry) -> str:
    return f"{entry.owner}.{entry.name}"


def test_every_entry_has_a_recipe() -> None:
    missing = [_id(e) for e in ENTRIES if recipe_for(e) is None]
    assert not missing, f"add a calling recipe to tests/o1/test_lists.py for: {missing}"


def test_listed_names_exist_on_installed_torch() -> None:
    assert lists.missing() == []
    for entry in ENTRIES:
        if entry.owner == "torch._VF":
            assert hasattr(torch._C._VariableFunctions, entry.name)
        else:
            assert callable(getattr(lists.owner_object(entry.owner), entry.name))


def test_no_name_is_listed_twice() -> None:
    keys = [(e.owner, e.name) for e in ENTRIES]
    assert len(keys) == len(set(keys))


def test_apex_lists_are_included() -> None:
    names = {(e.owner, e.name): e.policy for e in ENTRIES}
    for name in ("conv2d", "linear", "conv_tbc"):
        assert names[("torch.nn.functional", name)] is CastRule.LOWER
    for name in ("softmax", "log_softmax", "layer_norm", "cross_entropy", "ctc_loss"):
        assert names[("torch.nn.functional", name)] is CastRule.FP32
    for name in ("addmm", "matmul", "mm", "bmm", "baddbmm", "addbmm"):
        assert names[("torch", name)] is CastRule.LOWER
        assert names[("torch.Tensor", name)] is CastRule.LOWER
    for name in ("exp", "log", "pow", "sum", "softmax", "cumsum", "norm"):
        assert names[("torch", name)] is CastRule.FP32
    for name in ("add", "mul", "cat", "stack"):
        assert names[("torch", name)] in (CastRule.PROMOTE, CastRule.SEQUENCE_PROMOTE)
    assert names[("torch.Tensor", "__matmul__")] is CastRule.LOWER
    assert names[("torch.Tensor", "__iadd__")] is CastRule.INPLACE_MATCH_SELF
    assert names[("torch.Tensor", "exp_")] is CastRule.INPLACE_FP32_ERROR
    assert names[("torch.nn.functional", "binary_cross_entropy")] is CastRule.BANNED


class _Recorder(TorchFunctionMode):
    """Records the floating dtypes of the tensors each torch call receives."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, set[torch.dtype]]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        found: set[torch.dtype] = set()
        _collect((args, kwargs), found)
        name = getattr(func, "__name__", "") or getattr(func, "__wrapped__", func).__name__
        self.calls.append((name, found))
        return func(*args, **kwargs)


def _collect(value: Any, found: set[torch.dtype]) -> None:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            found.add(value.dtype)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _collect(v, found)


def _maker(dtypes: list[torch.dtype]) -> Make:
    """t(*shape): the i-th tensor made gets dtypes[i] (the last one repeats)."""
    made = [0]

    def t(*shape: int) -> torch.Tensor:
        dtype = dtypes[min(made[0], len(dtypes) - 1)]
        made[0] += 1
        with torch._C.DisableTorchFunction():  # not recorded as the operation under test
            return (torch.rand(*shape) * 0.8 + 0.1).to(dtype)

    return t


def _call(entry: ListEntry, t: Make) -> tuple[Any, list[tuple[str, set[torch.dtype]]]]:
    fn = getattr(lists.owner_object(entry.owner), entry.name)
    recipe = recipe_for(entry)
    assert recipe is not None
    recorder = _Recorder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecations of listed functions (chain_matmul...)
        with recorder:
            out = recipe(fn, t)
    return out, recorder.calls


# Calls the recorder sees that are not the listed operation itself: property reads, the
# casts ampx makes, and shape queries of modules.
_NOT_THE_OP = {"__get__", "half", "float", "bfloat16", "double", "to", "dim", "size",
               "is_floating_point", "unsqueeze", "contiguous", "permute", "transpose"}
_ALIASES = {"__iadd__": "add_", "__isub__": "sub_", "__imul__": "mul_", "__itruediv__": "div_",
            "__idiv__": "div_", "__ipow__": "pow_", "check_input": "lstm",
            "__matmul__": "matmul", "__rmatmul__": "matmul"}


def _reached(entry: ListEntry, calls: list[tuple[str, set[torch.dtype]]]) -> set[torch.dtype]:
    """Floating dtypes that reached the listed function (by name, else the first operation
    that received floating tensors)."""
    wanted = {entry.name, _ALIASES.get(entry.name, entry.name)}
    ops = [(name, found) for name, found in calls if found and name not in _NOT_THE_OP]
    for name, found in ops:
        if name in wanted:
            return found
    return ops[0][1] if ops else set()


def _first_floating(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    if isinstance(out, (list, tuple)):
        for v in out:
            found = _first_floating(v)
            if found is not None:
                return found
    return None


@pytest.fixture
def o1(half_dtype: torch.dtype) -> torch.dtype:
    patch.activate(patch.CastConfig(dtype=half_dtype, device_types=frozenset({"cpu"})))
    return half_dtype


@pytest.mark.parametrize("entry", ENTRIES, ids=_id)
def test_entry_computes_in_documented_dtype(entry: ListEntry, o1: torch.dtype) -> None:
    half = o1
    other_half = torch.bfloat16 if half == torch.float16 else torch.float16
    policy = entry.policy
    if policy in (CastRule.LOWER, CastRule.RNN, CastRule.RNN_CHECK):
        out, calls = _call(entry, _maker([torch.float32]))
        assert _reached(entry, calls) == {half}
        assert _first_floating(out).dtype == half  # type: ignore[union-attr]
    elif policy is CastRule.FP32:
        out, calls = _call(entry, _maker([half]))
        assert _reached(entry, calls) == {torch.float32}
        result = _first_floating(out)
        if result is not None:
            assert result.dtype == torch.float32
    elif policy in (CastRule.PROMOTE, CastRule.SEQUENCE_PROMOTE):
        for dtypes in ([half, torch.float32], [torch.float32, other_half], [half, other_half]):
            out, calls = _call(entry, _maker(dtypes))
            assert _reached(entry, calls) == {torch.float32}, dtypes
            result = _first_floating(out)
            if result is not None:
                assert result.dtype == torch.float32
    elif policy is CastRule.INPLACE_MATCH_SELF:
        for dtypes in ([half, torch.float32], [torch.float32, half]):
            out, calls = _call(entry, _maker(dtypes))
            assert _reached(entry, calls) == {dtypes[0]}, dtypes
            assert out.dtype == dtypes[0]
    elif policy is CastRule.INPLACE_FP32_ERROR:
        with pytest.raises(ampx.CastError, match="in-place"):
            _call(entry, _maker([half]))
        with pytest.raises(NotImplementedError):  # what apex code catches
            _call(entry, _maker([half]))
        out, calls = _call(entry, _maker([torch.float32, half]))
        assert _reached(entry, calls) == {torch.float32}
        with ampx.disable_casts():  # the in-place op runs as torch would run it
            out, _ = _call(entry, _maker([half]))
        assert out.dtype == half
    elif policy is CastRule.BANNED:
        with pytest.raises(ampx.CastError, match="allow_banned"):
            _call(entry, _maker([half]))
        patch.activate(patch.CastConfig(dtype=half, device_types=frozenset({"cpu"}),
                                        allow_banned=True))
        out, calls = _call(entry, _maker([half]))
        assert _reached(entry, calls) == {torch.float32}
        assert out.dtype == torch.float32
    else:  # pragma: no cover
        pytest.fail(f"no dtype rule for policy {policy}")


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.policy is CastRule.LOWER][:6], ids=_id)
def test_float64_is_never_cast(entry: ListEntry, o1: torch.dtype) -> None:
    _, calls = _call(entry, _maker([torch.float64]))
    assert _reached(entry, calls) == {torch.float64}


def test_fp32_inputs_pass_fp32_functions_untouched(o1: torch.dtype) -> None:
    x = torch.randn(3)
    assert torch.exp(x).dtype == torch.float32
    assert F.softmax(x, 0).dtype == torch.float32


def test_committed_cast_lists_doc_matches_generated() -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "cast-lists.md"
    text = doc.read_text()
    version = torch.__version__.split("+")[0]
    if f"on torch {version})" not in text:
        pytest.skip(f"docs/cast-lists.md was generated on another torch than {version}")
    regenerate = "regenerate: python -m ampx._docs cast-lists > docs/cast-lists.md"
    assert text == lists.markdown(), regenerate
