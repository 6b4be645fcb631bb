"""The transformers 5 `Trainer` through `ampx.integrations.accelerate.attach` (CPU, in process).

transformers 5 has no apex backend: its Trainer creates an Accelerator and calls
`accelerator.prepare(model, optimizer)`, `accelerator.backward(loss)` and
`accelerator.clip_grad_norm_(model.parameters(), ...)` itself. A subclass attaches ampx to that
Accelerator; each run is compared with the same training written by hand with ampx, bit for
bit. Skipped where transformers < 5 is installed (the test extra pins 4.x for the apex path).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _shared import fresh_accelerate_state  # noqa: F401  (autouse)

import ampx
from ampx import frontend

transformers = pytest.importorskip("transformers", minversion="5.0")

from ampx.integrations.accelerate import AmpxAccelerator, attach  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import _hf_trainer_script as script  # noqa: E402

sys.path.remove(str(Path(__file__).parent))

STEPS = 5


class AmpxTrainer(script.InOrderTrainer):
    """The recipe of docs/hf-trainer.md, on the in-order, loss-recording Trainer."""

    def __init__(self, *args: Any, ampx_options: dict[str, Any], overflow_at: int | None = None,
                 **kwargs: Any) -> None:
        self.ampx_options = ampx_options  # read by __init__, which creates the Accelerator
        self.overflow_at = overflow_at
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        attach(self.accelerator, **self.ampx_options)

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        loss = super().compute_loss(*args, **kwargs)
        return loss * float("inf") if self.state.global_step == self.overflow_at else loss


def arguments(tmp: Path) -> Any:
    # no --bf16/--fp16: the Trainer's Accelerator runs no mixed precision of its own
    return transformers.TrainingArguments(
        output_dir=str(tmp), max_steps=STEPS, per_device_train_batch_size=4, report_to="none",
        save_strategy="no", logging_strategy="no", disable_tqdm=True, use_cpu=True)


def run_trainer(level: str, dtype: str, tmp: Path, overflow_at: int | None = None
                ) -> tuple[AmpxTrainer, Any]:
    model = script.tiny_gpt2()
    trainer = AmpxTrainer(model=model, args=arguments(tmp), train_dataset=script.dataset(),
                          ampx_options={"opt_level": level, "dtype": dtype},
                          overflow_at=overflow_at)
    trainer.losses = []
    trainer.train()
    return trainer, model


def by_hand(level: str, dtype: str, tmp: Path, overflow_at: int | None = None
            ) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """The Trainer's loop written out: initialize, scale_loss, clip on the masters, and the
    scheduler held back after a skipped step (Accelerate's rule)."""
    model = script.tiny_gpt2()
    helper = transformers.Trainer(model=model, args=arguments(tmp))  # the same optimizer/schedule
    opt = helper.create_optimizer()
    sched = helper.create_scheduler(STEPS, optimizer=opt)
    model, opt = ampx.initialize(model, opt, opt_level=level, dtype=dtype, verbosity=0)
    data = script.dataset()
    losses, lrs = [], []
    model.train()
    for step in range(STEPS):
        first = (step % 2) * 4
        rows = data[first:first + 4]
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        loss = model(**batch, num_items_in_batch=batch["labels"].ne(-100).sum()).loss
        if step == overflow_at:
            loss = loss * float("inf")
        with ampx.scale_loss(loss, opt) as scaled:
            scaled.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(ampx.master_params(opt), 1.0)
        opt.step()
        if not ampx.step_was_skipped(opt):
            sched.step()
        lrs.append(sched.get_last_lr()[0])
        model.zero_grad()
    state = {k: v.clone() for k, v in model.state_dict().items()}  # before restore: the
    ampx.restore()  # masters (restore takes the fp32 state-dict hook off)
    return losses, state, lrs


def weights_equal(model: torch.nn.Module, want: dict[str, torch.Tensor]) -> bool:
    got = model.state_dict()
    return got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_trainer_v5_with_ampx_attached_matches_by_hand(level: str, tmp_path: Path) -> None:
    want_losses, want_weights, _ = by_hand(level, "bf16", tmp_path)
    trainer, model = run_trainer(level, "bf16", tmp_path)
    assert type(trainer.accelerator) is AmpxAccelerator
    assert trainer.accelerator.mixed_precision == "no"  # ampx alone casts and scales
    assert trainer.state.global_step == STEPS
    assert frontend.default_session().optimizers[0]._ampx.steps == STEPS
    half = model.transformer.h[0].attn.c_attn.weight.dtype
    assert half == (torch.bfloat16 if level == "O2" else torch.float32)
    assert trainer.losses == want_losses
    assert weights_equal(model, want_weights)


@pytest.mark.slow
def test_trainer_v5_skipped_step_holds_the_scheduler_back(tmp_path: Path) -> None:
    want_losses, want_weights, want_lrs = by_hand("O2", "fp16", tmp_path, overflow_at=2)
    trainer, model = run_trainer("O2", "fp16", tmp_path, overflow_at=2)
    state = frontend.default_session().optimizers[0]._ampx
    assert state.skipped_steps == 1 and trainer.state.global_step == STEPS
    assert frontend.default_session().loss_scale() == 2.0**15
    assert trainer.losses == want_losses  # inf at step 2 on both sides
    assert trainer.lr_scheduler.get_last_lr()[0] == want_lrs[-1]
    assert want_lrs[2] == want_lrs[1]  # the skipped step did not advance the schedule
    assert weights_equal(model, want_weights)
