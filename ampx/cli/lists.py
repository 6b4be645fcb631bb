"""`ampx lists`: what each patched function does at an opt level, as text or JSON.

One job: turn `ampx.o1.lists.resolve()` (the O1 cast lists) and the level's properties into the
report the command prints. Printing is the command line's job; these functions return text.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from .info import format_columns

__all__ = ["UnknownPolicy", "policy_effect", "report"]

class UnknownPolicy(ValueError):
    """`--policy` named no policy."""


def policy_effect(policy: str, dtype_name: str) -> str:
    """What a policy does to a call, in words ("bfloat16", "widest input type", ...)."""
    return {
        "lower": dtype_name,
        "fp32": "float32",
        "promote": "widest input type",
        "sequence_promote": "widest type in the sequence",
        "banned": "error on half inputs (float32 with allow_banned=True)",
        "inplace_match_self": "other inputs cast to self's type",
        "inplace_fp32_error": "error if self is half",
        "rnn": f"{dtype_name} (inputs, states and weights)",
        "rnn_check": "accepts inputs whose dtype differs from the weights",
    }.get(policy, policy)


def _unpatched_summary(level: str, props: Any) -> str:
    import torch

    from ..options.values import dtype_name

    if props.cast_model_type is None or props.cast_model_type == torch.float32:
        return (f"{level}: nothing is patched and nothing is cast; every function runs in "
                "float32.")
    cast = dtype_name(props.cast_model_type)
    bn = "kept in float32" if props.keep_batchnorm_fp32 else f"in {cast} too"
    masters = "with" if props.master_weights else "without"
    return (f"{level}: nothing is patched; the model is cast to {cast} (batchnorm {bn}), "
            f"{masters} float32 master weights, loss scale {props.loss_scale}. Functions run "
            "in the dtype of their inputs. (`ampx lists --level O1` shows O1's function "
            "table.)")


def report(level: str, dtype: str, policy: Optional[str] = None, *, as_json: bool) -> str:
    """The `ampx lists` output.

    Args:
        level: "O0".."O3".
        dtype: "fp16" or "bf16".
        policy: Show only this policy.
        as_json: JSON instead of a table.

    Raises:
        UnknownPolicy: `policy` is not a policy name.
    """
    from ..o1 import lists
    from ..options import values
    from ..options.levels import resolve_properties
    from ..options.values import parse_dtype

    dtype_name = values.dtype_name(parse_dtype(dtype))
    props = resolve_properties(level, dtype=dtype_name)
    policies = [p.value for p in lists.CastRule]
    if policy is not None and policy not in policies:
        raise UnknownPolicy(f"unknown policy {policy!r}: choose from {', '.join(policies)}")
    if not props.patch_torch_functions:
        summary = _unpatched_summary(level, props)
        if as_json:
            return json.dumps({"level": level, "dtype": dtype_name, "patched": [],
                               "properties": props.as_dict(), "summary": summary}, indent=1)
        return summary
    order = {name: i for i, name in enumerate(policies)}
    entries = sorted(lists.resolve(), key=lambda e: (order[e.policy.value], e.owner, e.name))
    if policy is not None:
        entries = [e for e in entries if e.policy.value == policy]
    if as_json:
        return json.dumps({
            "level": level, "dtype": dtype_name,
            "patched": [{"function": f"{e.owner}.{e.name}", "owner": e.owner, "name": e.name,
                         "policy": e.policy.value,
                         "runs_in": policy_effect(e.policy.value, dtype_name)}
                        for e in entries],
        }, indent=1)
    rows = [["function", "policy", "runs in"]]
    rows += [[f"{e.owner}.{e.name}", e.policy.value, policy_effect(e.policy.value, dtype_name)]
             for e in entries]
    return (f"{level} with {dtype_name}: {len(entries)} patched functions and methods\n"
            + format_columns(rows))
