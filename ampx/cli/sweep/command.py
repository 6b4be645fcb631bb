"""The `ampx sweep` command: options to a planned sweep, notes, the table, the verdict, the files.

One job: turn the parsed options into a `SweepSpec`; on a CPU probe the half dtypes' matmul
speed at the example's real shapes (`probe`) and plan a size and step count that fit the time
budget (`plan`), saying what was picked and why; run the sweep (`rounds`); print the table and
the verdict (`verdict`); write sweep.json, sweep.csv and sweep.png; exit 130 after Ctrl-C with
everything that ran (and what never started) written.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

from . import plan as sweep_plan
from . import rounds
from .accuracy import DRIFT, MIN_EVALS, TOLERANCE, Metric
from .probe import Probe, probe
from .run import SweepSpec, build_configs
from .stats import Row

__all__ = ["main", "prepare", "spec_from_args"]

Say = Callable[[str], None]


def _default_dtypes() -> list[str]:
    import torch

    if torch.cuda.is_available():
        return ["fp16", "bf16"] if torch.cuda.is_bf16_supported() else ["fp16"]
    return ["bf16"]


def spec_from_args(args: argparse.Namespace) -> SweepSpec:
    """The sweep that `ampx sweep` options describe, before planning (the script was checked
    by the parser). A built-in example gets the default budget unless --budget or --timeout
    says otherwise; a script gets --timeout (900 s) and the budget only when one is given."""
    from ...examples import EXAMPLES
    from ...options.values import OPT_LEVELS, SWEEP_EXTRA

    example = None
    if args.script is None:
        example = EXAMPLES[args.example or "transformer"]
        script = example.path
    else:
        script = Path(args.script)
    budget = getattr(args, "budget", None)
    if budget is None and example is not None and args.timeout is None:
        budget = sweep_plan.DEFAULT_BUDGET_S
    metric = None
    if getattr(args, "metric", None) or getattr(args, "metric_regex", None):
        metric = Metric(args.metric or "metric", bool(args.higher_is_better), args.metric_regex)
    elif example is not None:
        metric = Metric()  # the examples' held-out loss
    run_options = ["--quiet"]
    if args.force_apex_alias or example is not None:
        run_options.append("--force-apex-alias")  # the examples must run on ampx, not apex
    return SweepSpec(
        script=script.resolve(), script_args=list(args.script_args),
        configs=build_configs(args.levels or [*OPT_LEVELS, SWEEP_EXTRA],
                              args.dtypes or _default_dtypes(),
                              autocast=example is not None and not args.no_autocast),
        out=args.out,
        steps=args.steps if args.steps is not None else (
            example.default_steps if example else None),
        timeout_s=args.timeout if args.timeout is not None or budget else 900.0,
        repeat=args.repeat, budget_s=budget,
        example=example.name if example else None, run_options=run_options,
        numerics=bool(getattr(args, "numerics", False)), metric=metric,
    )


def _emulation_note(found: Probe, dtype: str, where: str) -> Optional[str]:
    if not found.emulated(dtype):
        return None
    label, worst = found.slowest(dtype)
    how = ("emulated (no native kernels: " if not found.native.get(dtype, True)
           else "slow (")
    return (f"ampx sweep: note: {dtype} matmuls are {how}{found.capability} CPU, no "
            f"AVX512-{dtype.upper()}/AMX): at {where} they run {found.slowdown(dtype):.0f}x "
            f"slower than fp32 ({label}: {worst:.0f}x; probed in {found.elapsed_s:.2f} s), so "
            f"the {dtype} rows will be slower than O0, not faster")


def _plan_example(spec: SweepSpec, args: argparse.Namespace, say: Say,
                  cpu: bool) -> tuple[Optional[sweep_plan.Plan], Optional[Probe]]:
    from ...examples import EXAMPLES
    from ...examples.sizes import LADDERS

    example = EXAMPLES[spec.example or "transformer"]
    ladder = LADDERS[example.name]
    half = sorted({c.dtype for c in spec.configs if c.dtype})
    if not cpu:
        return None, None
    if spec.script_args or spec.budget_s is None:  # the user's size, or no budget to fit
        found = probe(ladder[0].kernels, half)
        for dtype in half:
            note = _emulation_note(found, dtype, "the example's default shapes")
            if note:
                say(note)
        return None, found
    dtypes = [c.dtype for c in spec.configs]
    busy, load = sweep_plan.contention()
    chosen, probes = sweep_plan.choose(
        ladder, dtypes, spec.budget_s, example.default_steps, args.steps,
        lambda size: probe(size.kernels, half), sweep_plan.startup_s(busy), busy)
    chosen.load = load
    for dtype in half:
        note = _emulation_note(probes[0], dtype, f"the example's default shapes "
                               f"({ladder[0].label})")
        if note:
            say(note)
    spec.steps = chosen.steps
    spec.script_args = list(chosen.size.args) if chosen.size else []
    spec.estimates = {c.label: chosen.run_s(c.dtype) or 0.0 for c in spec.configs}
    say(_plan_text(chosen, ladder[0], probes[0], dtypes, example.default_steps))
    return chosen, probes[-1]


def _plan_text(chosen: sweep_plan.Plan, default: Any, first: Probe,
               dtypes: list[Optional[str]], default_steps: int) -> str:
    fmt = sweep_plan.format_duration
    text = (f"ampx sweep: plan: {chosen.size.label if chosen.size else 'as given'}, "
            f"{chosen.steps} steps per configuration, about {fmt(chosen.estimate_s or 0)} "
            f"estimated for the {fmt(chosen.budget_s or 0)} budget (--budget changes it)")
    if chosen.size is not default or (chosen.steps or 0) < default_steps:
        step_s = {n: sweep_plan.estimate_step_s(first, None if n == "fp32" else n, chosen.busy)
                  for n in first.forward_s}
        full = sum(chosen.startup_s + default_steps * step_s[d or "fp32"] for d in dtypes)
        text += (f"; the default ({default.label}, {default_steps} steps) would take about "
                 f"{fmt(full)} here")
    if chosen.busy > 1.2 and chosen.load is not None:
        text += (f" (estimates {chosen.busy:.1f}x an idle machine's: load average "
                 f"{chosen.load:.1f} on {os.cpu_count()} CPUs)")
    return text


def _threads(spec: SweepSpec, say: Say) -> None:
    """On a busy machine give each run only the CPUs that are free (at least one).

    torch's threads wait on each other at every parallel operation; when other processes
    hold the CPUs, each wait lasts a time slice: on a 2-core VM at load 13 a d_model 128 step
    took 4.9 s with 2 threads and 0.23 s with 1. OMP_NUM_THREADS set by the user is kept.
    """
    if "OMP_NUM_THREADS" in os.environ or not hasattr(os, "getloadavg"):
        return
    cpus, load = os.cpu_count() or 1, os.getloadavg()[0]
    # whole CPUs held by others (a load below 1 is mostly the sweep's own probe: at 0.8 on
    # a quiet 2-core VM one thread per run made the bf16 rows no faster)
    threads = max(1, cpus - math.floor(load))
    if threads >= cpus:
        return
    spec.env["OMP_NUM_THREADS"] = str(threads)
    say(f"ampx sweep: note: the machine is busy (load average {load:.1f} on {cpus} CPUs), so "
        f"each run uses {threads} thread{'s' if threads > 1 else ''} (OMP_NUM_THREADS="
        f"{threads}; set it to choose): threads that wait on each other stall on a busy "
        "machine")


def prepare(spec: SweepSpec, args: argparse.Namespace,
            say: Say) -> tuple[Optional[sweep_plan.Plan], Optional[Probe]]:
    """Probe, plan and say so; adjusts `spec` (size, steps, estimates) to the plan."""
    import torch

    cpu = not torch.cuda.is_available()
    chosen: Optional[sweep_plan.Plan] = None
    found: Optional[Probe] = None
    if spec.example is not None:
        chosen, found = _plan_example(spec, args, say, cpu)
    elif cpu and any(c.dtype for c in spec.configs):
        from ...examples.sizes import LADDERS

        found = probe(LADDERS["transformer"][0].kernels, sorted({c.dtype for c in spec.configs
                                                                 if c.dtype}))
        for dtype in found.native:
            note = _emulation_note(found, dtype, "the built-in transformer's shapes")
            if note:
                say(note + "; each may need a larger --timeout or --budget")
    if spec.example is None and not args.no_autocast:
        say("ampx sweep: note: the autocast row is only produced for the built-in examples")
    if spec.budget_s is not None and spec.example is None:
        say(f"ampx sweep: note: the {sweep_plan.format_duration(spec.budget_s)} budget sets "
            "each run's time limit (a script's size and length are its own)")
    _threads(spec, say)
    what = f"example '{spec.example}'" if spec.example else str(spec.script)
    repeat = f" x {spec.repeat} rounds" if spec.repeat > 1 else ""
    say(f"ampx sweep: {what}, {len(spec.configs)} configurations{repeat}, "
        f"{spec.steps if spec.steps is not None else 'all'} steps each, output in {spec.out}/ "
        "(the load of other processes is measured during each run)")
    return chosen, found


def _write(rows: list[Row], spec: SweepSpec, args: argparse.Namespace, interrupted: bool,
           extra: dict[str, Any], say: Say) -> list[Path]:
    import torch

    from . import plot as sweep_plot
    from . import report as sweep_report

    meta = {**sweep_report.sweep_meta(spec, interrupted=interrupted), **extra}
    written = [sweep_report.write_json(rows, spec.out / "sweep.json", meta),
               sweep_report.write_csv(rows, spec.out / "sweep.csv")]
    if args.no_plot:
        return written
    device = "cuda" if torch.cuda.is_available() else "cpu"
    title = f"ampx sweep: {spec.script.name} ({device})" + (" - INTERRUPTED" if interrupted
                                                             else "")
    png = sweep_plot.write_png(rows, spec.out / "sweep.png", device=device, title=title,
                               metric=spec.metric.label if spec.metric else "held-out loss",
                               higher_is_better=bool(spec.metric and spec.metric.higher_is_better))
    if png is None:
        say("ampx sweep: matplotlib is not installed (pip install 'torch-ampx[plot]'); "
            "no sweep.png")
    else:
        written.append(png)
    return written


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (a job runner's stop) stops the sweep like Ctrl-C: the running configuration is
    stopped too, not left behind, and what ran is written."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave SIGTERM alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _missing_data(spec: SweepSpec) -> Optional[str]:
    """Why the example cannot get its data here (scikit-learn missing), or None."""
    from ...examples import data

    if spec.example == "convnet" and "synthetic" not in spec.script_args \
            and not data.digits_available():
        return "ampx sweep: error: " + data.need_sklearn("the convnet example")
    return None


def _data(rows: list[Row]) -> Optional[dict[str, Any]]:
    """What the runs trained on: the `data` record of the first run that wrote one."""
    from ... import telemetry

    for row in rows:
        if row.log:
            found = telemetry.read_metrics(Path(row.log).with_suffix(".jsonl"))[1]
            if found:
                return found
    return None


def _metric_meta(spec: SweepSpec) -> Optional[dict[str, Any]]:
    if spec.metric is None:
        return None
    return {"name": spec.metric.name, "higher_is_better": spec.metric.higher_is_better,
            "regex": spec.metric.regex, "tolerance": TOLERANCE, "drift": DRIFT,
            "min_evals": MIN_EVALS}


def main(args: argparse.Namespace) -> int:
    """`ampx sweep`: plan, run, print the table and verdict (stdout) and progress (stderr),
    write the files.

    Returns:
        0 when at least one configuration finished, 1 when none did, 130 after Ctrl-C (the
        runs that finished, and those that never started, are written first).
    """
    from .report import Progress, format_table
    from .verdict import verdict

    spec = spec_from_args(args)
    progress = Progress()
    missing = _missing_data(spec)
    if missing:
        progress.line(missing)
        return 2
    chosen, found = prepare(spec, args, progress.line)
    spec.out.mkdir(parents=True, exist_ok=True)
    interrupted = False
    try:
        with _terminate_as_interrupt():
            rows = rounds.run_sweep(spec, progress=progress.line, on_steps=progress.steps)
    except rounds.SweepInterrupted as exc:
        rows, interrupted = exc.rows, True
        progress.line("ampx sweep: interrupted; writing the runs that finished")
    try:
        said = verdict(rows, found, spec.metric)
        print(format_table(rows))
        print(said)
        extra = {"verdict": said, "budget_s": spec.budget_s, "env": spec.env,
                 "data": _data(rows), "metric": _metric_meta(spec),
                 "plan": None if chosen is None else {
                     "size": chosen.size.label if chosen.size else None,
                     "script_args": spec.script_args, "steps": chosen.steps,
                     "estimate_s": chosen.estimate_s, "step_s": chosen.step_s},
                 "probe": None if found is None else found.as_dict()}
        written = _write(rows, spec, args, interrupted, extra, progress.line)
    except KeyboardInterrupt:  # a second Ctrl-C while writing
        return 130
    print("wrote " + ", ".join(str(p) for p in written))
    if interrupted:
        return 130
    return 0 if any(row.ok for row in rows) else 1
