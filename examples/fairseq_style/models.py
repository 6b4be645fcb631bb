"""Models of the example: each has `add_args(parser)` and `build_model(args)`, as in fairseq."""

from __future__ import annotations

import argparse

import torch
from torch import nn

from .registry import register_model


@register_model("mlp")
class MLPModel(nn.Module):
    """A small classifier: Linear, LayerNorm, GELU, Linear."""

    def __init__(self, input_dim: int, hidden_dim: int, num_classes: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(input_dim, hidden_dim)
        self.norm = nn.LayerNorm(hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, num_classes)

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        """Model-specific flags."""
        parser.add_argument("--hidden-dim", type=int, default=32, help="hidden layer size")

    @classmethod
    def build_model(cls, args: argparse.Namespace) -> MLPModel:
        """Build from parsed flags."""
        return cls(args.input_dim, args.hidden_dim, args.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of a batch."""
        return self.fc2(torch.nn.functional.gelu(self.norm(self.fc1(x))))


@register_model("convnet")
class ConvNetModel(nn.Module):
    """A 1-D convolution with batchnorm (exercises keep_batchnorm_fp32 at O2)."""

    def __init__(self, input_dim: int, hidden_dim: int, num_classes: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, hidden_dim, kernel_size=3, padding=1)
        self.bn = nn.BatchNorm1d(hidden_dim)
        self.fc = nn.Linear(hidden_dim * input_dim, num_classes)

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        """Model-specific flags."""
        parser.add_argument("--hidden-dim", type=int, default=8, help="convolution channels")

    @classmethod
    def build_model(cls, args: argparse.Namespace) -> ConvNetModel:
        """Build from parsed flags."""
        return cls(args.input_dim, args.hidden_dim, args.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of a batch."""
        h = torch.relu(self.bn(self.conv(x.unsqueeze(1))))
        return self.fc(h.flatten(1))
