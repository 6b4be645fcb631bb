"""A synthetic classification task whose batches depend only on (seed, update, micro, rank).

Because a batch is a pure function of its position, a resumed run sees exactly the batches the
uninterrupted run would have seen, without saving any data-loader state.
"""

from __future__ import annotations

import torch


class SyntheticTask:
    """Gaussian inputs, labels from a fixed random linear teacher."""

    def __init__(self, input_dim: int, num_classes: int, seed: int) -> None:
        self.input_dim = input_dim
        self.seed = seed
        gen = torch.Generator().manual_seed(seed)
        self.teacher = torch.randn(input_dim, num_classes, generator=gen)

    def batch(self, update: int, micro: int, rank: int, batch_size: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch `micro` of update `update` on rank `rank`."""
        gen = torch.Generator().manual_seed(
            hash((self.seed, update, micro, rank)) & 0x7FFF_FFFF)
        x = torch.randn(batch_size, self.input_dim, generator=gen)
        return x, (x @ self.teacher).argmax(dim=1)
