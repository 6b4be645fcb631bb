"""The transformers 5 `Trainer` with one ampx call, `attach(trainer.accelerator, ...)` (CPU).

transformers 5 has no apex backend: its Trainer creates an Accelerator in `__init__` and later
calls `accelerator.prepare(model, optimizer)`, `accelerator.backward(loss)` and
`accelerator.clip_grad_norm_(model.parameters(), ...)` itself; `attach` makes those calls
ampx's. The runs are compared with the same training written by hand with ampx, bit for bit
(on the script's in-order, loss-recording Trainer), and a stock `Trainer` checkpointed and
resumed is compared with the same run uninterrupted (the loss scale comes back through the
Trainer's own optimizer.pt). Skipped where transformers < 5 is installed (the test extra pins
4.x for the apex path); docs/hf-trainer.md has the command that runs it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _shared import fresh_accelerate_state  # noqa: F401  (autouse)

import ampx
from ampx import frontend

transformers = pytest.importorskip("transformers", minversion="5.0")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from ampx.integrations.accelerate import AmpxAccelerator, attach  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import _hf_trainer_script as script  # noqa: E402

sys.path.remove(str(Path(__file__).parent))

STEPS = 5


def overflow_at(model: torch.nn.Module, step: int | None) -> None:
    """Make the loss of training forward number `step` (from 0) inf (no Trainer subclass)."""
    calls = [0]

    def hook(module: torch.nn.Module, args: Any, out: Any) -> Any:
        if module.training:
            if calls[0] == step:
                out.loss = out.loss * float("inf")
            calls[0] += 1
        return out

    model.register_forward_hook(hook)


def arguments(tmp: Path, **kwargs: Any) -> Any:
    # no --bf16/--fp16: the Trainer's Accelerator runs no mixed precision of its own
    options = dict(output_dir=str(tmp), max_steps=STEPS, per_device_train_batch_size=4,
                   report_to="none", save_strategy="no", logging_strategy="no",
                   disable_tqdm=True, use_cpu=True)
    return transformers.TrainingArguments(**{**options, **kwargs})


def run_in_order(level: str, dtype: str, tmp: Path, overflow: int | None = None
                 ) -> tuple[Any, torch.nn.Module]:
    model = script.tiny_gpt2()
    overflow_at(model, overflow)
    trainer = script.InOrderTrainer(model=model, args=arguments(tmp),
                                    train_dataset=script.dataset())
    attach(trainer.accelerator, opt_level=level, dtype=dtype)  # the one ampx call
    trainer.losses = []
    trainer.train()
    return trainer, model


def by_hand(level: str, dtype: str, tmp: Path, overflow: int | None = None
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
        if step == overflow:
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
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return losses, state, lrs


def weights_equal(model: torch.nn.Module, want: dict[str, torch.Tensor]) -> bool:
    got = model.state_dict()
    return got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_trainer_v5_with_ampx_attached_matches_by_hand(level: str, tmp_path: Path) -> None:
    want_losses, want_weights, _ = by_hand(level, "bf16", tmp_path)
    trainer, model = run_in_order(level, "bf16", tmp_path)
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
    want_losses, want_weights, want_lrs = by_hand("O2", "fp16", tmp_path, overflow=2)
    trainer, model = run_in_order("O2", "fp16", tmp_path, overflow=2)
    state = frontend.default_session().optimizers[0]._ampx
    assert state.skipped_steps == 1 and trainer.state.global_step == STEPS
    assert frontend.default_session().loss_scale() == 2.0**15
    assert trainer.losses == want_losses  # inf at step 2 on both sides
    assert trainer.lr_scheduler.get_last_lr()[0] == want_lrs[-1]
    assert want_lrs[2] == want_lrs[1]  # the skipped step did not advance the schedule
    assert weights_equal(model, want_weights)


def stock_run(out: Path, resume: str | None = None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """A stock Trainer, O2 fp16, checkpointing at step 3; the first run skips step 1."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    model = script.tiny_gpt2()
    overflow_at(model, None if resume else 1)
    trainer = transformers.Trainer(model=model, train_dataset=script.dataset(),
                                   args=arguments(out, save_strategy="steps", save_steps=3))
    attach(trainer.accelerator, opt_level="O2", dtype="fp16")
    trainer.train(resume_from_checkpoint=resume)
    session = frontend.default_session()
    scales = [session.loss_scale(), float(session.optimizers[0]._ampx.steps)]
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    ampx.restore()
    return weights, scales


@pytest.mark.slow
def test_a_stock_trainer_resumes_bit_for_bit_with_its_loss_scale(tmp_path: Path) -> None:
    want, (scale, steps) = stock_run(tmp_path)
    assert scale == 2.0**15 and steps == STEPS  # the skip at step 1 halved it
    saved = torch.load(tmp_path / "checkpoint-3" / "optimizer.pt", weights_only=True)
    assert saved["ampx"]["loss_scaler0"]["loss_scale"] == 2.0**15
    got, (scale, steps) = stock_run(tmp_path, resume=str(tmp_path / "checkpoint-3"))
    assert scale == 2.0**15 and steps == STEPS - 3  # not 2**16: the scale came back
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.slow
def test_the_docs_block_runs_as_written(tmp_path: Path) -> None:
    page = Path(__file__).parents[2] / "docs" / "hf-trainer.md"
    mark = "<!-- runs in tests/integrations/test_hf_trainer_v5.py (transformers 5) -->"
    (code,) = re.findall(re.escape(mark) + r"\n```python\n(.*?)\n```", page.read_text(), re.S)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, timeout=300,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert {"checkpoint-2", "checkpoint-4"} <= {p.name for p in (tmp_path / "out").iterdir()}
    saved = torch.load(tmp_path / "out" / "checkpoint-4" / "optimizer.pt", weights_only=True)
    assert saved["ampx"]["loss_scaler0"]["loss_scale"] == 1.0  # bf16: no scaling needed
