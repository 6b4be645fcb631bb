"""One configuration of `ampx sweep`, run in a fresh process.

One job: start ``python -m ampx run --opt-level L --dtype D --telemetry-file F script ...``
(or a test's launcher), follow its telemetry while it runs (step progress), measure the load
other processes put on the machine meanwhile, stop it on timeout or Ctrl-C, and summarise it
into a `Row`. The sweep (`ampx.cli.sweep`) decides what runs and in which order.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Callable, Optional

from ... import telemetry
from .accuracy import Metric, attach
from .stats import LoadMeter, Row, summarize, withhold

__all__ = ["LEVEL_ROWS", "RunInterrupted", "SweepConfig", "SweepSpec", "build_configs", "child_env",
           "command_for", "run_one"]

_AMPX_ROOT = Path(__file__).resolve().parents[3]  # the directory that holds `ampx/`
_POLL_S = 0.2

StepCallback = Callable[["SweepConfig", int, Optional[int], Optional[float]], None]
"""`on_steps(config, steps_done, steps_expected, last_step_time_s)`."""
Launcher = Callable[["SweepConfig", Path], list[str]]


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during one run; the run was stopped and `row` summarises what it did."""

    def __init__(self, row: Row) -> None:
        super().__init__("run interrupted")
        self.row = row


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    """One configuration of a sweep.

    Attributes:
        opt_level: "O0".."O3", or None for the plain torch.autocast row.
        dtype: "fp16" or "bf16" (None for O0, which runs in float32).
        variant: A name for a row of the same level and dtype with other options ("" for
            the level's own row); it ends the label.
        options: Extra `ampx run` options of this row (e.g. an opt-level override).
        compensation: "kahan" for O3's compensated half weights (the level "O3+kahan").
    """

    opt_level: Optional[str]
    dtype: Optional[str]
    variant: str = ""
    options: tuple[str, ...] = ()
    compensation: Optional[str] = None

    @property
    def autocast(self) -> bool:
        """True for the torch.autocast comparison row."""
        return self.opt_level is None

    @property
    def label(self) -> str:
        """The row label: "O0", "O2 bf16", "autocast bf16"."""
        head = self.opt_level or "autocast"
        if self.compensation:
            head += f"+{self.compensation}"
        label = f"{head} {self.dtype}" if self.dtype else head
        return f"{label} {self.variant}" if self.variant else label

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
        timeout_s: Wall-clock limit of one run (None: only the budget limits it).
        budget_s: Seconds for the whole sweep (None: none); each run gets its share of what
            is left (`plan.run_limit`), and a configuration is not started once it is spent.
        estimates: Estimated seconds of each configuration's run, by label (from the plan).
        example: Name of the built-in example being run, or None for a user script.
        python: The interpreter for the runs.
        repeat: Rounds of runs (every other round in reverse order, so that a drift in the
            machine's speed hits every configuration alike); each configuration keeps its
            fastest (least disturbed) run.
        run_options: Extra `ampx run` options for every run.
        numerics: Run the O1-O3 configurations with ``ampx run --numerics`` (the report goes
            next to the run's telemetry, ``runs/<slug>.numerics/``).
        env: Extra environment variables for the runs.
        metric: What accuracy is judged by (the built-in examples: their held-out loss;
            a script: `--metric NAME`, or None when it reports none).
    """

    script: Path
    script_args: list[str]
    configs: list[SweepConfig]
    out: Path
    steps: Optional[int] = None
    timeout_s: Optional[float] = 900.0
    example: Optional[str] = None
    budget_s: Optional[float] = None
    estimates: dict[str, float] = dataclasses.field(default_factory=dict)
    python: str = sys.executable
    repeat: int = 1
    run_options: list[str] = dataclasses.field(default_factory=list)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    numerics: bool = False
    metric: Optional[Metric] = None


LEVEL_ROWS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    # opt level -> its rows per half dtype: (variant name, extra `ampx run` options), one a line
    "O1": (("", ()),),
    "O2": (("", ()),),
    "O3": (("", ()),),
}
"""The sweep's rows per opt level, as data: a new variant of a level is one more line."""


def build_configs(levels: Sequence[str], dtypes: Sequence[str], *,
                  autocast: bool) -> list[SweepConfig]:
    """The configurations of a sweep: O0 once (float32), other levels once per dtype and
    `LEVEL_ROWS` variant.

    Args:
        levels: Opt levels, e.g. ["O0", "O1", "O2", "O3", "O3+kahan"].
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
        level, _, compensation = level.partition("+")  # "O3+kahan"
        configs.extend(SweepConfig(level, dtype, variant, options, compensation or None)
                       for dtype in dtypes
                       for variant, options in LEVEL_ROWS.get(level, (("", ()),)))
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
        cmd += list(config.options)
        if config.compensation is not None:
            cmd += ["--compensation", config.compensation]
    if spec.steps is not None:
        cmd += ["--max-steps", str(spec.steps)]
    if spec.numerics and config.opt_level not in (None, "O0"):
        cmd += ["--numerics", str(numerics_dir(telemetry_file))]
    cmd += list(spec.run_options)
    cmd += [str(spec.script), *spec.script_args]
    if spec.example is not None:
        if spec.steps is not None:
            cmd += ["--steps", str(spec.steps)]
        if config.autocast:
            cmd += ["--autocast", "--dtype", config.dtype or "bf16"]
    return cmd


def numerics_dir(telemetry_file: Path) -> Path:
    """Where a run's numerics report goes (beside its telemetry)."""
    return telemetry_file.with_suffix(".numerics")


def child_env(extra: Mapping[str, str]) -> dict[str, str]:
    """The environment of a run: ours, with this ampx first on PYTHONPATH."""
    env = dict(os.environ)
    env.pop("AMPX_TELEMETRY", None)  # each run gets its own file through --telemetry-file
    paths = [str(_AMPX_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _last_error_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if not line.startswith(("File ", "^", "~")) and "Traceback" not in line:
            return line[:300]
    return lines[-1][:300] if lines else ""


def _stop(proc: subprocess.Popen[Any]) -> None:
    """End a run: SIGINT (it may have had one from the terminal already), then harder."""
    for action in (lambda: proc.send_signal(signal.SIGINT), proc.terminate, proc.kill):
        if proc.poll() is not None:
            return
        try:
            action()
            proc.wait(timeout=5)
        except (subprocess.TimeoutExpired, OSError, ValueError):  # ValueError: no SIGINT (Windows)
            continue


def _wait(proc: subprocess.Popen[Any], spec: SweepSpec, config: SweepConfig, tail: telemetry.Tail,
          meter: LoadMeter, on_steps: Optional[StepCallback],
          limit_s: Optional[float]) -> Optional[str]:
    """Wait for a run, reporting steps and sampling load; "timeout" when it ran too long."""
    deadline = time.monotonic() + (limit_s if limit_s is not None else math.inf)
    while True:
        try:
            proc.wait(timeout=_POLL_S)
            tail.poll()
            return None
        except subprocess.TimeoutExpired:
            pass
        meter.sample()
        if tail.poll() and on_steps is not None:
            on_steps(config, tail.steps, spec.steps, tail.last_step_s)
        if time.monotonic() > deadline:
            _stop(proc)
            tail.poll()  # what it wrote since the last poll: its last step may be among it
            return "timeout"


def _start(cmd: list[str], env: dict[str, str], log: IO[str],
           err: IO[str]) -> subprocess.Popen[Any]:
    return subprocess.Popen(cmd, stdout=log, stderr=err, text=True, env=env)


def run_one(spec: SweepSpec, config: SweepConfig, launcher: Optional[Launcher] = None,
            round_index: int = 0, on_steps: Optional[StepCallback] = None,
            limit_s: Optional[float] = None) -> Row:
    """Run one configuration in a fresh process and summarise it.

    Args:
        spec: The sweep.
        config: The configuration.
        launcher: Builds the command from (config, telemetry file); tests use it to run a fake
            script. Default: `command_for`.
        round_index: Which repetition this is (names the run's files).
        on_steps: Called while the run goes whenever new step records arrived.
        limit_s: This run's time limit (None: `spec.timeout_s`).

    Returns:
        The row (its O0-relative columns are filled by `compare`; a run that did not finish
        has its results withheld, `stats.withhold`).

    Raises:
        KeyboardInterrupt: Ctrl-C; the run was stopped (the exception's `row` is its row).
    """
    runs = spec.out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    name = config.slug if round_index == 0 else f"{config.slug}.{round_index + 1}"
    telemetry_file = runs / f"{name}.jsonl"
    for stale in runs.glob(f"{name}.jsonl*"):
        stale.unlink()
    log_file, err_file = runs / f"{name}.log", runs / f"{name}.stderr"
    cmd = launcher(config, telemetry_file) if launcher else command_for(spec, config,
                                                                         telemetry_file)
    env = child_env(spec.env)
    env["AMPX_TELEMETRY"] = str(telemetry_file)  # for launchers that bypass `ampx run`
    row = Row(label=config.label, opt_level=config.opt_level or "autocast", dtype=config.dtype,
              command=cmd, log=str(log_file))
    meter, tail = LoadMeter(), telemetry.Tail(telemetry_file)
    interrupted = False
    if limit_s is None:
        limit_s = spec.timeout_s
    with open(log_file, "w", encoding="utf-8") as log, \
            open(err_file, "w+", encoding="utf-8") as err:
        started = time.perf_counter()
        try:
            proc: Optional[subprocess.Popen[Any]] = _start(cmd, env, log, err)
        except OSError as exc:
            row.status, row.error = "error", f"could not start: {exc}"
            proc = None
        if proc is not None:
            try:
                outcome = _wait(proc, spec, config, tail, meter, on_steps, limit_s)
                if outcome == "timeout" and spec.steps and tail.steps >= spec.steps:
                    outcome = "done"  # every step ran; only the process's exit was cut short
            except KeyboardInterrupt:
                _stop(proc)
                outcome, interrupted = "interrupted", True
            _finish(row, proc, outcome, limit_s, err, started)
        err.seek(0)
        log.write(err.read())
    err_file.unlink()
    meter.finish(row)
    _summarize_run(row, telemetry_file, spec.metric)
    if interrupted:
        raise RunInterrupted(row)
    return row


def _finish(row: Row, proc: subprocess.Popen[Any], outcome: Optional[str],
            limit_s: Optional[float], err: IO[str], started: float) -> None:
    row.wall_s = time.perf_counter() - started
    row.returncode = proc.returncode if outcome is None else None
    if outcome == "done":
        return
    if outcome == "timeout":
        row.status, row.error = "timeout", f"timed out after {limit_s or 0:.0f} s"
    elif outcome == "interrupted":
        row.status, row.error = "interrupted", "stopped by Ctrl-C"
    elif proc.returncode != 0:
        err.seek(0)
        row.status = "error"
        row.error = f"exit {proc.returncode}: {_last_error_line(err.read())}"


def _summarize_run(row: Row, telemetry_file: Path, metric: Optional[Metric]) -> None:
    init, steps = telemetry.read_telemetry(telemetry_file)
    summarize(row, init, steps)
    attach(row, telemetry.read_metrics(telemetry_file)[0], steps, metric or Metric())
    report = numerics_dir(telemetry_file) / "numerics.json"
    if report.is_file():  # the run's numerics report (sweep --numerics): its top modules at risk
        try:
            modules = json.loads(report.read_text(encoding="utf-8"))["modules"]
            row.numerics_at_risk = [[m["name"], m["issue"]] for m in modules
                                    if m["issue"] != "ok"][:3]
        except (ValueError, KeyError, TypeError):
            row.numerics_at_risk = []
    withhold(row)
    if row.status == "no data":
        if steps:
            row.status = "ok"
        else:
            row.error = ("no telemetry step records: the script never stepped an optimizer "
                         "passed through amp.initialize")
