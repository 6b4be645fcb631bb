"""Training step time and peak memory: fp32, torch.autocast and ampx O1/O2/O3, side by side.

The model is a 4-layer transformer encoder (d_model 512, 8 heads, FFN 2048) on batch 16 x
sequence 128, trained with AdamW. Each configuration runs in its own process, one after the
other, so peak memory is not shared and no configuration warms the caches of another.

Step time: the median over the timed steps (after warm-up steps) of a full step
(zero_grad, forward, loss, backward, optimizer step).

Peak memory: on CPU there is no allocator counter, so the worker measures resident memory.
After the model and the optimizer exist (the fp32 weights, identical in every configuration)
it resets the kernel's high-water mark (`/proc/self/clear_refs`, "5") and records the
resident set as the baseline; the peak is the high-water mark (VmHWM) after the timed steps
minus that baseline: every byte a configuration adds on top of the fp32 model (cast copies,
gradients, optimizer state, activations, workspace). Where clear_refs is unavailable the
baseline is taken the same way and the peak is ru_maxrss (which then may include import-time
peaks). On CUDA, torch.cuda.max_memory_allocated is used instead.

Usage::

    python benchmarks/bench_training.py                  # CPU, bf16, all configurations
    python benchmarks/bench_training.py --steps 20 --configs fp32 autocast O2
    python benchmarks/bench_training.py --device cuda --dtype fp16

Targets (issue #3, CPU with bf16): O2 step time <= 0.9x autocast; O2 peak memory <= 0.7x fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CONFIGS = ("fp32", "autocast", "O1", "O2", "O3")
REPO = Path(__file__).resolve().parents[1]


# -- worker (one configuration, in its own process) ---------------------------------------------

def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """Train `args.config` for warm-up + timed steps; returns the measurements."""
    import torch
    from torch import nn

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=args.d_model, nhead=8,
                                       dim_feedforward=4 * args.d_model, dropout=0.1,
                                       batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=args.layers,
                                  enable_nested_tensor=False).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(args.batch, args.seq, args.d_model, generator=g).to(device)
    y = torch.randn(args.batch, args.seq, args.d_model, generator=g).to(device)

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        exact = _reset_peak()
        base = (_status_kib("VmRSS") or 0) * 1024

    amp = None
    if args.config.startswith("O"):
        sys.path.insert(0, str(REPO))
        import ampx

        amp = ampx
        model, opt = ampx.initialize(model, opt, opt_level=args.config, dtype=dtype,
                                     verbosity=0)
    scaler = None
    if args.config == "autocast" and cuda and dtype == torch.float16:
        scaler = torch.amp.GradScaler("cuda")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        if args.config == "autocast":
            with torch.autocast(device.type, dtype=dtype):
                out = model(x)
            loss = nn.functional.mse_loss(out.float(), y)
        else:
            loss = nn.functional.mse_loss(model(x).float(), y)
        if amp is not None:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
        elif scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
        method = "cuda.max_memory_allocated"
    elif exact:
        peak = (_status_kib("VmHWM") or 0) * 1024 - base
        method = "VmHWM after clear_refs"
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
        method = "ru_maxrss"
    return {"config": args.config, "step_s": statistics.median(times), "min_s": min(times),
            "peak_bytes": peak, "memory_method": method, "threads": torch.get_num_threads()}


# -- driver -------------------------------------------------------------------------------------

def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        args.config = args.worker
        print(json.dumps(worker(args)))
        return 0

    results: dict[str, dict[str, Any]] = {}
    passthrough = ["--device", args.device, "--dtype", args.dtype, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--batch", str(args.batch), "--seq",
                   str(args.seq), "--d-model", str(args.d_model), "--layers", str(args.layers),
                   "--threads", str(args.threads)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    for config in args.configs:
        proc = subprocess.run([sys.executable, __file__, "--worker", config, *passthrough],
                              capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)
            return proc.returncode
        results[config] = json.loads(proc.stdout.strip().splitlines()[-1])

    fp32 = results.get("fp32")
    auto = results.get("autocast")
    any_result = next(iter(results.values()))
    print(f"4-layer transformer encoder d={args.d_model} seq={args.seq} batch={args.batch}, "
          f"AdamW, {args.device} {args.dtype}, {any_result['threads']} threads, median of "
          f"{args.steps} steps after {args.warmup} warm-up; peak memory = "
          f"{any_result['memory_method']} above the fp32 model+optimizer baseline")
    print()
    print("| config | step (ms) | vs fp32 | vs autocast | peak mem (MiB) | vs fp32 | vs autocast |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for config, r in results.items():
        ms = r["step_s"] * 1e3
        mib = r["peak_bytes"] / 2**20
        print(f"| {config} | {ms:.1f} | "
              f"{_ratio(r['step_s'], fp32['step_s']) if fp32 else '-'} | "
              f"{_ratio(r['step_s'], auto['step_s']) if auto else '-'} | {mib:.0f} | "
              f"{_ratio(r['peak_bytes'], fp32['peak_bytes']) if fp32 else '-'} | "
              f"{_ratio(r['peak_bytes'], auto['peak_bytes']) if auto else '-'} |")
    if "O2" in results and fp32 and auto:
        o2 = results["O2"]
        print()
        print(f"targets: O2 step <= 0.9x autocast: {o2['step_s'] / auto['step_s']:.2f}x "
              f"({'met' if o2['step_s'] <= 0.9 * auto['step_s'] else 'NOT met'}); "
              f"O2 peak memory <= 0.7x fp32: {o2['peak_bytes'] / fp32['peak_bytes']:.2f}x "
              f"({'met' if o2['peak_bytes'] <= 0.7 * fp32['peak_bytes'] else 'NOT met'})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
