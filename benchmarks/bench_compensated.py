"""The compensated (Kahan) AdamW step: ampx's native kernel against torch's own AdamW.

One optimizer step (no forward/backward) over the parameters of bench_training.py's model (a
4-layer transformer encoder, d_model 512, 8 heads, FFN 2048: 48 tensors, 12.6M elements;
`--layers` changes the depth), CPU. Configurations, all in one process, interleaved round by
round (each round runs every configuration `--steps` times and keeps its median step time;
the result is the median over `--rounds` rounds):

    native bf16+c       ampx._ext.compensated_adam_ (native): bf16 w and c, bf16 grads,
                        float32 moments (`--state bf16`: bf16 moments)
    reference bf16+c    the same through ampx._reference_compensated (pure torch)
    torch foreach bf16  torch.optim.AdamW(foreach=True) on plain bf16 parameters
    torch fused bf16    torch.optim.AdamW(fused=True) on plain bf16 parameters
    torch foreach fp32  torch.optim.AdamW(foreach=True) on float32 parameters
    torch fused fp32    torch.optim.AdamW(fused=True) on float32 parameters

Ratios are against torch's fused fp32 step (the usual full-precision baseline) and torch's
fused bf16 step. The 1-minute load average is printed before and after: on a shared machine
quote it with the numbers.

Memory: the peak of the bytes that torch's CPU allocator holds live during one step, above
what was live before it (torch.profiler with profile_memory=True; allocations outside torch's
allocator, such as the native kernel's small work-item list, are not seen). The native kernel
reads and writes the tensors in place and allocates no tensor, so its row is 0.

Run::

    python benchmarks/bench_compensated.py [--rounds 5] [--steps 5] [--threads 1]
        [--layers 4] [--state fp32|bf16]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from ampx import _ext
from ampx import _reference_compensated as spec

Step = Callable[[], None]
LR, BETAS, EPS, WD = 1e-4, (0.9, 0.999), 1e-8, 0.01


def model_params(layers: int) -> list[torch.Tensor]:
    layer = nn.TransformerEncoderLayer(512, 8, dim_feedforward=2048, dropout=0.0,
                                       batch_first=True)
    model = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    return [p.detach() for p in model.parameters()]


def compensated(params: list[torch.Tensor], state: torch.dtype,
                fn: Callable[..., None]) -> Step:
    w = [p.to(torch.bfloat16) for p in params]
    c = [(p - h.float()).to(torch.bfloat16) for p, h in zip(params, w)]
    g = [(torch.randn_like(p) * 1e-2).to(torch.bfloat16) for p in params]
    m = [torch.zeros_like(p, dtype=state) for p in params]
    v = [torch.zeros_like(p, dtype=state) for p in params]
    t = [0]

    def step() -> None:
        t[0] += 1
        fn(w, c, g, m, v, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD,
           decoupled=True, maximize=False, step_size=LR / (1 - BETAS[0] ** t[0]),
           bias2_sqrt=math.sqrt(1 - BETAS[1] ** t[0]))
    return step


def torch_adamw(params: list[torch.Tensor], dtype: torch.dtype, fused: bool) -> Step:
    ps = [nn.Parameter(p.to(dtype)) for p in params]
    for p in ps:
        p.grad = (torch.randn_like(p) * 1e-2)
    opt = torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                            foreach=not fused, fused=fused or None)
    return opt.step


def step_time(step: Step, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_bytes(step: Step) -> int:
    """Peak bytes live in torch's CPU allocator during one step, above the start."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.events() if e.cpu_memory_usage != 0),
                    key=lambda e: e.time_range.start)
    live = top = 0
    for e in events:
        live += e.cpu_memory_usage
        top = max(top, live)
    return top


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--state", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory probe")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if _ext._native_module() is None:
        raise SystemExit(f"the native extension is not active ({_ext.IMPORT_ERROR}): run "
                         "`python -m ampx build-ext` first")
    params = model_params(args.layers)
    state = torch.float32 if args.state == "fp32" else torch.bfloat16
    configs: dict[str, Step] = {
        "native bf16+c": compensated(params, state, _ext.compensated_adam_),
        "reference bf16+c": compensated(params, state, spec.compensated_adam_),
        "torch foreach bf16": torch_adamw(params, torch.bfloat16, fused=False),
        "torch fused bf16": torch_adamw(params, torch.bfloat16, fused=True),
        "torch foreach fp32": torch_adamw(params, torch.float32, fused=False),
        "torch fused fp32": torch_adamw(params, torch.float32, fused=True),
    }
    numel = sum(p.numel() for p in params)
    print(f"{len(params)} tensors, {numel:,} elements; threads {args.threads}; moments "
          f"{args.state}; {args.rounds} rounds x {args.steps} steps; load before "
          f"{os.getloadavg()[0]:.2f}")
    for step in configs.values():  # warm-up (and the optimizers' state)
        step()
    medians: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, step in configs.items():
            medians[name].append(step_time(step, args.steps))
    result = {name: statistics.median(ts) for name, ts in medians.items()}
    memory = {} if args.no_memory else {name: peak_bytes(s) for name, s in configs.items()}
    base32, base16 = result["torch fused fp32"], result["torch fused bf16"]
    print(f"{'configuration':20} {'ms/step':>9} {'vs fused fp32':>14} {'vs fused bf16':>14} "
          f"{'peak MiB':>9}")
    for name, t in result.items():
        mib = f"{memory[name] / 2**20:9.1f}" if memory else f"{'-':>9}"
        print(f"{name:20} {t * 1e3:9.2f} {t / base32:13.2f}x {t / base16:13.2f}x {mib}")
    print(f"load after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
