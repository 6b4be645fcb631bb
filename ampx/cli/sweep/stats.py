"""`ampx sweep`'s numbers: one row per configuration, its metrics, and how far to trust them.

One job: turn a run's telemetry (and the machine load measured while it ran) into a `Row`,
and compare rows with the O0 baseline: speed-up with its interquartile range, memory ratio,
loss difference, divergence, and whether the timings are reliable. Nothing here runs
processes or writes files.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from typing import Any, Optional

__all__ = [
    "BUSY_CPUS",
    "DIVERGENCE_FACTOR",
    "NOISY_SPREAD",
    "LoadMeter",
    "Row",
    "compare",
    "not_run",
    "summarize",
    "withhold",
]

DIVERGENCE_FACTOR = 10.0
"""A final loss above this multiple of O0's (or a non-finite one) marks the row as diverged."""

NOISY_SPREAD = 1.5
"""Rows whose step times vary more than this (75th/25th percentile) are marked unreliable."""

BUSY_CPUS = 0.5
"""Rows during which other processes used more than this many CPUs (on average; at least 10%
of the machine's CPUs) are marked unreliable: they competed with the run for the machine."""


@dataclasses.dataclass
class Row:
    """The outcome of one configuration (the metrics are None when unknown).

    Attributes:
        label: The configuration's label.
        opt_level: "O0".."O3" or "autocast".
        dtype: "fp16", "bf16" or None.
        status: "ok", "diverged", "error", "timeout", "interrupted", "no data" or "not run"
            (the sweep was interrupted, or its budget spent, before this configuration
            started).
        error: Why a run failed (the last line of its stderr), or None.
        returncode: The process's exit code (None after a timeout).
        wall_s: Wall time of the whole process.
        steps: Number of step records.
        step_time_s: Median step time (the first step, which includes warm-up, is left out).
        step_time_q1: 25th percentile of the step times.
        step_time_q3: 75th percentile of the step times.
        step_time_spread: `step_time_q3 / step_time_q1`: far above 1 when something else
            competed for the device during much of the run.
        other_cpus: CPUs used by other processes during the run, on average (None where it
            cannot be measured).
        load_avg: The highest 1-minute load average seen during the run.
        peak_mem_bytes: Largest peak-memory reading of the run.
        final_loss: Mean loss over the last 10% of the steps (at least one); None for a run
            that did not finish (a loss after 3 of 40 steps is not a result).
        skipped: Skipped steps.
        final_scale: The loss scale after the last step.
        speedup: O0's median step time divided by this row's.
        speedup_low: O0's 25th percentile over this row's 75th (the slow end of the range).
        speedup_high: O0's 75th percentile over this row's 25th.
        mem_ratio: This row's peak memory divided by O0's.
        loss_delta: (final_loss - O0's) / |O0's|.
        skip_culprits: The modules most often named by the overflow reports of skipped steps
            (`[[name, count], ...]`, top 3; the forward module when the report has one).
        numerics_at_risk: With ``ampx sweep --numerics``: the numerics report's top modules
            at risk (`[[name, issue], ...]`, top 3).
        unreliable: Why this row's timings (or O0's, which its speed-up divides) are not to
            be trusted, or None.
        heldout: The final value of every metric the run evaluated (the built-in examples:
            `{"loss": ..., "accuracy": ...}` on their held-out split); None without any.
        heldout_gap: The judged metric's final relative gap to O0's (positive: worse).
        gap_trend: That gap's fitted growth over the run (`accuracy.trend`), and
            `gap_trend_se` its standard error.
        heldout_evals: Evaluations compared with O0's.
        time_to_quality_s: Training seconds until the judged metric first reached O0's final
            value (None: never).
        accuracy_verdict: "same", "drifting", "worse" or "too-short" (`accuracy.judge`);
            None when there is nothing to judge by; `accuracy_note` says why.
        series: Per-step "loss", "loss_scale", "step_time_s" and "skipped" lists; with
            evaluations also "heldout" ([step, value] of the judged metric),
            "heldout_time_s" and "metrics" (every metric's [step, value] pairs).
        init: The run's telemetry `init` record (properties, requested and forced options).
        command: The command line that ran.
        log: Path of the run's captured stdout/stderr.
    """

    label: str
    opt_level: str
    dtype: Optional[str]
    status: str = "no data"
    error: Optional[str] = None
    returncode: Optional[int] = None
    wall_s: Optional[float] = None
    steps: int = 0
    step_time_s: Optional[float] = None
    step_time_q1: Optional[float] = None
    step_time_q3: Optional[float] = None
    step_time_spread: Optional[float] = None
    other_cpus: Optional[float] = None
    load_avg: Optional[float] = None
    peak_mem_bytes: Optional[int] = None
    final_loss: Optional[float] = None
    skipped: Optional[int] = None
    final_scale: Optional[float] = None
    speedup: Optional[float] = None
    speedup_low: Optional[float] = None
    speedup_high: Optional[float] = None
    mem_ratio: Optional[float] = None
    loss_delta: Optional[float] = None
    skip_culprits: list[list[Any]] = dataclasses.field(default_factory=list)
    numerics_at_risk: list[list[str]] = dataclasses.field(default_factory=list)
    unreliable: Optional[str] = None
    heldout: Optional[dict[str, float]] = None
    heldout_gap: Optional[float] = None
    gap_trend: Optional[float] = None
    gap_trend_se: Optional[float] = None
    heldout_evals: int = 0
    time_to_quality_s: Optional[float] = None
    accuracy_verdict: Optional[str] = None
    accuracy_note: Optional[str] = None
    series: dict[str, Any] = dataclasses.field(default_factory=dict)
    init: Optional[dict[str, Any]] = None
    command: list[str] = dataclasses.field(default_factory=list)
    log: Optional[str] = None

    @property
    def ok(self) -> bool:
        """True when the run finished and produced step records."""
        return self.status in ("ok", "diverged")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _timings(row: Row, step_times: list[Any]) -> None:
    times = [t for t in step_times[1:] if _finite(t)] or [t for t in step_times if _finite(t)]
    row.step_time_s = statistics.median(times) if times else None
    if len(times) >= 4:
        q1, _, q3 = statistics.quantiles(times, n=4)
    elif times:
        q1, q3 = min(times), max(times)
    else:
        return
    row.step_time_q1, row.step_time_q3 = q1, q3
    row.step_time_spread = q3 / q1 if q1 > 0 else None


def _culprits(steps: list[dict[str, Any]]) -> list[list[Any]]:
    counts: dict[str, int] = {}
    for record in steps:
        report = record.get("overflow")
        if not record.get("skipped") or not isinstance(report, dict):
            continue
        name = report.get("forward_module")
        modules = report.get("modules")
        if not name and isinstance(modules, list) and modules and isinstance(modules[0], list):
            name = modules[0][0]
        if name:
            counts[str(name)] = counts.get(str(name), 0) + 1
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:3]
    return [[name, count] for name, count in ranked]


def summarize(row: Row, init: Optional[dict[str, Any]], steps: list[dict[str, Any]]) -> Row:
    """Fill a row's own metrics (not those relative to O0) from its telemetry."""
    row.init = init
    row.steps = len(steps)
    if not steps:
        return row
    losses = [r.get("loss") for r in steps]
    row.series = {
        "loss": losses,
        "loss_scale": [r.get("loss_scale") for r in steps],
        "step_time_s": [r.get("step_time_s") for r in steps],
        "skipped": [bool(r.get("skipped")) for r in steps],
    }
    _timings(row, row.series["step_time_s"])
    mems = [int(r["peak_mem_bytes"]) for r in steps if _finite(r.get("peak_mem_bytes"))]
    row.peak_mem_bytes = max(mems) if mems else None
    tail = [float(v) for v in losses[-max(1, len(losses) // 10):] if v is not None]
    if tail:
        bad = [v for v in tail if not math.isfinite(v)]
        row.final_loss = bad[-1] if bad else math.fsum(tail) / len(tail)
    row.skipped = sum(row.series["skipped"])
    row.skip_culprits = _culprits(steps)
    scale = steps[-1].get("loss_scale")
    row.final_scale = float(scale) if isinstance(scale, (int, float)) else None
    return row


def withhold(row: Row) -> Row:
    """Clear the results of a run that did not finish, and say in its error how far it got.

    Its per-step `series` stay (sweep.json keeps what was measured), but nothing that reads
    as an outcome: final loss, loss scale, skips, step time, memory.
    """
    if row.ok or row.status in ("no data", "not run"):
        return row
    if row.steps:
        step = f", {row.step_time_s:.3g} s per step" if row.step_time_s else ""
        row.error = f"{row.error or row.status} ({row.steps} steps done{step}; no result)"
    row.final_loss = row.final_scale = row.step_time_s = None
    row.step_time_q1 = row.step_time_q3 = row.step_time_spread = None
    row.skipped, row.peak_mem_bytes, row.skip_culprits = None, None, []
    row.heldout = None
    return row


def not_run(label: str, opt_level: str, dtype: Optional[str], why: str) -> Row:
    """The row of a configuration that never started."""
    return Row(label=label, opt_level=opt_level, dtype=dtype, status="not run",
               error=f"not started: {why}")


def _own_noise(row: Row) -> Optional[str]:
    cpus = os.cpu_count() or 1
    if row.other_cpus is not None and row.other_cpus > max(BUSY_CPUS, 0.1 * cpus):
        return (f"other processes used {row.other_cpus:.1f} of {cpus} CPUs during the run"
                + (f" (load average {row.load_avg:.1f})" if row.load_avg is not None else ""))
    if (row.step_time_spread or 1.0) > NOISY_SPREAD:
        return (f"step times varied {row.step_time_spread:.1f}x within the run (75th vs 25th "
                "percentile)")
    return None


def _relative(row: Row, base: Row) -> None:
    if row.step_time_s and base.step_time_s:
        row.speedup = base.step_time_s / row.step_time_s
    if row.step_time_q1 and row.step_time_q3 and base.step_time_q1 and base.step_time_q3:
        row.speedup_low = base.step_time_q1 / row.step_time_q3
        row.speedup_high = base.step_time_q3 / row.step_time_q1
    if row.peak_mem_bytes and base.peak_mem_bytes:
        row.mem_ratio = row.peak_mem_bytes / base.peak_mem_bytes
    if (row.final_loss is not None and base.final_loss is not None
            and math.isfinite(row.final_loss) and base.final_loss != 0):
        row.loss_delta = (row.final_loss - base.final_loss) / abs(base.final_loss)


def _mark_divergence(row: Row, base: Optional[Row]) -> None:
    diverged = row.final_loss is not None and not math.isfinite(row.final_loss)
    if (not diverged and base is not None and row.final_loss is not None
            and base.final_loss is not None and base.final_loss > 0):
        diverged = row.final_loss > DIVERGENCE_FACTOR * base.final_loss
    if diverged:
        row.status = "diverged"
        row.error = row.error or (
            f"final loss {row.final_loss:.4g}"
            + (f" vs O0's {base.final_loss:.4g}" if base and base.final_loss else "")
        )
    elif row.status == "diverged":
        row.status = "ok"


def compare(rows: list[Row]) -> None:
    """Fill the O0-relative columns, mark diverged and unreliable rows, in place.

    The baseline is the first finished O0 row; without one only non-finite losses count as
    divergence. A row's timing is unreliable when its own run was disturbed or when O0's was
    (its speed-up divides by O0's time).
    """
    base = next((r for r in rows if r.opt_level == "O0" and r.ok), None)
    base_noise = _own_noise(base) if base is not None else None
    for row in rows:
        if not row.ok:
            row.unreliable = None
            continue
        if row is base:
            row.speedup, row.mem_ratio, row.loss_delta = 1.0, 1.0, 0.0
            row.speedup_low = row.speedup_high = 1.0
        elif base is not None:
            _relative(row, base)
        _mark_divergence(row, base)
        noise = _own_noise(row)
        if noise is None and base_noise is not None and row is not base:
            noise = f"O0's run was disturbed: {base_noise}"
        row.unreliable = noise


def _busy_seconds() -> Optional[float]:
    """CPU-seconds the whole machine has spent busy since boot (Linux), or None."""
    try:
        with open("/proc/stat", encoding="ascii") as handle:
            fields = handle.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    busy = sum(values[:8]) - idle  # user..steal; guest time is already inside user
    return busy / os.sysconf("SC_CLK_TCK")


def _process_cpu_seconds(who: int) -> Optional[float]:
    try:
        import resource
    except ImportError:
        return None
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class LoadMeter:
    """Measures how much of the machine other processes used while one run was going.

    Create it just before the run starts, call `sample()` while it runs, and `finish()` after
    it was waited for. The CPU time of this process and of its waited-for children (the run)
    is subtracted from the machine's busy time; what remains is everyone else's.
    """

    def __init__(self) -> None:
        self._start = time.monotonic()
        self._busy = _busy_seconds()
        self._ours = self._our_cpu()
        self.load_avgs: list[float] = []
        self.sample()

    @staticmethod
    def _our_cpu() -> Optional[float]:
        try:
            import resource
        except ImportError:
            return None
        mine = _process_cpu_seconds(resource.RUSAGE_SELF)
        children = _process_cpu_seconds(resource.RUSAGE_CHILDREN)
        return None if mine is None or children is None else mine + children

    def sample(self) -> None:
        """Record the current 1-minute load average (where the OS has one)."""
        if hasattr(os, "getloadavg"):
            self.load_avgs.append(os.getloadavg()[0])

    def finish(self, row: Row) -> None:
        """Store `other_cpus` and `load_avg` in the row."""
        self.sample()
        wall = time.monotonic() - self._start
        busy, ours = _busy_seconds(), self._our_cpu()
        busy0, ours0 = self._busy, self._ours
        row.load_avg = max(self.load_avgs) if self.load_avgs else None
        if busy is None or ours is None or busy0 is None or ours0 is None or wall <= 0:
            return
        row.other_cpus = max(0.0, (busy - busy0) - (ours - ours0)) / wall
