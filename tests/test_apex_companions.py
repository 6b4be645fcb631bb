"""apex's companion modules in ampx (ampx.compat.apex), and O1's `Tensor.cpu` (issue 11).

Each name is checked three ways: its signature against apex's documented parameter names and
defaults, its behaviour, and its numerics against a reference written here from apex's
documented update rules (the formulas of apex's CUDA kernels), over several steps, with float32
and with half parameters. The last test runs a legacy-style script whose ``try:`` block imports
every companion under `ampx run`.
"""

from __future__ import annotations

import inspect
import io
import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import required

import ampx
from ampx.compat.apex import fp16_utils, larc, normalization, optimizers, parallel
from ampx.compat.apex.fp16_utils import FP16_Optimizer
from ampx.compat.apex.optimizers import FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

ROOT = Path(__file__).resolve().parents[1]

# -- signatures: apex's documented parameter names and defaults ---------------------------------

APEX_SIGNATURES: dict[Any, list[tuple[str, Any]]] = {
    FusedAdam: [("params", None), ("lr", 1e-3), ("bias_correction", True),
                ("betas", (0.9, 0.999)), ("eps", 1e-8), ("adam_w_mode", True),
                ("weight_decay", 0.0), ("amsgrad", False), ("set_grad_none", True),
                ("capturable", False), ("master_weights", False)],
    FusedSGD: [("params", None), ("lr", required), ("momentum", 0), ("dampening", 0),
               ("weight_decay", 0), ("nesterov", False), ("wd_after_momentum", False),
               ("materialize_master_grads", True), ("set_grad_none", False)],
    FusedLAMB: [("params", None), ("lr", 1e-3), ("bias_correction", True),
                ("betas", (0.9, 0.999)), ("eps", 1e-6), ("weight_decay", 0.01),
                ("amsgrad", False), ("adam_w_mode", True), ("grad_averaging", True),
                ("set_grad_none", True), ("max_grad_norm", 1.0), ("use_nvlamb", False)],
    FusedNovoGrad: [("params", None), ("lr", 1e-3), ("bias_correction", True),
                    ("betas", (0.9, 0.999)), ("eps", 1e-8), ("weight_decay", 0.0),
                    ("amsgrad", False), ("reg_inside_moment", False), ("grad_averaging", True),
                    ("norm_type", 2), ("init_zero", False), ("set_grad_none", True)],
    normalization.FusedLayerNorm: [("normalized_shape", None), ("eps", 1e-5),
                                   ("elementwise_affine", True), ("memory_efficient", False)],
    normalization.FusedRMSNorm: [("normalized_shape", None), ("eps", 1e-5),
                                 ("elementwise_affine", True), ("memory_efficient", False)],
    normalization.MixedFusedLayerNorm: [("normalized_shape", None), ("eps", 1e-5),
                                        ("memory_efficient", False), ("kwargs", None)],
    FP16_Optimizer: [("init_optimizer", None), ("static_loss_scale", 1.0),
                     ("dynamic_loss_scale", False), ("dynamic_loss_args", None),
                     ("verbose", True)],
    FP16_Optimizer.backward: [("self", None), ("loss", None), ("update_master_grads", True),
                              ("retain_graph", False)],
    FP16_Optimizer.step: [("self", None), ("closure", None)],
    FP16_Optimizer.clip_master_grads: [("self", None), ("max_norm", None), ("norm_type", 2)],
    FP16_Optimizer.zero_grad: [("self", None), ("set_grads_to_None", False)],
    fp16_utils.DynamicLossScaler: [("init_scale", 2**32), ("scale_factor", 2.0),
                                   ("scale_window", 1000)],
    fp16_utils.network_to_half: [("network", None)],
    fp16_utils.BN_convert_float: [("module", None)],
    fp16_utils.prep_param_lists: [("model", None), ("flat_master", False)],
    fp16_utils.model_grads_to_master_grads: [("model_params", None), ("master_params", None),
                                             ("flat_master", False)],
    fp16_utils.master_params_to_model_params: [("model_params", None), ("master_params", None),
                                               ("flat_master", False)],
    fp16_utils.to_python_float: [("t", None)],
    parallel.DistributedDataParallel: [
        ("module", None), ("message_size", 10000000), ("delay_allreduce", False),
        ("shared_param", None), ("allreduce_trigger_params", None),
        ("retain_allreduce_buffers", False), ("allreduce_always_fp32", False),
        ("num_allreduce_streams", 1), ("allreduce_communicators", None),
        ("gradient_average", True), ("gradient_predivide_factor", 1.0),
        ("gradient_average_split_factor", None), ("prof", False)],
    parallel.SyncBatchNorm: [("num_features", None), ("eps", 1e-5), ("momentum", 0.1),
                             ("affine", True), ("track_running_stats", True),
                             ("process_group", None), ("channel_last", False),
                             ("fuse_relu", False)],
    parallel.convert_syncbn_model: [("module", None), ("process_group", None),
                                    ("channel_last", False)],
    larc.LARC: [("optimizer", None), ("trust_coefficient", 0.02), ("clip", True),
                ("eps", 1e-8)],
}


@pytest.mark.parametrize("obj", list(APEX_SIGNATURES), ids=lambda o: o.__qualname__)
def test_signature_matches_apex(obj: Any) -> None:
    params = inspect.signature(obj).parameters.values()
    got = [(p.name, None if p.default is inspect.Parameter.empty else p.default) for p in params]
    assert got == APEX_SIGNATURES[obj]


# -- optimizer references, written from apex's kernels ------------------------------------------

def ref_adam(p: torch.Tensor, g: torch.Tensor, st: dict, step: int, lr: float = 1e-3,
             betas: tuple = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
             adam_w_mode: bool = True, bias_correction: bool = True) -> torch.Tensor:
    """multi_tensor_adam.cu, AdamFunctor, per element in float32."""
    b1, b2 = betas
    m, v = st.setdefault("m", torch.zeros_like(p)), st.setdefault("v", torch.zeros_like(p))
    c1 = 1 - b1**step if bias_correction else 1.0
    c2 = 1 - b2**step if bias_correction else 1.0
    if not adam_w_mode:
        g = g + weight_decay * p
    m = st["m"] = b1 * m + (1 - b1) * g
    v = st["v"] = b2 * v + (1 - b2) * g * g
    update = (m / c1) / (torch.sqrt(v / c2) + eps)
    if adam_w_mode:
        update = update + weight_decay * p
    return p - lr * update


def ref_sgd(p: torch.Tensor, g: torch.Tensor, st: dict, step: int, lr: float = 0.1,
            momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
            nesterov: bool = False, wd_after_momentum: bool = False) -> torch.Tensor:
    """multi_tensor_sgd_kernel.cu, SGDFunctor."""
    if weight_decay != 0 and not wd_after_momentum:
        g = g + weight_decay * p
    if momentum != 0:
        buf = st["buf"] = g if "buf" not in st else st["buf"] * momentum + (1 - dampening) * g
        g = g + momentum * buf if nesterov else buf
    if weight_decay != 0 and wd_after_momentum:
        g = g + weight_decay * p
    return p - lr * g


def ref_lamb_stage1(p: torch.Tensor, g: torch.Tensor, st: dict, step: int, clip: float,
                    betas: tuple, eps: float, weight_decay: float, adam_w_mode: bool,
                    grad_averaging: bool, bias_correction: bool) -> torch.Tensor:
    """multi_tensor_lamb.cu, LAMBStage1Functor: the update before the trust ratio."""
    b1, b2 = betas
    b3 = 1 - b1 if grad_averaging else 1.0
    c1 = 1 - b1**step if bias_correction else 1.0
    c2 = 1 - b2**step if bias_correction else 1.0
    m, v = st.setdefault("m", torch.zeros_like(p)), st.setdefault("v", torch.zeros_like(p))
    sg = g / clip
    if not adam_w_mode:
        sg = sg + weight_decay * p
    m = st["m"] = m * b1 + b3 * sg
    v = st["v"] = v * b2 + (1 - b2) * sg * sg
    update = (m / c1) / (torch.sqrt(v / c2) + eps)
    return update + weight_decay * p if adam_w_mode else update


def ref_lamb(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict],
             step: int, lr: float = 1e-3, betas: tuple = (0.9, 0.999), eps: float = 1e-6,
             weight_decay: float = 0.01, adam_w_mode: bool = True, grad_averaging: bool = True,
             max_grad_norm: float = 1.0, use_nvlamb: bool = False,
             bias_correction: bool = True) -> list[torch.Tensor]:
    """FusedLAMB.step + LAMBStage2Functor: global-norm clip, then per-tensor trust ratio."""
    global_norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
    clip = global_norm / max_grad_norm if global_norm > max_grad_norm else 1.0
    out = []
    for p, g, st in zip(params, grads, states):
        u = ref_lamb_stage1(p, g, st, step, clip, betas, eps, weight_decay, adam_w_mode,
                            grad_averaging, bias_correction)
        ratio = lr
        if use_nvlamb or weight_decay != 0:
            pn, un = float(p.norm()), float(u.norm())
            ratio = lr * (pn / un) if pn != 0 and un != 0 else lr
        out.append(p - ratio * u)
    return out


def ref_novograd(p: torch.Tensor, g: torch.Tensor, st: dict, step: int, lr: float = 1e-3,
                 betas: tuple = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 reg_inside_moment: bool = False, grad_averaging: bool = True,
                 norm_type: int = 2, init_zero: bool = False,
                 bias_correction: bool = True) -> torch.Tensor:
    """FusedNovoGrad.step (norm init and blend) + NovoGradFunctor."""
    b1, b2 = betas
    b3 = 1 - b1 if grad_averaging else 1.0
    c1 = 1 - b1**step if bias_correction else 1.0
    c2 = math.sqrt(1 - b2**step) if bias_correction else 1.0
    n = float(g.abs().max()) if norm_type == 0 else float(g.pow(2).sum().sqrt())
    if "norm" not in st:
        st["norm"] = 0.0 if init_zero else n
    if norm_type == 0:
        st["norm"] = b2 * st["norm"] + (1 - b2) * n
    else:
        st["norm"] = math.sqrt(b2 * st["norm"] ** 2 + (1 - b2) * n * n)
    m = st.setdefault("m", torch.zeros_like(p))
    denom = st["norm"] / c2 + eps
    if reg_inside_moment:
        m = st["m"] = b1 * m + b3 * (g / denom + weight_decay * p)
        return p - lr * (m / c1)
    m = st["m"] = b1 * m + b3 * g
    return p - lr * ((m / c1) / denom + weight_decay * p)


def _params(dtype: torch.dtype) -> list[torch.Tensor]:
    shapes = [(6, 5), (5,), (3, 2, 2)]
    return [torch.randn(s).to(dtype).requires_grad_() for s in shapes]


def _grads(params: list[torch.Tensor], scale: float = 1.0) -> list[torch.Tensor]:
    return [(torch.randn(p.shape) * scale).to(p.dtype) for p in params]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=3e-6, atol=3e-7)
    else:  # one rounding into the half dtype either way: at most one unit in the last place
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-6)


def _run_per_tensor(make: Callable, ref: Callable, kwargs: dict, dtype: torch.dtype,
                    steps: int = 5) -> None:
    params = _params(dtype)
    opt = make(params, **kwargs)
    expected = [p.detach().float().clone() for p in params]
    states: list[dict] = [{} for _ in params]
    for step in range(1, steps + 1):
        grads = _grads(params)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        for i, g in enumerate(grads):
            # apex's kernels read the (half) parameter, compute in float32, write it back.
            expected[i] = ref(expected[i].to(dtype).float(), g.float(), states[i], step,
                              **kwargs).to(dtype).float()
        for p, e in zip(params, expected):
            _close(p.detach(), e.to(dtype))


ADAM_CASES = [
    {}, {"lr": 0.05, "weight_decay": 0.1}, {"lr": 0.05, "weight_decay": 0.1, "adam_w_mode": False},
    {"lr": 0.01, "betas": (0.8, 0.95), "eps": 1e-6, "bias_correction": False},
]
SGD_CASES = [
    {"lr": 0.1}, {"lr": 0.1, "momentum": 0.9}, {"lr": 0.1, "momentum": 0.9, "dampening": 0.2},
    {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1, "wd_after_momentum": True},
]
NOVOGRAD_CASES = [
    {}, {"lr": 0.01, "weight_decay": 0.1}, {"lr": 0.01, "weight_decay": 0.1,
                                            "reg_inside_moment": True},
    {"lr": 0.01, "norm_type": 0}, {"lr": 0.01, "init_zero": True},
    {"lr": 0.01, "grad_averaging": False, "bias_correction": False, "norm_type": 0,
     "init_zero": True},
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kwargs", ADAM_CASES, ids=str)
def test_fused_adam_matches_apex_rule(kwargs: dict, dtype: torch.dtype) -> None:
    _run_per_tensor(FusedAdam, ref_adam, kwargs, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kwargs", SGD_CASES, ids=str)
def test_fused_sgd_matches_apex_rule(kwargs: dict, dtype: torch.dtype) -> None:
    _run_per_tensor(FusedSGD, ref_sgd, kwargs, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kwargs", NOVOGRAD_CASES, ids=str)
def test_fused_novograd_matches_apex_rule(kwargs: dict, dtype: torch.dtype) -> None:
    _run_per_tensor(FusedNovoGrad, ref_novograd, kwargs, dtype)


LAMB_CASES = [
    ({}, 1.0), ({}, 0.01),  # the global gradient norm above and below max_grad_norm
    ({"lr": 0.01, "weight_decay": 0.0}, 1.0), ({"lr": 0.01, "weight_decay": 0.0,
                                                "use_nvlamb": True}, 1.0),
    ({"lr": 0.01, "adam_w_mode": False, "grad_averaging": False}, 1.0),
    ({"lr": 0.01, "max_grad_norm": 5.0, "bias_correction": False, "betas": (0.8, 0.9)}, 1.0),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("kwargs", "grad_scale"), LAMB_CASES, ids=str)
def test_fused_lamb_matches_apex_rule(kwargs: dict, grad_scale: float,
                                      dtype: torch.dtype) -> None:
    params = _params(dtype)
    opt = FusedLAMB([{"params": params[:2]}, {"params": params[2:]}], **kwargs)
    expected = [p.detach().float().clone() for p in params]
    states: list[dict] = [{} for _ in params]
    for step in range(1, 6):
        grads = _grads(params, grad_scale)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        current = [e.to(dtype).float() for e in expected]
        expected = [e.to(dtype).float() for e in ref_lamb(
            current, [g.float() for g in grads], states, step, **kwargs)]
        for p, e in zip(params, expected):
            _close(p.detach(), e.to(dtype))


@pytest.mark.parametrize(("ours", "theirs", "kwargs"), [
    (FusedAdam, torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
    (FusedAdam, torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.1, "adam_w_mode": False}),
    (FusedSGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True,
                                 "weight_decay": 0.01}),
], ids=["adamw", "adam", "sgd"])
def test_fused_optimizers_match_their_torch_twins(ours: Any, theirs: Any, kwargs: dict) -> None:
    a, b = _params(torch.float32), None
    b = [p.detach().clone().requires_grad_() for p in a]
    twin_kwargs = {k: v for k, v in kwargs.items() if k != "adam_w_mode"}
    opt_a, opt_b = ours(a, **kwargs), theirs(b, **twin_kwargs)
    for _ in range(5):
        for pa, pb, g in zip(a, b, _grads(a)):
            pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


# -- optimizer behaviour ------------------------------------------------------------------------

ALL_FUSED = [(FusedAdam, {}), (FusedSGD, {"lr": 0.1, "momentum": 0.9}), (FusedLAMB, {}),
             (FusedNovoGrad, {})]


@pytest.mark.parametrize(("cls", "kwargs"), ALL_FUSED, ids=lambda x: getattr(x, "__name__", ""))
def test_set_grad_none_and_state_dict_round_trip(cls: Any, kwargs: dict) -> None:
    params = _params(torch.float32)
    opt = cls(params, **kwargs)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.zero_grad()
    expect_none = getattr(opt, "set_grad_none")
    assert all((p.grad is None) == expect_none for p in params)
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in params)

    twin_params = [p.detach().clone().requires_grad_() for p in params]
    twin = cls(twin_params, **kwargs)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    twin.load_state_dict(torch.load(buffer, weights_only=True))
    for _ in range(2):
        grads = _grads(params)
        for p, q, g in zip(params, twin_params, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        twin.step()
    for p, q in zip(params, twin_params):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize(("cls", "kwargs"), ALL_FUSED, ids=lambda x: getattr(x, "__name__", ""))
def test_a_step_without_gradients_changes_nothing(cls: Any, kwargs: dict) -> None:
    params = _params(torch.float32)
    opt = cls(params, **kwargs)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    before = [p.detach().clone() for p in params]
    state = [v.clone() for s in opt.state.values() for v in s.values()]
    steps = [g.get("step") for g in opt.param_groups]
    opt.zero_grad(set_to_none=True)
    opt.step()  # what ampx's skipped step leaves the optimizer with: no gradients
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    assert [g.get("step") for g in opt.param_groups] == steps
    after = [v for s in opt.state.values() for v in s.values()]
    assert len(after) == len(state) and all(torch.equal(a, b) for a, b in zip(after, state))


def test_optimizer_errors_name_the_option() -> None:
    p = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam(p, amsgrad=True)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedLAMB(p, amsgrad=True)
    with pytest.raises(ValueError, match="lr"):
        FusedAdam(p, lr=-1)
    with pytest.raises(ValueError, match="betas"):
        FusedLAMB(p, betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="norm_type"):
        FusedNovoGrad(p, norm_type=1)
    with pytest.raises(ValueError, match="Nesterov"):
        FusedSGD(p, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="required optimization parameter lr"):
        FusedSGD(p)
    with pytest.raises(RuntimeError, match="call step\\(\\) with no arguments"):
        FusedAdam(p).step(scale=128.0)
    sparse = torch.zeros(3, requires_grad=True)
    sparse.grad = torch.zeros(3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        FusedAdam([sparse]).step()


def test_fused_adam_master_weights_keep_fp32_copies() -> None:
    p = torch.randn(8).bfloat16().requires_grad_()
    start = p.detach().float()
    opt = FusedAdam([p], lr=1e-4, master_weights=True)
    expected, st = start.clone(), {}
    for step in range(1, 4):
        g = torch.randn(8).bfloat16()
        p.grad = g
        opt.step()
        expected = ref_adam(expected, g.float(), st, step, lr=1e-4)
    master = opt.state[p]["master_param"]
    assert master.dtype == torch.float32
    torch.testing.assert_close(master, expected, rtol=3e-6, atol=3e-7)
    assert torch.equal(p.detach(), expected.bfloat16())  # one rounding, from the master


def test_closure_runs_with_grad_enabled() -> None:
    w = torch.ones(3, requires_grad=True)
    opt = FusedLAMB([w])

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (w * 2).sum()
        loss.backward()
        return loss

    with torch.no_grad():
        loss = opt.step(closure)
    assert float(loss.detach()) == 6.0 and not torch.equal(w.detach(), torch.ones(3))


@pytest.mark.parametrize(("cls", "kwargs"), ALL_FUSED, ids=lambda x: getattr(x, "__name__", ""))
def test_under_ampx_o2_fp16_overflow_skips_the_step(cls: Any, kwargs: dict) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = cls(model.parameters(), **kwargs)
    model, opt = ampx.initialize(model, opt, opt_level="O2", dtype="fp16", verbosity=0)
    x = torch.randn(16, 4).half()
    for _ in range(2):
        opt.zero_grad()
        with ampx.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    assert all(v.dtype == torch.float32 for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))
    before = [p.detach().clone() for p in model.parameters()]
    masters = [p.detach().clone() for p in ampx.master_params(opt)]
    opt.zero_grad()
    with ampx.scale_loss(model(x).float().sum() * float("inf"), opt) as scaled:
        scaled.backward()
    opt.step()
    assert ampx.step_was_skipped(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(masters, ampx.master_params(opt)))
    ampx.restore()


# -- Tensor.cpu under O1 (issue 11 item 1; apex's test_cpu_is_float) ------------------------------

def test_cpu_is_float(half_dtype: torch.dtype) -> None:
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampx.initialize(model, opt, opt_level="O1", dtype=half_dtype, verbosity=0)
    for dtype in (torch.float32, half_dtype):
        x = torch.randn(5, dtype=dtype, requires_grad=True)
        y = x.cpu()
        assert y.dtype == torch.float32
        y.float().sum().backward()
        assert x.grad is not None and x.grad.dtype == dtype  # the gradient goes back in kind
    logits = model(torch.randn(2, 4))
    assert logits.dtype == half_dtype
    array = logits.detach().cpu().numpy()  # numpy has no bfloat16: this raised before
    assert array.dtype.name == "float32" and array.shape == (2, 3)
    with ampx.disable_casts():
        assert logits.cpu().dtype == half_dtype
    assert torch.randn(2, dtype=torch.float64).cpu().dtype == torch.float64
    ampx.restore()
    assert logits.cpu().dtype == half_dtype
