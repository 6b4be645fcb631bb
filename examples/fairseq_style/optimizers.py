"""Optimizers of the example: `add_args(parser)` and `build(args, params)`, as in fairseq."""

from __future__ import annotations

import argparse
from collections.abc import Iterable

import torch

from .registry import register_optimizer


@register_optimizer("sgd")
class SGD:
    """torch.optim.SGD with momentum."""

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        """Optimizer-specific flags."""
        parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
        parser.add_argument("--weight-decay", type=float, default=0.0, help="weight decay")

    @staticmethod
    def build(args: argparse.Namespace, params: Iterable[torch.nn.Parameter]
              ) -> torch.optim.Optimizer:
        """Build from parsed flags."""
        return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum,
                               weight_decay=args.weight_decay)


@register_optimizer("adam")
class Adam:
    """torch.optim.AdamW."""

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        """Optimizer-specific flags."""
        parser.add_argument("--adam-betas", type=float, nargs=2, default=(0.9, 0.98),
                            metavar=("B1", "B2"), help="Adam betas")
        parser.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon")
        parser.add_argument("--weight-decay", type=float, default=0.01, help="weight decay")

    @staticmethod
    def build(args: argparse.Namespace, params: Iterable[torch.nn.Parameter]
              ) -> torch.optim.Optimizer:
        """Build from parsed flags."""
        return torch.optim.AdamW(params, lr=args.lr, betas=tuple(args.adam_betas),
                                 eps=args.adam_eps, weight_decay=args.weight_decay)
