"""Cast lists for the `torch` namespace (apex's torch_overrides, brought up to date).

The same lists apply on every device: unlike torch.autocast's CPU policy, softmax-like
reductions and transcendental functions stay in float32 on CPU too, so fp16 on CPU is as safe as
on CUDA.
"""

from __future__ import annotations

LOWER: tuple[str, ...] = (
    "conv1d", "conv2d", "conv3d",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "conv_tbc", "prelu",
    "addmm", "addmv", "addr", "matmul", "mm", "mv",
    "bmm", "baddbmm", "addbmm",  # apex put these on a list only for CUDA >= 9.1
    "einsum", "chain_matmul",
)

FP32: tuple[str, ...] = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log1p", "log2",
    "reciprocal", "rsqrt", "sinh", "tan", "pow",
    "cumprod", "cumsum", "dist", "norm", "prod", "std", "sum", "var", "renorm",
    "softmax", "log_softmax", "layer_norm", "group_norm", "rms_norm", "logsumexp",
    "cdist", "pdist", "cosine_similarity", "nuclear_norm", "frobenius_norm",
    "std_mean", "var_mean",
    # losses reachable as torch.* (their F.* twins are on the functional list)
    "binary_cross_entropy_with_logits", "kl_div", "poisson_nll_loss", "cosine_embedding_loss",
    "hinge_embedding_loss", "margin_ranking_loss", "triplet_margin_loss", "ctc_loss",
)

# Mixed floating inputs are cast to the widest floating type among them.
PROMOTE: tuple[str, ...] = (
    "addcdiv", "addcmul", "atan2", "cross", "bilinear", "dot", "vdot",
    "add", "sub", "div", "mul", "eq", "equal", "ge", "gt", "le", "lt", "ne",
    "tensordot", "index_put", "scatter_add",
)

# Like PROMOTE, over the tensors of the first (sequence) argument.
SEQUENCE_PROMOTE: tuple[str, ...] = (
    "cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack", "column_stack",
)

BANNED: tuple[str, ...] = ()
