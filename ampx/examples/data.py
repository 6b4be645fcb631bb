"""The built-in examples' data: real text and images that need no download, with held-out splits.

One job: build the training batches and the held-out set of each example, deterministically.

- ``stdlib`` (the transformer): the bytes of the Python standard library's own ``*.py`` files
  (the directory of ``os.py``), in sorted file order; every ``HOLDOUT_EVERY``-th file is held
  out, so the evaluation text was never trained on (a split by file, not by position).
- ``digits`` (the convnet): scikit-learn's handwritten digits (``load_digits``: 1,797 8x8
  images that ship with scikit-learn), a fixed permutation, the last 20% held out, scaled to
  [0, 1] and upsampled to the example's image size.
- ``synthetic``: the examples' former random data (a Markov chain of tokens; class patterns
  plus noise), only as an option: a loss on it says nothing about a real task.

Every function returns tensors on the CPU; the scripts move them.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

__all__ = ["HOLDOUT_EVERY", "Dataset", "digits", "digits_available", "markov", "need_sklearn",
           "patterns", "stdlib_bytes"]

HOLDOUT_EVERY = 10
"""The stdlib split: file number k (sorted by name) is held out when k % 10 == 9."""
_MAX_TRAIN_BYTES = 4 << 20  # enough text for any sweep; reading it takes milliseconds
SKLEARN_HINT = ("pip install scikit-learn (or pip install 'torch-ampx[examples]'), or pass "
                "--data synthetic")


@dataclasses.dataclass
class Dataset:
    """One example's data.

    Attributes:
        name: "stdlib", "digits" or "synthetic".
        source: Where it came from (a directory, a package function).
        train: Training batches, `(inputs, targets)`, cycled by the scripts.
        heldout: Held-out batches, never trained on.
        info: What sweep.json's `meta.data` reports besides name and source.
    """

    name: str
    source: str
    train: list[tuple[torch.Tensor, torch.Tensor]]
    heldout: list[tuple[torch.Tensor, torch.Tensor]]
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        """`{"name", "source", "synthetic", ...}` (for telemetry and sweep.json)."""
        return {"name": self.name, "source": self.source,
                "synthetic": self.name == "synthetic", **self.info}


def _windows(data: torch.Tensor, seq_len: int, batch: int, count: int,
             gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    starts = torch.randint(0, data.numel() - seq_len - 1, (count, batch), generator=gen)
    offsets = torch.arange(seq_len + 1)
    out = []
    for row in starts:
        tokens = data[row[:, None] + offsets].long()
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def stdlib_bytes(seq_len: int, batch: int, count: int, heldout_batches: int,
                 seed: int) -> Dataset:
    """Byte-level language modelling on the standard library's source (256 tokens).

    Args:
        seq_len: Tokens per sequence.
        batch: Sequences per batch.
        count: Training batches (random windows of the training files).
        heldout_batches: Held-out batches (fixed windows of the held-out files).
        seed: Seed of the window positions.
    """
    root = Path(os.__file__).resolve().parent
    files = sorted(root.glob("*.py"))
    train, held = bytearray(), bytearray()
    for k, path in enumerate(files):
        part = held if k % HOLDOUT_EVERY == HOLDOUT_EVERY - 1 else train
        if len(part) < _MAX_TRAIN_BYTES:
            part += path.read_bytes() + b"\n"
    train_t = torch.frombuffer(train, dtype=torch.uint8)
    held_t = torch.frombuffer(held, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    return Dataset(
        "stdlib", str(root), _windows(train_t, seq_len, batch, count, gen),
        _windows(held_t, seq_len, batch, heldout_batches, torch.Generator().manual_seed(12345)),
        {"files": len(files), "heldout_files": len(files) // HOLDOUT_EVERY,
         "train_bytes": len(train), "heldout_bytes": len(held),
         "split": f"by file: every {HOLDOUT_EVERY}th of the sorted *.py files held out"})


def digits_available() -> bool:
    """Whether scikit-learn (which ships the digits) is importable."""
    import importlib.util

    return importlib.util.find_spec("sklearn") is not None


def need_sklearn(what: str) -> str:
    """The message for a missing scikit-learn."""
    return f"{what} trains on scikit-learn's handwritten digits, and scikit-learn is not " \
        f"installed: {SKLEARN_HINT}"


def digits(batch: int, seed: int, image_size: int = 32, heldout_share: float = 0.2,
           device: Optional[torch.device] = None) -> Dataset:
    """scikit-learn's handwritten digits, 1x`image_size`x`image_size`, 10 classes.

    Args:
        batch: Images per training batch (the held-out set is batched the same).
        seed: Seed of the training order (the split itself is fixed).
        image_size: Side of the upsampled images (8 keeps the originals).
        heldout_share: Share of the images held out.
        device: Where the tensors go (default: CPU).

    Raises:
        ImportError: scikit-learn is not installed (the message says what to install).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError(need_sklearn("this example")) from None
    found = load_digits()
    images = torch.tensor(found.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(found.target, dtype=torch.long)
    if image_size != 8:
        images = F.interpolate(images, size=(image_size, image_size), mode="bilinear",
                               align_corners=False)
    images = (images - 0.3) / 0.4  # roughly zero mean, unit spread
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    cut = len(labels) - int(len(labels) * heldout_share)
    train_idx, held_idx = order[:cut], order[cut:]
    gen = torch.Generator().manual_seed(seed)
    shuffled = train_idx[torch.randperm(len(train_idx), generator=gen)]
    device = device or torch.device("cpu")

    def batches(index: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(images[index[i:i + batch]].to(device), labels[index[i:i + batch]].to(device))
                for i in range(0, len(index) - batch + 1 if len(index) >= batch else 1, batch)]

    return Dataset("digits", "sklearn.datasets.load_digits", batches(shuffled),
                   [(images[held_idx].to(device), labels[held_idx].to(device))],
                   {"train_images": cut, "heldout_images": len(held_idx),
                    "image_size": image_size, "split": "fixed permutation, last 20% held out"})


def markov(vocab: int, seq_len: int, batch: int, count: int, heldout_batches: int,
           seed: int) -> Dataset:
    """Tokens from a fixed random Markov chain (4 successors per token): synthetic."""
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 4), generator=gen)
    out = []
    for _ in range(count + heldout_batches):
        tokens = torch.empty(batch, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
        for t in range(seq_len):
            pick = torch.randint(0, 4, (batch,), generator=gen)
            tokens[:, t + 1] = successors[tokens[:, t], pick]
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return Dataset("synthetic", "a random Markov chain (4 successors per token)",
                   out[:count], out[count:], {"vocab": vocab})


def patterns(batch: int, count: int, heldout_batches: int, seed: int, image_size: int = 32,
             classes: int = 10) -> Dataset:
    """Images: a fixed random smooth pattern per class plus noise (1 channel): synthetic."""
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.randn(classes, 1, 8, 8, generator=gen)
    shapes = F.interpolate(coarse, size=(image_size, image_size), mode="bilinear",
                           align_corners=False)
    out = []
    for _ in range(count + heldout_batches):
        labels = torch.randint(0, classes, (batch,), generator=gen)
        noise = torch.randn(batch, 1, image_size, image_size, generator=gen)
        out.append((shapes[labels] + 1.5 * noise, labels))
    return Dataset("synthetic", "class patterns plus noise", out[:count], out[count:])
