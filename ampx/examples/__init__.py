"""Built-in example training scripts, written as legacy apex scripts (`from apex import amp`).

They are what `ampx sweep` runs when no script is given; each is also a plain script::

    ampx run -O O2 --dtype bf16 ampx/examples/transformer_lm.py --steps 20

Both train on real data that needs no download (the transformer on the Python standard
library's own source bytes, the convnet on scikit-learn's handwritten digits; `--data
synthetic` for random data), evaluate on a held-out split every `--eval-every` steps
(`ampx.log_metric("heldout_loss", ...)`), take `--steps`, `--opt-level`, `--seed` and
`--autocast` (a plain torch.autocast + GradScaler loop, the sweep's `autocast` row), and run on
CUDA when it is available, else on the CPU. What they share is in `ampx.examples.common`,
their data in `ampx.examples.data`; this module (the registry) imports no torch, so `ampx
--help` stays fast.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

__all__ = ["EXAMPLES", "Example", "example_path"]

_HERE = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Example:
    """A built-in example.

    Attributes:
        name: What `ampx sweep --example` takes.
        filename: The script inside `ampx/examples/`.
        description: One line for `--help`.
        default_steps: Steps per configuration in `ampx sweep`.
    """

    name: str
    filename: str
    description: str
    default_steps: int

    @property
    def path(self) -> Path:
        """Absolute path of the script."""
        return _HERE / self.filename


EXAMPLES: dict[str, Example] = {
    "transformer": Example(
        "transformer", "transformer_lm.py",
        "4-layer transformer language model (d_model 512, seq 128) on the Python standard "
        "library's source bytes (every 10th file held out)",
        40,
    ),
    "convnet": Example(
        "convnet", "convnet.py",
        "small ResNet-style convnet on scikit-learn's handwritten digits (a fifth held out; "
        "needs scikit-learn)",
        60,
    ),
}


def example_path(name: str) -> Path:
    """The path of a built-in example script.

    Args:
        name: "transformer" or "convnet".

    Raises:
        ValueError: For an unknown name.
    """
    try:
        return EXAMPLES[name].path
    except KeyError:
        raise ValueError(
            f"ampx.examples: unknown example {name!r}; choose from {sorted(EXAMPLES)}."
        ) from None
