"""`ampx sweep`'s verdict: which opt level to use on this machine, and why, in one paragraph.

One job: read compared and judged rows (`ampx.cli.sweep.stats`, `ampx.cli.sweep.accuracy`)
and the probe (`ampx.cli.sweep.probe`) and name the fastest configuration that keeps O0's
accuracy, with the reason and the evidence. Accuracy is judged on the held-out metric when
the runs evaluated one (the built-in examples; `--metric`): a level qualifies only when its
`accuracy_verdict` is `same`; rows that are `drifting`, `worse` or `too-short` are named with
their numbers. Without a held-out metric the final training loss must stay within
`LOSS_TOLERANCE` of O0's, and the verdict says that this is all it was judged on. On a CPU that
emulates the half dtypes the answer is fp32 (O0), and the memory a half level would save is
said too. Rows that did not finish are listed as not compared; unreliable timings are said to
be so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable, Optional

from .accuracy import DRIFT, MIN_EVALS, SIGNIFICANCE, TOLERANCE, Metric
from .probe import Probe
from .stats import Row

__all__ = ["LOSS_TOLERANCE", "verdict"]

LOSS_TOLERANCE = 0.01
"""Without a held-out metric, a row keeps O0's loss when its final training loss is within
this share of O0's."""

Keeps = Callable[[Row], bool]


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


def _memory(rows: Sequence[Row], base: Row, keeps: Keeps, what: str) -> str:
    saving = [r for r in rows if r is not base and r.mem_ratio is not None
              and r.mem_ratio < 0.98 and keeps(r)]
    if not saving:
        return ""
    best = min(saving, key=lambda r: r.mem_ratio or 1.0)
    percent = (1.0 - (best.mem_ratio or 1.0)) * 100
    return f"; {best.label} saves {percent:.0f}% memory (peak) and keeps the {what}"


def _left_out(rows: Sequence[Row], base: Row, keeps: Keeps, heldout: bool) -> str:
    notes = [f"{r.label} {r.status}" for r in rows if not r.ok]
    if heldout:
        notes += [f"{r.label} {r.accuracy_verdict} ({r.accuracy_note})" for r in rows
                  if r.ok and r is not base and r.accuracy_verdict != "same"
                  and r.accuracy_verdict is not None]
    else:
        notes += [f"{r.label} loss {r.loss_delta * 100:+.1f}%" for r in rows
                  if r.status == "ok" and r.loss_delta is not None and not keeps(r)]
        notes += [f"{r.label} diverged" for r in rows if r.status == "diverged"]
    return f" Not compared: {', '.join(notes)}." if notes else ""


def _evidence(rows: Sequence[Row], base: Row, metric: Optional[Metric]) -> str:
    if base.accuracy_verdict is None:
        return (" Accuracy: judged on the final training loss only (no held-out metric: "
                "report one with ampx.log_metric and pass --metric NAME).")
    label = metric.label if metric is not None else "held-out loss"
    last = base.series["heldout"][-1][0]
    text = (f" Accuracy: {label}, {base.heldout_evals} evaluations to step {last} "
            f"({base.steps} steps); a level keeps it when its final value is within "
            f"{TOLERANCE:.0%} of O0's and its gap to O0 does not grow by more than "
            f"{DRIFT * 100:g}% over the run (least squares over the last half of the evaluations, "
            f"{SIGNIFICANCE:.0f} standard errors).")
    short = [r.label for r in rows if r.ok and r.accuracy_verdict == "too-short"
             and r is not base]
    if short:
        text += (f" The run was too short to judge {', '.join(short)} (at least {MIN_EVALS} "
                 "evaluations at O0's steps are needed): give it more --steps or --budget.")
    return text


def verdict(rows: Sequence[Row], probe: Optional[Probe] = None,
            metric: Optional[Metric] = None) -> str:
    """One paragraph that names the configuration to use here, why, and on what evidence.

    Args:
        rows: Compared rows (judged by `accuracy.judge` where the runs evaluated a metric).
        probe: The sweep's probe of this CPU (None on a GPU or for a user script).
        metric: What accuracy was judged by (for the wording).
    """
    base = next((r for r in rows if r.opt_level == "O0" and r.status == "ok"), None)
    if base is None or base.step_time_s is None:
        done = [r.label for r in rows if r.status == "ok"]
        return ("verdict: none: O0 (the fp32 baseline) did not finish, so nothing can be "
                "compared with it" + (f" (finished: {', '.join(done)})" if done else "") + ".")
    heldout = base.accuracy_verdict is not None
    what = (metric.label if metric is not None else "held-out loss") if heldout else "loss"

    def keeps(row: Row) -> bool:
        if heldout:
            return row is base or row.accuracy_verdict == "same"
        return _keeps_loss(row, base)

    candidates = [r for r in rows if r.status == "ok" and r.step_time_s is not None
                  and keeps(r)]
    best = min(candidates, key=lambda r: r.step_time_s or 0.0)
    halves = [r for r in candidates if r is not base]
    evidence = _evidence(rows, base, metric)
    if not any(r.status == "ok" and r is not base for r in rows):
        return ("verdict: none: no configuration but O0 finished, so there is nothing to "
                "compare." + evidence + _left_out(rows, base, keeps, heldout))
    unsure = " (timings UNRELIABLE: other load; rerun on a quiet machine)" \
        if any(r.unreliable for r in candidates) else ""
    others = [r for r in rows if r.ok and r is not base]
    if best is base and not halves and heldout and all(
            r.accuracy_verdict == "too-short" for r in others):
        text = ("verdict: use O0 (fp32) here: the run was too short to judge the "
                f"half-precision levels' {what}, so none is recommended")
    elif best is base and not halves:
        text = (f"verdict: use O0 (fp32) here: no half-precision level kept O0's {what}"
                if heldout else "verdict: use O0 (fp32) here: it is the fastest")
    elif best is base:
        text = "verdict: use O0 (fp32) here: it is the fastest"
        fastest = min(halves, key=lambda r: r.step_time_s or 0.0)
        text += (f"; the fastest half-precision row, {fastest.label}, ran at "
                 f"{fastest.speedup or 0:.2f}x O0's speed")
        why = _emulation(probe, fastest.dtype)
        if why:
            text += f": {why}"
        text += _memory(rows, base, keeps, what)
    else:
        keep = (f"whose {what} is within {TOLERANCE:.0%} of O0's and not drifting" if heldout
                else f"whose final loss is within {LOSS_TOLERANCE:.0%} of O0's")
        text = (f"verdict: use {best.label} here: the fastest ({best.speedup or 0:.2f}x O0, "
                f"IQR {best.speedup_low or 0:.2f}-{best.speedup_high or 0:.2f}) of the rows "
                f"{keep}")
        if best.mem_ratio is not None:
            text += f", {(best.mem_ratio - 1) * 100:+.0f}% memory"
        if best.speedup_low is not None and best.speedup_low < 1.0:
            text += " (its range reaches below O0's speed: not clearly faster)"
        if best.time_to_quality_s is not None and base.time_to_quality_s:
            text += (f"; it reached O0's final {what} in {best.time_to_quality_s:.1f} s "
                     f"(O0: {base.time_to_quality_s:.1f} s)")
    return text + unsure + "." + evidence + _left_out(rows, base, keeps, heldout)
