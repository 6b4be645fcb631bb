"""A small convnet with batchnorm on synthetic images, written as a legacy apex script.

Ten classes, each a fixed random smooth 3x32x32 pattern; a sample is its class pattern plus
noise, so the loss falls quickly from ln(10) = 2.30. Batchnorm makes O2's
`keep_batchnorm_fp32` matter.

Run it through ampx (which provides `apex.amp` when apex is not installed)::

    ampx run -O O2 --dtype bf16 ampx/examples/convnet.py --steps 30

`--autocast` trains with plain torch.autocast + GradScaler instead of amp (the comparison row of
`ampx sweep`).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

try:  # a legacy apex script; `ampx run` provides `apex.amp` when apex is not installed
    from apex import amp
except ImportError:  # imported or run without `ampx run`
    from ampx import amp


def conv_block(cin: int, cout: int, stride: int) -> nn.Sequential:
    """conv 3x3 -> batchnorm -> relu."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class ConvNet(nn.Module):
    """Four conv blocks, global average pooling and a linear classifier.

    Args:
        width: Channels of the first block (doubled twice).
        classes: Number of classes.
    """

    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            conv_block(3, width, 1),
            conv_block(width, 2 * width, 2),
            conv_block(2 * width, 4 * width, 2),
            conv_block(4 * width, 4 * width, 1),
        )
        self.classifier = nn.Linear(4 * width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.features(images).mean(dim=(2, 3))
        return self.classifier(features)


def synthetic_batches(batch: int, count: int, seed: int, device: torch.device,
                      classes: int = 10) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` (images, labels) batches: class patterns plus noise.

    Args:
        batch: Images per batch.
        count: Number of batches.
        seed: Seed of the patterns and the samples.
        device: Where the batches live.
        classes: Number of classes.
    """
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.randn(classes, 3, 8, 8, generator=gen)
    patterns = F.interpolate(coarse, size=(32, 32), mode="bilinear", align_corners=False)
    batches = []
    for _ in range(count):
        labels = torch.randint(0, classes, (batch,), generator=gen)
        images = patterns[labels] + 1.5 * torch.randn(batch, 3, 32, 32, generator=gen)
        batches.append((images.to(device), labels.to(device)))
    return batches


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's command line."""
    from ampx.examples.common import example_parser

    parser = example_parser(__doc__, steps=60, batch_size=64, lr=0.05)
    parser.add_argument("--width", type=int, default=32)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Train for `--steps` steps."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = ConvNet(args.width).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    data = synthetic_batches(args.batch_size, 64, args.seed + 1, device)

    if args.autocast:
        from ampx.examples.common import train_autocast

        train_autocast(model, optimizer, data, args, convnet_loss)
        return

    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)
    for step in range(args.steps):
        images, labels = data[step % len(data)]
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        if step % args.log_interval == 0 or step == args.steps - 1:
            scale = amp._amp_state.loss_scalers[0].loss_scale()
            print(f"step {step:4d}  loss {loss.item():.4f}  scale {scale:g}", flush=True)
    if args.save:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "amp": amp.state_dict()}, args.save)


def convnet_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of one batch of images (the autocast loop's loss)."""
    images, labels = batch
    return F.cross_entropy(model(images).float(), labels)


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"done in {time.perf_counter() - started:.1f} s")
