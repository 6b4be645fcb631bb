"""A small transformer language model on synthetic data, written as a legacy apex script.

The data is a fixed random Markov chain over 1024 tokens in which every token has 4 possible
successors, so the loss falls from ln(1024) = 6.93 towards ln(4) = 1.39 within a few dozen
steps. The model is matmul-heavy (4 pre-norm layers, d_model 512, sequence 128), which is where
bf16 pays off on a CPU with AVX512-BF16/AMX and fp16/bf16 on a GPU.

Run it through ampx (which provides `apex.amp` when apex is not installed)::

    ampx run -O O2 --dtype bf16 ampx/examples/transformer_lm.py --steps 20

`--autocast` trains with plain torch.autocast + GradScaler instead of amp (the comparison row of
`ampx sweep`); it writes the same telemetry records as ampx when AMPX_TELEMETRY is set.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

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


def markov_batches(vocab: int, seq_len: int, batch: int, count: int, seed: int,
                   device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` (input, target) batches sampled from a fixed random Markov chain.

    Args:
        vocab: Vocabulary size.
        seq_len: Sequence length.
        batch: Sequences per batch.
        count: Number of batches.
        seed: Seed of the chain and the samples.
        device: Where the batches live.
    """
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 4), generator=gen)
    batches = []
    for _ in range(count):
        tokens = torch.empty(batch, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
        for t in range(seq_len):
            pick = torch.randint(0, 4, (batch,), generator=gen)
            tokens[:, t + 1] = successors[tokens[:, t], pick]
        tokens = tokens.to(device)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's command line."""
    from ampx.examples.common import example_parser

    parser = example_parser(__doc__, steps=40, batch_size=8, lr=1e-3)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Train for `--steps` steps."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = TransformerLM(args.vocab, args.d_model, args.layers, max(1, args.d_model // 64),
                          args.seq_len).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    data = markov_batches(args.vocab, args.seq_len, args.batch_size, 64, args.seed + 1, device)

    if args.autocast:
        from ampx.examples.common import train_autocast

        train_autocast(model, optimizer, data, args, lm_loss)
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
    if args.save:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "amp": amp.state_dict()}, args.save)


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy of one batch (the autocast loop's loss)."""
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"done in {time.perf_counter() - started:.1f} s")
