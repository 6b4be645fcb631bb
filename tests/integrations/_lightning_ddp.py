"""Run by tests/integrations/test_lightning.py: Trainer(strategy="ddp", devices=2), CPU/gloo,
AmpxPrecision.

Lightning's launcher starts rank 1 by running this script again. Each rank saves its weights,
global_step and skipped-step count to $AMPX_TEST_OUT/rank<R>.pt. Rank 1 alone overflows at
global step 1: the cross-rank flag agreement must skip that step on both ranks.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ampx.integrations.lightning import AmpxPrecision

warnings.filterwarnings("ignore")  # Lightning's advice about tiny CPU loaders


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(),
                                 nn.Linear(16, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x).float(), y)
        if self.global_step == 1 and self.global_rank == 1:
            loss = loss * float("inf")
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g))
    model = Net()
    plugin = AmpxPrecision(opt_level="O2", dtype="fp16")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1,
                         plugins=[plugin], enable_progress_bar=False, logger=False,
                         enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=4))
    state = plugin.amp.optimizers[0]._ampx  # type: ignore[union-attr]
    out = os.environ["AMPX_TEST_OUT"]
    # parameters (fp32 masters at O2); batchnorm's running stats are per rank under DDP
    weights = [t.clone() for k, t in model.state_dict().items()
               if "running" not in k and "num_batches" not in k]
    torch.save({"weights": weights,
                "global_step": trainer.global_step, "skipped": state.skipped_steps,
                "dtype": str(model.net[0].weight.dtype)},
               os.path.join(out, f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()
