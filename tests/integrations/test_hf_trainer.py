"""HF Trainer (transformers 4.x) with `--half_precision_backend apex` under `ampx run`.

transformers decides whether apex is installed from metadata (`importlib.util.find_spec` and
`importlib.metadata.version`), at import; the alias answers both while `ampx run` has it
installed. The Trainer's run is compared with the same training written by hand with ampx.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ampx
from ampx.compat import apex_alias

SCRIPT = Path(__file__).with_name("_hf_trainer_script.py")


def test_the_alias_is_visible_to_metadata_checks_only_while_installed() -> None:
    if apex_alias.real_apex_spec() is not None:
        pytest.skip("a real apex is installed here; the alias stays out of its way")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("apex")
    assert apex_alias.install()
    try:
        assert importlib.util.find_spec("apex") is not None
        assert importlib.metadata.version("apex") == "0.1+ampx"
        assert "apex" in importlib.metadata.packages_distributions().get("apex", [])
        assert importlib.metadata.distribution("apex").metadata["Name"] == "apex"
    finally:
        apex_alias.uninstall()
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("apex")


def by_hand(level: str, tmp: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The Trainer's apex path, written out: initialize, scale_loss, clip on the masters."""
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import _hf_trainer_script as script
    finally:
        sys.path.remove(str(SCRIPT.parent))
    model = script.tiny_gpt2()
    args = transformers.TrainingArguments(output_dir=str(tmp), max_steps=5, report_to=[],
                                          per_device_train_batch_size=4)
    helper = transformers.Trainer(model=model, args=args)  # builds the same optimizer/schedule
    opt = helper.create_optimizer()
    sched = helper.create_scheduler(5, optimizer=opt)
    model, opt = ampx.initialize(model, opt, opt_level=level)
    data = script.dataset()
    losses = []
    model.train()
    for step in range(5):
        first = (step % 2) * 4
        rows = data[first:first + 4]
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        loss = model(**batch, num_items_in_batch=batch["labels"].ne(-100).sum()).loss
        with ampx.scale_loss(loss, opt) as scaled:
            scaled.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(ampx.master_params(opt), 1.0)
        opt.step()
        sched.step()
        model.zero_grad()
    state = {k: v.clone() for k, v in model.state_dict().items()}  # before restore: the
    ampx.restore()  # masters (restore takes the fp32 state-dict hook off)
    return losses, state


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_trainer_apex_backend_under_ampx_run_matches_by_hand(level: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers", minversion="4.0")
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        pytest.skip("transformers 5 has no apex backend; its Trainer goes through Accelerate")
    # one intra-op thread, as the in-process half runs (conftest): the same reduction order
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "ampx", "run", str(SCRIPT), "--output_dir", str(tmp_path),
           "--fp16", "--half_precision_backend", "apex", "--fp16_opt_level", level]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = torch.load(tmp_path / "result.pt")
    assert got["use_apex"] is True
    assert got["dtype"] == ("torch.float16" if level == "O2" else "torch.float32")

    losses, weights = by_hand(level, tmp_path)
    assert got["losses"] == losses
    assert all(torch.equal(got["weights"][k], v) for k, v in weights.items())


@pytest.mark.slow
def test_a_forced_bf16_under_the_trainers_fp16_flag_is_said(tmp_path: Path) -> None:
    """`ampx run --dtype bf16` over `--fp16`: the Trainer still says fp16; ampx says bf16."""
    transformers = pytest.importorskip("transformers", minversion="4.0")
    if int(transformers.__version__.split(".")[0]) >= 5:
        pytest.skip("transformers 5 has no apex backend; its Trainer goes through Accelerate")
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "ampx", "run", "--dtype", "bf16", str(SCRIPT), "--output_dir",
           str(tmp_path), "--fp16", "--half_precision_backend", "apex", "--fp16_opt_level", "O2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = torch.load(tmp_path / "result.pt")
    assert got["use_apex"] is True and got["dtype"] == "torch.bfloat16"
    assert ("ampx run --dtype bfloat16: training in bfloat16. The script's initialize passed no "
            "dtype (apex's API trains float16)") in proc.stderr
