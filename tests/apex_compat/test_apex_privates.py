"""apex's private optimizer names (`_amp_stash` and its methods), used as published scripts do."""

from __future__ import annotations

import copy
import io
import os
import pickle
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ampx
from ampx import amp
from ampx.compat.apex import stash as apex_stash
from ampx.compat.apex.optimizers import FusedLAMB

REPO = Path(__file__).resolve().parents[2]
PRIVATE_NAMES = ("_amp_stash", *apex_stash.METHOD_NAMES)

# NVIDIA DeepLearningExamples BERT run_pretraining.py, reduced to a tiny model (with FusedLAMB
# from `apex.optimizers`, ampx's under the alias, as BERT uses apex's): the checkpoint
# holds model, optimizer, amp state and `list(amp.master_params(optimizer))`; the resume loads
# the model before initialize, then the optimizer state twice around the private calls, and
# copies the saved masters back with `param.data.copy_()`.
BERT_SCRIPT = '''
import sys

import torch
from torch import nn

N_FIRST, N_MORE = 3, 3


def build(lamb):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    optimizer = lamb([{"params": decay, "weight_decay": 0.01},
                      {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
    return model, optimizer


def initialize(amp, model, optimizer, dtype):
    return amp.initialize(model, optimizer, opt_level="O2", dtype=dtype, verbosity=0)


def train(amp, model, optimizer, steps):
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        loss = nn.functional.mse_loss(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().float())
    return torch.stack(losses)


def results(amp, model, optimizer, losses):
    return {"losses": losses,
            "masters": [p.detach().clone() for p in amp.master_params(optimizer)],
            "model": [p.detach().clone() for p in model.parameters()],
            "loss_scale": amp._amp_state.loss_scalers[0].loss_scale()}


def resume(checkpoint_path, out_path, dtype):
    from apex import amp
    from apex.optimizers import FusedLAMB

    model, optimizer = build(FusedLAMB)
    checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
    model.load_state_dict(checkpoint["model"])
    model, optimizer = initialize(amp, model, optimizer, dtype)
    optimizer.load_state_dict(checkpoint["optimizer"])
    # Restore AMP master parameters
    optimizer._lazy_init_maybe_master_weights()
    optimizer._amp_stash.lazy_init_called = True
    optimizer.load_state_dict(checkpoint["optimizer"])
    before = [p.detach().clone() for p in amp.master_params(optimizer)]
    for param, saved_param in zip(amp.master_params(optimizer), checkpoint["master params"]):
        param.data.copy_(saved_param.data)
    amp.load_state_dict(checkpoint["amp"])
    restored = [p.detach().clone() for p in amp.master_params(optimizer)]
    losses = train(amp, model, optimizer, range(N_FIRST, N_FIRST + N_MORE))
    out = results(amp, model, optimizer, losses)
    out.update(before=before, restored=restored)
    torch.save(out, out_path)


if __name__ == "__main__":
    torch.set_num_threads(1)
    resume(sys.argv[1], sys.argv[2], sys.argv[3])
'''


_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Same dtypes, shapes and bits (NaNs included)."""
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape
        and torch.equal(x.detach().view(_INT_OF_SIZE[x.dtype.itemsize]),
                        y.detach().view(_INT_OF_SIZE[y.dtype.itemsize]))
        for x, y in zip(a, b))


def _apex_model_state(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model state as apex saved it at O2: half weights cast to fp32 (masters not in it)."""
    half = {name for name, p in model.named_parameters() if p.dtype == dtype}
    return {k: v.to(dtype).float() if k in half else v for k, v in model.state_dict().items()}


def test_bert_resume_recipe_is_bitwise_in_a_fresh_process(half_dtype: torch.dtype,
                                                          tmp_path: Path) -> None:
    script = tmp_path / "bert_resume.py"
    script.write_text(BERT_SCRIPT)
    bert = runpy.run_path(str(script), run_name="bert_resume")
    dtype = "fp16" if half_dtype == torch.float16 else "bf16"
    model, optimizer = bert["initialize"](amp, *bert["build"](FusedLAMB), dtype)
    bert["train"](amp, model, optimizer, range(bert["N_FIRST"]))
    saved_masters = [p.detach().clone() for p in amp.master_params(optimizer)]
    torch.save({"model": _apex_model_state(model, half_dtype),
                "optimizer": optimizer.state_dict(), "amp": amp.state_dict(),
                "master params": list(amp.master_params(optimizer))}, tmp_path / "ckpt.pt")
    losses = bert["train"](amp, model, optimizer,
                           range(bert["N_FIRST"], bert["N_FIRST"] + bert["N_MORE"]))
    straight = bert["results"](amp, model, optimizer, losses)

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH",
                                                                                 "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "ampx", "run", "-q", str(script), str(tmp_path / "ckpt.pt"),
         str(tmp_path / "out.pt"), dtype],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed = torch.load(tmp_path / "out.pt", weights_only=True)
    assert not _bitwise(resumed["before"], saved_masters)  # the copy is what restores them
    assert _bitwise(resumed["restored"], saved_masters)
    for key in ("masters", "model"):
        assert _bitwise(resumed[key], straight[key]), key
    assert torch.equal(resumed["losses"], straight["losses"])
    assert resumed["loss_scale"] == straight["loss_scale"]


# -- poking each name the way scripts do -------------------------------------------------------

def _setup(level: str = "O2", dtype: torch.dtype = torch.float16, own_scalers: bool = False,
           **kw: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model and optimizer through `amp.initialize` (or an `ampx.Amp` with own scalers).

    Module-level sessions share apex's one list of loss scalers (`_amp_state.loss_scalers`),
    so a reference run next to the run under test gets `own_scalers=True`.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if own_scalers:
        session = ampx.Amp(level, dtype=dtype, verbosity=0, **kw)
        return session.initialize(model, optimizer)
    return amp.initialize(model, optimizer, opt_level=level, dtype=dtype, verbosity=0, **kw)


def _loss(model: nn.Module, step: int, poison: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(8, 8, generator=gen)
    if poison:
        x[0, 0] = float("inf")
    return nn.functional.mse_loss(model(x), torch.randn(8, 4, generator=gen))


def test_stash_lists_are_live_views_of_the_masters(half_dtype: torch.dtype) -> None:
    model, opt = _setup(dtype=half_dtype)
    stash = opt._amp_stash
    assert type(opt) is torch.optim.AdamW and "step" not in vars(opt)
    masters = list(amp.master_params(opt))
    # Megatron-era name mapping: model parameter -> master, after the lazy init
    names = {p: n for n, p in model.named_parameters()}
    opt._amp_lazy_init()
    for p_model, p_master in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params):
        names[p_master] = names.pop(p_model)
        assert p_model.dtype == half_dtype and p_master.dtype == torch.float32
        assert torch.equal(p_master.to(half_dtype), p_model)
    assert set(names) == set(masters)  # every parameter the optimizer steps got its name
    assert all(any(m is p for p in masters) for m in stash.all_fp32_from_fp16_params)
    bn = model[1]
    assert stash.all_fp32_from_fp32_params == [bn.weight, bn.bias]
    flat = [p for g in stash.fp32_from_fp16_groups for p in g]
    assert flat == stash.all_fp32_from_fp16_params
    assert [p for g in stash.fp16_groups for p in g] == stash.all_fp16_params
    assert [p for g in stash.fp32_from_fp32_groups for p in g] == stash.all_fp32_from_fp32_params
    assert not hasattr(stash, "all_fp32_params")  # apex's O2 stash had no such name
    # writing into a master's data writes what the optimizer steps
    with torch.no_grad():
        stash.all_fp32_from_fp16_params[0].data.fill_(0.25)
    assert bool((masters[0] == 0.25).all())
    # a group added after initialize shows up at once
    extra = nn.Parameter(torch.ones(3, dtype=half_dtype))
    opt.add_param_group({"params": [extra]})
    opt._amp_lazy_init()  # gives the new half parameter its master, in the group
    assert opt.param_groups[-1]["params"][0].dtype == torch.float32
    assert stash.all_fp16_params[-1] is extra
    assert stash.all_fp32_from_fp16_params[-1].dtype == torch.float32


def test_master_params_to_model_params_copies_now(half_dtype: torch.dtype) -> None:
    model, opt = _setup(dtype=half_dtype)
    with torch.no_grad():
        for master in amp.master_params(opt):
            master.add_(0.5)
    opt._master_params_to_model_params()
    for p_model, p_master in zip(opt._amp_stash.all_fp16_params,
                                 opt._amp_stash.all_fp32_from_fp16_params):
        assert torch.equal(p_model, p_master.to(half_dtype))
    assert torch.equal(model[0].weight, opt._amp_stash.all_fp32_from_fp16_params[0].to(half_dtype))


def _custom_scale_loss(opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    """The custom scale_loss of apex-era scripts, driving the privates directly."""
    scaler = amp._amp_state.loss_scalers[0]
    if not opt._amp_stash.params_have_scaled_gradients:
        opt._prepare_amp_backward()
    (loss.float() * scaler.loss_scale()).backward()
    opt._post_amp_backward(scaler)
    opt._amp_stash.params_have_scaled_gradients = False


@pytest.mark.parametrize("level", ["O2", "O1"])
def test_prepare_and_post_match_scale_loss_bitwise(level: str, half_dtype: torch.dtype) -> None:
    ref_model, ref_opt = _setup(level, half_dtype, own_scalers=True)
    model, opt = _setup(level, half_dtype)  # _amp_state.loss_scalers are this one's
    for step in range(3):
        for micro in range(2):  # two backward passes per step accumulate
            with amp.scale_loss(_loss(ref_model, 10 * step + micro), ref_opt) as scaled:
                scaled.backward()
            _custom_scale_loss(opt, _loss(model, 10 * step + micro))
        assert _bitwise([p.grad for p in amp.master_params(opt)],
                        [p.grad for p in amp.master_params(ref_opt)])
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    assert _bitwise(list(amp.master_params(opt)), list(amp.master_params(ref_opt)))
    assert _bitwise(list(model.parameters()), list(ref_model.parameters()))
    ref_scale = ref_opt._ampx.owner.scalers[0].loss_scale()
    assert amp._amp_state.loss_scalers[0].loss_scale() == ref_scale


def test_grad_stash_views_between_prepare_and_post(half_dtype: torch.dtype) -> None:
    model, opt = _setup(dtype=half_dtype)
    stash = opt._amp_stash
    with amp.scale_loss(_loss(model, 0), opt) as scaled:
        scaled.backward()
    first = [p.grad for p in stash.all_fp32_from_fp32_params]
    assert all(g is not None for g in first)
    values = [g.clone() for g in first]
    opt._prepare_amp_backward()
    assert all(s is g for s, g in zip(stash.all_fp32_from_fp32_grad_stash, first))
    assert all(p.grad is None for p in stash.all_fp32_from_fp32_params)
    assert stash.all_fp16_grad_stash == [None] * len(stash.all_fp16_params)
    (_loss(model, 1).float() * amp._amp_state.loss_scalers[0].loss_scale()).backward()
    opt._post_amp_backward()  # no scaler: the session's first, as loss_id 0
    assert stash.all_fp32_from_fp32_grad_stash == [None, None]
    for param, value in zip(stash.all_fp32_from_fp32_params, values):  # this pass added in
        assert param.grad is not None and not torch.equal(param.grad, value)


def test_overflow_through_the_privates_skips_the_next_step(half_dtype: torch.dtype) -> None:
    model, opt = _setup(dtype=half_dtype)
    stash = opt._amp_stash
    assert stash.already_patched is False
    scale = amp._amp_state.loss_scalers[0].loss_scale()
    _custom_scale_loss(opt, _loss(model, 0, poison=True))
    assert stash.already_patched is True
    backed_off = scale / 2 if half_dtype == torch.float16 else scale  # bf16: static 1.0
    assert amp._amp_state.loss_scalers[0].loss_scale() == backed_off
    before = [p.detach().clone() for p in amp.master_params(opt)]
    opt.step()
    assert ampx.step_was_skipped(opt) and stash.already_patched is False
    assert _bitwise([p.detach() for p in amp.master_params(opt)], before)


def test_master_grads_cleared_by_the_stash_loop(half_dtype: torch.dtype) -> None:
    model, opt = _setup(dtype=half_dtype)
    with amp.scale_loss(_loss(model, 0), opt) as scaled:
        scaled.backward()
    stash = opt._amp_stash
    for param in stash.all_fp32_from_fp16_params:  # a zero_grad of apex-era scripts
        param.grad = None
    masters = [p for p in amp.master_params(opt) if p.grad is None]
    assert len(masters) == len(stash.all_fp32_from_fp16_params) == 4
    assert all(p.grad is not None for p in stash.all_fp32_from_fp32_params)  # batchnorm's


def test_lazy_init_resets_grads_and_flags_accept_writes(half_dtype: torch.dtype) -> None:
    model, opt = _setup(dtype=half_dtype)
    stash = opt._amp_stash
    assert stash.lazy_init_called is True  # ampx makes the masters at initialize
    stash.lazy_init_called = True
    stash.lazy_init_called = False  # accepted; nothing is lazy
    with pytest.raises(TypeError, match="lazy_init_called must be a bool"):
        stash.lazy_init_called = "yes"
    with amp.scale_loss(_loss(model, 0), opt) as scaled:
        scaled.backward()
    opt._lazy_init_maybe_master_weights()
    assert all(p.grad is None for p in amp.master_params(opt))
    stash.isfinite = True  # scripts hang their own things on the stash
    assert stash.isfinite is True
    with pytest.raises(TypeError, match="params_have_scaled_gradients must be a bool"):
        stash.params_have_scaled_gradients = 1
    with pytest.raises(AttributeError):
        stash.already_patched = False  # type: ignore[misc]


def test_delay_unscale_through_the_stash_flag_matches_scale_loss(half_dtype: torch.dtype
                                                                 ) -> None:
    ref_model, ref_opt = _setup(dtype=half_dtype, own_scalers=True)
    model, opt = _setup(dtype=half_dtype)
    stash = opt._amp_stash
    scaler = amp._amp_state.loss_scalers[0]
    for step in range(2):
        with amp.scale_loss(_loss(ref_model, 2 * step), ref_opt, delay_unscale=True) as scaled:
            scaled.backward()
        with amp.scale_loss(_loss(ref_model, 2 * step + 1), ref_opt) as scaled:
            scaled.backward()
        opt._prepare_amp_backward()
        (_loss(model, 2 * step).float() * scaler.loss_scale()).backward()
        stash.params_have_scaled_gradients = True  # what apex's scale_loss did on delay_unscale
        with pytest.raises(RuntimeError, match="still scaled"):
            opt.step()
        with pytest.raises(RuntimeError, match="still scaled"):
            stash.params_have_scaled_gradients = False
        _custom_scale_loss(opt, _loss(model, 2 * step + 1))  # skips the prepare: still scaled
        assert stash.params_have_scaled_gradients is False
        ref_opt.step()
        opt.step()
    assert _bitwise(list(amp.master_params(opt)), list(amp.master_params(ref_opt)))
    assert _bitwise(list(model.parameters()), list(ref_model.parameters()))


def test_post_rejects_a_scaler_of_another_session() -> None:
    _, first = _setup(own_scalers=True)
    _, second = _setup()
    with pytest.raises(ValueError, match="loss scalers of the session"):
        first._post_amp_backward(amp._amp_state.loss_scalers[0])
    with pytest.raises(ValueError, match="loss scalers of the session"):
        second._post_amp_backward(ampx.LossScaler("dynamic"))


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_levels_without_master_weights_have_apex_other_names(level: str,
                                                             half_dtype: torch.dtype) -> None:
    model, opt = _setup(level, half_dtype)
    stash = opt._amp_stash
    expect_half = level == "O3"
    params = list(model.parameters())
    assert stash.all_fp16_params == (params if expect_half else [])
    assert stash.all_fp32_params == ([] if expect_half else params)
    assert stash.all_fp32_grad_stash == [None] * len(stash.all_fp32_params)
    with amp.scale_loss(_loss(model, 0), opt) as scaled:
        scaled.backward()
    grads = [p.grad for p in params]
    opt._prepare_amp_backward()
    stashed = stash.all_fp16_grad_stash if expect_half else stash.all_fp32_grad_stash
    assert all(s is g for s, g in zip(stashed, grads)) and len(stashed) == len(params)
    assert all(p.grad is None for p in params)
    opt._post_amp_backward(amp._amp_state.loss_scalers[0])  # nothing new: the stash returns
    assert all(p.grad is g for p, g in zip(params, grads))
    assert not hasattr(opt, "_master_params_to_model_params")  # apex bound it only at O2
    for name in ("all_fp32_from_fp16_params", "all_fp32_from_fp32_params", "fp16_groups"):
        assert not hasattr(stash, name)
    opt._lazy_init_maybe_master_weights()
    opt._amp_lazy_init()


# -- what attaching must not break ------------------------------------------------------------

def test_class_schedulers_pickling_and_restore(half_dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=half_dtype, verbosity=0)
    after = torch.optim.lr_scheduler.MultiplicativeLR(opt, lambda step: 1.0)
    assert type(opt) is torch.optim.AdamW and isinstance(opt, torch.optim.Optimizer)
    assert all(hasattr(opt, name) for name in PRIVATE_NAMES)
    for step in range(2):
        with amp.scale_loss(_loss(model, step), opt) as scaled:
            scaled.backward()
        opt.step()  # filterwarnings=error: no scheduler warning may be raised
        before.step()
        after.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)
    state = opt.state_dict()
    assert pickle.loads(pickle.dumps(state))["param_groups"] == state["param_groups"]
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["state"].keys() == state["state"].keys()
    for clone in (pickle.loads(pickle.dumps(opt)), copy.deepcopy(opt)):
        assert type(clone) is torch.optim.AdamW
        assert not any(name in vars(clone) for name in (*PRIVATE_NAMES, "_ampx"))
    ampx.restore()
    assert not any(hasattr(opt, name) for name in PRIVATE_NAMES)
    x = torch.randn(8, 8).to(half_dtype)  # restore took the input cast off: a half model
    with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:  # the optimizer
        scaled.backward()  # keeps working
    opt.step()
    with pytest.raises(RuntimeError, match="should only be passed through amp.initialize once"):
        amp.initialize(nn.Linear(2, 2), opt, opt_level="O2", verbosity=0)


def test_passed_through_initialize_twice_keeps_apex_errors() -> None:
    _, opt = _setup("O1")
    with pytest.raises(RuntimeError, match="should only be passed through amp.initialize once"):
        amp.initialize(nn.Linear(2, 2), opt, opt_level="O2", verbosity=0)
    assert apex_stash.is_attached(opt)  # the failed second call left the first one's names


@pytest.mark.parametrize("name", apex_stash.METHOD_NAMES)
def test_an_optimizer_with_an_apex_method_is_refused(name: str) -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    setattr(opt, name, lambda: None)
    with pytest.raises(RuntimeError, match=f"Incoming optimizer already has {name} defined"):
        amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert model.weight.dtype == torch.float32 and not hasattr(opt, "_ampx")
    assert not hasattr(opt, "_amp_stash")


def test_failed_initialize_leaves_no_private_names(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("late failure")

    with monkeypatch.context() as patched:
        patched.setattr("ampx.scaling.scaler.LossScaler.to_", broken)
        with pytest.raises(RuntimeError, match="late failure"):
            amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert not any(name in vars(opt) for name in (*PRIVATE_NAMES, "_ampx"))
    assert not apex_stash.is_attached(opt)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert apex_stash.is_attached(opt)


def test_attach_is_all_or_nothing() -> None:
    _, opt = _setup()
    apex_stash.detach(opt)
    opt._amp_lazy_init = "mine"
    with pytest.raises(RuntimeError, match="already has _amp_lazy_init defined"):
        apex_stash.attach(opt)
    assert not any(name in vars(opt) for name in PRIVATE_NAMES if name != "_amp_lazy_init")
    assert opt._amp_lazy_init == "mine"
    apex_stash.detach(opt)  # leaves the script's own object alone
    assert opt._amp_lazy_init == "mine"


def test_disabled_initialize_binds_nothing_as_in_apex() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, enabled=False, verbosity=0)
    assert not any(hasattr(opt, name) for name in PRIVATE_NAMES)
    _, opt0 = _setup("O0")  # O0 is processed like every other level
    assert apex_stash.is_attached(opt0) and opt0._amp_stash.all_fp16_params == []


def test_an_optimizer_with_a_foreign_amp_stash_is_refused_as_in_apex() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt._amp_stash = object()  # passed through a real apex before
    with pytest.raises(RuntimeError, match="should only be passed through amp.initialize once"):
        amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert model.weight.dtype == torch.float32 and not hasattr(opt, "_ampx")


def test_privates_called_out_of_order_raise_and_change_nothing() -> None:
    model, opt = _setup()
    stash = opt._amp_stash
    with pytest.raises(RuntimeError, match="_prepare_amp_backward"):
        opt._post_amp_backward()  # no pass open
    with pytest.raises(RuntimeError, match="no backward pass is open"):
        stash.params_have_scaled_gradients = True
    assert stash.params_have_scaled_gradients is False
    opt._prepare_amp_backward()
    with pytest.raises(RuntimeError, match="already inside a scale_loss"):
        opt._prepare_amp_backward()
    (_loss(model, 0).float() * amp._amp_state.loss_scalers[0].loss_scale()).backward()
    opt._post_amp_backward()
    assert all(p.grad is not None for p in amp.master_params(opt))
    opt.step()  # the pass was complete: step runs


def test_a_failing_post_drops_the_pass_and_restores_earlier_gradients(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _setup()
    stash = opt._amp_stash
    with amp.scale_loss(_loss(model, 0), opt) as scaled:
        scaled.backward()
    earlier = [p.grad for p in stash.all_fp32_from_fp32_params]
    masters = [p.grad for p in stash.all_fp32_from_fp16_params]
    scale = amp._amp_state.loss_scalers[0].loss_scale()
    opt._prepare_amp_backward()
    (_loss(model, 1).float() * scale).backward()

    def broken(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr("ampx.scaling.unscale.run", broken)
        with pytest.raises(KeyboardInterrupt):
            opt._post_amp_backward()
    assert all(p.grad is g for p, g in zip(stash.all_fp32_from_fp32_params, earlier))
    assert all(p.grad is g for p, g in zip(stash.all_fp32_from_fp16_params, masters))
    assert all(p.grad is None for p in stash.all_fp16_params)
    assert amp._amp_state.loss_scalers[0].loss_scale() == scale
    assert stash.params_have_scaled_gradients is False
    opt._prepare_amp_backward()  # the optimizer is usable again
