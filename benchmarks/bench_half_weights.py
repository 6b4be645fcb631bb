"""Held-out loss of half weights: fp32, O2, O3 and O3 with compensation="kahan" (issue 40).

A 3-layer GPT-2-style language model (written out below: token and position embeddings,
pre-LayerNorm blocks of causal self-attention and a GELU MLP, a tied head) learns the bytes
of the Python standard library's own .py files. The files are split by file: every tenth
file (sorted by path) is held out, the rest is training text. Each configuration trains the
same model from the same seed on the same batches with AdamW (bf16 by default), then reports
the mean next-byte cross-entropy on fixed held-out windows, evaluated with the model as
trained (the half model for O2/O3), and its gap to fp32.

In bf16 an update smaller than 2^-9 of a weight is rounded away: at small learning rates
plain O3 loses most of its updates (LayerNorm gains near 1.0 never move at lr 1e-4), O2
keeps them in float32 masters, and O3+kahan keeps them in a half compensation per weight.

Measured (CPU, 2 cores shared, load average 12-15; ``--threads 1``, one process per lr,
defaults otherwise: 400 steps, bf16, seed 0; reference compensated kernels)::

    | lr   | config   | held-out loss | gap to fp32 |
    | 1e-3 | fp32     | 2.0936        | +0.00%      |
    | 1e-3 | O2       | 2.0899        | -0.18%      |
    | 1e-3 | O3       | 2.1198        | +1.25%      |
    | 1e-3 | O3+kahan | 2.0827        | -0.52%      |
    | 1e-4 | fp32     | 2.5753        | +0.00%      |
    | 1e-4 | O2       | 2.5750        | -0.01%      |
    | 1e-4 | O3       | 2.8515        | +10.73%     |
    | 1e-4 | O3+kahan | 2.5745        | -0.03%      |

Usage::

    python benchmarks/bench_half_weights.py                     # lr 1e-3 and 1e-4, 400 steps
    python benchmarks/bench_half_weights.py --steps 100 --lr 1e-4
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("fp32", "O2", "O3", "O3+kahan")


# -- data ---------------------------------------------------------------------------------------

def stdlib_bytes(limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) byte tensors: the stdlib's .py files, every tenth file held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts
                   and "test" not in p.parts and "tests" not in p.parts)
    train, held = bytearray(), bytearray()
    for i, path in enumerate(files):
        target = held if i % 10 == 0 else train
        if len(target) >= (limit // 8 if target is held else limit):
            continue
        try:
            target += path.read_bytes() + b"\n"
        except OSError:
            continue
    as_tensor = (lambda b: torch.tensor(list(b), dtype=torch.long))  # noqa: E731
    return as_tensor(train[:limit]), as_tensor(held[: limit // 8])


def windows(data: torch.Tensor, count: int, ctx: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - ctx - 1, (count,), generator=gen)
    return torch.stack([data[s: s + ctx + 1] for s in starts.tolist()])


# -- the model ----------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2's shape at a small size: 256 byte tokens, learned positions, tied head."""

    def __init__(self, d: int = 128, layers: int = 3, heads: int = 4, ctx: int = 64) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.apply(self._init)
        for block in self.blocks:  # GPT-2's scaled init of the residual projections
            for layer in (block.proj, block.out):
                nn.init.normal_(layer.weight, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tok.weight.t()


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1]).float()
    return nn.functional.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))


# -- one configuration ---------------------------------------------------------------------------

def train(config: str, lr: float, args: argparse.Namespace, data: tuple) -> float:
    """Train one configuration; returns its held-out loss."""
    sys.path.insert(0, str(REPO))
    import ampx

    train_data, held = data
    torch.manual_seed(args.seed)
    model = GPT(ctx=args.ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    amp = None
    if config != "fp32":
        level, _, compensation = config.partition("+")
        amp = ampx.Amp(level, dtype=args.dtype, compensation=compensation or None,
                       verbosity=0)
        model, opt = amp.initialize(model, opt)
    gen = torch.Generator().manual_seed(args.seed + 1)
    for _ in range(args.steps):
        batch = windows(train_data, args.batch, args.ctx, gen)
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, batch)
        if amp is None:
            loss.backward()
        else:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
    eval_gen = torch.Generator().manual_seed(12345)
    with torch.no_grad():
        losses = [_loss(model, windows(held, args.batch, args.ctx, eval_gen)).item()
                  for _ in range(args.eval_batches)]
    if amp is not None:
        amp.restore()
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-3, 1e-4])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--ctx", type=int, default=64)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--bytes", type=int, default=2_000_000, help="training text size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    data = stdlib_bytes(args.bytes)
    print(f"GPT-2-style LM, 3 layers d=128, ctx {args.ctx}, batch {args.batch}, AdamW "
          f"(wd 0.01), {args.steps} steps, {args.dtype}, seed {args.seed}; stdlib .py bytes: "
          f"{data[0].numel()} train / {data[1].numel()} held-out (split by file)")
    print()
    print("| lr | config | held-out loss | gap to fp32 | train time (s) |")
    print("|---|---|---:|---:|---:|")
    for lr in args.lr:
        base = None
        for config in args.configs:
            t0 = time.perf_counter()
            loss = train(config, lr, args, data)
            elapsed = time.perf_counter() - t0
            if config == "fp32":
                base = loss
            gap = f"{100 * (loss - base) / base:+.2f}%" if base is not None else "-"
            print(f"| {lr:g} | {config} | {loss:.4f} | {gap} | {elapsed:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
