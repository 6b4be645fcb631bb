"""One O2 step of a model with many small parameters against plain torch (issue 39 item 4).

The reference O2 master -> model copy used to be recorded by autograd (torch runs step hooks
outside the optimizer's `no_grad`, and the masters require grad) with one node per tensor,
each saving the whole list: 10k parameters took 3-4 GB and about 20 s for one step. Target:
one O2 step within 2x plain torch's time, adding under 50 MiB.

Two models of `--params` float32 parameters of `--size` elements (same values): plain torch
(fp32, SGD) and ampx O2 (bf16, SGD, fp32 masters). Each round times, per configuration,
`optimizer.step()` alone (`step`) and a whole training step (zero_grad + forward + backward
through `scale_loss` + step: `train`). Rounds alternate the order of the configurations; the
table gives medians, spreads (25th-75th percentile) and the median of the per-round O2/torch
ratios. The memory a step adds is measured in a fresh process per configuration (memory freed
by earlier steps would otherwise be reused unseen): the RSS peak of its first
`optimizer.step()` above the RSS before it (`/proc/self/status` VmHWM, reset through
`/proc/self/clear_refs`). The kernel backend is
the reference unless `--backend native` (AMPX_DISABLE_EXT is set before ampx loads). Run::

    python benchmarks/bench_many_params.py [--params 10000] [--reps 7] [--backend reference]

and quote the load average it prints.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

_STATUS = Path("/proc/self/status")


def _kib(field: str) -> int:
    match = re.search(rf"{field}:\s+(\d+)", _STATUS.read_text())
    return int(match.group(1)) if match else 0


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class Many(nn.Module):
    """`n` parameters of `size` elements; the forward touches each once."""

    def __init__(self, n: int, size: int) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(size) / size) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([(x * w).sum() for w in self.weights]).sum()


class Config:
    """One configuration: its model, optimizer and (O2) session."""

    def __init__(self, name: str, n: int, size: int) -> None:
        import ampx

        torch.manual_seed(0)
        self.name = name
        self.model: nn.Module = Many(n, size)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.amp = None
        if name == "O2":
            self.amp = ampx.Amp("O2", dtype=torch.bfloat16, verbosity=0)
            self.model, self.opt = self.amp.initialize(self.model, self.opt)
        self.x = torch.randn(size)

    def backward(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(self.x).float()
        if self.amp is None:
            loss.backward()
            return
        with self.amp.scale_loss(loss, self.opt) as scaled:
            scaled.backward()

    def step_adds(self) -> float:
        """MiB the RSS peak of one `optimizer.step()` rises above the RSS before it."""
        self.backward()
        rss = _kib("VmRSS")
        _reset_peak()
        self.opt.step()
        return (_kib("VmHWM") - rss) / 1024

    def round(self) -> tuple[float, float]:
        """(step s, whole training step s)."""
        self.backward()
        start = time.perf_counter()
        self.opt.step()
        step = time.perf_counter() - start
        start = time.perf_counter()
        self.backward()
        self.opt.step()
        return step, time.perf_counter() - start


def _spread(values: list[float], fmt: str) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return f"{q[1]:{fmt}} ({q[0]:{fmt}}-{q[2]:{fmt}})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=10_000)
    parser.add_argument("--size", type=int, default=8)
    parser.add_argument("--reps", type=int, default=7, help="timed rounds")
    parser.add_argument("--backend", choices=("reference", "native"), default="reference")
    parser.add_argument("--child", choices=("torch", "O2"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.backend == "reference":
        os.environ["AMPX_DISABLE_EXT"] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ampx import _ext

    if args.child:  # one fresh process: the memory of its first step
        print(f"{Config(args.child, args.params, args.size).step_adds():.1f}")
        return
    print(f"torch {torch.__version__}, ampx kernels {_ext.BACKEND}, {args.params} parameters "
          f"of {args.size}, {torch.get_num_threads()} threads; load {os.getloadavg()}")
    if not _reset_peak():
        print("(cannot reset the RSS peak here: the added-memory column is an upper bound)")
    added = {}
    for name in ("torch", "O2"):
        child = [sys.executable, __file__, "--child", name, "--params", str(args.params),
                 "--size", str(args.size), "--backend", args.backend]
        added[name] = subprocess.run(child, check=True, capture_output=True, text=True,
                                     timeout=3600).stdout.split()[-1]
    configs = [Config("torch", args.params, args.size), Config("O2", args.params, args.size)]
    for config in configs:  # warm-up: optimizer state, masters in use
        config.round()
    results: dict[str, list[tuple[float, float]]] = {c.name: [] for c in configs}
    for rep in range(args.reps):
        for config in configs if rep % 2 == 0 else configs[::-1]:
            results[config.name].append(config.round())
    print("| config | step ms | train step ms | first step adds MiB |")
    print("| --- | --- | --- | --- |")
    for name, rows in results.items():
        step, train = zip(*rows)
        print(f"| {name} | {_spread([s * 1e3 for s in step], '.1f')} | "
              f"{_spread([t * 1e3 for t in train], '.1f')} | {added[name]} |")
    torch_rows, o2_rows = results["torch"], results["O2"]
    for label, i in (("step", 0), ("train step", 1)):
        ratios = [b[i] / a[i] for a, b in zip(torch_rows, o2_rows)]
        print(f"O2/torch {label}: {_spread(ratios, '.2f')}")
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
