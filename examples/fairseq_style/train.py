"""Command line of the example trainer (fairseq's `fairseq-train` shape).

    python -m examples.fairseq_style.train --arch mlp --optimizer adam \
        --opt-level O2 --amp-dtype fp16 --update-freq 4 --clip-norm 1.0 --max-update 50
    python examples/fairseq_style/train.py ...       # as a file: the same (also under ampx run)
    torchrun --nproc_per_node 2 -m examples.fairseq_style.train --distributed-world-size 2 ...
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ampx.options.flags import add_args as add_ampx_args

if not __package__:  # run as a file (`python .../train.py`, `ampx run .../train.py`), not with -m
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
    __package__ = "examples.fairseq_style"  # so the relative imports below resolve

from . import models, optimizers  # noqa: F401  (register the built-in components)
from .registry import MODEL_REGISTRY, OPTIMIZER_REGISTRY
from .trainer import Trainer

logger = logging.getLogger("fairseq_style")


def get_parser() -> argparse.ArgumentParser:
    """The base parser (component flags are added by `parse_args_and_arch`)."""
    parser = argparse.ArgumentParser(description="fairseq-style trainer using ampx")
    parser.add_argument("--arch", default="mlp", choices=sorted(MODEL_REGISTRY))
    parser.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZER_REGISTRY))
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-update", type=int, default=20)
    parser.add_argument("--update-freq", type=int, default=1, help="micro-batches per update")
    parser.add_argument("--batch-size", type=int, default=8, help="per micro-batch, per rank")
    parser.add_argument("--clip-norm", type=float, default=0.0, help="0 disables clipping")
    parser.add_argument("--input-dim", type=int, default=16)
    parser.add_argument("--num-classes", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--save-dir", default="", help="checkpoint directory ('' = none)")
    parser.add_argument("--save-interval-updates", type=int, default=0)
    parser.add_argument("--restore-file", default="checkpoint_last.pt",
                        help="resumed from save-dir when it exists")
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--distributed-world-size", type=int, default=1,
                        help="number of processes (launch them with torchrun)")
    add_ampx_args(parser)  # --opt-level, --amp-dtype, --loss-scale, --init-scale, ...
    return parser


def parse_args_and_arch(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Two-stage parse, as fairseq: the chosen model and optimizer add their own flags."""
    parser = get_parser()
    known, _ = parser.parse_known_args(argv)
    MODEL_REGISTRY[known.arch].add_args(parser)
    OPTIMIZER_REGISTRY[known.optimizer].add_args(parser)
    return parser.parse_args(argv)


def distributed_init(args: argparse.Namespace) -> None:
    """Join the torchrun process group (gloo on CPU, nccl on CUDA)."""
    if args.distributed_world_size <= 1:
        return
    if int(os.environ.get("WORLD_SIZE", "1")) != args.distributed_world_size:
        raise SystemExit("--distributed-world-size must match torchrun's --nproc_per_node")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)


def main(args: argparse.Namespace) -> Trainer:
    """Train `--max-update` updates, resuming from the last checkpoint; returns the trainer."""
    distributed_init(args)
    trainer = Trainer(args)
    try:
        restore = os.path.join(args.save_dir, args.restore_file) if args.save_dir else ""
        if restore and os.path.exists(restore):
            trainer.load_checkpoint(restore)
            if trainer.rank == 0:
                logger.info("resumed from %s at update %d", restore, trainer.num_updates)
        while trainer.num_updates < args.max_update:
            stats = trainer.train_step()
            if trainer.rank == 0 and args.log_interval and \
                    trainer.num_updates % args.log_interval == 0:
                logger.info("update %d | loss %.4f | gnorm %.3f | loss_scale %g",
                            trainer.num_updates, stats["loss"], stats["grad_norm"],
                            stats["loss_scale"])
            if args.save_interval_updates and \
                    trainer.num_updates % args.save_interval_updates == 0:
                trainer.save_checkpoint()
        trainer.save_checkpoint()
    finally:
        trainer.close()
    return trainer


def cli_main(argv: Sequence[str] | None = None) -> None:
    """Entry point of `python -m examples.fairseq_style.train`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s | %(name)s | %(message)s")
    args = parse_args_and_arch(argv)
    try:
        main(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    cli_main()
