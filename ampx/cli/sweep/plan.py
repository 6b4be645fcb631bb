"""`ampx sweep`'s plan: the model size and steps that fit the time budget, and each run's limit.

One job: from the probe (`ampx.cli.sweep.probe`) estimate how long one step of each
configuration takes at each size of a built-in example (`ampx.examples.sizes`), pick the largest
size that runs enough steps in every configuration within the budget, say why, and give each
run its time limit while the sweep goes (its share of what is left, by its estimate). On a CPU
that emulates bf16 the example's default size would take hours; the plan shrinks it and says so.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Sequence
from typing import Callable, Optional

from ...examples.sizes import Size
from .probe import Probe

ProbeFn = Callable[[Size], Probe]

__all__ = ["DEFAULT_BUDGET_S", "STARTUP_S", "WRITE_S", "Plan", "choose", "contention", "startup_s",
           "estimate_step_s", "format_duration", "parse_duration", "run_limit"]

DEFAULT_BUDGET_S = 240.0
"""What a built-in example's sweep plans for without --budget (the main job: a few minutes)."""
STARTUP_S = 15.0
"""A run's start-up: interpreter, torch, ampx, the example's data, `initialize` (11-17 s
measured on a busy 2-core VM; O1's initialize is the longest). `startup_s` scales it with the
machine's contention, up to `_STARTUP_BUSY` times: on 2 CPUs a run's start-up, evaluations
and exit took about 29 s at load 12 and 33-37 s at load 14 (sweeps that planned 15 s, then
30 s, left their last row, autocast, 35 s and 24 s: it stopped before its last step)."""
_STARTUP_BUSY = 2.5
_STEP_OVERHEAD_S = 0.04
"""Seconds of one training step on an idle machine that do not shrink with the model: Python,
autograd and optimizer dispatch of a small transformer (a d_model 128 step took 0.23-0.40 s
at load 12-13 on 2 CPUs, where its products alone estimate 0.03 s)."""
MIN_STEPS = 10
"""Fewer steps than this say little about the loss or the step time."""
_MARGIN = 0.75
"""The plan fills this share of the time left for steps (estimates are rough on a busy machine)."""
_OTHER_WORK = 0.3
"""Everything but the products (norms, softmax, optimizer), as a share of their fp32 time."""
EVAL_SHARE = 0.25
"""The built-in examples' held-out evaluations (about 8 per run, a few forward passes each),
as a share of the training steps' time."""
WRITE_S = 10.0
"""Kept back from the budget for writing the table, JSON, CSV and the figure."""
_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?")


def parse_duration(text: str) -> float:
    """Seconds of "90", "90s", "2m", "1m30s", "1.5m" or "1h".

    Raises:
        ValueError: Not a duration, or not above zero.
    """
    match = _DURATION.fullmatch(text.strip().lower())
    if not text.strip() or match is None or not any(match.groups()):
        raise ValueError(f"{text!r} is not a duration: write it like 90s, 2m or 5m")
    hours, minutes, seconds = (float(g) if g else 0.0 for g in match.groups())
    total = hours * 3600 + minutes * 60 + seconds
    if not total > 0:
        raise ValueError(f"{text!r} must be longer than zero")
    return total


def format_duration(seconds: float) -> str:
    """"45 s", "3 min 20 s", "2 h 5 min"."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        minutes, rest = divmod(round(seconds), 60)
        return f"{minutes} min {rest} s" if rest else f"{minutes} min"
    hours, rest = divmod(round(seconds / 60), 60)
    return f"{hours} h {rest} min" if rest else f"{hours} h"


def contention() -> tuple[float, Optional[float]]:
    """How many times slower than on an idle machine a run will go, from the load average
    (runnable processes) against the CPUs: (1 + load) / CPUs, at least 1; and the load."""
    import os

    if not hasattr(os, "getloadavg"):
        return 1.0, None
    load = os.getloadavg()[0]
    return max(1.0, (1.0 + load) / (os.cpu_count() or 1)), load


def estimate_step_s(probe: Probe, dtype: Optional[str], busy: float = 1.0) -> float:
    """One training step's seconds: forward and backward products (three times the forward's)
    in `dtype` (None: fp32), plus the rest of the step at fp32 speed, plus the step's share of
    the held-out evaluations (`EVAL_SHARE`), plus the fixed dispatch overhead
    (`_STEP_OVERHEAD_S`); times `busy` (the probe takes the fastest of a few
    runs, a training run shares the machine all along)."""
    fp32 = probe.forward_s["fp32"]
    products = probe.forward_s[dtype] if dtype is not None else fp32
    return busy * ((3.0 * products + 3.0 * fp32 * _OTHER_WORK) * (1.0 + EVAL_SHARE)
                   + _STEP_OVERHEAD_S)


def startup_s(busy: float) -> float:
    """A run's estimated start-up on a machine `busy` times slower than idle."""
    return STARTUP_S * min(max(busy, 1.0), _STARTUP_BUSY)


@dataclasses.dataclass
class Plan:
    """What the sweep runs.

    Attributes:
        size: The example's size (None: the script's own, or a user script).
        steps: Steps per configuration.
        startup_s: Estimated start-up of one run (interpreter, torch, ampx, initialize).
        step_s: Estimated seconds per step, per dtype name ("fp32", "bf16", ...).
        estimate_s: The whole sweep's estimated seconds (None: nothing to estimate from).
        budget_s: The time budget (None: none; each run has --timeout).
        busy: The machine's contention the estimates were scaled by (`contention`).
        load: The 1-minute load average when planning (None where unknown).
    """

    size: Optional[Size]
    steps: Optional[int]
    startup_s: float = 0.0
    step_s: dict[str, float] = dataclasses.field(default_factory=dict)
    estimate_s: Optional[float] = None
    budget_s: Optional[float] = None
    busy: float = 1.0
    load: Optional[float] = None

    def run_s(self, dtype: Optional[str]) -> Optional[float]:
        """One configuration's estimated seconds, start-up included."""
        step = self.step_s.get(dtype or "fp32")
        if step is None or self.steps is None:
            return None
        return self.startup_s + self.steps * step


def _total(step_s: dict[str, float], dtypes: Sequence[Optional[str]], steps: int,
           startup_s: float) -> float:
    return sum(startup_s + steps * step_s[d or "fp32"] for d in dtypes)


def _fit(step_s: dict[str, float], dtypes: Sequence[Optional[str]], budget_s: float,
         startup_s: float) -> float:
    """Steps per configuration that fit the budget's margin (not rounded)."""
    left = _MARGIN * (budget_s - WRITE_S - len(dtypes) * startup_s)
    per_step = sum(step_s[d or "fp32"] for d in dtypes)
    return max(0.0, left / per_step) if per_step > 0 else 1e6


def choose(ladder: Sequence[Size], dtypes: Sequence[Optional[str]], budget_s: float,
           default_steps: int, steps: Optional[int], probe_size: ProbeFn,
           startup_s: float, busy: float = 1.0) -> tuple[Plan, list[Probe]]:
    """Pick the largest size of `ladder` (default first) whose runs fit `budget_s`.

    Args:
        ladder: The example's sizes, largest first (a size whose flops say it is four times
            too big to fit, from the last size probed, is skipped without probing).
        dtypes: Each configuration's dtype (None for fp32: O0).
        budget_s: Seconds for the whole sweep (the probe's time already taken off).
        default_steps: The example's steps; a size fits when it runs at least half of them
            (or `steps`, when given) in every configuration.
        steps: Steps the user asked for, or None.
        probe_size: Times one size's products (called largest first, until one fits).
        startup_s: Estimated start-up of one run.
        busy: How much slower than the probe the runs will go (`contention`).

    Returns:
        The plan, and the probe of every size tried (the first is the default size's).
    """
    wanted = steps if steps is not None else max(MIN_STEPS, default_steps // 2)
    probes: list[Probe] = []
    plan: Optional[Plan] = None
    fit, flops = 0.0, 0.0
    for n, size in enumerate(ladder):
        if n and n < len(ladder) - 1 and fit * flops / size.flops < wanted / 4:
            continue  # far too big still, judged by its flops: not worth probing
        found = probe_size(size)
        probes.append(found)
        flops = size.flops
        step_s = {name: estimate_step_s(found, None if name == "fp32" else name, busy)
                  for name in found.forward_s}
        fit = _fit(step_s, dtypes, budget_s, startup_s)
        plan = Plan(size, steps if steps is not None else min(default_steps, math.floor(fit)),
                    startup_s, step_s, budget_s=budget_s, busy=busy)
        if fit >= wanted:
            break
    assert plan is not None  # the ladder is never empty
    if plan.steps is not None and plan.steps < MIN_STEPS and steps is None:
        plan.steps = MIN_STEPS  # the smallest size: run enough steps to say something
    plan.estimate_s = _total(plan.step_s, dtypes, plan.steps or 0, startup_s)
    return plan, probes


def run_limit(deadline: Optional[float], timeout_s: Optional[float],
              estimates: Sequence[Optional[float]]) -> Optional[float]:
    """The time limit of the next run.

    Args:
        deadline: `time.monotonic()` by which every run must be over (None: no budget).
        timeout_s: The per-run limit the user set (None: none).
        estimates: Estimated seconds of the next run and of every run after it (None where
            unknown). The next run's share of the time left is its estimate's share of
            theirs (an equal share where estimates are missing); it may use up to 1.5 times
            that (estimates are rough), never past the deadline.

    Returns:
        Seconds (0 or less: the budget is spent), or None when there is neither a budget nor
        a timeout.
    """
    limit = timeout_s
    if deadline is not None:
        left = deadline - time.monotonic()
        known = [e for e in estimates if e is not None]
        if known and len(known) == len(estimates) and sum(known) > 0:
            share = left * known[0] / sum(known)
        else:
            share = left / max(1, len(estimates))
        share = min(left, 1.5 * share)
        limit = share if limit is None else min(limit, share)
    return limit
