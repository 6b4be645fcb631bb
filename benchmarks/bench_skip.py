"""Cost of making a skipped step a no-op: three mechanisms, interleaved in one process.

- standin: ampx's choice: the optimizer's own step runs on a parameter-less shallow copy;
- empty_groups: the real param groups temporarily hold no parameters during the step;
- grads_none: the old mechanism: every `.grad` is set to None for the step (not a no-op for
  optimizers that don't check `p.grad is None` or decay weights first).

Each is timed per skipped step of AdamW over a model with many parameters; reported as the
median microseconds per step and the ratio to `grads_none`. Run:
`python benchmarks/bench_skip.py` (quote `cat /proc/loadavg` with the numbers).
"""

from __future__ import annotations

import statistics
import time

import torch

from ampx.scaling.stepping import _standin


def _model(n: int) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(64)) for _ in range(n)]


def standin(opt: torch.optim.Optimizer) -> None:
    type(opt).step.__wrapped__(_standin(opt))  # type: ignore[attr-defined]


def empty_groups(opt: torch.optim.Optimizer) -> None:
    saved = [g["params"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["params"] = []
    try:
        type(opt).step.__wrapped__(opt)  # type: ignore[attr-defined]
    finally:
        for g, params in zip(opt.param_groups, saved):
            g["params"] = params


def grads_none(opt: torch.optim.Optimizer) -> None:
    saved = [(p, p.grad) for g in opt.param_groups for p in g["params"]]
    for p, _ in saved:
        p.grad = None
    type(opt).step.__wrapped__(opt)  # type: ignore[attr-defined]
    for p, grad in saved:
        p.grad = grad


def main(n_params: int = 400, rounds: int = 30, inner: int = 20) -> None:
    params = _model(n_params)
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # state exists, as in training
    mechanisms = {"standin": standin, "empty_groups": empty_groups, "grads_none": grads_none}
    times: dict[str, list[float]] = {k: [] for k in mechanisms}
    for _ in range(rounds):
        for name, fn in mechanisms.items():  # interleaved
            start = time.perf_counter()
            for _ in range(inner):
                fn(opt)
            times[name].append((time.perf_counter() - start) / inner * 1e6)
    base = statistics.median(times["grads_none"])
    for name, values in times.items():
        med = statistics.median(values)
        print(f"{name:13s} {med:9.1f} us/skipped step  ratio {med / base:5.2f}")


if __name__ == "__main__":
    main()
