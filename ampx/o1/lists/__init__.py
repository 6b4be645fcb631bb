"""The O1 cast lists as data, resolved against the installed torch.

`resolve()` is the one place that consults the installed torch: a listed name that this torch
lacks is dropped (and the drop can be inspected with `missing()`), so the data modules never
branch on versions.
"""

from __future__ import annotations

import enum
import functools
import textwrap
import types
from typing import Any, NamedTuple

import torch
import torch.nn.functional

from . import functional, tensor_methods, torch_functions

__all__ = ["ListEntry", "CastRule", "missing", "owner_object", "resolve"]


class CastRule(str, enum.Enum):
    """What a patched function does with its floating-point inputs."""

    LOWER = "lower"  # cast to the session's half dtype (weights through the cache)
    FP32 = "fp32"  # cast to float32
    PROMOTE = "promote"  # cast mixed inputs to the widest floating type
    SEQUENCE_PROMOTE = "sequence_promote"  # PROMOTE over the first (sequence) argument
    BANNED = "banned"  # raise on half inputs unless allow_banned
    INPLACE_MATCH_SELF = "inplace_match_self"  # in-place: cast other inputs to self's dtype
    INPLACE_FP32_ERROR = "inplace_fp32_error"  # in-place FP32 op: raise if self is half
    RNN = "rnn"  # fused RNN entry points: inputs, states and weights to half
    RNN_CHECK = "rnn_check"  # RNN modules accept inputs whose dtype differs from the weights


class ListEntry(NamedTuple):
    """One patched attribute: `owner` is the dotted name of the object that holds it."""

    owner: str
    name: str
    policy: CastRule


_RNN_FUNCTIONS = ("lstm", "gru", "rnn_tanh", "rnn_relu",
                  "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell")

OWNERS = ("torch", "torch.Tensor", "torch.nn.functional", "torch._VF", "torch.nn.RNNBase")


def owner_object(owner: str) -> Any:
    """The live object behind an owner name ("torch.Tensor" -> torch.Tensor)."""
    return _OWNER_OBJECTS[owner]


_OWNER_OBJECTS: dict[str, Any] = {
    "torch": torch,
    "torch.Tensor": torch.Tensor,
    "torch.nn.functional": torch.nn.functional,
    "torch._VF": torch._VF,
    "torch.nn.RNNBase": torch.nn.RNNBase,
}


def _candidates() -> list[tuple[ListEntry, bool]]:
    """Entries in patching order, each with whether a miss is worth reporting.

    Names derived from another list (in-place variants, torch-list names tried on Tensor) are
    expected to be missing for many entries, so only the data modules' own names are reported.
    """
    out: list[tuple[ListEntry, bool]] = []

    def add(owner: str, names: tuple[str, ...], policy: CastRule, *, derived: bool = False) -> None:
        out.extend((ListEntry(owner, name, policy), not derived) for name in names)

    def inplace(*lists: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(name + "_" for names in lists for name in names if not name.startswith("__"))

    tf, tm, fn = torch_functions, tensor_methods, functional
    add("torch.nn.functional", fn.LOWER, CastRule.LOWER)
    add("torch.nn.functional", fn.FP32, CastRule.FP32)
    add("torch.nn.functional", fn.BANNED, CastRule.BANNED)

    add("torch", tf.LOWER, CastRule.LOWER)
    add("torch", tf.FP32, CastRule.FP32)
    add("torch", tf.PROMOTE, CastRule.PROMOTE)
    add("torch", tf.SEQUENCE_PROMOTE, CastRule.SEQUENCE_PROMOTE)
    add("torch", inplace(tf.FP32), CastRule.INPLACE_FP32_ERROR, derived=True)

    # Tensor methods: the Tensor-only names, then every torch-list name that is also a method.
    add("torch.Tensor", tm.LOWER, CastRule.LOWER)
    add("torch.Tensor", tf.LOWER, CastRule.LOWER, derived=True)
    add("torch.Tensor", tm.FP32, CastRule.FP32)
    add("torch.Tensor", tf.FP32, CastRule.FP32, derived=True)
    add("torch.Tensor", tm.PROMOTE, CastRule.PROMOTE)
    add("torch.Tensor", tf.PROMOTE, CastRule.PROMOTE, derived=True)
    add("torch.Tensor", tm.INPLACE_FP32, CastRule.INPLACE_FP32_ERROR)
    add("torch.Tensor", inplace(tm.FP32, tf.FP32), CastRule.INPLACE_FP32_ERROR, derived=True)
    add("torch.Tensor", tm.INPLACE_MATCH_SELF, CastRule.INPLACE_MATCH_SELF)
    add("torch.Tensor", inplace(tm.LOWER, tf.LOWER, tm.PROMOTE, tf.PROMOTE),
        CastRule.INPLACE_MATCH_SELF, derived=True)

    add("torch._VF", _RNN_FUNCTIONS, CastRule.RNN)
    # nn.RNN/LSTM/GRU refuse an input whose dtype differs from their weights unless
    # torch.autocast is on; under O1 the _VF entry points above cast both.
    add("torch.nn.RNNBase", ("check_input",), CastRule.RNN_CHECK)
    return out


def _exists(entry: ListEntry) -> bool:
    owner = owner_object(entry.owner)
    if entry.owner == "torch._VF":
        return hasattr(torch._C._VariableFunctions, entry.name)
    value = getattr(owner, entry.name, None)
    if value is None:
        return False
    # Dunder names that only exist as object's defaults (e.g. __eq__ on a module) don't count.
    return not isinstance(owner, types.ModuleType) or callable(value)


@functools.cache
def _resolved() -> tuple[tuple[ListEntry, ...], tuple[ListEntry, ...]]:
    seen: set[tuple[str, str]] = set()
    present: list[ListEntry] = []
    absent: list[ListEntry] = []
    for entry, report in _candidates():
        key = (entry.owner, entry.name)
        if key in seen:  # first list wins, so no name is wrapped twice
            continue
        seen.add(key)
        if _exists(entry):
            present.append(entry)
        elif report:
            absent.append(entry)
    return tuple(present), tuple(absent)


def resolve() -> list[ListEntry]:
    """Every cast-list entry that exists on the installed torch, in patching order."""
    return list(_resolved()[0])


def missing() -> list[ListEntry]:
    """Listed names the installed torch lacks (they are simply not patched)."""
    return list(_resolved()[1])


_POLICY_TEXT: dict[CastRule, str] = {
    CastRule.LOWER: "run in the session's half dtype (float16 or bfloat16); parameters are cast "
                  "once per iteration through the weight cache",
    CastRule.FP32: "run in float32 (half inputs are cast up)",
    CastRule.PROMOTE: "mixed floating inputs are cast to the widest type among them",
    CastRule.SEQUENCE_PROMOTE: "like promote, over the tensors of the first (sequence) argument",
    CastRule.BANNED: "raise `ampx.CastError` on half inputs, unless `allow_banned=True` "
                   "(then float32)",
    CastRule.INPLACE_MATCH_SELF: "in-place: other inputs are cast to self's dtype",
    CastRule.INPLACE_FP32_ERROR: "in-place form of a float32 function: raise `ampx.CastError` "
                               "when self is half (unless inside `ampx.disable_casts()`)",
    CastRule.RNN: "fused RNN entry points: input, hidden state and each weight in half "
                "(weights through the cache; gradients reach the float32 weights)",
    CastRule.RNN_CHECK: "accept an input whose dtype differs from the float32 weights",
}


def markdown() -> str:
    """The text of docs/cast-lists.md, generated from the lists and the installed torch.

    `python -m ampx._docs cast-lists > docs/cast-lists.md` regenerates the page; a test checks
    that the committed page matches.
    """
    entries = resolve()
    lines = [
        "# O1 cast lists",
        "",
        "<!-- Generated by `python -m ampx._docs cast-lists > docs/cast-lists.md`. -->",
        "",
        "At O1, ampx wraps the functions below. The same lists apply on every device, so",
        "float16 on CPU is as safe as on CUDA: softmax, log_softmax, layer_norm, exp, log,",
        "pow, sum and the losses stay float32 everywhere (torch.autocast's CPU policy runs",
        "several of them in low precision). Only floating tensors on the session's device",
        "types are cast, float64 tensors are never cast, and `ampx.disable_casts()` turns",
        "every cast off in its block.",
        "",
        "The lists start from apex's and are brought up to date: `bmm`, `baddbmm` and",
        "`addbmm` are lowered on every device (apex: CUDA >= 9.1 only),",
        "`scaled_dot_product_attention`, `einsum`, `rms_norm` and newer losses are listed,",
        "Tensor dunders (`@`, `+`, `*`, `**`, comparisons, in-place `+=`...) are covered,",
        "and vanilla `nn.RNN` is cast again. Names missing from the installed torch are",
        "skipped (`ampx.o1.lists.missing()`).",
        "",
        *textwrap.wrap(tensor_methods.CPU_NOTE, 86),
        "",
        "`ampx.register_half_function`, `register_float_function` and",
        "`register_promote_function` (or the `half_function`, `float_function` and",
        "`promote_function` decorators) add functions; a registration overrides a listed",
        "entry of the same name.",
        "",
        "## Policies",
        "",
        "| policy | effect |",
        "| --- | --- |",
    ]
    lines += [f"| `{policy.value}` | {_POLICY_TEXT[policy]} |" for policy in CastRule]
    lines += ["", f"## Entries ({len(entries)} on torch {_torch_version()})", ""]
    for owner in OWNERS:
        rows = [e for e in entries if e.owner == owner]
        if not rows:
            continue
        lines += [f"### `{owner}`", "", "| policy | names |", "| --- | --- |"]
        for policy in CastRule:
            names = [f"`{e.name}`" for e in rows if e.policy is policy]
            if names:
                lines.append(f"| `{policy.value}` | {', '.join(names)} |")
        lines.append("")
    return "\n".join(lines)


def _torch_version() -> str:
    return torch.__version__.split("+")[0]
