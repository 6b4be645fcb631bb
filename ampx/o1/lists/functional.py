"""Cast lists for `torch.nn.functional` (apex's functional_overrides, brought up to date)."""

from __future__ import annotations

# Run in the session's half dtype: the matmul/conv family and attention.
LOWER: tuple[str, ...] = (
    "conv1d", "conv2d", "conv3d",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "conv_tbc", "linear", "bilinear", "prelu",
    "scaled_dot_product_attention",
)

# Run in float32: range- or precision-sensitive functions, normalisations and every loss.
FP32: tuple[str, ...] = (
    "interpolate", "grid_sample", "softplus", "softmin", "log_softmax", "softmax",
    "gelu", "layer_norm", "group_norm", "local_response_norm", "rms_norm", "normalize",
    "cosine_similarity", "pairwise_distance", "pdist",
    "poisson_nll_loss", "gaussian_nll_loss", "cosine_embedding_loss", "cross_entropy",
    "hinge_embedding_loss", "kl_div", "l1_loss", "mse_loss", "huber_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "multilabel_soft_margin_loss",
    "multi_margin_loss", "nll_loss", "binary_cross_entropy_with_logits", "smooth_l1_loss",
    "soft_margin_loss", "triplet_margin_loss", "triplet_margin_with_distance_loss",
    "ctc_loss",
)

PROMOTE: tuple[str, ...] = ()
SEQUENCE_PROMOTE: tuple[str, ...] = ()

# Unsafe in half precision; raise unless initialize(allow_banned=True), then float32.
BANNED: tuple[str, ...] = ("binary_cross_entropy",)
