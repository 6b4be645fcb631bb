"""`ampx sweep`'s text and files: progress, the table, sweep.json and sweep.csv.

One job: present compared rows (`ampx.cli.sweep.stats`). Functions return strings or write files;
printing is the command line's job. The figure is `ampx.cli.sweep.plot`.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Optional

from .stats import Row

__all__ = ["Progress", "format_table", "sweep_meta", "table_rows", "write_csv", "write_json"]

_COLUMNS = ("config", "status", "speed-up", "IQR", "timing", "step ms", "peak MiB",
            "mem vs O0", "final loss", "loss vs O0", "skipped", "final scale", "held-out",
            "vs O0", "trend", "accuracy", "to O0 s")
"""The last five: the judged held-out metric's final value, its gap to O0's (positive:
worse), that gap's fitted growth over the run, the accuracy verdict, time to O0's quality."""


def _fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:{spec}}{suffix}"


def _timing(row: Row) -> str:
    if not row.ok or row.step_time_s is None:
        return "-"
    return "UNRELIABLE" if row.unreliable else "steady"


def table_rows(rows: Sequence[Row]) -> list[list[str]]:
    """The table's cells as strings (header first)."""
    out = [list(_COLUMNS)]
    for row in rows:
        mib = row.peak_mem_bytes / 2**20 if row.peak_mem_bytes is not None else None
        delta = row.loss_delta * 100 if row.loss_delta is not None else None
        spread = "-"
        if row.speedup_low is not None and row.speedup_high is not None:
            spread = f"{row.speedup_low:.2f}-{row.speedup_high:.2f}"
        out.append([
            row.label,
            row.status,
            _fmt(row.speedup, ".2f", "x"),
            spread,
            _timing(row),
            _fmt(row.step_time_s * 1e3 if row.step_time_s is not None else None, ".1f"),
            _fmt(mib, ".0f"),
            _fmt(row.mem_ratio, ".2f", "x"),
            _fmt(row.final_loss, ".4f"),
            _fmt(delta, "+.2f", "%"),
            _fmt(row.skipped, "d"),
            _fmt(row.final_scale, "g"),
            *_heldout_cells(row),
        ])
    return out


def _heldout_cells(row: Row) -> list[str]:
    judged = row.series.get("heldout") if row.ok else None
    final = float(judged[-1][1]) if judged else None
    return [
        _fmt(final, ".4f"),
        _fmt(row.heldout_gap * 100 if row.heldout_gap is not None else None, "+.2f", "%"),
        _fmt(row.gap_trend * 100 if row.gap_trend is not None else None, "+.2f", "%"),
        row.accuracy_verdict or "-",
        _fmt(row.time_to_quality_s, ".1f"),
    ]


def format_table(rows: Sequence[Row]) -> str:
    """The sweep table as aligned plain text, then one line per failed or unreliable row.

    Args:
        rows: Compared rows (see `sweep_stats.compare`).

    Returns:
        The text, without a trailing newline.
    """
    cells = table_rows(rows)
    widths = [max(len(line[i]) for line in cells) for i in range(len(_COLUMNS))]
    lines = []
    for n, line in enumerate(cells):
        parts = [line[0].ljust(widths[0]), line[1].ljust(widths[1])]
        parts += [cell.rjust(width) for cell, width in zip(line[2:], widths[2:])]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        if row.error:
            lines.append(f"{row.label}: {row.status}: {row.error}")
        if row.skip_culprits:
            named = ", ".join(f"{name} ({count})" for name, count in row.skip_culprits)
            lines.append(f"{row.label}: skipped steps overflowed first in {named}")
        if row.ok and row.accuracy_note:
            lines.append(f"{row.label}: accuracy {row.accuracy_verdict}: {row.accuracy_note}")
        if row.numerics_at_risk:
            named = ", ".join(f"{name} ({issue})" for name, issue in row.numerics_at_risk)
            lines.append(f"{row.label}: numerics at risk: {named}")
    noisy = [r for r in rows if r.ok and r.unreliable]
    for row in noisy:
        lines.append(f"{row.label}: note: {row.unreliable}")
    if noisy:
        lines.append("note: timings marked UNRELIABLE are not to be trusted (nor their "
                     "speed-ups); rerun on a quiet machine or with --repeat K")
    return "\n".join(lines)


def _jsonable_float(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no inf/nan; keep them readable
    if isinstance(value, list):
        return [_jsonable_float(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable_float(v) for k, v in value.items()}
    return value


def sweep_meta(spec: Any, *, interrupted: bool = False) -> dict[str, Any]:
    """Where and how the sweep ran (for sweep.json).

    Args:
        spec: The `sweep.SweepSpec`.
        interrupted: The sweep was stopped (Ctrl-C) before every run finished.
    """
    import torch

    from ... import __version__

    return {
        "script": str(spec.script),
        "script_args": spec.script_args,
        "example": spec.example,
        "steps": spec.steps,
        "repeat": spec.repeat,
        "configs": [c.label for c in spec.configs],
        "interrupted": interrupted,
        "ampx": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_json(rows: Sequence[Row], path: Path, meta: Mapping[str, Any]) -> Path:
    """Write `sweep.json`: metadata and every row with its per-step series."""
    data = {"meta": dict(meta), "rows": [_jsonable_float(dataclasses.asdict(r)) for r in rows]}
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return path


_CSV_FIELDS = ["label", "opt_level", "dtype", "status", "speedup", "speedup_low", "speedup_high",
               "unreliable", "step_time_s", "step_time_q1", "step_time_q3", "step_time_spread",
               "other_cpus", "load_avg", "peak_mem_bytes", "mem_ratio", "final_loss",
               "loss_delta", "skipped", "final_scale", "steps", "wall_s", "returncode", "error",
               "numerics_at_risk", "heldout_final", "heldout_gap", "gap_trend", "gap_trend_se",
               "heldout_evals", "time_to_quality_s", "accuracy_verdict", "heldout"]


def write_csv(rows: Sequence[Row], path: Path) -> Path:
    """Write `sweep.csv`: one line per row with the table's columns as raw numbers."""
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=_CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            values = {f: getattr(row, f, None) for f in _CSV_FIELDS}
            judged = row.series.get("heldout")
            values["heldout_final"] = judged[-1][1] if judged and row.ok else None
            values["heldout"] = json.dumps(row.heldout) if row.heldout else None
            values["numerics_at_risk"] = "; ".join(
                f"{name} ({issue})" for name, issue in row.numerics_at_risk)
            writer.writerow(values)
    return path


class Progress:
    """Sweep progress on a stream: whole lines, plus step progress inside a run.

    On a terminal the step progress is one bar redrawn in place; otherwise it is a line every
    `interval_s` seconds (so logs of CI jobs stay short).

    Args:
        stream: Where to write (default: stderr).
        tty: Draw a bar (default: whether `stream` is a terminal).
        interval_s: Seconds between step lines when not drawing a bar.
    """

    def __init__(self, stream: Optional[IO[str]] = None, tty: Optional[bool] = None,
                 interval_s: float = 10.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval_s = interval_s
        self._bar = False
        self._last = time.monotonic()

    def line(self, text: str) -> None:
        """Write one line (ending a bar in progress)."""
        if self._bar:
            self.stream.write("\n")
            self._bar = False
        self.stream.write(text + "\n")
        self.stream.flush()
        self._last = time.monotonic()

    def steps(self, config: Any, done: int, total: Optional[int],
              step_s: Optional[float]) -> None:
        """Report `done` of `total` steps of the running configuration."""
        speed = f", {step_s * 1e3:.0f} ms/step" if step_s is not None else ""
        count = f"{done}/{total}" if total else f"{done}"
        if self.tty:
            width = 30
            filled = min(width, width * done // total) if total else 0
            bar = f"[{'#' * filled}{'.' * (width - filled)}] " if total else ""
            self.stream.write(f"\r  {config.label}: {bar}{count} steps{speed}\x1b[K")
            self.stream.flush()
            self._bar = True
        elif time.monotonic() - self._last >= self.interval_s:
            self.line(f"  {config.label}: {count} steps{speed}")
