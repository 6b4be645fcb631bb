"""Peak memory of training: fp32, torch.autocast, ampx O1 and ampx O2 (CPU, bf16 by default).

Each configuration runs in a process of its own (the allocator's state of one would otherwise
shape the next): torch and ampx are imported and the model and its optimizer are built before
the baseline is read (torch's optimizer imports dynamo then, in every configuration); then
ampx's `initialize` runs (O1, O2) and 5 AdamW steps (zero_grad, forward, loss, backward
through `scale_loss` for ampx, step). The number is the process's peak resident set
(`ru_maxrss`) above that baseline, in MiB: everything `initialize` and training add on top of
the built model (what `initialize` imports, O2's copies, gradients, optimizer state,
activations kept for backward, casts, ampx's bookkeeping). glibc's allocator keeps freed
memory mapped, so the peak is what matters, not what is resident afterwards.

Models (issue #21): an MLP of 8 x Linear(1024) (ReLU between), batch 64; a 4-layer
transformer encoder (d_model 512, 8 heads, FFN 2048, dropout off), sequence 128, batch 8.

Run::

    python benchmarks/bench_memory.py [--dtype bf16] [--repeat 3] [--steps 5] [--seq 128]

`--seq` sets the encoder's sequence length (bf16 matmuls are slow on CPUs without native
bf16: a shorter sequence keeps the run short; say so with the numbers).

Targets (issue #21): O1 <= 1.05 x autocast, O2 <= autocast. `--repeat` runs each
configuration that many times (separate processes), interleaved, and reports the medians.
The peak of one run moves by several MiB between identical runs: address-space randomization
and the hash seed change the order of allocations, and glibc's heap fragments differently.
So run i of every configuration gets the same `PYTHONHASHSEED` and, where util-linux's
`setarch -R` works, no address randomization: each configuration starts alike, and the
ratios are the median of the per-run ratios (paired runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys

from _child_step import rss_mib as _rss_mib  # benchmarks/ is sys.path[0]
from _child_step import train_step

CONFIGS = ("fp32", "autocast", "O1", "O2")
MODELS = {"mlp": "MLP 8 x Linear(1024), batch 64",
          "encoder": "encoder 4 x 512, batch 8"}


def child(model_key: str, config: str, dtype_name: str, steps: int = 5,
          seq: int = 128) -> dict[str, float]:
    """Runs in the child process: the peak above the baseline, in MiB."""
    import torch
    from torch import nn

    import ampx

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float16
    if model_key == "mlp":
        layers: list[nn.Module] = []
        for _ in range(8):
            layers += [nn.Linear(1024, 1024), nn.ReLU()]
        model: nn.Module = nn.Sequential(*layers)
        x, y = torch.randn(64, 1024), torch.randn(64, 1024)
    else:
        layer = nn.TransformerEncoderLayer(512, 8, dim_feedforward=2048, dropout=0.0,
                                           batch_first=True)
        model = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        x, y = torch.randn(8, seq, 512), torch.randn(8, seq, 512)
    opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    baseline = _rss_mib()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    amp = None
    if config in ("O1", "O2"):
        amp = ampx.Amp(config, dtype=dtype, verbosity=0)
        model, opt = amp.initialize(model, opt)
    for _ in range(steps):
        train_step(model, opt, x, y, amp,
                   autocast_dtype=dtype if config == "autocast" else None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"above": peak - baseline, "baseline": baseline, "peak_before": peak_before}


def _fixed_layout() -> list[str]:
    """The command prefix that turns address-space randomization off (util-linux `setarch`),
    or nothing where there is none."""
    setarch = shutil.which("setarch")
    if setarch is None or not sys.platform.startswith("linux"):
        return []
    probe = subprocess.run([setarch, platform.machine(), "-R", "true"], capture_output=True)
    return [setarch, platform.machine(), "-R"] if probe.returncode == 0 else []


def run_one(model_key: str, config: str, dtype: str, steps: int, seq: int, run: int,
            prefix: list[str]) -> float:
    """One child process: run `run` of every configuration has the same hash seed (and, with
    `prefix`, the same address layout), so glibc's heap starts each configuration alike."""
    env = dict(os.environ, PYTHONHASHSEED=str(run + 1))
    out = subprocess.run([*prefix, sys.executable, __file__, "--child", model_key, config,
                          dtype, str(steps), str(seq)], check=True, capture_output=True,
                         text=True, env=env)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["above"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=128, help="the encoder's sequence length")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        key, config, dtype, steps, seq = args.child
        print(json.dumps(child(key, config, dtype, int(steps), int(seq))))
        return
    print(f"peak RSS above the built model (before initialize) over {args.steps} AdamW steps, "
          f"{args.dtype}, encoder sequence {args.seq}, one process per "
          f"run, median of {args.repeat}; load average before: "
          + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    print()
    print("| model | fp32 MiB | autocast MiB | O1 MiB | O2 MiB | O1/autocast | O2/autocast |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    prefix = _fixed_layout()
    for key in args.models:
        runs: dict[str, list[float]] = {c: [] for c in CONFIGS}
        for run in range(args.repeat):  # interleaved: run i of each configuration in turn
            for c in CONFIGS:
                runs[c].append(run_one(key, c, args.dtype, args.steps, args.seq, run, prefix))
        peaks = {c: statistics.median(v) for c, v in runs.items()}
        ratios = {c: statistics.median(a / b for a, b in zip(runs[c], runs["autocast"]))
                  for c in ("O1", "O2")}
        print(f"| {MODELS[key]} | " + " | ".join(f"{peaks[c]:.0f}" for c in CONFIGS)
              + f" | {ratios['O1']:.2f} | {ratios['O2']:.2f} |", flush=True)
    print()
    print("address randomization " + ("off (setarch -R)" if prefix else "on (no setarch)")
          + "; run i of every configuration with PYTHONHASHSEED=i+1; ratios: median of the "
          "per-run ratios")
    print()
    print("load average after: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))


if __name__ == "__main__":
    main()
