"""ampx's fixed per-step cost on the small MLP: where the time of `scale_loss` and the step goes.

Phases, each timed on its own around the same training loop (O1 or O2, AdamW, bf16 or fp16):

- `scale_loss` entry: `scale_loss(...).__enter__()` (begin: stash earlier gradients, scale);
- `scale_loss` exit: `__exit__` (unscale + non-finite check, the scaler update, the commit);
- step hooks: ampx's step pre-hook and post-hook, called as torch's step wrapper calls them
  (the skip decision and its one host sync, the casts-off flag, the O2 master copy at O2,
  the commit); the optimizer's own update is not run (it is no cost of ampx's);
- zero_grad handler: `optimizer.zero_grad()` minus the optimizer class's own `zero_grad`
  (which the handler calls), timed on alternate steps over the same gradients.

The fixed cost is the sum of the four. Each phase is the median over `--steps` steps
(the zero_grad baseline on alternate steps); the load average is printed before and after.

For scale, the same loop is timed with torch's own `torch.amp.GradScaler` (which does the same
jobs: scale the loss, unscale and check every gradient, one host sync, update the scale), its
phases interleaved with ampx's step by step: `scaler.scale(loss)` as the entry,
`scaler.unscale_(opt)` as the exit, `found_inf` read on the host + `scaler.update()` as the
step's share (the optimizer's update itself is not run for either). torch's bookkeeping runs in
Python too, so its sum says what this machine charges for a per-step protocol of that shape.

Run::

    python benchmarks/bench_phases.py [--steps 400] [--level O1] [--dtype bf16] [--threads 1]

Target (issue #21): fixed cost <= 100 us on the small MLP.
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


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


YARDSTICKS = ("a trivial with-block", "one small tensor op")


def gradscaler_step(model: torch.nn.Module, opt: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler, x: torch.Tensor, y: torch.Tensor,
                    times: dict[str, list[float]] | None) -> None:
    """One step of the GradScaler loop, its phases timed into `times` (None: warm-up)."""
    clock = time.perf_counter
    opt.zero_grad()
    loss = F.mse_loss(model(x).float(), y)
    t0 = clock()
    scaled = scaler.scale(loss)
    t1 = clock()
    scaled.backward()
    # yardsticks at the same point (right after a backward): what this machine charges for a
    # trivial `with` block and for one small tensor op, outside any phase
    ta = clock()
    with _Nothing():
        pass
    tb = clock()
    scaled.detach() * 2.0
    tc = clock()
    if times is not None:
        times["a trivial with-block"].append(tb - ta)
        times["one small tensor op"].append(tc - tb)
    t2 = clock()
    scaler.unscale_(opt)
    t3 = clock()
    found = sum(v.item() for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
                .values())  # what scaler.step reads before stepping
    scaler.update()
    t4 = clock()
    if found < 0:
        raise AssertionError
    if times is not None:
        times["scale_loss entry"].append(t1 - t0)
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
    torch.manual_seed(0)
    ref_model = mlp()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-4)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    ref: dict[str, list[float]] = {p: [] for p in (*PHASES[:3], *YARDSTICKS)}
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
            with ampx.disable_casts():  # the reference loop is plain fp32 (no O1 casts)
                gradscaler_step(ref_model, ref_opt, ref_scaler, x, y, ref if i >= 20 else None)
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
    print("| phase | ampx median us | 25th-75th percentile us | GradScaler median us |")
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
    print()
    print("yardsticks, right after a backward (medians): " + ", ".join(
        f"{name} {statistics.median(ref[name]) * 1e6:.1f} us" for name in YARDSTICKS))
    print()
    print("load average after: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))


if __name__ == "__main__":
    main()
