"""A small transformer language model on real text, written as a legacy apex script.

It learns the bytes (256 tokens) of the Python standard library's own source files, which
are on every machine that runs Python: no download (`ampx.examples.data.stdlib_bytes`). Every
10th file (sorted by name) is held out; the held-out loss is evaluated every `--eval-every`
steps and reported with `ampx.log_metric("heldout_loss", ...)`, which is what `ampx sweep`
judges the opt levels by. `--data synthetic` trains on a random Markov chain instead. The
model is matmul-heavy (4 pre-norm layers, d_model 512, sequence 128), which is where bf16 pays
off on a CPU with AVX512-BF16/AMX and fp16/bf16 on a GPU.

Run it through ampx (which provides `apex.amp` when apex is not installed)::

    ampx run -O O2 --dtype bf16 ampx/examples/transformer_lm.py --steps 20

`--autocast` trains with plain torch.autocast + GradScaler instead of amp (the comparison row of
`ampx sweep`); it writes the same telemetry records as ampx when AMPX_TELEMETRY is set.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

if TYPE_CHECKING:
    from ampx.examples.data import Dataset

try:  # a legacy apex script; `ampx run` provides `apex.amp` when apex is not installed
    from apex import amp
except ImportError:  # imported or run without `ampx run`
    from ampx import amp


class TransformerLM(nn.Module):
    """A decoder-only transformer (pre-norm, causal self-attention, no dropout).

    Args:
        vocab: Vocabulary size.
        d_model: Width.
        layers: Number of transformer layers.
        heads: Attention heads.
        seq_len: Maximum sequence length.
    """

    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0,
                                       batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        mask = nn.Transformer.generate_square_subsequent_mask(seq_len)
        self.mask: torch.Tensor
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        hidden = self.embed(tokens) + self.pos[:length]
        mask = self.mask[:length, :length]
        for layer in self.layers:
            hidden = layer(hidden, src_mask=mask, is_causal=True)
        return self.head(self.norm(hidden))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's command line."""
    from ampx.examples.common import example_parser

    parser = example_parser(__doc__, steps=40, batch_size=8, lr=1e-3)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256,
                        help="tokens (the stdlib's bytes: 256; --data synthetic may use more)")
    parser.add_argument("--data", default="stdlib", choices=["stdlib", "synthetic"],
                        help="the standard library's source bytes (default) or a synthetic "
                             "Markov chain")
    parser.add_argument("--heldout-batches", type=int, default=3)
    return parser.parse_args(argv)


def load_data(args: argparse.Namespace) -> Dataset:
    """The training batches and the held-out split the options ask for."""
    from ampx.examples import data

    if args.data == "synthetic":
        return data.markov(args.vocab, args.seq_len, args.batch_size, 64, args.heldout_batches,
                           args.seed + 1)
    if args.vocab < 256:
        raise SystemExit("transformer_lm.py: --data stdlib needs --vocab 256 or more (bytes)")
    return data.stdlib_bytes(args.seq_len, args.batch_size, 256, args.heldout_batches,
                             args.seed + 1)


def main(argv: list[str] | None = None) -> None:
    """Train for `--steps` steps."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = TransformerLM(args.vocab, args.d_model, args.layers, max(1, args.d_model // 64),
                          args.seq_len).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    dataset = load_data(args)
    data = [(x.to(device), y.to(device)) for x, y in dataset.train]
    heldout = [(x.to(device), y.to(device)) for x, y in dataset.heldout]
    from ampx.examples.common import Evaluator, record_data

    record_data(dataset.describe())
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    evaluator = Evaluator(heldout, lm_metrics, args.steps, args.eval_every,
                          autocast=half if args.autocast else None, eval_mode=False)

    if args.autocast:
        from ampx.examples.common import train_autocast

        train_autocast(model, optimizer, data, args, lm_loss, evaluator)
        return

    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)
    for step in range(args.steps):
        tokens, targets = data[step % len(data)]
        logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        if step % args.log_interval == 0 or step == args.steps - 1:
            scale = amp._amp_state.loss_scalers[0].loss_scale()
            print(f"step {step:4d}  loss {loss.item():.4f}  scale {scale:g}", flush=True)
        evaluator.after(model, step + 1)
    if args.save:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "amp": amp.state_dict()}, args.save)


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy of one batch (the autocast loop's loss)."""
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def lm_metrics(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
               ) -> tuple[torch.Tensor, None, int]:
    """Summed next-token cross-entropy of one held-out batch, and its token count."""
    tokens, targets = batch
    logits = model(tokens).float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           reduction="sum")
    return loss, None, targets.numel()


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"done in {time.perf_counter() - started:.1f} s")
