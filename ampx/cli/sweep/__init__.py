"""`ampx sweep`: run a script at each opt level and dtype in fresh processes and compare them.

The package's parts, one job each: `command` (the `ampx sweep` command: options, notes, output
files), `probe` (the half dtypes' matmul speed at the example's real shapes on this CPU),
`plan` (a model size, step count and per-run limits that fit the time budget), `rounds` (which
configuration runs when, and which run counts), `run` (one configuration in a fresh process,
so memory peaks and torch patches never leak from one run into the next), `stats` (rows,
metrics, trust), `verdict` (which level to use here), `report` (the table and files) and
`plot` (the figure). A configuration that crashes, times out or diverges becomes a row with its
error and the sweep carries on; Ctrl-C stops the running configuration and keeps what
finished (`SweepInterrupted`).
"""

from __future__ import annotations

from .command import main, spec_from_args
from .rounds import SweepInterrupted, run_sweep
from .run import Launcher, StepCallback, SweepConfig, SweepSpec, build_configs, command_for, run_one

__all__ = [
    "Launcher",
    "StepCallback",
    "SweepConfig",
    "SweepInterrupted",
    "SweepSpec",
    "build_configs",
    "command_for",
    "main",
    "run_one",
    "run_sweep",
    "spec_from_args",
]
