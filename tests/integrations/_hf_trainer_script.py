"""A transformers 4.x Trainer script of the apex era, unchanged but tiny (run by test_hf_trainer).

    ampx run tests/integrations/_hf_trainer_script.py --output_dir OUT --fp16 \\
        --half_precision_backend apex --fp16_opt_level O2

A GPT-2 of one layer built from a config (no hub access), 8 fixed sequences, 5 steps on CPU.
The Trainer takes its batches in order (a SequentialSampler) so a hand-written loop can
replay them; it writes each step's loss and the final weights to OUT/result.pt.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.data import SequentialSampler
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    set_seed,
)


def tiny_gpt2() -> GPT2LMHeadModel:
    set_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (8, 16), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


class InOrderTrainer(Trainer):
    """Batches in dataset order; records each step's loss."""

    losses: list[float]

    def _get_train_sampler(self, *args: Any, **kwargs: Any) -> SequentialSampler:
        return SequentialSampler(self.train_dataset)

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().training_step(*args, **kwargs)
        self.losses.append(loss.item())
        return loss


def main() -> None:
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    args.max_steps, args.per_device_train_batch_size = 5, 4
    args.report_to, args.save_strategy, args.logging_strategy = [], "no", "no"
    args.disable_tqdm = True
    model = tiny_gpt2()
    trainer = InOrderTrainer(model=model, args=args, train_dataset=dataset())
    trainer.losses = []
    trainer.train()
    torch.save({"losses": trainer.losses, "use_apex": trainer.use_apex,
                "weights": {k: v.clone() for k, v in model.state_dict().items()},
                "dtype": str(model.transformer.h[0].attn.c_attn.weight.dtype)},
               os.path.join(args.output_dir, "result.pt"))


if __name__ == "__main__":
    main()
