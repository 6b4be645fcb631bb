"""The numerics report: modules ranked by how close they are to breaking, and what to do.

:class:`NumericsReport` turns a :class:`~ampx.overflow.numerics.NumericsMonitor`'s samples
into one row per module (:class:`ModuleNumerics`), ranked by risk:

1. ``overflow``: its output overflowed the half dtype while its inputs were in range, and no
   module inside it overflowed first: the overflow starts here;
2. ``precision``: re-run in float32 on the same inputs (the shadow), its half output is off by
   more than a few units of the half dtype's precision (no loss scale can fix that);
3. ``underflow`` (fp16): more than 1 % of the gradient arriving at it, or of its parameters'
   gradients, is subnormal in fp16 at the loss scale in use (exact zeros do not count: a
   saturated softmax has true zero gradients; bf16 underflows where float32 does, so it is
   not judged there);
4. ``near overflow``: its inputs or outputs use more than 1/8 of the half dtype's range;
5. ``inf/NaN from upstream``: it only carried an overflow that started elsewhere.

:meth:`NumericsReport.advice` says what to do as lines to paste (``keep_fp32=[...]``, ``dtype=
"bf16"``, a loss-scale range). The report prints as a table and writes JSON, CSV and a
heat map (modules x watched steps; overflow and underflow).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .report import ROOT_MODULE

__all__ = ["ModuleNumerics", "NumericsReport"]

_MAX, _OVER, _UNDER, _ZERO, _MINNZ, _NUMEL = range(6)
# relative error of a half output against float32 above which a module loses precision:
# 8 units of the dtype's rounding (fp16: 2^-11, bf16: 2^-8)
_PRECISION_UNITS = 8
_NEAR_EDGE = 1 / 8       # share of the half range in use that counts as near overflow
_UNDERFLOW_SHARE = 0.01  # share of a gradient flushed that counts as underflow

_RISK = {"overflow": 4.0, "precision": 3.0, "underflow": 2.0, "near overflow": 1.0,
         "inf/NaN from upstream": 0.5, "ok": 0.0}


@dataclass(frozen=True)
class ModuleNumerics:
    """One module's numbers over the watched steps (fractions in [0, 1]; None: not seen)."""

    name: str
    leaf: bool                    # no child modules: its output is its own computation
    issue: str                    # see the module docstring
    risk: float                   # the ranking key (higher is worse)
    steps: int                    # watched steps it ran in
    origin_steps: int             # watched steps whose overflow started in it
    max_abs: float | None         # largest |output|
    max_input: float | None       # largest |input|
    overflow: float | None        # largest share of its output beyond the half range
    underflow: float | None       # largest share of its output below the half normal range
    range_bits: float | None      # log2(max |x| / smallest non-zero |x|) of its output
    grad_overflow: float | None   # the gradient arriving at its output, at the loss scale
    grad_underflow: float | None
    param_flush: float | None     # share of its parameters' gradients zero or subnormal
    param_underflow: float | None  # share of its parameters' gradients subnormal
    shadow_error: float | None    # relative error of its half output against float32
    grad_max: float | None        # largest |gradient| at its output, scaled
    grad_min: float | None        # smallest non-zero |gradient| at its output, scaled
    loss_scale: float             # the loss scale at its last watched step


def _share(row: list[float] | None, col: int) -> float | None:
    return None if row is None or row[_NUMEL] == 0 else row[col] / row[_NUMEL]


def _maxopt(values: list[float | None]) -> float | None:
    seen = [v for v in values if v is not None]
    return max(seen) if seen else None


def _descends(child: str, parent: str) -> bool:
    """Whether module `child` lies inside module `parent` (names as in the report)."""
    if child == parent:
        return False
    head, _, tail = parent.rpartition(".")
    if tail == ROOT_MODULE:  # "(root)" or "model<i>.(root)": every module of that model
        return not head or child.startswith(head + ".")
    return child.startswith(parent + ".")


class NumericsReport:
    """Per-module numerics of the watched steps, ranked by risk (worst first).

    Built by :meth:`NumericsMonitor.report`. `modules` is the ranking; `history` holds each
    module's overflow and underflow share per watched step (the heat map).
    """

    def __init__(self, dtype: torch.dtype, steps: int, every: int,
                 modules: list[ModuleNumerics], history: dict[str, Any],
                 fallbacks: list[tuple[str, int, str]],
                 call: str = 'ampx.initialize(model, optimizer, opt_level="O1"') -> None:
        self.dtype = dtype
        self.call = call
        self.steps = steps
        self.every = every
        self.modules = modules
        self.history = history
        self.fallbacks = fallbacks

    # -- building ---------------------------------------------------------------------------
    @classmethod
    def from_monitor(cls, monitor: Any) -> NumericsReport:
        """The report of a :class:`~ampx.overflow.numerics.NumericsMonitor`'s samples so far
        (not imported here: the monitor imports this module for its ``report()``)."""
        info = torch.finfo(monitor.dtype)
        fmax = float(info.max)
        tolerance = _PRECISION_UNITS * float(info.eps) / 2
        origins = cls._origins(monitor, fmax)
        watched = sorted({s.step for samples in monitor.samples for s in samples})
        column = {step: i for i, step in enumerate(watched)}
        rows: list[ModuleNumerics] = []
        overflow_map: list[list[float]] = []
        underflow_map: list[list[float]] = []
        order = {index: rank for rank, index in enumerate(monitor.order)}
        indices = sorted(range(len(monitor.names)), key=lambda i: order.get(i, len(order) + i))
        names: list[str] = []
        for index in indices:
            samples = monitor.samples[index]
            if not samples:
                continue
            name = monitor.names[index]
            names.append(name)
            over_row = [0.0] * len(watched)
            under_row = [0.0] * len(watched)
            for s in samples:
                # the forward only: gradients overflowing at a too-high scale are the
                # scaler's routine (a skipped step), not a numerics risk
                over_row[column[s.step]] = _share(s.forward, _OVER) or 0.0
                under_row[column[s.step]] = max(
                    [v for v in (_share(s.forward, _UNDER), _share(s.grad, _UNDER),
                                 _share(s.params, _UNDER)) if v] or [0])
            overflow_map.append(over_row)
            underflow_map.append(under_row)
            rows.append(cls._summarize(name, monitor.leaf[index], samples,
                                       origins.get(index, 0), fmax, tolerance,
                                       monitor.dtype == torch.float16))
        rows.sort(key=lambda r: (-r.risk, names.index(r.name)))
        history = {"steps": watched, "modules": names, "overflow": overflow_map,
                   "underflow": underflow_map}
        return cls(monitor.dtype, monitor.steps, monitor.every, rows, history,
                   list(monitor.fallbacks), monitor.call)

    @staticmethod
    def _flush(row: list[float] | None) -> float | None:
        if row is None or row[_NUMEL] == 0:
            return None
        return (row[_UNDER] + row[_ZERO]) / row[_NUMEL]

    @staticmethod
    def _origins(monitor: Any, fmax: float) -> dict[int, int]:
        """Per module, the watched steps whose forward overflow started in it."""
        by_step: dict[int, list[int]] = {}
        for index, samples in enumerate(monitor.samples):
            for s in samples:
                fed_in_range = s.inputs is None or s.inputs <= fmax
                if s.forward is not None and s.forward[_OVER] > 0 and fed_in_range:
                    by_step.setdefault(s.step, []).append(index)
        counts: dict[int, int] = {}
        for candidates in by_step.values():
            names = [monitor.names[i] for i in candidates]
            for index in candidates:  # a block whose child started it is not the origin
                if not any(_descends(other, monitor.names[index]) for other in names):
                    counts[index] = counts.get(index, 0) + 1
        return counts

    @staticmethod
    def _summarize(name: str, leaf: bool, samples: list[Any], origin_steps: int, fmax: float,
                   tolerance: float, judge_underflow: bool) -> ModuleNumerics:
        overflow = _maxopt([_share(s.forward, _OVER) for s in samples])
        grad_underflow = _maxopt([_share(s.grad, _UNDER) for s in samples])
        flush = _maxopt([NumericsReport._flush(s.params) for s in samples])
        param_under = _maxopt([_share(s.params, _UNDER) for s in samples])
        shadow = _maxopt([s.shadow_error for s in samples])
        max_abs = _maxopt([s.forward[_MAX] if s.forward else None for s in samples])
        max_input = _maxopt([s.inputs for s in samples])
        ranges = [math.log2(s.forward[_MAX] / s.forward[_MINNZ]) for s in samples
                  if s.forward and 0 < s.forward[_MINNZ] <= s.forward[_MAX] < math.inf]
        grads = [s.grad for s in samples if s.grad is not None]
        # a whole model's error is its modules' errors added up: not a place to act on
        is_root = name.rpartition(".")[2] == ROOT_MODULE
        edge = max((v for v in (max_abs, max_input) if v is not None and v < math.inf),
                   default=0.0) / fmax
        if origin_steps:
            issue, extra = "overflow", overflow or 0.0
        elif shadow is not None and shadow > tolerance and not is_root:
            issue, extra = "precision", min(shadow, 1.0)
        elif judge_underflow and max(grad_underflow or 0.0, param_under or 0.0) \
                > _UNDERFLOW_SHARE:
            issue, extra = "underflow", max(grad_underflow or 0.0, param_under or 0.0)
        elif edge > _NEAR_EDGE:
            issue, extra = "near overflow", min(edge, 1.0)
        elif overflow:
            issue, extra = "inf/NaN from upstream", overflow
        else:
            issue, extra = "ok", min(edge, 1.0) * 0.5
        return ModuleNumerics(
            # bands of width 1 by issue, ordered inside a band by how bad (at most 0.49)
            name=name, leaf=leaf, issue=issue, risk=_RISK[issue] + min(extra, 1.0) * 0.49,
            steps=len(samples),
            origin_steps=origin_steps, max_abs=max_abs, max_input=max_input,
            overflow=overflow, underflow=_maxopt([_share(s.forward, _UNDER) for s in samples]),
            range_bits=max(ranges) if ranges else None,
            grad_overflow=_maxopt([_share(s.grad, _OVER) for s in samples]),
            grad_underflow=grad_underflow, param_flush=flush, param_underflow=param_under,
            shadow_error=shadow,
            grad_max=max((g[_MAX] for g in grads), default=None),
            grad_min=min((g[_MINNZ] for g in grads if g[_MINNZ] < math.inf), default=None),
            loss_scale=samples[-1].loss_scale)

    # -- reading ----------------------------------------------------------------------------
    def at_risk(self) -> list[ModuleNumerics]:
        """The modules with an issue (not ``ok``), worst first."""
        return [m for m in self.modules if m.issue != "ok"]

    def advice(self, call: str | None = None) -> list[str]:
        """What to do, as lines to paste (`call`: the initialize call, unclosed; default: the
        session's own)."""
        call = self.call if call is None else call
        lines: list[str] = []
        half = "fp16" if self.dtype == torch.float16 else "bf16"
        fp32 = [m.name for m in self.modules if m.issue in ("overflow", "precision")
                and m.name.rpartition(".")[2] != ROOT_MODULE]
        # O2/O3 cast a kept module's output back to the half dtype for the half modules after
        # it: an output that itself overflows would overflow again there. O1 keeps it float32.
        cast_back = [m.name for m in self.modules if m.issue == "overflow" and m.leaf
                     and 'opt_level="O1"' not in call]
        if fp32 and not cast_back:
            lines.append(f"# keep where it breaks in float32 ({', '.join(fp32)}):")
            lines.append(f"{call}, keep_fp32={fp32!r})")
        elif fp32:
            o1 = re.sub(r'opt_level="O\d"', 'opt_level="O1"', call)
            lines.append(f"# {', '.join(cast_back)} overflow in their own output, which this "
                         "level casts back to half: keep them in float32 under O1:")
            lines.append(f"{o1}, keep_fp32={fp32!r})")
        overflows = [m for m in self.modules if m.issue == "overflow"]
        if overflows and self.dtype == torch.float16:
            bf16_max = float(torch.finfo(torch.bfloat16).max)
            fits = all(m.max_input is None or m.max_input < bf16_max for m in overflows)
            if fits:
                lines.append("# or bf16, whose range (3.4e38) holds these values without "
                             "overflow (fp16 stops at 65504):")
                lines.append(f'{call}, dtype="bf16")')
        near = [m for m in self.modules if m.issue == "near overflow"]
        if near and self.dtype == torch.float16 and not any("bf16" in x for x in lines):
            worst = max(max(v for v in (m.max_abs, m.max_input) if v is not None) for m in near)
            lines.append(f"# {', '.join(m.name for m in near)} see values up to {worst:.3g}, "
                         f"{100 * worst / float(torch.finfo(torch.float16).max):.0f} % of fp16's "
                         "range: bf16 has headroom to spare:")
            lines.append(f'{call}, dtype="bf16")')
        scale = self.scale_range()
        if scale is not None:
            low, high = scale
            if low <= high:
                lines.append(f"# a loss scale between 2^{low} and 2^{high} keeps the watched "
                             "gradients inside fp16's normal range:")
                lines.append(f"{call}, min_loss_scale=2.0**{low}, max_loss_scale=2.0**{high})")
            else:
                under = [m.name for m in self.modules if m.issue == "underflow"]
                lines.append(f"# no loss scale fits every gradient in {half}: the smallest need "
                             f"at least 2^{low}, the largest allow at most 2^{high}; keep "
                             f"{', '.join(under)} in float32 or use bf16")
        for name, step, why in self.fallbacks:
            lines.append(f"# step {step}: the fp32 fallback moved {name} to float32 ({why})")
        return lines

    def scale_range(self) -> tuple[int, int] | None:
        """``(low, high)`` exponents of the loss scales that keep gradients normal (fp16 only).

        `high`: the largest scale at which the biggest watched gradient stays finite; `low`:
        the smallest at which the gradients of underflowing modules become normal. None in
        bf16, or when no gradient was watched.
        """
        if self.dtype != torch.float16:
            return None
        info = torch.finfo(torch.float16)
        highs, lows = [], []
        for m in self.modules:
            if m.grad_max is not None and 0 < m.grad_max < math.inf:
                highs.append(math.log2(float(info.max) / (m.grad_max / m.loss_scale)))
            if m.issue == "underflow" and m.grad_min is not None and m.grad_min > 0:
                lows.append(math.log2(float(info.tiny) / (m.grad_min / m.loss_scale)))
        if not highs:
            return None
        high = math.floor(min(highs)) - 1  # one power of two of headroom
        low = math.ceil(max(lows)) if lows else min(0, high)
        return low, high

    # -- output -----------------------------------------------------------------------------
    _COLUMNS = ("name", "issue", "max_abs", "max_input", "overflow", "underflow", "range_bits",
                "grad_overflow", "grad_underflow", "param_flush", "shadow_error")

    def table(self, limit: int = 20) -> str:
        """The ranking as text (at most `limit` rows) followed by the advice."""
        def pct(v: float | None) -> str:
            return "-" if v is None else ("0" if v == 0 else f"{100 * v:.3g}%")

        def num(v: float | None) -> str:
            return "-" if v is None else f"{v:.3g}"

        head = ["#", "module", "issue", "max|out|", "max|in|", "over", "under", "range",
                "grad over", "grad under", "param flush", "fp32 err"]
        body = [[str(i + 1), m.name, m.issue, num(m.max_abs), num(m.max_input), pct(m.overflow),
                 pct(m.underflow), "-" if m.range_bits is None else f"{m.range_bits:.0f}b",
                 pct(m.grad_overflow), pct(m.grad_underflow), pct(m.param_flush),
                 num(m.shadow_error)] for i, m in enumerate(self.modules[:limit])]
        widths = [max(len(r[c]) for r in [head, *body]) for c in range(len(head))]
        out = [f"ampx numerics ({'fp16' if self.dtype == torch.float16 else 'bf16'}): "
               f"{len(self.history['steps'])} watched steps of {self.steps}, "
               f"{len(self.at_risk())} of {len(self.modules)} modules at risk"]
        for r in [head, *body]:
            out.append("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
        if len(self.modules) > limit:
            out.append(f"... {len(self.modules) - limit} more in the CSV")
        out.extend(self.advice())
        return "\n".join(out)

    def as_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready (inf written as the string "inf")."""
        def clean(v: Any) -> Any:
            return "inf" if isinstance(v, float) and math.isinf(v) else v

        return {"dtype": str(self.dtype).replace("torch.", ""), "steps": self.steps,
                "every": self.every,
                "modules": [{k: clean(v) for k, v in asdict(m).items()} for m in self.modules],
                "advice": self.advice(), "history": self.history,
                "fallbacks": [{"module": n, "step": s, "why": w} for n, s, w in self.fallbacks]}

    def csv(self) -> str:
        """One row per module, ranked, every field of :class:`ModuleNumerics`."""
        buf = io.StringIO()
        fields = list(ModuleNumerics.__dataclass_fields__)
        writer = csv.DictWriter(buf, fieldnames=["rank", *fields])
        writer.writeheader()
        for rank, m in enumerate(self.modules, 1):
            writer.writerow({"rank": rank, **asdict(m)})
        return buf.getvalue()

    def write(self, directory: str | Path, prefix: str = "numerics") -> list[Path]:
        """Write ``{prefix}.txt``, ``.json``, ``.csv`` and (with matplotlib) ``.png``."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / f"{prefix}.txt", out / f"{prefix}.json", out / f"{prefix}.csv"]
        paths[0].write_text(self.table(limit=len(self.modules)) + "\n")
        paths[1].write_text(json.dumps(self.as_dict(), indent=1) + "\n")
        paths[2].write_text(self.csv())
        try:
            from .numerics_plot import plot_heatmap
        except ImportError:  # matplotlib is optional (the [plot] extra)
            return paths
        paths.append(plot_heatmap(self, out / f"{prefix}.png"))
        return paths
