"""`ampx sweep`'s figure, sweep.png.

One job: draw compared rows (`ampx.cli.sweep.stats`) so that each configuration can be told
apart: the held-out curves (when the runs evaluated a metric) and their relative gap to O0's
with the tolerance, the training loss curves and their difference from O0 in distinct line
styles and markers,
step times, speed-up bars with their interquartile range, peak memory (labelled with what
it measures), and the loss-scale panel only when some configuration scales its loss.
Unreliable timings are hatched and named in the title; a sweep where nothing finished gets
one panel that lists the failures instead of empty axes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from .stats import Row

__all__ = ["build_figure", "write_png"]

_LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _floats(values: Sequence[Any]) -> list[float]:
    return [float(v) if isinstance(v, (int, float)) else math.nan for v in values]


def _styles(rows: Sequence[Row]) -> dict[str, dict[str, Any]]:
    """One colour, line style and marker per row, the same in every panel."""
    styles = {}
    for i, row in enumerate(rows):
        count = max(1, len(row.series.get("loss", [])))
        every = max(1, count // 8)
        styles[row.label] = {
            "label": row.label, "color": f"C{i % 10}", "linewidth": 2.6 if i == 0 else 1.4,
            "linestyle": _LINESTYLES[i % len(_LINESTYLES)], "marker": _MARKERS[i % len(_MARKERS)],
            "markevery": (i % every, every), "markersize": 5, "alpha": 0.9,
        }
    return styles


def _scales(rows: Sequence[Row]) -> bool:
    """Whether any configuration used a loss scale other than a constant 1."""
    for row in rows:
        values = [v for v in _floats(row.series.get("loss_scale", [])) if math.isfinite(v)]
        if any(v != 1.0 for v in values):
            return True
    return False


def _curves(axes: dict[str, Any], rows: Sequence[Row], styles: dict[str, dict[str, Any]],
            scales: bool) -> None:
    finished = [r for r in rows if r.ok and r.series.get("loss")]  # a stopped run's
    # first steps are not a result
    base = next((r for r in finished if r.opt_level == "O0"), None)
    for row in finished:
        losses = _floats(row.series["loss"])
        steps = range(1, len(losses) + 1)
        style = styles[row.label]
        axes["loss"].plot(steps, losses, **style)
        if base is not None and row is not base:
            reference = _floats(base.series["loss"])
            count = min(len(losses), len(reference))
            axes["delta"].plot(range(1, count + 1),
                               [a - b for a, b in zip(losses[:count], reference[:count])],
                               **style)
        if scales:
            axes["scale"].plot(steps, _floats(row.series["loss_scale"]), **style)
        axes["time"].plot(steps, [t * 1e3 for t in _floats(row.series["step_time_s"])],
                          **style)
    axes["loss"].set(title="loss", xlabel="step", ylabel="loss")
    axes["delta"].axhline(0.0, color="black", linewidth=0.8)
    axes["delta"].set(title="loss minus O0's loss (0 = same as fp32; symlog)", xlabel="step",
                      ylabel="difference")
    _symlog(axes["delta"])
    axes["time"].set(title="step time", xlabel="step", ylabel="ms", yscale="log")
    if scales:
        axes["scale"].set(title="loss scale", xlabel="step", ylabel="scale", yscale="log")
    for name in ("loss", "delta", "time", "scale"):
        if name in axes:
            if any(not line.get_label().startswith("_") for line in axes[name].get_lines()):
                axes[name].legend(fontsize="small")
            axes[name].grid(alpha=0.3)


def _heldout(axes: dict[str, Any], rows: Sequence[Row], styles: dict[str, dict[str, Any]],
             label: str, higher: bool) -> None:
    from .accuracy import TOLERANCE

    finished = [r for r in rows if r.ok and r.series.get("heldout")]
    base = next((r for r in finished if r.opt_level == "O0"), None)
    reference = {int(s): float(v) for s, v in base.series["heldout"]} if base else {}
    for row in finished:
        style = dict(styles[row.label], markevery=1)
        if row.accuracy_verdict:
            style["label"] = f"{row.label} ({row.accuracy_verdict})"
        steps = [int(s) for s, _ in row.series["heldout"]]
        values = [float(v) for _, v in row.series["heldout"]]
        axes["heldout"].plot(steps, values, **style)
        if row is base or not reference:
            continue
        pairs = [(s, v, reference[s]) for s, v in zip(steps, values)
                 if s in reference and reference[s]]
        gaps = [((b - v) if higher else (v - b)) / abs(b) * 100 for _, v, b in pairs]
        axes["gap"].plot([s for s, _, _ in pairs], gaps, **style)
    axes["heldout"].set(title=f"{label} (held-out evaluations)", xlabel="step", ylabel=label)
    axes["gap"].axhline(0.0, color="black", linewidth=0.8)
    axes["gap"].axhline(TOLERANCE * 100, color="firebrick", linewidth=1.0, linestyle="--",
                        label=f"tolerance (+{TOLERANCE:.0%})")
    axes["gap"].set(title=f"{label}: gap to O0 (% , + = worse)", xlabel="step", ylabel="%")
    for name in ("heldout", "gap"):
        axes[name].legend(fontsize="small")
        axes[name].grid(alpha=0.3)


def _symlog(ax: Any) -> None:
    """A symmetric log scale, so that small differences are not flattened by one big one."""
    values = [abs(v) for line in ax.get_lines() for v in line.get_ydata()
              if isinstance(v, float) and math.isfinite(v) and v != 0.0]
    if values:
        ax.set_yscale("symlog", linthresh=max(max(values) * 1e-3, 1e-12))


def _bars(axes: dict[str, Any], rows: Sequence[Row], styles: dict[str, dict[str, Any]],
          device: str) -> None:
    labels = [r.label if r.ok else f"{r.label}\n({r.status})" for r in rows]
    colors = [styles[r.label]["color"] for r in rows]
    hatches = ["//" if r.unreliable else "" for r in rows]
    speed = [r.speedup or 0.0 for r in rows]
    low = [max(0.0, s - (r.speedup_low or s)) for s, r in zip(speed, rows)]
    high = [max(0.0, (r.speedup_high or s) - s) for s, r in zip(speed, rows)]
    bars = axes["speed"].bar(labels, speed, color=colors, hatch=hatches, edgecolor="black",
                             yerr=[low, high], capsize=4)
    for bar, row in zip(bars, rows):
        if row.speedup:  # the value at the foot of its bar, clear of the IQR whiskers
            axes["speed"].annotate(f"{row.speedup:.2f}x" + ("?" if row.unreliable else ""),
                                   (bar.get_x() + bar.get_width() / 2, 0.0),
                                   ha="center", va="bottom", fontsize="small",
                                   xytext=(0, 4), textcoords="offset points",
                                   bbox={"boxstyle": "round", "fc": "white", "alpha": 0.85})
    axes["speed"].axhline(1.0, color="black", linewidth=0.8)
    axes["speed"].set(title="speed-up vs O0 (median step time, bars: IQR; hatched: unreliable)",
                      ylabel="x")
    what = ("CUDA max allocated" if device.startswith("cuda")
            else "process peak RSS, torch included")
    axes["mem"].bar(labels, [(r.peak_mem_bytes or 0) / 2**20 for r in rows], color=colors,
                    edgecolor="black")
    axes["mem"].set(title=f"peak memory ({what})", ylabel="MiB")
    for name in ("speed", "mem"):
        axes[name].tick_params(axis="x", labelrotation=30)
        axes[name].grid(axis="y", alpha=0.3)


def _failed_figure(fig: Any, rows: Sequence[Row], title: str) -> None:
    ax = fig.add_subplot()
    ax.axis("off")
    text = "\n".join(f"{r.label}: {r.status}: {r.error or 'no step records'}"[:140]
                     for r in rows) or "no configurations ran"
    ax.text(0.0, 1.0, "No configuration finished; nothing to plot.\n\n" + text,
            va="top", ha="left", family="monospace", fontsize="small", wrap=True)
    fig.suptitle(title)


def build_figure(rows: Sequence[Row], title: str = "ampx sweep", device: str = "cpu",
                 metric: str = "held-out loss", higher_is_better: bool = False) -> Any:
    """The figure of `write_png` (a matplotlib Figure; raises ImportError without matplotlib)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not any(r.ok and r.series.get("loss") for r in rows):
        fig = Figure(figsize=(10, 1.5 + 0.3 * len(rows)), layout="constrained")
        FigureCanvasAgg(fig)
        _failed_figure(fig, rows, title)
        return fig
    scales = _scales(rows)
    heldout = any(r.ok and r.series.get("heldout") for r in rows)
    layout: Any = ([["loss", "delta", "scale"], ["time", "speed", "mem"]] if scales
                   else [["loss", "loss", "delta", "delta", "time", "time"],
                         ["speed", "speed", "speed", "mem", "mem", "mem"]])
    if heldout:
        layout = [["heldout", "gap", "loss"], ["delta", "time", "scale" if scales else "time"],
                  ["speed", "speed", "mem"]]
    fig = Figure(figsize=(15, 12.5 if heldout else 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplot_mosaic(layout)
    styles = _styles(rows)
    if heldout:
        _heldout(axes, rows, styles, metric, higher_is_better)
    _curves(axes, rows, styles, scales)
    _bars(axes, rows, styles, device)
    unreliable = [r.label for r in rows if r.ok and r.unreliable]
    if unreliable:
        fig.suptitle(f"{title}\nTIMINGS UNRELIABLE for {', '.join(unreliable)} (other load "
                     "or noisy steps; see the table)", color="firebrick")
    else:
        fig.suptitle(title)
    return fig


def write_png(rows: Sequence[Row], path: Path, title: str = "ampx sweep",
              device: str = "cpu", metric: str = "held-out loss",
              higher_is_better: bool = False) -> Optional[Path]:
    """Write `sweep.png` (see `build_figure`).

    Args:
        rows: Compared rows.
        path: Destination.
        title: Figure title.
        device: "cpu" or "cuda..." (says what the peak-memory bars measure).
        metric: The judged metric's label; `higher_is_better` its direction.

    Returns:
        The path, or None when matplotlib is not installed (`pip install 'torch-ampx[plot]'`).
    """
    try:
        fig = build_figure(rows, title, device, metric, higher_is_better)
    except ImportError:
        return None
    fig.savefig(path, dpi=100)
    return path
