"""`ampx sweep`'s order of runs: which configuration runs when, for how long, and which run counts.

One job: run every configuration (every other round reversed, so a drift in the machine's
speed hits all alike), give each run its time limit from the budget that is left
(`plan.run_limit`), keep each configuration's least disturbed run, and, when Ctrl-C or the
budget stops the sweep, return every configuration: what finished, what was stopped, and
rows that say "not run" for the ones that never started.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from .accuracy import Metric, judge
from .plan import WRITE_S, format_duration, run_limit
from .run import Launcher, StepCallback, SweepConfig, SweepSpec, run_one
from .stats import Row, compare, not_run

__all__ = ["MIN_RUN_S", "SweepInterrupted", "run_sweep"]

MIN_RUN_S = 5.0
"""A configuration is not started with less time than this left of the budget."""


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C during a sweep; `rows` holds a row for every configuration: the compared rows of
    what ran (the interrupted configuration's status is "interrupted"), then "not run"."""

    def __init__(self, rows: list[Row]) -> None:
        super().__init__("sweep interrupted")
        self.rows = rows


def _row_not_run(config: SweepConfig, why: str) -> Row:
    return not_run(config.label, config.opt_level or "autocast", config.dtype, why)


def run_sweep(spec: SweepSpec, progress: Optional[Callable[[str], None]] = None,
              launcher: Optional[Launcher] = None,
              on_steps: Optional[StepCallback] = None) -> list[Row]:
    """Run every configuration of `spec`, one fresh process each, and compare them with O0.

    With `spec.repeat` > 1 the configurations run that many rounds, every other round in
    reverse order, and each keeps its least disturbed run (the lowest median step time); a
    run that fails in any round makes the configuration's row that failure. With
    `spec.budget_s` each run's limit is its share of the time left, and a configuration that
    would start with less than `MIN_RUN_S` left is not started.

    Args:
        spec: The sweep.
        progress: Called with one line of progress text before and after each run.
        launcher: See `run_one`.
        on_steps: See `run_one`.

    Returns:
        One row per configuration, in `spec.configs` order.

    Raises:
        SweepInterrupted: Ctrl-C; carries a row for every configuration.
    """
    say = progress or (lambda text: None)
    deadline = (time.monotonic() + spec.budget_s - WRITE_S) if spec.budget_s else None
    best: dict[SweepConfig, Row] = {}
    order = [c for r in range(spec.repeat) for c in (spec.configs if r % 2 == 0
                                                      else spec.configs[::-1])]
    try:
        for count, config in enumerate(order, 1):
            round_index = (count - 1) // len(spec.configs)
            later = [spec.estimates.get(c.label) for c in order[count - 1:]]
            limit = run_limit(deadline, spec.timeout_s, later)
            left = deadline - time.monotonic() if deadline is not None else None
            if left is not None and limit is not None:
                limit = min(left, max(limit, MIN_RUN_S))  # enough to start a run at all
            if left is not None and left < MIN_RUN_S:
                spent = format_duration(spec.budget_s or 0)
                best.setdefault(config, _row_not_run(config, f"the {spent} budget was spent"))
                say(f"[{count}/{len(order)}] {config.label}: not run (budget spent)")
                continue
            say(f"[{count}/{len(order)}] {config.label}: running"
                + (f" (limit {format_duration(limit)})" if deadline is not None
                   and limit is not None else ""))
            row = run_one(spec, config, launcher, round_index, on_steps, limit)
            kept = best.get(config)
            if kept is None or (kept.ok and (not row.ok or _faster(row, kept))):
                best[config] = row
            _compare([best[c] for c in spec.configs if c in best], spec)
            say(f"[{count}/{len(order)}] {config.label}: {_progress_text(row)}")
    except KeyboardInterrupt as exc:
        stopped: Optional[Row] = getattr(exc, "row", None)
        if stopped is not None:
            best.setdefault(next(c for c in spec.configs if c.label == stopped.label), stopped)
        rows = [best.get(c) or _row_not_run(c, "the sweep was interrupted first")
                for c in spec.configs]
        _compare(rows, spec)
        raise SweepInterrupted(rows) from None
    rows = [best[c] for c in spec.configs]
    _compare(rows, spec)
    return rows


def _compare(rows: list[Row], spec: SweepSpec) -> None:
    """Speed, memory and loss against O0 (`stats.compare`), then accuracy (`accuracy.judge`)."""
    compare(rows)
    judge(rows, spec.metric or Metric())


def _faster(row: Row, than: Row) -> bool:
    if row.step_time_s is None:
        return False
    return than.step_time_s is None or row.step_time_s < than.step_time_s


def _progress_text(row: Row) -> str:
    wall = f"{row.wall_s:.1f} s" if row.wall_s is not None else "?"
    if not row.ok:
        return f"{row.status} after {wall} ({row.error})"
    step = f"{row.step_time_s * 1e3:.1f} ms/step" if row.step_time_s else "? ms/step"
    loss = f"loss {row.final_loss:.4g}" if row.final_loss is not None else "no loss"
    busy = f", other load {row.other_cpus:.1f} CPUs" if row.other_cpus is not None else ""
    judged = row.series.get("heldout")
    held = f", held-out {judged[-1][1]:.4g} at step {judged[-1][0]}" if judged else ""
    return f"{row.status}, {wall}, {row.steps} steps, {step}, {loss}{held}{busy}"
