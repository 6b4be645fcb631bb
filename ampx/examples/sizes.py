"""The built-in examples' model sizes, and the matmul and conv shapes one training step runs.

One job: describe, without importing torch, each example's size ladder (its default size
first, then smaller ones) and, for every size, the products of one forward pass at their
real shapes. `ampx sweep` times those shapes in fp32 and in the half dtypes before it starts
(`ampx.cli.sweep.probe`) and picks the largest size whose runs fit its time budget
(`ampx.cli.sweep.plan`). The shapes follow the scripts' own defaults (`transformer_lm.py`,
`convnet.py`); a test checks that the default size is what the scripts build.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Kernel", "LADDERS", "Size", "conv_sizes", "transformer_sizes"]


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One product of a forward pass, `count` times per step.

    Attributes:
        kind: "mm" (rows x k times k x n) or "conv" (a 3x3 convolution, padding 1).
        rows: What the cost grows with linearly: the matmul's rows (tokens), or the conv's
            batch. The probe times fewer rows and scales up when the full shape is slow.
        dims: "mm": (k, n); "conv": (c_in, c_out, height_width, stride).
        count: How many times one forward pass runs it.
    """

    kind: str
    rows: int
    dims: tuple[int, ...]
    count: int = 1

    @property
    def flops(self) -> float:
        """Multiply-adds times two, of one run."""
        if self.kind == "mm":
            k, n = self.dims
            return 2.0 * self.rows * k * n
        c_in, c_out, hw, stride = self.dims
        out = (hw + stride - 1) // stride
        return 2.0 * self.rows * out * out * c_out * c_in * 9

    @property
    def label(self) -> str:
        """"1024x512x2048" (rows x k x n) or "conv 64x3x32x32->32"."""
        if self.kind == "mm":
            return f"{self.rows}x{self.dims[0]}x{self.dims[1]}"
        c_in, c_out, hw, stride = self.dims
        return f"conv {self.rows}x{c_in}x{hw}x{hw}->{c_out}" + (f"/{stride}" if stride > 1 else "")


@dataclasses.dataclass(frozen=True)
class Size:
    """One size of an example.

    Attributes:
        label: What the sweep reports ("d_model 512, 4 layers").
        args: The script options that build it (empty for the script's defaults).
        kernels: The forward pass's products (the backward pass runs about twice as many).
    """

    label: str
    args: tuple[str, ...]
    kernels: tuple[Kernel, ...]

    @property
    def flops(self) -> float:
        """The forward pass's flops."""
        return sum(k.flops * k.count for k in self.kernels)


def transformer_sizes(d_model: int, layers: int, seq_len: int = 128, batch: int = 8,
                      vocab: int = 256) -> tuple[Kernel, ...]:
    """The matmuls of `transformer_lm.py`'s forward pass (attention's own small bmm left out)."""
    tokens, d = batch * seq_len, d_model
    return (
        Kernel("mm", tokens, (d, 3 * d), layers),  # q, k, v projection
        Kernel("mm", tokens, (d, d), layers),  # attention output projection
        Kernel("mm", tokens, (d, 4 * d), layers),  # feed-forward up
        Kernel("mm", tokens, (4 * d, d), layers),  # feed-forward down
        Kernel("mm", tokens, (d, vocab)),  # the head
    )


def conv_sizes(width: int, batch: int = 64, image: int = 16) -> tuple[Kernel, ...]:
    """The 3x3 convolutions and the classifier of `convnet.py`'s forward pass (the two 1x1
    shortcut projections, a ninth of a 3x3's work each, are left out)."""
    half, quarter = (image + 1) // 2, (image + 3) // 4
    return (
        Kernel("conv", batch, (1, width, image, 1)),  # the stem
        Kernel("conv", batch, (width, width, image, 1), 2),  # block 1
        Kernel("conv", batch, (width, 2 * width, image, 2)),  # block 2
        Kernel("conv", batch, (2 * width, 2 * width, half, 1)),
        Kernel("conv", batch, (2 * width, 4 * width, half, 2)),  # block 3
        Kernel("conv", batch, (4 * width, 4 * width, quarter, 1)),
        Kernel("mm", batch, (4 * width, 10)),
    )


def _transformer(d_model: int, layers: int, seq_len: int = 128, batch: int = 8) -> Size:
    default = (d_model, layers, seq_len, batch) == (512, 4, 128, 8)
    args = () if default else ("--d-model", str(d_model), "--layers", str(layers),
                               "--seq-len", str(seq_len), "--batch-size", str(batch))
    label = f"d_model {d_model}, {layers} layer{'s' if layers > 1 else ''}"
    if (seq_len, batch) != (128, 8):
        label += f", seq {seq_len}, batch {batch}"
    return Size(label, args, transformer_sizes(d_model, layers, seq_len, batch))


def _convnet(width: int, batch: int = 64) -> Size:
    args = () if (width, batch) == (32, 64) else ("--width", str(width),
                                                   "--batch-size", str(batch))
    label = f"width {width}" + (f", batch {batch}" if batch != 64 else "")
    return Size(label, args, conv_sizes(width, batch))


LADDERS: dict[str, tuple[Size, ...]] = {
    "transformer": (_transformer(512, 4), _transformer(256, 2), _transformer(128, 2),
                    _transformer(64, 1, 64, 8), _transformer(32, 1, 32, 4)),
    "convnet": (_convnet(32), _convnet(16), _convnet(8), _convnet(8, 16)),
}
"""Each example's sizes, its default first, then smaller ones (the sweep picks among them)."""
