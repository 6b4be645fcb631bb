"""fp16 training step time on one GPU: fp32, autocast+GradScaler, ampx O1, O2, O2 on the reference.

Run ``python benchmarks/bench_gpu.py`` on a CUDA machine after ``ampx build-ext
--require-cuda`` (``benchmarks/gpu_check.sh`` does both). Two models: a ResNet-18-like
convnet (batch 64, 224x224, SGD with momentum) and a stack of transformer encoder layers
(batch 16, 512 tokens, width 1024, AdamW). Five configurations per model, in one process,
interleaved: every round sets each configuration up afresh (same seed, same weights),
warms it up and times ``--steps`` steps with CUDA events; rounds alternate the order, and
the table shows the median step time over all rounds and its ratio to autocast. ``O2 ref``
is O2 with the native kernels switched off as ``AMPX_DISABLE_EXT=1`` would (this process
keeps one extension loaded, so the switch is made on ``ampx._ext``'s loaded state).

Writes the table to stdout and, with ``--out DIR`` (default ``$OUT`` when set), as
``bench_gpu.json`` and ``bench_gpu.md`` there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

try:
    from ampx import _ext
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ampx import _ext
from ampx.frontend import Amp

CONFIGS = ("fp32", "autocast", "O1", "O2", "O2 ref")


class Block(nn.Module):
    """ResNet basic block."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True), nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
            nn.BatchNorm2d(cout))
        self.skip = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def resnet18(classes: int = 1000) -> nn.Module:
    """ResNet-18's layout (2-2-2-2 basic blocks, 64..512 channels)."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                               nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


class Transformer(nn.Module):
    """Encoder layers and a linear head, a token-level regression loss."""

    def __init__(self, width: int = 1024, layers: int = 4) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(width, 16, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def workload(name: str, device: torch.device) -> tuple[Callable[[], nn.Module],
                                                       Callable[..., Any], Any, Any]:
    """(model factory, optimizer factory, input, target) of one model."""
    g = torch.Generator(device="cpu").manual_seed(0)
    if name == "resnet18":
        x = torch.randn(64, 3, 224, 224, generator=g).to(device)
        y = torch.randint(0, 1000, (64,), generator=g).to(device)
        return (resnet18, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), x, y)
    x = torch.randn(16, 512, 1024, generator=g).to(device)
    return (Transformer, lambda p: torch.optim.AdamW(p, lr=1e-4), x, torch.randn_like(x))


def loss_of(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "resnet18":
        return nn.functional.cross_entropy(out.float(), y)
    return nn.functional.mse_loss(out.float(), y)


@contextlib.contextmanager
def reference_kernels() -> Iterator[None]:
    """The loaded `ampx._ext` state with no native module, as AMPX_DISABLE_EXT=1 gives."""
    saved = _ext._state
    off = _ext._State()
    off.loaded, off.error = True, "switched off by bench_gpu.py (as AMPX_DISABLE_EXT=1)"
    _ext._state = off
    try:
        yield
    finally:
        _ext._state = saved


def stepper(config: str, name: str, device: torch.device
            ) -> tuple[Callable[[], None], Callable[[], None]]:
    """One training step of `config` on a fresh copy of model `name`, and its teardown."""
    make, make_opt, x, y = workload(name, device)
    torch.manual_seed(0)
    model = make().to(device)
    optimizer = make_opt(model.parameters())
    if config in ("fp32", "autocast"):
        enabled = config == "autocast"
        scaler = torch.amp.GradScaler("cuda", enabled=enabled)

        def plain() -> None:
            with torch.autocast("cuda", dtype=torch.float16, enabled=enabled):
                loss = loss_of(name, model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

        return plain, lambda: None
    stack = contextlib.ExitStack()
    if config == "O2 ref":
        stack.enter_context(reference_kernels())
    amp = Amp(config.split()[0], dtype="fp16", verbosity=0)
    model, optimizer = amp.initialize(model, optimizer)

    def amp_step() -> None:
        loss = loss_of(name, model(x), y)
        optimizer.zero_grad(set_to_none=True)
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()

    def close() -> None:
        amp.restore()
        stack.close()

    return amp_step, close


def time_steps(step: Callable[[], None], steps: int) -> list[float]:
    """Milliseconds per step, each timed with CUDA events."""
    out = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def bench(models: list[str], rounds: int, steps: int, warmup: int,
          device: torch.device) -> dict[str, dict[str, list[float]]]:
    times: dict[str, dict[str, list[float]]] = {m: {c: [] for c in CONFIGS} for m in models}
    for r in range(rounds):
        for name in models:
            for config in CONFIGS if r % 2 == 0 else CONFIGS[::-1]:
                step, close = stepper(config, name, device)
                try:
                    time_steps(step, warmup)
                    times[name][config] += time_steps(step, steps)
                finally:
                    close()
                print(f"bench_gpu: round {r + 1}/{rounds} {name} {config}: "
                      f"{statistics.median(times[name][config]):.2f} ms", file=sys.stderr,
                      flush=True)
    return times


def table(times: dict[str, dict[str, list[float]]]) -> str:
    lines = ["| model | " + " | ".join(f"{c} ms" for c in CONFIGS)
             + " | O1/autocast | O2/autocast | O2/O2 ref |",
             "| --- |" + " ---: |" * (len(CONFIGS) + 3)]
    for name, by_config in times.items():
        med = {c: statistics.median(v) for c, v in by_config.items()}
        lines.append(f"| {name} | " + " | ".join(f"{med[c]:.2f}" for c in CONFIGS)
                     + f" | {med['O1'] / med['autocast']:.2f} | "
                     f"{med['O2'] / med['autocast']:.2f} | {med['O2'] / med['O2 ref']:.2f} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,transformer")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default=os.environ.get("OUT"), help="directory for results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device visible", file=sys.stderr)
        return 2
    device = torch.device("cuda:0")
    torch.backends.cudnn.benchmark = True
    info = _ext.describe()
    header = (f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, kernels "
              f"{info['backend']} (CUDA kernels: {info['cuda_kernels']}, archs "
              f"{info.get('cuda_archs')}), {args.rounds} rounds x {args.steps} steps, median")
    print(header)
    times = bench(args.models.split(","), args.rounds, args.steps, args.warmup, device)
    text = table(times)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_gpu.md").write_text(header + "\n\n" + text + "\n")
        (out / "bench_gpu.json").write_text(json.dumps({"header": header, "ms": times},
                                                       indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
