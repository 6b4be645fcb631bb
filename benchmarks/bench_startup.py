"""Start-up as users meet it: imports, `initialize` at O0-O3 and the first step, fresh processes.

Each run is a process of its own, which times (and reads the resident set around) `import
torch`, `import ampx`, `ampx.initialize` of a 10-layer MLP (10 x Linear(512), ReLU between,
AdamW) and its first training step (forward, loss, backward through `scale_loss`, step),
beside the same first step under `torch.autocast` with no ampx session. It also counts the
modules of torch's compiler (`torch._dynamo*`, `torch._inductor*`) loaded at the end. Torch's
optimizers import dynamo when constructed (`add_param_group` is wrapped by
`torch._disable_dynamo`), before `initialize`, in every configuration; O1 imports no more of
the compiler (no inductor), see docs/compile.md.

RSS is the resident set read from /proc/self/statm before and after each phase, in MiB.
Bytecode is cached first (one discarded run with PYTHONDONTWRITEBYTECODE unset), as in an
installed package; a process compiling ampx's sources would add about 0.2 s to `initialize`.

Run::

    python benchmarks/bench_startup.py [--runs 3] [--dtype bf16]

Target (issue #30): O1's `initialize` <= 100 ms and <= 10 MiB, with no compiler module.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _child_step import rss_mib as _rss_mib  # benchmarks/ is sys.path[0]
from _child_step import train_step

CONFIGS = ("O0", "O1", "O2", "O3", "autocast")


def child(config: str, dtype_name: str) -> dict[str, float]:
    """One fresh process: times (s) and RSS deltas (MiB) of each phase."""
    result: dict[str, float] = {}
    rss, t = _rss_mib(), time.perf_counter()
    import torch
    result["import torch s"], result["import torch MiB"] = time.perf_counter() - t, _rss_mib() - rss
    rss, t = _rss_mib(), time.perf_counter()
    import ampx
    result["import ampx s"], result["import ampx MiB"] = time.perf_counter() - t, _rss_mib() - rss

    from torch import nn

    torch.manual_seed(0)
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float16
    layers: list[nn.Module] = []
    for _ in range(10):
        layers += [nn.Linear(512, 512), nn.ReLU()]
    model: nn.Module = nn.Sequential(*layers)
    opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(64, 512), torch.randn(64, 512)

    rss, t = _rss_mib(), time.perf_counter()
    amp = None
    if config != "autocast":
        amp = ampx.Amp(config, dtype=dtype, verbosity=0)
        model, opt = amp.initialize(model, opt)
    result["initialize s"], result["initialize MiB"] = time.perf_counter() - t, _rss_mib() - rss

    rss, t = _rss_mib(), time.perf_counter()
    train_step(model, opt, x, y, amp, autocast_dtype=dtype if amp is None else None)
    result["first step s"], result["first step MiB"] = time.perf_counter() - t, _rss_mib() - rss
    for part in ("dynamo", "inductor"):
        result[f"{part} modules"] = sum(name.startswith(f"torch._{part}") for name in sys.modules)
    return result


def run_one(config: str, dtype: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out = subprocess.run([sys.executable, __file__, "--child", config, dtype], check=True,
                         capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    run_one("O1", args.dtype)  # writes the bytecode caches
    print(f"fresh processes, 10 x Linear(512) MLP, AdamW, batch 64, {args.dtype}; {args.runs} "
          "runs per configuration, interleaved; each cell: the runs' values; load average "
          "before: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in args.configs}
    for _ in range(args.runs):
        for config in args.configs:
            runs[config].append(run_one(config, args.dtype))
    columns = list(runs[args.configs[0]][0])
    print()
    print("| config | " + " | ".join(columns) + " |")
    print("| --- " * (len(columns) + 1) + "|")
    for config, results in runs.items():
        cells = []
        for col in columns:
            values = [r[col] for r in results]
            unit = 1000 if col.endswith(" s") else 1
            fmt = "{:.0f}" if unit == 1000 or col.endswith("modules") else "{:.1f}"
            cells.append(" / ".join(fmt.format(v * unit) for v in values))
        print(f"| {config} | " + " | ".join(cells) + " |")
    print("\n(times in ms)")
    if "O1" in runs and "O2" in runs:
        o1 = statistics.median(r["initialize s"] for r in runs["O1"])
        o2 = statistics.median(r["initialize s"] for r in runs["O2"])
        print(f"O1 / O2 initialize time (medians): {o1 / o2:.2f}")
    print("load average after: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))


if __name__ == "__main__":
    main()
