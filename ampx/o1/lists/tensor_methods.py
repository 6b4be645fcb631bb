"""Cast lists for `torch.Tensor` methods (apex's tensor_overrides, brought up to date).

Every name of the matching `torch` list that is also a Tensor method is added by
`ampx.o1.lists.resolve`; only the Tensor-specific names live here.
"""

from __future__ import annotations

LOWER: tuple[str, ...] = ("__matmul__", "__rmatmul__")

# `cpu` is on apex's FP32 list: a half tensor leaving for the host comes back float32, so
# legacy lines such as `logits.detach().cpu().numpy()` work with bf16 (numpy has no bfloat16).
FP32: tuple[str, ...] = ("__pow__", "__rpow__", "softmax", "log_softmax", "cpu")

# The sentence docs/cast-lists.md says about `cpu` (the page is generated from the lists).
CPU_NOTE: str = (
    "`Tensor.cpu` is on the float32 list, as in apex: at O1 a float16 or bfloat16 tensor on "
    "one of the session's device types comes back from `.cpu()` as float32 (a cast, then the "
    "copy), so `logits.detach().cpu().numpy()` works with bf16, which numpy lacks. Inside "
    "`ampx.disable_casts()`, and outside O1, `.cpu()` keeps the dtype."
)

PROMOTE: tuple[str, ...] = (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
    "__truediv__", "__rtruediv__", "__div__", "__rdiv__",
    "__eq__", "__ne__", "__ge__", "__gt__", "__le__", "__lt__",
)

# In-place dunders keep self's dtype (other operands are cast to it).
INPLACE_MATCH_SELF: tuple[str, ...] = (
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__idiv__",
)

# In-place dunders of FP32-list functions: a half self cannot hold an fp32 result.
INPLACE_FP32: tuple[str, ...] = ("__ipow__",)

SEQUENCE_PROMOTE: tuple[str, ...] = ()
BANNED: tuple[str, ...] = ()
