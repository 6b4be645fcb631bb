"""The trainer: fairseq's train_step shape (update-freq accumulation, multiply_grads,
clip_grad_norm, OverflowError/FloatingPointError handling) and checkpoint save/resume.

ampx appears only through its object API: `ampx.Amp.from_args(args)`, `amp.initialize`, and the
fairseq-style wrapper `ampx.compat.fairseq.AmpOptimizer`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ampx
from ampx.compat.fairseq.optimizer import AmpOptimizer
from ampx.options.flags import optimizer_kwargs_from_args

from .data import SyntheticTask
from .registry import MODEL_REGISTRY, OPTIMIZER_REGISTRY

logger = logging.getLogger("fairseq_style")


class Trainer:
    """Builds model, optimizer and ampx session from `args`; runs updates; saves checkpoints."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        torch.manual_seed(args.seed)  # identical initial weights (and masters) on every rank
        model = MODEL_REGISTRY[args.arch].build_model(args)
        optimizer = OPTIMIZER_REGISTRY[args.optimizer].build(args, model.parameters())
        self.amp = ampx.Amp.from_args(args, verbosity=0)
        model, optimizer = self.amp.initialize(model, optimizer)
        self.module = model
        self.model: nn.Module = model
        if self.world_size > 1:  # after initialize, as with apex
            self.model = nn.parallel.DistributedDataParallel(model)
        self.optimizer = AmpOptimizer(optimizer, self.amp, **optimizer_kwargs_from_args(args))
        self.task = SyntheticTask(args.input_dim, args.num_classes, args.seed)
        self.criterion = nn.CrossEntropyLoss(reduction="sum")
        self.num_updates = 0
        self.overflows = 0

    # -- one update ------------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        """One update over `--update-freq` micro-batches (fairseq's Trainer.train_step)."""
        args = self.args
        self.model.train()
        self.optimizer.zero_grad()
        sample_size = 0
        loss_sum = torch.zeros(())
        for micro in range(args.update_freq):
            x, y = self.task.batch(self.num_updates, micro, self.rank, args.batch_size)
            last = micro == args.update_freq - 1
            sync = contextlib.nullcontext() if last or self.world_size == 1 \
                else self.model.no_sync()  # type: ignore[operator]
            with sync:
                loss = self.criterion(self.model(x).float(), y)
                self.optimizer.backward(loss)
            sample_size += len(y)
            loss_sum += loss.detach().float()
        if self.world_size > 1:  # fairseq all-reduces the sample size
            size = torch.tensor([float(sample_size)])
            dist.all_reduce(size)
            sample_size = int(size.item())
        overflow = False
        grad_norm = torch.zeros(())
        try:
            # DDP averages gradients over ranks; fairseq multiplies back by the world size.
            self.optimizer.multiply_grads(self.world_size / sample_size)
            grad_norm = self.optimizer.clip_grad_norm(args.clip_norm)
            self.optimizer.step()
        except OverflowError as exc:
            overflow = True
            self.overflows += 1
            if self.rank == 0:
                logger.info("NOTE: gradient overflow detected, ignoring gradient, %s", exc)
            self.optimizer.zero_grad()
        except FloatingPointError:
            self.save_checkpoint("checkpoint_crash.pt")
            raise
        self.num_updates += 1
        return {"loss": float(loss_sum) / max(1, sample_size // self.world_size),
                "grad_norm": float(grad_norm), "overflow": overflow,
                "loss_scale": self.optimizer.loss_scale}

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs (the scaler state rides in the optimizer's state dict)."""
        return {
            "model": self.module.state_dict(),  # fp32 at O2: the masters
            "optimizer": self.optimizer.state_dict(),
            "num_updates": self.num_updates,
            "overflows": self.overflows,
            "rng": torch.get_rng_state(),
            "args": vars(self.args),
        }

    def save_checkpoint(self, name: str = "checkpoint_last.pt") -> str | None:
        """Rank 0 writes `save_dir/name` (atomically); returns the path on rank 0."""
        state = self.state_dict()  # every rank: reading the scaler syncs, keep ranks in step
        if self.rank != 0 or not self.args.save_dir:
            return None
        os.makedirs(self.args.save_dir, exist_ok=True)
        path = os.path.join(self.args.save_dir, name)
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
        return path

    def load_checkpoint(self, path: str) -> None:
        """Resume from `path` (every rank reads the same file)."""
        state = torch.load(path, map_location="cpu", weights_only=False)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.num_updates = int(state["num_updates"])
        self.overflows = int(state["overflows"])
        torch.set_rng_state(state["rng"])

    def close(self) -> None:
        """Undo the session's O1 patches (if any)."""
        self.amp.restore()
