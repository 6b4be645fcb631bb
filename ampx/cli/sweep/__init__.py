"""`ampx sweep`: run a script at each opt level and dtype in fresh processes and compare them.

One job: the sweep — which configurations run in which order (every other round reversed,
so a drift in the machine's speed hits all alike), which run each configuration keeps, and
the `ampx sweep` command around it (options, notes, output files, Ctrl-C). Each configuration
runs in its own process (`ampx.cli.sweep.run`), so memory peaks and torch patches never leak from
one run into the next; a configuration that crashes, times out or diverges becomes a row with
its error and the sweep carries on. Rows, metrics and trust are `ampx.cli.sweep.stats`; the table
and files `ampx.cli.sweep.report`; the figure `ampx.cli.sweep.plot`. Ctrl-C stops the running
configuration and keeps what finished (`SweepInterrupted`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Optional

from .run import Launcher, StepCallback, SweepConfig, SweepSpec, build_configs, command_for, run_one
from .stats import Row, compare

__all__ = [
    "SweepConfig",
    "SweepInterrupted",
    "SweepSpec",
    "build_configs",
    "command_for",
    "main",
    "run_one",
    "run_sweep",
]


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C during a sweep; `rows` holds the compared rows of what ran (the interrupted
    configuration's row has status "interrupted")."""

    def __init__(self, rows: list[Row]) -> None:
        super().__init__("sweep interrupted")
        self.rows = rows


def run_sweep(spec: SweepSpec, progress: Optional[Callable[[str], None]] = None,
              launcher: Optional[Launcher] = None,
              on_steps: Optional[StepCallback] = None) -> list[Row]:
    """Run every configuration of `spec`, one fresh process each, and compare them with O0.

    With `spec.repeat` > 1 the configurations run that many rounds, every other round in
    reverse order, and each keeps its least disturbed run (the lowest median step time); a
    run that fails in any round makes the configuration's row that failure.

    Args:
        spec: The sweep.
        progress: Called with one line of progress text before and after each run.
        launcher: See `run_one`.
        on_steps: See `run_one`.

    Returns:
        One row per configuration, in `spec.configs` order.

    Raises:
        SweepInterrupted: Ctrl-C; carries the compared rows of the runs so far.
    """
    say = progress or (lambda text: None)
    best: dict[SweepConfig, Row] = {}
    total, count = len(spec.configs) * spec.repeat, 0
    try:
        for round_index in range(spec.repeat):
            order = spec.configs if round_index % 2 == 0 else spec.configs[::-1]
            for config in order:
                count += 1
                say(f"[{count}/{total}] {config.label}: running")
                row = run_one(spec, config, launcher, round_index, on_steps)
                kept = best.get(config)
                if kept is None or (kept.ok and (not row.ok or _faster(row, kept))):
                    best[config] = row
                compare([best[c] for c in spec.configs if c in best])
                say(f"[{count}/{total}] {config.label}: {_progress_text(row)}")
    except KeyboardInterrupt as exc:
        stopped: Optional[Row] = getattr(exc, "row", None)
        if stopped is not None:
            best.setdefault(next(c for c in spec.configs if c.label == stopped.label), stopped)
        rows = [best[c] for c in spec.configs if c in best]
        compare(rows)
        raise SweepInterrupted(rows) from None
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
    busy = f", other load {row.other_cpus:.1f} CPUs" if row.other_cpus is not None else ""
    return f"{row.status}, {wall}, {row.steps} steps, {step}, {loss}{busy}"


# -- the `ampx sweep` command ----------------------------------------------------------------

def _default_dtypes() -> list[str]:
    import torch

    if torch.cuda.is_available():
        return ["fp16", "bf16"] if torch.cuda.is_bf16_supported() else ["fp16"]
    return ["bf16"]


def spec_from_args(args: argparse.Namespace) -> SweepSpec:
    """The sweep that `ampx sweep` options describe (the script was checked by the parser)."""
    from ...examples import EXAMPLES
    from ...options.values import OPT_LEVELS

    example = None
    if args.script is None:
        example = EXAMPLES[args.example or "transformer"]
        script = example.path
    else:
        script = Path(args.script)
    dtypes = args.dtypes or _default_dtypes()
    run_options = ["--quiet"]
    if args.force_apex_alias or example is not None:
        run_options.append("--force-apex-alias")  # the examples must run on ampx, not apex
    return SweepSpec(
        script=script.resolve(), script_args=list(args.script_args),
        configs=build_configs(args.levels or list(OPT_LEVELS), dtypes,
                              autocast=example is not None and not args.no_autocast),
        out=args.out,
        steps=args.steps if args.steps is not None else (
            example.default_steps if example else None),
        timeout_s=args.timeout, repeat=args.repeat,
        example=example.name if example else None, run_options=run_options,
    )


def bf16_matmul_slowdown(size: int = 256, reps: int = 3) -> float:
    """How many times slower a bf16 matmul is than an fp32 one on this CPU (best of `reps`).

    Without native bf16 matmul kernels (no AVX512-BF16/AMX, or a torch build that does not
    use them) torch emulates bf16 matmuls: 10-100x slower than fp32 was seen on a 2-core
    AVX2 machine, which makes every bf16 row of a sweep slower than O0. About 30 ms there.
    """
    import time

    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, y = a.to(dtype), b.to(dtype)
        torch.mm(x, y)  # warm-up
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            torch.mm(x, y)
            times.append(time.perf_counter() - start)
        best[dtype] = max(min(times), 1e-9)
    return best[torch.bfloat16] / best[torch.float32]


def _notes(spec: SweepSpec, args: argparse.Namespace, say: Callable[[str], None]) -> None:
    import torch

    if any(c.dtype == "fp16" for c in spec.configs) and not torch.cuda.is_available():
        say("ampx sweep: note: fp16 matmuls are emulated on most CPUs and can be very slow; "
            "bf16 is the CPU's half dtype")
    if any(c.dtype == "bf16" for c in spec.configs) and not torch.cuda.is_available():
        slowdown = bf16_matmul_slowdown()
        if slowdown > 2.0:
            say(f"ampx sweep: note: a bf16 matmul runs {slowdown:.0f}x slower than an fp32 one "
                f"on this CPU (torch {torch.__version__}, "
                f"{torch.backends.cpu.get_cpu_capability()} kernels: no native bf16 matmul), "
                "so the bf16 rows will be slower than O0, not faster; each may need a larger "
                f"--timeout than {spec.timeout_s:.0f} s (or fewer --steps)")
    if spec.example is None and not args.no_autocast:
        say("ampx sweep: note: the autocast row is only produced for the built-in examples")
    what = f"example '{spec.example}'" if spec.example else str(spec.script)
    rounds = f" x {spec.repeat} rounds" if spec.repeat > 1 else ""
    steps = spec.steps if spec.steps is not None else "all"
    say(f"ampx sweep: {what}, {len(spec.configs)} configurations{rounds}, {steps} steps each, "
        f"output in {spec.out}/ (the load of other processes is measured during each run)")


def _write(rows: list[Row], spec: SweepSpec, args: argparse.Namespace, interrupted: bool,
           say: Callable[[str], None]) -> list[Path]:
    import torch

    from . import plot as sweep_plot
    from . import report as sweep_report

    meta = sweep_report.sweep_meta(spec, interrupted=interrupted)
    written = [sweep_report.write_json(rows, spec.out / "sweep.json", meta),
               sweep_report.write_csv(rows, spec.out / "sweep.csv")]
    if args.no_plot or interrupted:
        return written
    device = "cuda" if torch.cuda.is_available() else "cpu"
    png = sweep_plot.write_png(rows, spec.out / "sweep.png", device=device,
                               title=f"ampx sweep: {spec.script.name} ({device})")
    if png is None:
        say("ampx sweep: matplotlib is not installed (pip install 'torch-ampx[plot]'); "
            "no sweep.png")
    else:
        written.append(png)
    return written


def main(args: argparse.Namespace) -> int:
    """`ampx sweep`: run, print the table (stdout) and progress (stderr), write the files.

    Returns:
        0 when at least one configuration finished, 1 when none did, 130 after Ctrl-C (the
        runs that finished are written to sweep.json and sweep.csv first).
    """
    from .report import Progress, format_table

    spec = spec_from_args(args)
    progress = Progress()
    _notes(spec, args, progress.line)
    spec.out.mkdir(parents=True, exist_ok=True)
    interrupted = False
    try:
        rows = run_sweep(spec, progress=progress.line, on_steps=progress.steps)
    except SweepInterrupted as exc:
        rows, interrupted = exc.rows, True
        progress.line("ampx sweep: interrupted; writing the runs that finished")
    try:
        print(format_table(rows))
        written = _write(rows, spec, args, interrupted, progress.line)
    except KeyboardInterrupt:  # a second Ctrl-C while writing
        return 130
    print("wrote " + ", ".join(str(p) for p in written))
    if interrupted:
        return 130
    return 0 if any(row.ok for row in rows) else 1
