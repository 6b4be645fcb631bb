"""Checkpoints: apex's keys, validation, O2 masters, and a bitwise resume in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import ampx
from ampx import CheckpointError

REPO = Path(__file__).resolve().parents[2]


def make(level="O2", dtype=torch.float16, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return ampx.initialize(model, opt, opt_level=level, dtype=dtype, verbosity=0, **kw)


def test_state_dict_keys_are_apex_keys_extended():
    make(num_losses=2)
    sd = ampx.state_dict()
    assert list(sd) == ["loss_scaler0", "loss_scaler1"]
    entry = sd["loss_scaler0"]
    assert entry["loss_scale"] == 2.0**16 and entry["unskipped"] == 0
    assert {"version", "dynamic", "hysteresis", "hysteresis_tracker", "min_loss_scale",
            "max_loss_scale", "growth_factor", "backoff_factor", "growth_interval"} <= set(entry)
    assert "state_dict" in ampx.amp.__dict__ and ampx.amp.state_dict is ampx.state_dict


def test_apex_checkpoint_loads():
    make(num_losses=2)
    apex_sd = {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 17},
               "loss_scaler1": {"loss_scale": 8.0, "unskipped": 3}}
    ampx.amp.load_state_dict(apex_sd)
    amp = ampx.frontend.default_session()
    assert amp is not None
    assert [s.loss_scale() for s in amp.scalers] == [1024.0, 8.0]
    assert [s.clean_steps for s in amp.scalers] == [17, 3]
    assert ampx.amp._amp_state.loss_scalers[0]._loss_scale == 1024.0


def test_entries_matched_by_number_not_order():
    make(num_losses=2)
    ampx.load_state_dict({"loss_scaler1": {"loss_scale": 2.0, "unskipped": 0},
                          "loss_scaler0": {"loss_scale": 4.0, "unskipped": 0}})
    amp = ampx.frontend.default_session()
    assert [s.loss_scale() for s in amp.scalers] == [4.0, 2.0]  # type: ignore[union-attr]


def test_round_trip_through_torch_save_weights_only(tmp_path: Path):
    make(hysteresis=2)
    amp = ampx.frontend.default_session()
    assert amp is not None
    amp.scalers[0].update_(torch.ones(1))
    torch.save(ampx.state_dict(), tmp_path / "amp.pt")
    loaded = torch.load(tmp_path / "amp.pt", weights_only=True)
    make(hysteresis=2)
    ampx.load_state_dict(loaded)
    assert ampx.state_dict() == loaded


@pytest.mark.parametrize("bad, needle", [
    ({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}, "optimizer": {}}, "'optimizer'"),
    ({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0},
      "loss_scaler1": {"loss_scale": 0.0, "unskipped": 0}}, "loss_scaler1"),
    ({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0},
      "loss_scaler1": {"unskipped": 0}}, "loss_scaler1"),
    ({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0},
      "loss_scaler1": {"loss_scale": -2.0, "unskipped": 0, "dynamic": False}}, "loss_scaler1"),
    ({"loss_scaler0": {"loss_scale": float("nan"), "unskipped": 0}}, "loss_scaler0"),
    ({"loss_scaler0": {"loss_scale": float("inf"), "unskipped": 0}}, "loss_scaler0"),
    ({"loss_scaler0": {"loss_scale": "4.0", "unskipped": 0}}, "loss_scaler0"),
    ({"loss_scaler0": {"loss_scale": True, "unskipped": 0}}, "loss_scaler0"),
    ({"loss_scaler0": {"loss_scale": 4.0, "unskipped": -1}}, "loss_scaler0"),
    ([("loss_scaler0", {})], "expected a dict"),
])
def test_malformed_checkpoint_raises_naming_key_and_loads_nothing(bad, needle):
    make(num_losses=2)
    before = ampx.state_dict()
    with pytest.raises(CheckpointError, match=needle):
        ampx.load_state_dict(bad)
    assert ampx.state_dict() == before
    assert issubclass(CheckpointError, RuntimeError) and issubclass(CheckpointError, ValueError)


def test_count_mismatch_warns_like_apex():
    make(num_losses=1)
    two = {"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0},
           "loss_scaler1": {"loss_scale": 2.0, "unskipped": 0}}
    with pytest.warns(UserWarning, match="num_losses"):
        with pytest.warns(UserWarning, match="contains 2 entries"):
            ampx.load_state_dict(two)
    assert ampx.frontend.default_session().loss_scale() == 4.0  # type: ignore[union-attr]


def test_state_dict_before_initialize_raises():
    ampx.restore()
    with pytest.raises(RuntimeError, match="initialize"):
        ampx.state_dict()


# -- O2 masters ----------------------------------------------------------------------------------

def _train(model, opt, steps=3):
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        opt.zero_grad()
        with ampx.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt) as s:
            s.backward()
        opt.step()


def test_model_state_dict_carries_masters_and_load_restores_them(half_dtype):
    model, opt = make(dtype=half_dtype, init_scale=2.0**8)
    _train(model, opt)
    masters = [m.detach().clone() for m in ampx.master_params(opt)]
    sd = model.state_dict()
    assert torch.equal(sd["0.weight"], masters[0])
    assert not torch.equal(sd["0.weight"].to(half_dtype).float(), masters[0])  # not lossy
    model2, opt2 = make(dtype=half_dtype, init_scale=2.0**8)
    model2.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(masters, ampx.master_params(opt2)))
    assert torch.equal(model2[0].weight, masters[0].to(half_dtype))


def test_nvidia_bert_master_params_recipe(half_dtype):
    """NVIDIA/DeepLearningExamples#397 saved list(amp.master_params(opt)) and copied it back."""
    model, opt = make(dtype=half_dtype, init_scale=2.0**8)
    _train(model, opt)
    saved = [p.detach().clone() for p in ampx.master_params(opt)]
    model2, opt2 = make(dtype=half_dtype, init_scale=2.0**8)
    with torch.no_grad():
        for param, value in zip(ampx.master_params(opt2), saved):
            param.copy_(value)
    assert all(torch.equal(a, b) for a, b in zip(saved, ampx.master_params(opt2)))
    _train(model2, opt2, 1)
    for half, master in opt2._ampx.masters.pairs():
        assert torch.equal(half, master.to(half_dtype))


# -- resume in a fresh process -----------------------------------------------------------------

TRAIN_SRC = textwrap.dedent('''
    import torch
    from torch import nn
    import ampx

    def build(level, dtype, seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(),
                              nn.Linear(32, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
        model, opt = ampx.initialize(model, opt, opt_level=level, dtype=dtype, verbosity=0,
                                     init_scale=2.0**12, growth_interval=3)
        return model, opt, sched

    def run(level, dtype, start, stop, ckpt=None, save_path=None, save_at=None):
        model, opt, sched = build(level, dtype, 0 if ckpt is None else 123)
        if ckpt is not None:
            sd = torch.load(ckpt, weights_only=True)
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optimizer"])
            sched.load_state_dict(sd["scheduler"])
            ampx.load_state_dict(sd["amp"])
        for i in range(start, stop):
            if i == save_at:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                            "scheduler": sched.state_dict(), "amp": ampx.state_dict()},
                           save_path)
            g = torch.Generator().manual_seed(1000 + i)
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x).float(), y)
            with ampx.scale_loss(loss, opt) as scaled:
                scaled.backward()
                if i in (4, 13):  # forced overflows, one on each side of the checkpoint
                    model[0].weight.grad.view(-1)[0] = float("inf")
            opt.step()
            if not ampx.step_was_skipped(opt):
                sched.step()
        out = {"model": model.state_dict(), "optimizer": opt.state_dict(),
               "amp": ampx.state_dict(), "lr": opt.param_groups[0]["lr"],
               "half": [p.detach().clone() for p in model.parameters()]}
        ampx.restore()
        return out
''')

CONFIGS = [("O1", "fp16"), ("O2", "fp16"), ("O2", "bf16")]


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(u, v) for u, v in zip(a, b))
    return a == b


@pytest.mark.slow
def test_resume_in_fresh_process_is_bitwise_equal(tmp_path: Path):
    ns: dict = {}
    exec(TRAIN_SRC, ns)  # noqa: S102  (the same code the fresh process runs)
    full = {}
    for level, dtype in CONFIGS:
        full[level, dtype] = ns["run"](level, dtype, 0, 20, save_at=10,
                                       save_path=tmp_path / f"{level}{dtype}.pt")
    script = TRAIN_SRC + textwrap.dedent(f'''
        import sys
        torch.set_num_threads({torch.get_num_threads()})
        results = {{}}
        for level, dtype in {CONFIGS!r}:
            results[level + dtype] = run(level, dtype, 10, 20,
                                         ckpt=r"{tmp_path}/" + level + dtype + ".pt")
        torch.save(results, r"{tmp_path}/resumed.pt")
    ''')
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    for level, dtype in CONFIGS:
        a, b = full[level, dtype], resumed[level + dtype]
        for key in ("model", "optimizer", "amp", "lr", "half"):
            assert _equal(a[key], b[key]), (level, dtype, key)
        if level == "O2":
            assert all(v.dtype == torch.float32 for v in a["model"].values()
                       if v.is_floating_point())


# -- all or nothing (issue 9 item 9) -------------------------------------------------------------

@pytest.mark.parametrize("bad, needle", [
    ({"loss_scale": 8.0, "unskipped": 2**40}, "int32"),
    ({"loss_scale": 1e39, "unskipped": 0}, "float32"),
    ({"loss_scale": 8.0, "unskipped": 0, "hysteresis_tracker": 2**40}, "int32"),
    ({"loss_scale": torch.tensor([2.0, 4.0]), "unskipped": 0}, "1-element"),
])
def test_values_that_do_not_fit_are_refused_before_anything_applies(bad, needle):
    make(num_losses=2, hysteresis=2)
    before = ampx.state_dict()
    good = {"loss_scale": 4.0, "unskipped": 3}
    with pytest.raises(CheckpointError, match=needle):
        ampx.load_state_dict({"loss_scaler0": good, "loss_scaler1": bad})
    assert ampx.state_dict() == before


def test_duplicate_indices_are_refused():
    make(num_losses=1)
    before = ampx.state_dict()
    with pytest.raises(CheckpointError, match="loss_scaler00"):
        ampx.load_state_dict({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0},
                              "loss_scaler00": {"loss_scale": 8.0, "unskipped": 0}})
    assert ampx.state_dict() == before


def test_apex_fp16_entry_does_not_rescale_a_static_bf16_scaler():
    """apex assigned any scale; ampx keeps a static scale (configuration) with one warning,
    takes the counters, and keeps refusing corrupt entries."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ampx.initialize(model, opt, opt_level="O1", dtype=torch.bfloat16, verbosity=0)
    before = ampx.state_dict()
    assert before["loss_scaler0"]["dynamic"] is False
    with pytest.warns(UserWarning, match=r"static \(loss_scale=1.0\); keeping 1.0") as seen:
        ampx.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 17}})
    assert len(seen) == 1 and seen[0].filename == __file__  # one warning, at the caller
    after = ampx.state_dict()["loss_scaler0"]
    assert after["loss_scale"] == 1.0 and after["unskipped"] == 17
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ampx.load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 3}})  # same
    assert ampx.state_dict()["loss_scaler0"]["unskipped"] == 3
    for corrupt in (float("nan"), -1.0, "1024", None):
        with pytest.raises(CheckpointError, match="loss_scale"):
            ampx.load_state_dict({"loss_scaler0": {"loss_scale": corrupt, "unskipped": 17}})
    assert ampx.state_dict()["loss_scaler0"]["unskipped"] == 3
