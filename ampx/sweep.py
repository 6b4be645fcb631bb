"""`ampx sweep`: run a script at each opt level and dtype in fresh processes and compare them.

Each configuration runs as ``python -m ampx run --opt-level L --dtype D --telemetry-file F
script ...`` in its own process (so memory peaks and torch patches never leak from one run into
the next), with a timeout. The per-step telemetry (docs/internals.md) is summarised into one
row per configuration: speed-up and peak memory against O0, median step time, final loss and its
divergence from O0, skipped steps and the final loss scale. A configuration that crashes, times
out or diverges becomes a row with its error; the sweep itself carries on.

Reporting functions return strings or write files; printing is the command line's job.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable, Optional

__all__ = [
    "DIVERGENCE_FACTOR",
    "NOISY_SPREAD",
    "Row",
    "SweepConfig",
    "SweepSpec",
    "build_configs",
    "compare",
    "format_table",
    "read_telemetry",
    "run_sweep",
    "summarize",
    "write_csv",
    "write_json",
    "write_png",
]

logger = logging.getLogger("ampx")

DIVERGENCE_FACTOR = 10.0
"""A final loss above this multiple of O0's (or a non-finite one) marks the row as diverged."""

NOISY_SPREAD = 1.5
"""Rows whose step times vary more than this (75th/25th percentile) get a note under the table."""

_AMPX_ROOT = Path(__file__).resolve().parent.parent  # the directory that holds `ampx/`


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    """One configuration of a sweep.

    Attributes:
        opt_level: "O0".."O3", or None for the plain torch.autocast row.
        dtype: "fp16" or "bf16" (None for O0, which runs in float32).
    """

    opt_level: Optional[str]
    dtype: Optional[str]

    @property
    def autocast(self) -> bool:
        """True for the torch.autocast comparison row."""
        return self.opt_level is None

    @property
    def label(self) -> str:
        """The row label: "O0", "O2 bf16", "autocast bf16"."""
        head = self.opt_level or "autocast"
        return f"{head} {self.dtype}" if self.dtype else head

    @property
    def slug(self) -> str:
        """A file-name-safe label."""
        return self.label.replace(" ", "-")


@dataclasses.dataclass
class SweepSpec:
    """What to sweep.

    Attributes:
        script: The training script (a built-in example's path when `example` is set).
        script_args: Arguments for the script.
        configs: The configurations, in run order (O0 first gives the baseline).
        out: Directory for sweep.json, sweep.csv, sweep.png and the per-run logs.
        steps: Optimizer steps per run (None: the script's own length). Built-in examples
            get `--steps N`; any script is also stopped after N steps by `ampx run`.
        timeout_s: Wall-clock limit of one run.
        example: Name of the built-in example being run, or None for a user script.
        python: The interpreter for the runs.
        repeat: Rounds of runs; each configuration keeps its fastest (least disturbed) run.
        run_options: Extra `ampx run` options for every run.
        env: Extra environment variables for the runs.
    """

    script: Path
    script_args: list[str]
    configs: list[SweepConfig]
    out: Path
    steps: Optional[int] = None
    timeout_s: float = 900.0
    example: Optional[str] = None
    python: str = sys.executable
    repeat: int = 1
    run_options: list[str] = dataclasses.field(default_factory=list)
    env: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Row:
    """The outcome of one configuration (the metrics are None when unknown).

    Attributes:
        label: The configuration's label.
        opt_level: "O0".."O3" or "autocast".
        dtype: "fp16", "bf16" or None.
        status: "ok", "diverged", "error", "timeout" or "no data".
        error: Why a run failed (the last line of its stderr), or None.
        returncode: The process's exit code (None after a timeout).
        wall_s: Wall time of the whole process.
        steps: Number of step records.
        step_time_s: Median step time (the first step, which includes warm-up, is left out).
        step_time_spread: 75th over 25th percentile of the step times: far above 1 when
            something else competed for the device during much of the run.
        peak_mem_bytes: Largest peak-memory reading of the run.
        final_loss: Mean loss over the last 10% of the steps (at least one).
        skipped: Skipped steps.
        final_scale: The loss scale after the last step.
        speedup: O0's median step time divided by this row's.
        mem_ratio: This row's peak memory divided by O0's.
        loss_delta: (final_loss - O0's) / |O0's|.
        culprits: (module, skipped steps it caused), most first (top 3; from the overflow
            provenance of skipped steps, docs/debugging-overflows.md).
        series: Per-step "loss", "loss_scale", "step_time_s" and "skipped" lists.
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
    step_time_spread: Optional[float] = None
    peak_mem_bytes: Optional[int] = None
    final_loss: Optional[float] = None
    skipped: Optional[int] = None
    final_scale: Optional[float] = None
    speedup: Optional[float] = None
    mem_ratio: Optional[float] = None
    loss_delta: Optional[float] = None
    culprits: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    series: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    init: Optional[dict[str, Any]] = None
    command: list[str] = dataclasses.field(default_factory=list)
    log: Optional[str] = None

    @property
    def ok(self) -> bool:
        """True when the run finished and produced step records."""
        return self.status in ("ok", "diverged")


def build_configs(levels: Sequence[str], dtypes: Sequence[str], *,
                  autocast: bool) -> list[SweepConfig]:
    """The configurations of a sweep: O0 once (float32), other levels once per dtype.

    Args:
        levels: Opt levels, e.g. ["O0", "O1", "O2", "O3"].
        dtypes: Half dtypes, e.g. ["bf16"].
        autocast: Add one torch.autocast row per dtype.

    Returns:
        The configurations in run order, O0 first.

    >>> [c.label for c in build_configs(["O2", "O0"], ["bf16"], autocast=True)]
    ['O0', 'O2 bf16', 'autocast bf16']
    """
    configs: list[SweepConfig] = []
    if "O0" in levels:
        configs.append(SweepConfig("O0", None))
    for level in levels:
        if level == "O0":
            continue
        configs.extend(SweepConfig(level, dtype) for dtype in dtypes)
    if autocast:
        configs.extend(SweepConfig(None, dtype) for dtype in dtypes)
    return configs


def command_for(spec: SweepSpec, config: SweepConfig, telemetry_file: Path) -> list[str]:
    """The `python -m ampx run ...` command line of one configuration."""
    cmd = [spec.python, "-m", "ampx", "run", "--telemetry-file", str(telemetry_file)]
    if config.opt_level is not None:
        cmd += ["--opt-level", config.opt_level]
        if config.dtype is not None:
            cmd += ["--dtype", config.dtype]
    if spec.steps is not None:
        cmd += ["--max-steps", str(spec.steps)]
    cmd += list(spec.run_options)
    cmd += [str(spec.script), *spec.script_args]
    if spec.example is not None:
        if spec.steps is not None:
            cmd += ["--steps", str(spec.steps)]
        if config.autocast:
            cmd += ["--autocast", "--dtype", config.dtype or "bf16"]
    return cmd


def child_env(extra: Mapping[str, str]) -> dict[str, str]:
    """The environment of a run: ours, with this ampx first on PYTHONPATH."""
    env = dict(os.environ)
    env.pop("AMPX_TELEMETRY", None)  # each run gets its own file through --telemetry-file
    paths = [str(_AMPX_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def read_telemetry(path: Path) -> tuple[Optional[dict[str, Any]], list[dict[str, Any]]]:
    """Read a telemetry file (rank 0's; other ranks write `path.N`).

    Args:
        path: The JSONL file.

    Returns:
        The last `init` record (or None) and the `step` records of the first optimizer that
        follow it. Lines that are not valid JSON (a run killed mid-write) are ignored.
    """
    init: Optional[dict[str, Any]] = None
    steps: list[dict[str, Any]] = []
    if not path.exists():
        return None, []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict):
            continue
        if record.get("event") == "init":
            init, steps = record, []  # a second initialize starts a new series
        elif record.get("event") == "step":
            steps.append(record)
    if steps:
        first = min(int(r.get("optimizer", 0) or 0) for r in steps)
        steps = [r for r in steps if int(r.get("optimizer", 0) or 0) == first]
    return init, steps


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


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
    times = [t for t in row.series["step_time_s"][1:] if _finite(t)] or [
        t for t in row.series["step_time_s"] if _finite(t)
    ]
    row.step_time_s = statistics.median(times) if times else None
    if len(times) >= 4:
        quartiles = statistics.quantiles(times, n=4)
        row.step_time_spread = quartiles[2] / quartiles[0] if quartiles[0] > 0 else None
    mems = [int(r["peak_mem_bytes"]) for r in steps if _finite(r.get("peak_mem_bytes"))]
    row.peak_mem_bytes = max(mems) if mems else None
    tail = [float(v) for v in losses[-max(1, len(losses) // 10):] if v is not None]
    if tail:
        bad = [v for v in tail if not math.isfinite(v)]
        row.final_loss = bad[-1] if bad else math.fsum(tail) / len(tail)
    row.skipped = sum(row.series["skipped"])
    from .overflow import tally_culprits  # imports torch: only once there is telemetry

    row.culprits = tally_culprits(r.get("overflow") for r in steps)
    scale = steps[-1].get("loss_scale")
    row.final_scale = float(scale) if isinstance(scale, (int, float)) else None
    return row


def compare(rows: list[Row]) -> None:
    """Fill the O0-relative columns and mark diverged rows, in place.

    The baseline is the first finished O0 row; without one only non-finite losses count as
    divergence.
    """
    base = next((r for r in rows if r.opt_level == "O0" and r.ok), None)
    for row in rows:
        if not row.ok:
            continue
        if base is not None and row is not base:
            if row.step_time_s and base.step_time_s:
                row.speedup = base.step_time_s / row.step_time_s
            if row.peak_mem_bytes and base.peak_mem_bytes:
                row.mem_ratio = row.peak_mem_bytes / base.peak_mem_bytes
            if (row.final_loss is not None and base.final_loss is not None
                    and math.isfinite(row.final_loss) and base.final_loss != 0):
                row.loss_delta = (row.final_loss - base.final_loss) / abs(base.final_loss)
        elif row is base:
            row.speedup, row.mem_ratio, row.loss_delta = 1.0, 1.0, 0.0
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


def _last_error_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if not line.startswith(("File ", "^", "~")) and "Traceback" not in line:
            return line[:300]
    return lines[-1][:300] if lines else ""


def run_one(spec: SweepSpec, config: SweepConfig,
            launcher: Optional[Callable[[SweepConfig, Path], list[str]]] = None,
            round_index: int = 0) -> Row:
    """Run one configuration in a fresh process and summarise it.

    Args:
        spec: The sweep.
        config: The configuration.
        launcher: Builds the command from (config, telemetry file); tests use it to run a fake
            script. Default: `command_for`.
        round_index: Which repetition this is (names the run's files).

    Returns:
        The row (its O0-relative columns are filled by `compare`).
    """
    runs = spec.out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    name = config.slug if round_index == 0 else f"{config.slug}.{round_index + 1}"
    telemetry_file = runs / f"{name}.jsonl"
    for stale in runs.glob(f"{name}.jsonl*"):
        stale.unlink()
    log_file = runs / f"{name}.log"
    cmd = launcher(config, telemetry_file) if launcher else command_for(spec, config,
                                                                         telemetry_file)
    env = child_env(spec.env)
    env["AMPX_TELEMETRY"] = str(telemetry_file)  # for launchers that bypass `ampx run`
    row = Row(label=config.label, opt_level=config.opt_level or "autocast", dtype=config.dtype,
              command=cmd, log=str(log_file))
    start = time.perf_counter()
    try:
        with open(log_file, "w", encoding="utf-8") as log:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.PIPE, text=True, env=env,
                                  timeout=spec.timeout_s, check=False)
            log.write(proc.stderr)
        row.returncode = proc.returncode
        if proc.returncode != 0:
            row.status = "error"
            row.error = f"exit {proc.returncode}: {_last_error_line(proc.stderr)}"
    except subprocess.TimeoutExpired:
        row.status = "timeout"
        row.error = f"timed out after {spec.timeout_s:g} s"
    except OSError as exc:
        row.status = "error"
        row.error = f"could not start: {exc}"
    row.wall_s = time.perf_counter() - start
    init, steps = read_telemetry(telemetry_file)
    summarize(row, init, steps)
    if row.status == "no data":
        if steps:
            row.status = "ok"
        else:
            row.error = ("no telemetry step records: the script never stepped an optimizer "
                         "passed through amp.initialize")
    return row


def run_sweep(
    spec: SweepSpec,
    progress: Optional[Callable[[str], None]] = None,
    launcher: Optional[Callable[[SweepConfig, Path], list[str]]] = None,
) -> list[Row]:
    """Run every configuration of `spec`, one fresh process each, and compare them with O0.

    With `spec.repeat` > 1 the configurations run round-robin that many times and each keeps
    its least disturbed run (the lowest median step time); a run that fails in any round makes
    the configuration's row that failure.

    Args:
        spec: The sweep.
        progress: Called with one line of progress text before and after each run.
        launcher: See `run_one`.

    Returns:
        One row per configuration, in `spec.configs` order.
    """
    say = progress or (lambda text: None)
    best: dict[SweepConfig, Row] = {}
    total = len(spec.configs) * spec.repeat
    count = 0
    for round_index in range(spec.repeat):
        for config in spec.configs:
            count += 1
            say(f"[{count}/{total}] {config.label}: running")
            row = run_one(spec, config, launcher, round_index)
            kept = best.get(config)
            if kept is None or (kept.ok and (not row.ok or _faster(row, kept))):
                best[config] = row
            compare([best[c] for c in spec.configs if c in best])
            say(f"[{count}/{total}] {config.label}: {_progress_text(row)}")
    rows = [best[c] for c in spec.configs]
    compare(rows)
    return rows


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
    return f"{row.status}, {wall}, {row.steps} steps, {step}, {loss}"


# -- reporting ----------------------------------------------------------------------------------

_COLUMNS = ("config", "status", "speed-up", "step ms", "peak MiB", "mem vs O0", "final loss",
            "loss vs O0", "skipped", "final scale")


def _fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:{spec}}{suffix}"


def table_rows(rows: Sequence[Row]) -> list[list[str]]:
    """The table's cells as strings (header first)."""
    out = [list(_COLUMNS)]
    for row in rows:
        mib = row.peak_mem_bytes / 2**20 if row.peak_mem_bytes is not None else None
        delta = row.loss_delta * 100 if row.loss_delta is not None else None
        out.append([
            row.label,
            row.status,
            _fmt(row.speedup, ".2f", "x"),
            _fmt(row.step_time_s * 1e3 if row.step_time_s is not None else None, ".1f"),
            _fmt(mib, ".0f"),
            _fmt(row.mem_ratio, ".2f", "x"),
            _fmt(row.final_loss, ".4f"),
            _fmt(delta, "+.2f", "%"),
            _fmt(row.skipped, "d"),
            _fmt(row.final_scale, "g"),
        ])
    return out


def format_table(rows: Sequence[Row]) -> str:
    """The sweep table as aligned plain text, followed by one line per failed row.

    Args:
        rows: Compared rows (see `compare`).

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
    for row in rows:
        if row.culprits:
            lines.append(f"{row.label}: skipped steps came from " + ", ".join(
                f"{module} ({count})" for module, count in row.culprits))
    noisy = [r for r in rows if r.ok and (r.step_time_spread or 1.0) > NOISY_SPREAD]
    for row in noisy:
        lines.append(f"{row.label}: note: step times varied {row.step_time_spread:.1f}x within "
                     "the run (75th vs 25th percentile); something else was probably using "
                     "the machine")
    if noisy:
        lines.append("note: timings are unreliable; rerun on a quiet machine or with --repeat K")
    return "\n".join(lines)


def _jsonable_float(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no inf/nan; keep them readable
    if isinstance(value, list):
        return [_jsonable_float(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable_float(v) for k, v in value.items()}
    return value


def sweep_meta(spec: SweepSpec) -> dict[str, Any]:
    """Where and how the sweep ran (for sweep.json)."""
    import torch

    from . import __version__

    return {
        "script": str(spec.script),
        "script_args": spec.script_args,
        "example": spec.example,
        "steps": spec.steps,
        "configs": [c.label for c in spec.configs],
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


def write_csv(rows: Sequence[Row], path: Path) -> Path:
    """Write `sweep.csv`: one line per row with the table's columns as raw numbers."""
    fields = ["label", "opt_level", "dtype", "status", "speedup", "step_time_s",
              "step_time_spread",
              "peak_mem_bytes", "mem_ratio", "final_loss", "loss_delta", "skipped",
              "final_scale", "steps", "wall_s", "returncode", "error"]
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({f: getattr(row, f) for f in fields})
    return path


def _floats(values: Sequence[Any]) -> list[float]:
    return [float(v) if isinstance(v, (int, float)) else math.nan for v in values]


def write_png(rows: Sequence[Row], path: Path, title: str = "ampx sweep") -> Optional[Path]:
    """Write `sweep.png`: loss curves, their difference from O0, the loss-scale trajectory,
    step times, and speed-up and peak-memory bars.

    Args:
        rows: Compared rows.
        path: Destination.
        title: Figure title.

    Returns:
        The path, or None when matplotlib is not installed (`pip install ampx[plot]`).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(15, 8), layout="constrained")
    FigureCanvasAgg(fig)
    (ax_loss, ax_delta, ax_scale), (ax_speed, ax_mem, ax_time) = fig.subplots(2, 3)
    finished = [r for r in rows if r.series.get("loss")]
    base = next((r for r in finished if r.opt_level == "O0"), None)
    color = {r.label: f"C{i % 10}" for i, r in enumerate(rows)}  # one color per row, everywhere
    for row in finished:
        losses = _floats(row.series["loss"])
        steps = range(1, len(losses) + 1)
        style = {"label": row.label, "color": color[row.label], "linewidth": 1.2}
        ax_loss.plot(steps, losses, **style)
        if base is not None and row is not base:
            reference = _floats(base.series["loss"])
            count = min(len(losses), len(reference))
            ax_delta.plot(range(1, count + 1),
                          [a - b for a, b in zip(losses[:count], reference[:count])], **style)
        ax_scale.plot(steps, _floats(row.series["loss_scale"]), **style)
        ax_time.plot(steps, [t * 1e3 for t in _floats(row.series["step_time_s"])], **style)
    ax_loss.set(title="loss", xlabel="step", ylabel="loss")
    ax_delta.set(title="loss minus O0's loss", xlabel="step", ylabel="difference")
    ax_scale.set(title="loss scale", xlabel="step", ylabel="scale", yscale="log")
    ax_time.set(title="step time", xlabel="step", ylabel="ms", yscale="log")
    for ax in (ax_loss, ax_delta, ax_scale, ax_time):
        if ax.get_lines():
            ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    labels = [r.label if r.status == "ok" else f"{r.label}\n({r.status})" for r in rows]
    colors = [color[r.label] for r in rows]
    ax_speed.bar(labels, [r.speedup or 0.0 for r in rows], color=colors)
    ax_speed.axhline(1.0, color="black", linewidth=0.8)
    ax_speed.set(title="speed-up vs O0 (median step time)", ylabel="x")
    ax_mem.bar(labels, [(r.peak_mem_bytes or 0) / 2**20 for r in rows], color=colors)
    ax_mem.set(title="peak memory", ylabel="MiB")
    for ax in (ax_speed, ax_mem):
        ax.tick_params(axis="x", labelrotation=30)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    return path
