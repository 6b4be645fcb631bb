"""fairseq-style integration: the optimizer wrapper `AmpOptimizer` and how it updates."""

from .optimizer import AmpOptimizer

__all__ = ["AmpOptimizer"]
