"""The numerics monitor's per-tensor statistics, computed on the tensors' bits.

With its sign bit cleared, a float's bit pattern orders like its magnitude, as an integer:
zero < subnormal < normal < inf < NaN. So every number the monitor needs is an integer
reduction over one masked integer view of the tensor: max |x| is the largest pattern (a NaN
is larger than any other, so it shows without a separate test), the smallest non-zero one is
the smallest after zero is moved to the top, and the counts are of patterns at or above two
thresholds (the half dtype's smallest normal number, and inf), taken by a shift or a clamp.
On CPUs these integer passes run several times faster than float comparisons and counts of
their booleans (bf16/fp16 ones most of all), and nothing is converted.

:func:`measure` returns 0-d integer tensors that stay on the device (the monitor reads a whole
watched step's at once) or, on the CPU, host ints; :func:`decode` turns them into the row the
report reads.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass

import torch

__all__ = ["Format", "decode", "decode_flush", "decode_max", "measure", "measure_flush",
           "measure_max", "tensor_stats"]

PARTS = 5  # what measure returns per tensor (decode makes the six-number row of them)

_INT = {16: torch.int16, 32: torch.int32, 64: torch.int64}
_PACK = {torch.float16: ("<H", "<e"), torch.float32: ("<I", "<f"),
         torch.float64: ("<Q", "<d")}


@dataclass(frozen=True)
class Format:
    """How to read a float dtype's bits: its integer view and the patterns compared against."""

    dtype: torch.dtype      # the dtype measured (others are measured as float32)
    int_dtype: torch.dtype
    mask: int               # every bit but the sign
    tiny: int               # the smallest pattern >= the half dtype's smallest normal number
    inf: int                # inf's pattern: at or above it, inf or NaN

    def to_float(self, bits: int) -> float:
        """The magnitude a (sign-cleared) bit pattern stands for."""
        if self.dtype == torch.bfloat16:  # bf16 is float32's upper half
            return struct.unpack("<f", struct.pack("<I", bits << 16))[0]
        unsigned, real = _PACK[self.dtype]
        return struct.unpack(real, struct.pack(unsigned, bits))[0]


@functools.cache
def fmt(dtype: torch.dtype, tiny: float) -> Format:
    """The :class:`Format` of `dtype` judged against a half dtype whose smallest normal is
    `tiny` (float8 and other dtypes are measured in float32, which holds them exactly)."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        dtype = torch.float32
    int_dtype = _INT[torch.finfo(dtype).bits]
    limit = torch.tensor(tiny, dtype=torch.float64).to(dtype)  # rounded to nearest
    bits = int(limit.view(int_dtype).item())
    if float(limit) < tiny:  # the next pattern up is the next float up
        bits += 1
    inf = int(torch.tensor(math.inf, dtype=dtype).view(int_dtype).item())
    return Format(dtype, int_dtype, (1 << (torch.finfo(dtype).bits - 1)) - 1, bits, inf)


@functools.cache
def _const(value: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`value` as a 0-d tensor: a Python int operand is wrapped and converted again on every
    call (about 1 us, a few times per tensor measured)."""
    return torch.tensor(value, dtype=dtype, device=device)


def _magnitudes(t: torch.Tensor, tiny: float) -> tuple[torch.Tensor, Format]:
    f = fmt(t.dtype, tiny)
    t = t.detach()
    if t.dtype != f.dtype:
        t = t.to(f.dtype)
    return t.view(f.int_dtype).bitwise_and(_const(f.mask, f.int_dtype, t.device)), f


def _at_least(m: torch.Tensor, bits: int) -> torch.Tensor:
    """How many patterns in m are >= `bits` (>= 1): by a shift or a clamp to {0, 1}, which
    run several times faster than a comparison and a count of its booleans on CPUs."""
    if bits & (bits - 1) == 0:
        return torch.count_nonzero(m >> _const(bits.bit_length() - 1, m.dtype, m.device))
    return torch.count_nonzero(m.clamp(bits - 1, bits).sub_(_const(bits - 1, m.dtype, m.device)))


def _low(m: torch.Tensor, f: Format) -> torch.Tensor:
    """The smallest non-zero pattern less 1 (zero - 1 wraps to the top: the mask)."""
    return (m - _const(1, m.dtype, m.device)).bitwise_and_(_const(f.mask, m.dtype, m.device)).min()


def measure(t: torch.Tensor, tiny: float,
            eager: bool | None = None) -> tuple[list[torch.Tensor | int], Format]:
    """t's statistics and how to read them: the largest pattern, the smallest non-zero one
    less 1, the non-zero count, the count at or above `tiny` (inf and NaN included) and the
    count of inf and NaN.

    Not `eager` (off the CPU): 0-d integer tensors on t's device, no host sync. `eager` (the
    default on the CPU, where a read waits for nothing): host ints, the extremes read first
    so that the counts they rule out are not computed (nothing at or above inf's pattern
    below a finite max; nothing subnormal when the smallest non-zero is normal): in the
    common case, half the work.
    """
    m, f = _magnitudes(t, tiny)
    top, nonzero = m.max(), torch.count_nonzero(m)
    if not (m.device.type == "cpu" if eager is None else eager):
        return [top, _low(m, f), nonzero, _at_least(m, f.tiny), _at_least(m, f.inf)], f
    top_, nonzero_ = int(top), int(nonzero)
    # without a zero the smallest pattern is the smallest non-zero one: one pass, not three
    low_ = int(m.min()) - 1 if nonzero_ == m.numel() else int(_low(m, f))
    normal = nonzero_ if low_ + 1 >= f.tiny else int(_at_least(m, f.tiny))
    over = 0 if top_ < f.inf else int(_at_least(m, f.inf))
    return [top_, low_, nonzero_, normal, over], f


def measure_flush(t: torch.Tensor, tiny: float) -> tuple[list[torch.Tensor], Format]:
    """The counts alone (non-zero, at or above `tiny`): all a parameter gradient's row is
    read for (the share flushed to zero or subnormal), at a third of measure's work."""
    m, f = _magnitudes(t, tiny)
    return [torch.count_nonzero(m), _at_least(m, f.tiny)], f


def measure_max(t: torch.Tensor, tiny: float) -> tuple[torch.Tensor, Format]:
    """The largest |t| as a 0-d integer pattern (a NaN is the largest), and its format."""
    m, f = _magnitudes(t, tiny)
    return m.max(), f


def decode_max(bits: int, f: Format) -> float:
    """max |x| from :func:`measure_max`'s pattern; a NaN reads as inf."""
    value = f.to_float(bits)
    return math.inf if math.isnan(value) else value


def decode(parts: list[int], f: Format, numel: int) -> list[float]:
    """``[max|x|, n_overflow, n_underflow, n_zero, min non-zero |x|, numel]`` from
    :func:`measure`'s parts, as read to the host. max |x| is inf when there is a NaN; the
    smallest non-zero magnitude ignores NaN and is inf when there is none."""
    top, low, nonzero, normal, over = parts
    zeros, small = numel - nonzero, numel - normal
    low += 1
    minnz = math.inf if low > f.mask else decode_max(low, f)
    return [decode_max(top, f), float(over), float(small - zeros), float(zeros), minnz,
            float(numel)]


def decode_flush(parts: list[int], numel: int) -> list[float]:
    """A row from :func:`measure_flush`'s parts: the counts of zeros and of underflows; the
    numbers it did not measure (max, overflow, min non-zero) are NaN."""
    nonzero, normal = parts
    zeros = numel - nonzero
    return [math.nan, math.nan, float(numel - normal - zeros), float(zeros), math.nan,
            float(numel)]


def tensor_stats(t: torch.Tensor, tiny: float) -> torch.Tensor:
    """``[max|x|, n_overflow, n_underflow, n_zero, min non-zero |x|, numel]`` of one tensor,
    as float64 on t's device (read through the host; the monitor batches :func:`measure`).

    Overflow: non-finite in t's dtype (inf or NaN; a NaN makes max |x| inf). A float32 value
    beyond the half dtype's largest has not overflowed: the report judges it by max |x| (near
    overflow). Underflow: non-zero but below the half dtype's smallest normal number (`tiny`):
    subnormal, or flushed to zero once cast to the half dtype.
    """
    parts, f = measure(t, tiny)
    row = decode([int(v) for v in parts], f, t.numel())
    return torch.tensor(row, dtype=torch.float64, device=t.device)
