"""ampx's fixed per-step cost on the small MLP: where the time of `scale_loss` and the step goes.

Phases, each timed on its own around the same training loop (O1 or O2, AdamW, bf16 or fp16):

- `scale_loss` entry: `scale_loss(...).__enter__()` (begin: stash earlier gradients, scale);
- `scale_loss` exit: `__exit__` (unscale + non-finite check, the scaler update, the commit);
- step hooks: ampx's step pre-hook and post-hook, called as torch's step wrapper calls them
  (the skip decision and its one host sync, the casts-off flag, the O2 master copy at O2,
  the commit); the optimizer's own update is not run (it is no cost of ampx's);
- zero_grad handler: `optimizer.zero_grad()` minus the optimizer class's own `zero_grad`
  (which the handler calls), timed on alternate steps over the same gradients.

The fixed cost is the sum of the four. Each loop drops its step's tensors outside the phases
(the last reference to a step's autograd graph frees its nodes: ~13 us on the small MLP that a
loop pays wherever it drops that reference; the reference loop's go when its step function
returns). Each phase is the median over `--steps` steps (the zero_grad baseline on alternate
steps); the load average is printed before and after.

For scale, the same loop is timed with torch's own `torch.autocast` + `torch.amp.GradScaler`
(which do the same jobs: release the step's weight casts, scale the loss, unscale and check
every gradient, one host sync, update the scale), its phases interleaved with ampx's step by
step: autocast's `__exit__` (where autocast drops its weight-cast cache; ampx drops O1's at
`scale_loss` entry) + `scaler.scale(loss)` as the entry, `scaler.unscale_(opt)` as the exit,
`scaler.step(opt)` (its checks and its `found_inf` read; the optimizer's `step` a no-op) +
`scaler.update()` as the step's share (the optimizer's update itself is not run for either).
torch's bookkeeping runs in Python too, so its sum says what this machine charges for a
per-step protocol of that shape. One more per-step cost of torch.amp has no ampx counterpart:
making and entering the `torch.autocast` region before the forward (O1 casts without a region,
O2 casts the model); it is printed on its own row, and the ratio is printed without it (the
issue's definition) and with it (torch.amp's whole per-step protocol against ampx's). The
reference's forward runs under autocast in the half dtype, as ampx's runs under O1.

Run::

    python benchmarks/bench_phases.py [--steps 400] [--level O1] [--dtype bf16] [--threads 1]

Target (issue #29): fixed cost <= 1.0 x autocast + GradScaler's in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_patching import mlp  # noqa: E402

import ampx  # noqa: E402
from ampx.scaling.stepping import _step_post_hook, _step_pre_hook  # noqa: E402

PHASES = ("scale_loss entry", "scale_loss exit", "step hooks", "zero_grad handler")
# torch.amp's per-step cost with no ampx counterpart: O1 casts without a region to open
REGION = "autocast region (construct + __enter__)"


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


YARDSTICKS = ("a trivial with-block", "one small tensor op")


def gradscaler_step(model: torch.nn.Module, opt: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler, x: torch.Tensor, y: torch.Tensor,
                    times: dict[str, list[float]] | None, dtype: torch.dtype) -> None:
    """One step of the autocast + GradScaler loop, its phases timed into `times` (None:
    warm-up)."""
    clock = time.perf_counter
    opt.zero_grad()
    tr = clock()
    region = torch.autocast("cpu", dtype=dtype)
    region.__enter__()
    tr1 = clock()
    loss = F.mse_loss(model(x).float(), y)
    ta = clock()
    region.__exit__(None, None, None)  # releases autocast's weight-cast cache
    t0 = clock()
    scaled = scaler.scale(loss)
    t1 = clock()
    scaled.backward()
    # yardsticks at the same point (right after a backward): what this machine charges for a
    # trivial `with` block and for one small tensor op, outside any phase
    ya = clock()
    with _Nothing():
        pass
    yb = clock()
    scaled.detach() * 2.0
    yc = clock()
    if times is not None:
        times["a trivial with-block"].append(yb - ya)
        times["one small tensor op"].append(yc - yb)
    t2 = clock()
    scaler.unscale_(opt)
    t3 = clock()
    scaler.step(opt)  # its checks, the found_inf read, and `opt.step` (a no-op here)
    scaler.update()
    t4 = clock()
    if times is not None:
        times[REGION].append(tr1 - tr)
        times["scale_loss entry"].append(t1 - t0 + (t0 - ta))
        times["scale_loss exit"].append(t3 - t2)
        times["step hooks"].append(t4 - t3)


def measure(level: str, dtype: str, steps: int
            ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per-phase seconds of `steps` steps (after 20 warm-up steps)."""
    torch.manual_seed(0)
    model = mlp()
    amp = ampx.Amp(level, dtype=dtype, verbosity=0)
    model, opt = amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    x, y = torch.randn(8, 64), torch.randn(8, 64)
    half = torch.bfloat16 if dtype == "bf16" else torch.float16
    torch.manual_seed(0)
    ref_model = mlp()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-4)
    # GradScaler's step share without the update (ampx's hooks run without it too)
    ref_opt.step = lambda *args, **kwargs: None  # type: ignore[method-assign]
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    ref: dict[str, list[float]] = {p: [] for p in (*PHASES[:3], REGION, *YARDSTICKS)}
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    handler: list[float] = []
    own: list[float] = []
    clock = time.perf_counter
    try:
        for i in range(steps + 20):
            # Odd steps time the handler, even ones the class's own zero_grad (which the
            # handler calls): the difference of the two medians is the handler's cost.
            t0 = clock()
            if i % 2:
                opt.zero_grad()
            else:
                type(opt).zero_grad(opt, True)
            t1 = clock()
            loss = F.mse_loss(model(x).float(), y)
            t3 = clock()
            ctx = amp.scale_loss(loss, opt)
            scaled = ctx.__enter__()
            t4 = clock()
            scaled.backward()
            t5 = clock()
            ctx.__exit__(None, None, None)
            t6 = clock()
            args = (opt,)
            t7 = clock()
            _step_pre_hook(opt, args, {})
            _step_post_hook(opt, args, {})
            t8 = clock()
            # The step's tensors go now, outside the phases, as the reference's go when its
            # step function returns: the last reference to a step's autograd graph (the
            # scaled loss) frees the graph's nodes, wherever a loop happens to drop it
            del loss, ctx, scaled
            with ampx.disable_casts():  # the reference loop casts by autocast, not O1
                gradscaler_step(ref_model, ref_opt, ref_scaler, x, y, ref if i >= 20 else None,
                                half)
            if i >= 20:
                times["scale_loss entry"].append(t4 - t3)
                times["scale_loss exit"].append(t6 - t5)
                times["step hooks"].append(t8 - t7)
                (handler if i % 2 else own).append(t1 - t0)
    finally:
        amp.restore()
    base = statistics.median(own)
    times["zero_grad handler"] = [t - base for t in handler]
    return times, ref


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--level", default="O1", choices=["O1", "O2"])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.level} {args.dtype}, "
          f"small MLP (16 x Linear(64), batch 8), AdamW, {args.steps} steps; load average "
          "before: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    times, ref = measure(args.level, args.dtype, args.steps)
    print()
    print("| phase | ampx median us | 25th-75th percentile us | autocast + GradScaler median us |")
    print("| --- | --- | --- | --- |")
    total = ref_total = 0.0
    for phase in PHASES:
        q = statistics.quantiles(times[phase], n=4)
        total += q[1]
        theirs = ""
        if phase in ref and phase not in YARDSTICKS:
            median = statistics.median(ref[phase])
            ref_total += median
            theirs = f"{median * 1e6:.0f}"
        print(f"| {phase} | {q[1] * 1e6:.0f} | {q[0] * 1e6:.0f}-{q[2] * 1e6:.0f} | {theirs} |")
    print(f"| fixed per-step cost (sum of medians) | {total * 1e6:.0f} | | "
          f"{ref_total * 1e6:.0f} |")
    region = statistics.median(ref[REGION])
    print(f"| {REGION} | none | | {region * 1e6:.0f} |")
    print(f"| with the region | {total * 1e6:.0f} | | {(ref_total + region) * 1e6:.0f} |")
    print()
    print(f"ratio ampx / (autocast + GradScaler): {total / ref_total:.2f}; with autocast's "
          f"region entry: {total / (ref_total + region):.2f}")
    print()
    print("yardsticks, right after a backward (medians): " + ", ".join(
        f"{name} {statistics.median(ref[name]) * 1e6:.1f} us" for name in YARDSTICKS))
    print()
    print("load average after: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))


if __name__ == "__main__":
    main()
