"""Training step time and peak memory: fp32, torch.autocast and ampx O1/O2/O3, side by side.

The model is a 4-layer transformer encoder (d_model 512, 8 heads, FFN 2048) on batch 16 x
sequence 128, trained with AdamW. Each configuration runs in its own process, one after the
other, so peak memory is not shared and no configuration warms the caches of another.

Step time: the median over the timed steps (after warm-up steps) of a full step
(zero_grad, forward, loss, backward, optimizer step), in wall time and in process CPU time
(all threads). With `--rounds N` every configuration runs N times, interleaved, and the median
of the N medians is reported. On a shared machine use `--threads 1 --rounds 2`: wall time
then suffers from the other processes, but CPU time of a single thread does not (with several
threads OpenMP's spin-waiting inflates it under contention).

Peak memory is measured in a separate process per configuration (so that the allocator
setting below does not slow the timed run). On CPU there is no allocator counter, so the
worker measures resident memory, with glibc's mmap threshold fixed at 64 KiB
(MALLOC_MMAP_THRESHOLD_) so that freed tensors go back to the kernel instead of staying in
malloc's heap: resident memory then follows the live tensors. After the model and the
optimizer exist (the fp32 weights, identical in every configuration) the worker resets the
kernel's high-water mark (`/proc/self/clear_refs`, "5") and records the resident set as the
baseline; the peak is the high-water mark (VmHWM) after a warm-up step and two more steps,
minus that baseline: every byte a configuration adds on top of the fp32 model (cast copies,
master weights, gradients, optimizer state, activations, workspace). Where clear_refs is
unavailable the peak is ru_maxrss minus the same baseline. On CUDA,
torch.cuda.max_memory_allocated is used instead.

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

CONFIGS = ("fp32", "autocast", "O1", "O2", "O3", "O3+kahan")
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
    if args.half_sdpa:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
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
        level, _, compensation = args.config.partition("+")  # O3+kahan: compensated weights
        model, opt = ampx.initialize(model, opt, opt_level=level, dtype=dtype,
                                     compensation=compensation or None, verbosity=0)
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
    times, cpu_times = [], []
    for _ in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
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
            "cpu_s": statistics.median(cpu_times),
            "peak_bytes": peak, "memory_method": method, "threads": torch.get_num_threads(),
            "params": sum(p.numel() for p in model.parameters())}


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
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every configuration this many times, interleaved")
    parser.add_argument("--half-sdpa", action="store_true",
                        help="let torch's math attention reduce in fp16/bf16 instead of "
                        "upcasting to fp32 (torch.backends.cuda."
                        "allow_fp16_bf16_reduction_math_sdp), in every configuration")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        args.config = args.worker
        print(json.dumps(worker(args)))
        return 0

    common = ["--device", args.device, "--dtype", args.dtype, "--batch", str(args.batch),
              "--seq", str(args.seq), "--d-model", str(args.d_model), "--layers",
              str(args.layers), "--threads", str(args.threads)]
    if args.half_sdpa:
        common.append("--half-sdpa")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    mem_env = dict(env, MALLOC_MMAP_THRESHOLD_="65536")

    def run(config: str, extra: list[str], run_env: dict[str, str]) -> dict[str, Any]:
        proc = subprocess.run([sys.executable, __file__, "--worker", config, *common, *extra],
                              capture_output=True, text=True, env=run_env)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)
            raise SystemExit(proc.returncode)
        return json.loads(proc.stdout.strip().splitlines()[-1])

    timings: dict[str, list[float]] = {c: [] for c in args.configs}
    cpu: dict[str, list[float]] = {c: [] for c in args.configs}
    for _ in range(args.rounds):
        for config in args.configs:
            r = run(config, ["--steps", str(args.steps), "--warmup", str(args.warmup)], env)
            timings[config].append(r["step_s"])
            cpu[config].append(r["cpu_s"])
    results: dict[str, dict[str, Any]] = {}
    for config in args.configs:
        mem = run(config, ["--steps", "2", "--warmup", "1"], mem_env)
        results[config] = dict(mem, step_s=statistics.median(timings[config]),
                               cpu_s=statistics.median(cpu[config]), rounds=timings[config])

    fp32 = results.get("fp32")
    auto = results.get("autocast")
    any_result = next(iter(results.values()))
    print(f"4-layer transformer encoder d={args.d_model} seq={args.seq} batch={args.batch}, "
          f"AdamW, {args.device} {args.dtype}, {any_result['threads']} threads, median of "
          f"{args.steps} steps after {args.warmup} warm-up ({args.rounds} round(s)); peak "
          f"memory = {any_result['memory_method']} above the fp32 model+optimizer baseline"
          f"{'; half-precision math SDPA' if args.half_sdpa else ''}")
    print()
    print("| config | step wall (ms) | vs fp32 | vs autocast | step CPU (ms) | vs fp32 "
          "| vs autocast | peak mem (MiB) | vs fp32 | vs autocast |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for config, r in results.items():
        cells = [config]
        for key, scale in (("step_s", 1e3), ("cpu_s", 1e3), ("peak_bytes", 2.0**-20)):
            cells += [f"{r[key] * scale:.0f}",
                      _ratio(r[key], fp32[key]) if fp32 else "-",
                      _ratio(r[key], auto[key]) if auto else "-"]
        print("| " + " | ".join(cells) + " |")
    if "O2" in results and fp32 and auto:
        o2 = results["O2"]
        print()
        for key, label in (("step_s", "wall"), ("cpu_s", "CPU")):
            ratio = o2[key] / auto[key]
            print(f"target O2 step {label} time <= 0.9x autocast: {ratio:.2f}x "
                  f"({'met' if ratio <= 0.9 else 'NOT met'})")
        ratio = o2["peak_bytes"] / fp32["peak_bytes"]
        print(f"target O2 peak memory <= 0.7x fp32: {ratio:.2f}x "
              f"({'met' if ratio <= 0.7 else 'NOT met'})")
    kahan, o3, o2 = (results.get(c) for c in ("O3+kahan", "O3", "O2"))
    if kahan and o3 and o2:  # issue 40's targets
        print()
        extra = (kahan["peak_bytes"] - o3["peak_bytes"]) / kahan["params"]
        print(f"target O3+kahan peak <= O3's + 2 bytes/param: {extra:+.2f} bytes/param "
              f"({'met' if extra <= 2 else 'NOT met'}); < O2's: "
              f"{kahan['peak_bytes'] / o2['peak_bytes']:.2f}x "
              f"({'met' if kahan['peak_bytes'] < o2['peak_bytes'] else 'NOT met'})")
        for key, label in (("step_s", "wall"), ("cpu_s", "CPU")):
            ratio = kahan[key] / o3[key]
            print(f"target O3+kahan step {label} time <= 1.1x O3: {ratio:.2f}x "
                  f"({'met' if ratio <= 1.1 else 'NOT met'})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
