"""A legacy apex script whose model has four modules built to break in fp16.

The report it gives is the one shown in docs/debugging-overflows.md:

    ampx run --numerics numerics-out examples/numerics_demo.py

- ``block.up``: a Linear whose fp16 output exceeds 65504 (overflow);
- ``block.scores``: a softmax over logits offset by 500 (fp16 keeps 0.25 of them: precision);
- ``norm``: a LayerNorm fed activations near fp16's limit (near overflow);
- ``aux``: a side head whose gradients are 2^-30 of the loss's (underflow at a 2^16 scale).
"""

import argparse

import torch
from apex import amp  # `ampx run` provides apex.amp when apex is not installed
from torch import nn

D = 32


class Logits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)
        with torch.no_grad():
            self.proj.bias.fill_(500.0)

    def forward(self, x):
        return self.proj(x).softmax(-1) * 8.0


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scores = Logits()
        self.up = nn.Linear(D, D)
        with torch.no_grad():
            self.up.weight.mul_(1e6)
        self.down = nn.Linear(D, D)

    def forward(self, x):
        h = x + self.scores(x)
        return self.down(torch.relu(self.up(h)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, D)
        self.block = Block()
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, 1)
        self.aux = nn.Linear(D, 1)

    def forward(self, x):
        h = torch.relu(self.embed(x))
        y = self.block(h)
        main = self.head(self.norm(h * 1e4)).float().mean()
        return main + self.aux(h).float().mean() * 2.0**-30 + 0 * y.float().mean()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
    for _ in range(args.steps):
        loss = model(torch.randn(16, 8))
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main()
