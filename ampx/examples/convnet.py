"""A small ResNet-style convnet on real handwritten digits, written as a legacy apex script.

It learns scikit-learn's handwritten digits (`sklearn.datasets.load_digits`: 1,797 8x8
images that ship with scikit-learn, no download), upsampled to 16x16; a fixed 20% is held
out (`ampx.examples.data.digits`). The held-out loss and accuracy are evaluated every
`--eval-every` steps and reported with `ampx.log_metric`. Batchnorm makes O2's
`keep_batchnorm_fp32` matter. `--data synthetic` trains on random class patterns instead (and
needs no scikit-learn).

Run it through ampx (which provides `apex.amp` when apex is not installed)::

    ampx run -O O2 --dtype bf16 ampx/examples/convnet.py --steps 30

`--autocast` trains with plain torch.autocast + GradScaler instead of amp (the comparison row of
`ampx sweep`).
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

if TYPE_CHECKING:
    from ampx.examples.data import Dataset

try:  # a legacy apex script; `ampx run` provides `apex.amp` when apex is not installed
    from apex import amp
except ImportError:  # imported or run without `ampx run`
    from ampx import amp


class Block(nn.Module):
    """A residual block: two 3x3 convs with batchnorm, a 1x1 projection when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ConvNet(nn.Module):
    """A stem conv, three residual blocks (width, 2x, 4x; the last two halve the image),
    global average pooling and a linear classifier.

    Args:
        width: Channels of the first block.
        classes: Number of classes.
        channels: Input channels.
    """

    def __init__(self, width: int = 32, classes: int = 10, channels: int = 1) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        self.blocks = nn.Sequential(Block(width, width, 1), Block(width, 2 * width, 2),
                                    Block(2 * width, 4 * width, 2))
        self.classifier = nn.Linear(4 * width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.blocks(self.stem(images)).mean(dim=(2, 3))
        return self.classifier(features)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's command line."""
    from ampx.examples.common import example_parser

    parser = example_parser(__doc__, steps=60, batch_size=64, lr=0.05)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--data", default="digits", choices=["digits", "synthetic"],
                        help="scikit-learn's handwritten digits (default) or synthetic patterns")
    return parser.parse_args(argv)


def load_data(args: argparse.Namespace) -> Dataset:
    """The training batches and the held-out split the options ask for."""
    from ampx.examples import data

    if args.data == "synthetic":
        return data.patterns(args.batch_size, 64, 6, args.seed + 1, args.image_size)
    try:
        return data.digits(args.batch_size, args.seed + 1, args.image_size)
    except ImportError as exc:
        raise SystemExit(f"convnet.py: {exc}") from None


def main(argv: list[str] | None = None) -> None:
    """Train for `--steps` steps."""
    from ampx.examples.common import Evaluator, record_data

    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = ConvNet(args.width).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    dataset = load_data(args)
    data = [(x.to(device), y.to(device)) for x, y in dataset.train]
    record_data(dataset.describe())
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    evaluator = Evaluator([(x.to(device), y.to(device)) for x, y in dataset.heldout],
                          convnet_metrics, args.steps, args.eval_every,
                          autocast=half if args.autocast else None)

    if args.autocast:
        from ampx.examples.common import train_autocast

        train_autocast(model, optimizer, data, args, convnet_loss, evaluator)
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
        evaluator.after(model, step + 1)
    if args.save:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "amp": amp.state_dict()}, args.save)


def convnet_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of one batch of images (the autocast loop's loss)."""
    images, labels = batch
    return F.cross_entropy(model(images).float(), labels)


def convnet_metrics(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Summed cross-entropy, correct predictions and count of one held-out batch."""
    images, labels = batch
    logits = model(images).float()
    return (F.cross_entropy(logits, labels, reduction="sum"),
            (logits.argmax(dim=1) == labels).sum(), labels.numel())


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"done in {time.perf_counter() - started:.1f} s")
