"""The numerics report's picture: modules x watched steps, overflow beside underflow.

Needs matplotlib (the ``[plot]`` extra); :meth:`NumericsReport.write` skips the picture
without it. Rows are the modules in the report's ranking (worst on top), one row each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402  (matplotlib's own dependency)
from matplotlib.colors import LogNorm  # noqa: E402

__all__ = ["plot_heatmap"]


def plot_heatmap(report: Any, path: Path) -> Path:
    """Draw a ``NumericsReport``'s overflow and underflow shares per module and watched step
    to `path` (the report imports this module, so it is not imported back)."""
    history = report.history
    position = {name: i for i, name in enumerate(history["modules"])}
    names = [m.name for m in report.modules if m.name in position]
    labels = [f"{m.name}  [{m.issue}]" if m.issue != "ok" else m.name
              for m in report.modules if m.name in position]
    steps = history["steps"]
    height = max(2.5, 0.28 * len(names) + 1.6)
    width = min(16.0, 6.0 + 0.12 * len(steps))
    fig, axes = plt.subplots(1, 2, figsize=(width, height), sharey=True)
    try:
        for ax, key, cmap, title in ((axes[0], "overflow", "Reds", "forward overflow (share)"),
                                     (axes[1], "underflow", "Blues", "underflow (share)")):
            # log colours: 0.01 % of a tensor overflowing matters as much as all of it;
            # zero stays white
            grid = np.ma.masked_less_equal(
                np.array([history[key][position[n]] for n in names] or [[0.0]], dtype=float), 0)
            image = ax.imshow(grid, aspect="auto", cmap=cmap,
                              norm=LogNorm(vmin=1e-4, vmax=1.0, clip=True),
                              interpolation="nearest")
            ax.set_title(title)
            ax.set_xlabel("step")
            ticks = list(range(len(steps)))[:: max(1, len(steps) // 10)]
            ax.set_xticks(ticks)
            ax.set_xticklabels([str(steps[t]) for t in ticks])
            fig.colorbar(image, ax=ax, fraction=0.04)
        axes[0].set_yticks(range(len(labels)))
        axes[0].set_yticklabels(labels, fontsize=8)
        dtype = "fp16" if "16" in str(report.dtype) and "bfloat" not in str(report.dtype) \
            else "bf16"
        fig.suptitle(f"ampx numerics ({dtype}): modules ranked by risk, watched steps")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path
