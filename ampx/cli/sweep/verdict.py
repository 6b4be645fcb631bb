"""`ampx sweep`'s verdict: which opt level to use on this machine, and why, in one paragraph.

One job: read compared rows (`ampx.cli.sweep.stats`) and the probe (`ampx.cli.sweep.probe`)
and name the fastest configuration whose final loss stays within `LOSS_TOLERANCE` of O0's,
with the reason: on a CPU that emulates the half dtypes that is fp32 (O0), and the memory a
half level would save is said too; elsewhere it is the fastest level that keeps the loss.
Rows that did not finish are listed as not compared; unreliable timings are said to be so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from .probe import Probe
from .stats import Row

__all__ = ["LOSS_TOLERANCE", "verdict"]

LOSS_TOLERANCE = 0.01
"""A row keeps O0's loss when its final loss is within this share of O0's."""


def _keeps_loss(row: Row, base: Row) -> bool:
    return row is base or (row.loss_delta is not None and abs(row.loss_delta) <= LOSS_TOLERANCE)


def _emulation(probe: Optional[Probe], dtype: Optional[str]) -> Optional[str]:
    if probe is None or dtype is None or not probe.emulated(dtype):
        return None
    slowdown = probe.slowdown(dtype)
    how = "emulated" if not probe.native.get(dtype, True) else "slow"
    times = f", {slowdown:.0f}x slower than fp32 at this model's shapes" if slowdown else ""
    return (f"{dtype} matmuls are {how} here (no native {dtype} kernels: "
            f"{probe.capability} CPU, no AVX512-{dtype.upper()}/AMX){times}")


def _memory(rows: Sequence[Row], base: Row) -> str:
    saving = [r for r in rows if r is not base and r.mem_ratio is not None
              and r.mem_ratio < 0.98 and _keeps_loss(r, base)]
    if not saving:
        return ""
    best = min(saving, key=lambda r: r.mem_ratio or 1.0)
    percent = (1.0 - (best.mem_ratio or 1.0)) * 100
    return f"; {best.label} saves {percent:.0f}% memory (peak) and keeps the loss"


def _left_out(rows: Sequence[Row], base: Row) -> str:
    notes = [f"{r.label} {r.status}" for r in rows if not r.ok]
    notes += [f"{r.label} loss {r.loss_delta * 100:+.1f}%" for r in rows
              if r.status == "ok" and r.loss_delta is not None and not _keeps_loss(r, base)]
    notes += [f"{r.label} diverged" for r in rows if r.status == "diverged"]
    return f" Not compared: {', '.join(notes)}." if notes else ""


def verdict(rows: Sequence[Row], probe: Optional[Probe] = None) -> str:
    """One paragraph that names the configuration to use here and why.

    Args:
        rows: Compared rows.
        probe: The sweep's probe of this CPU (None on a GPU or for a user script).
    """
    base = next((r for r in rows if r.opt_level == "O0" and r.status == "ok"), None)
    if base is None or base.step_time_s is None:
        done = [r.label for r in rows if r.status == "ok"]
        return ("verdict: none: O0 (the fp32 baseline) did not finish, so nothing can be "
                "compared with it" + (f" (finished: {', '.join(done)})" if done else "") + ".")
    candidates = [r for r in rows if r.status == "ok" and r.step_time_s is not None
                  and _keeps_loss(r, base)]
    best = min(candidates, key=lambda r: r.step_time_s or 0.0)
    halves = [r for r in candidates if r is not base]
    if not any(r.status == "ok" and r is not base for r in rows):
        return ("verdict: none: no configuration but O0 finished, so there is nothing to "
                "compare." + _left_out(rows, base))
    unsure = " (timings UNRELIABLE: other load; rerun on a quiet machine)" \
        if any(r.unreliable for r in candidates) else ""
    if best is base:
        text = "verdict: use O0 (fp32) here: it is the fastest"
        fastest = min(halves, key=lambda r: r.step_time_s or 0.0) if halves else None
        why = _emulation(probe, fastest.dtype if fastest else None)
        if fastest is not None:
            text += (f"; the fastest half-precision row, {fastest.label}, ran at "
                     f"{fastest.speedup or 0:.2f}x O0's speed")
        if why:
            text += f": {why}"
        text += _memory(rows, base)
    else:
        text = (f"verdict: use {best.label} here: the fastest ({best.speedup or 0:.2f}x O0, "
                f"IQR {best.speedup_low or 0:.2f}-{best.speedup_high or 0:.2f}) of the rows "
                f"whose final loss is within {LOSS_TOLERANCE:.0%} of O0's")
        if best.mem_ratio is not None:
            text += f", {(best.mem_ratio - 1) * 100:+.0f}% memory"
        if best.speedup_low is not None and best.speedup_low < 1.0:
            text += " (its range reaches below O0's speed: not clearly faster)"
    return text + unsure + "." + _left_out(rows, base)
