"""`ampx sweep`'s accuracy judgement: held-out metrics, time to quality, and the drift test.

One job: read each run's evaluations (the `metric` records a script writes with
`ampx.log_metric`, or lines of its output matched by `--metric-regex`), and judge each
configuration against O0 on the judged metric (the built-in examples' held-out loss, or
`--metric NAME`):

- `same`: its final value is within `TOLERANCE` of O0's (relative; being better is never held
  against it) and its gap to O0 is not growing;
- `drifting`: within the tolerance at the end, but the gap grows: a least-squares line through
  the relative gap over the last half of the evaluations (at least `MIN_EVALS`) rises by more
  than `DRIFT` over the run, at least `SIGNIFICANCE` standard errors above zero, and the final
  gap is on the worse side;
- `worse`: its final value is more than `TOLERANCE` worse than O0's (or it diverged);
- `too-short`: fewer than `MIN_EVALS` evaluations at the same steps as O0's.

Time to quality is the training wall time (from the start of the first step, evaluations
included) a configuration took to first reach O0's final value; None when it never did.
Nothing here runs processes or prints.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any, Optional

from .stats import Row

__all__ = ["DRIFT", "MIN_EVALS", "SIGNIFICANCE", "TOLERANCE", "Metric", "attach", "judge",
           "trend"]

TOLERANCE = 0.01
"""A configuration's final held-out value may be this much worse than O0's (relative)."""
DRIFT = 0.0025
"""A gap that the fitted line says grows by more than this over the run (relative: a quarter
of the tolerance) drifts: a gap that keeps growing reaches the tolerance in a longer run."""
MIN_EVALS = 4
"""Fewer evaluations than this (at O0's steps) cannot show a trend: `too-short`."""
SIGNIFICANCE = 2.0
"""The fitted growth must be this many standard errors above zero (noise is not drift)."""
EXAMPLE_METRIC = "heldout_loss"


@dataclasses.dataclass(frozen=True)
class Metric:
    """What the sweep judges accuracy by.

    Attributes:
        name: The metric's name (`ampx.log_metric(name, ...)`).
        higher_is_better: True for accuracies, False for losses.
        regex: Read the metric from the script's output instead: the group `value` (or the
            first group other than `step`) is the number, an optional group `step` its step.
    """

    name: str = EXAMPLE_METRIC
    higher_is_better: bool = False
    regex: Optional[str] = None

    @property
    def label(self) -> str:
        """"held-out loss" for the examples' metric, else the name."""
        return "held-out loss" if self.name == EXAMPLE_METRIC else self.name


def _short(name: str) -> str:
    return name[len("heldout_"):] if name.startswith("heldout_") else name


def _from_log(log: Optional[str], pattern: str) -> list[dict[str, Any]]:
    if log is None or not Path(log).is_file():
        return []
    found = []
    for n, match in enumerate(re.finditer(pattern, Path(log).read_text(errors="replace")), 1):
        groups = match.groupdict()
        skip = match.re.groupindex.get("step")
        others = [match.group(i) for i in range(1, match.re.groups + 1) if i != skip]
        text = groups.get("value") or (others[0] if others else match.group(0))
        try:
            value = float(text)
        except (TypeError, ValueError):
            continue
        step = groups.get("step")
        found.append({"step": int(step) if step and step.isdigit() else n, "value": value,
                      "time": None})
    return found


def attach(row: Row, metrics: dict[str, list[dict[str, Any]]], steps: list[dict[str, Any]],
           metric: Metric) -> None:
    """Put a run's evaluations on its row: `heldout` (the final value of every metric the run
    reported, "heldout_" dropped from the examples' names), `series["heldout"]` ([step,
    value] of the judged metric), `series["heldout_time_s"]` (seconds since training began)
    and `series["metrics"]` (every metric's [step, value] pairs)."""
    if metric.regex is not None:
        metrics = {**metrics, metric.name: _from_log(row.log, metric.regex)}
    metrics = {name: records for name, records in metrics.items() if records}
    if not metrics:
        return
    row.heldout = {_short(name): records[-1]["value"] for name, records in metrics.items()}
    row.series["metrics"] = {name: [[r["step"], r["value"]] for r in records]
                             for name, records in metrics.items()}
    judged = metrics.get(metric.name, [])
    if not judged:
        return
    row.series["heldout"] = [[r["step"], r["value"]] for r in judged]
    start = None
    if steps and isinstance(steps[0].get("time"), (int, float)):
        start = float(steps[0]["time"]) - float(steps[0].get("step_time_s") or 0.0)
    row.series["heldout_time_s"] = [
        (float(r["time"]) - start) if start is not None and isinstance(r["time"], (int, float))
        else None for r in judged]


def trend(steps: list[float], gaps: list[float]) -> tuple[float, float]:
    """Least squares through the last half of (step, gap) (at least `MIN_EVALS` points):
    the gap's fitted growth over the whole run (slope times the last step), and that
    growth's standard error (inf with fewer than three points or no spread in steps)."""
    keep = max(MIN_EVALS, math.ceil(len(gaps) / 2))
    xs, ys = steps[-keep:], gaps[-keep:]
    n = len(xs)
    if n < 3:
        return 0.0, math.inf
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return 0.0, math.inf
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    resid = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys))
    se = math.sqrt(resid / (n - 2) / sxx)
    span = steps[-1] if steps[-1] > 0 else 1.0
    return slope * span, se * span


def _gap(value: float, base: float, higher_is_better: bool) -> Optional[float]:
    if not (math.isfinite(value) and math.isfinite(base)) or base == 0:
        return None
    diff = (base - value) if higher_is_better else (value - base)
    return diff / abs(base)


def _time_to(row: Row, target: float, higher_is_better: bool) -> Optional[float]:
    for (_, value), seconds in zip(row.series.get("heldout", []),
                                   row.series.get("heldout_time_s", [])):
        reached = value >= target if higher_is_better else value <= target
        if reached and seconds is not None:
            return float(seconds)
    return None


def _judge_row(row: Row, base: Row, metric: Metric) -> None:
    mine = {int(s): float(v) for s, v in row.series.get("heldout", [])}
    theirs = [(int(s), float(v)) for s, v in base.series.get("heldout", [])]
    pairs = [(s, _gap(mine[s], v, metric.higher_is_better)) for s, v in theirs if s in mine]
    if row.status == "diverged" or (pairs and pairs[-1][1] is None
                                    and not math.isfinite(mine[pairs[-1][0]])):
        row.accuracy_verdict = "worse"
        row.accuracy_note = "diverged"
        return
    gaps = [(s, g) for s, g in pairs if g is not None]
    row.heldout_evals = len(gaps)
    if gaps:
        row.heldout_gap = gaps[-1][1]
    if len(gaps) < MIN_EVALS or gaps[-1][0] != theirs[-1][0]:
        row.accuracy_verdict = "too-short"
        row.accuracy_note = (f"{len(gaps)} evaluations at O0's steps; at least {MIN_EVALS} "
                             "needed, the last at O0's last")
        return
    growth, se = trend([float(s) for s, _ in gaps], [g for _, g in gaps])
    row.gap_trend, row.gap_trend_se = growth, (se if math.isfinite(se) else None)
    final = gaps[-1][1]
    if final > TOLERANCE:
        row.accuracy_verdict = "worse"
        row.accuracy_note = f"{metric.label} {final * 100:+.2f}% vs O0; tolerance {TOLERANCE:.0%}"
    elif final > 0 and growth > DRIFT and growth >= SIGNIFICANCE * se:
        row.accuracy_verdict = "drifting"
        row.accuracy_note = (f"{metric.label} {final * 100:+.2f}% vs O0, the gap growing "
                             f"{growth * 100:+.2f}% over the run, +-{se * 100:.2f}%")
    else:
        row.accuracy_verdict = "same"


def judge(rows: list[Row], metric: Metric) -> None:
    """Fill every finished row's `heldout_gap`, `gap_trend`, `time_to_quality_s` and
    `accuracy_verdict` against the first finished O0 row with the judged metric, in place.
    Rows are left unjudged (None) when O0 has no evaluations of it."""
    base = next((r for r in rows if r.opt_level == "O0" and r.ok), None)
    for row in rows:
        row.heldout_gap = row.gap_trend = row.gap_trend_se = row.time_to_quality_s = None
        row.accuracy_verdict = row.accuracy_note = None
        row.heldout_evals = 0
    if base is None or not base.series.get("heldout"):
        return
    target = float(base.series["heldout"][-1][1])
    for row in rows:
        if not row.ok:
            continue
        if row.series.get("heldout"):
            row.time_to_quality_s = _time_to(row, target, metric.higher_is_better)
        if row is base:
            row.heldout_gap, row.heldout_evals = 0.0, len(base.series["heldout"])
            row.accuracy_verdict = ("same" if row.heldout_evals >= MIN_EVALS else "too-short")
            continue
        _judge_row(row, base, metric)
