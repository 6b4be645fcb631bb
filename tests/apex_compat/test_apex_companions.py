"""apex's companion modules in ampx (ampx.compat.apex), and O1's `Tensor.cpu` (issue 11).

Each name is checked three ways: its signature against apex's documented parameter names and
defaults, its behaviour, and its numerics against a reference written here from apex's
documented update rules (the formulas of apex's CUDA kernels), over several steps, with float32
and with half parameters. The last test runs a legacy-style script whose ``try:`` block imports
every companion under `ampx run`.
"""

from __future__ import annotations

import copy
import gc
import inspect
import io
import math
import os
import pickle
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
from ampx.compat.apex import fp16_utils, larc, normalization, parallel
from ampx.compat.apex.fp16_utils import FP16_Optimizer
from ampx.compat.apex.optimizers import FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

ROOT = Path(__file__).resolve().parents[2]

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
    tensors = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    assert all(v.dtype == torch.float32 for v in tensors)  # state in float32
    assert tensors or kwargs.get("momentum", 0) == 0  # (FusedSGD keeps none without momentum)


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
    expect_none = opt.set_grad_none
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


def test_no_op_options_and_per_parameter_details() -> None:
    def trained(make: Callable, grads: list) -> list[torch.Tensor]:
        params = [torch.ones(3, requires_grad=True), torch.ones(2, requires_grad=True)]
        opt = make(params)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = None if g is None else g.clone()
            opt.step()
        return [p.detach() for p in params]

    grads = [[torch.randn(3), None], [torch.randn(3), torch.randn(2)], [torch.randn(3),
                                                                         torch.randn(2)]]
    pairs = [
        (lambda p: FusedAdam(p, lr=0.1), lambda p: FusedAdam(p, lr=0.1, capturable=True)),
        (lambda p: FusedSGD(p, lr=0.1, momentum=0.9),
         lambda p: FusedSGD(p, lr=0.1, momentum=0.9, materialize_master_grads=False)),
        (lambda p: FusedLAMB(p, max_grad_norm=1e9), lambda p: FusedLAMB(p, max_grad_norm=0)),
        (lambda p: FusedLAMB(p, max_grad_norm=1e9), lambda p: FusedLAMB(p, max_grad_norm=None)),
    ]
    for a, b in pairs:
        assert all(torch.equal(x, y) for x, y in zip(trained(a, grads), trained(b, grads)))
    # FusedSGD: the second parameter's first step (step 2) starts its momentum at its gradient.
    sgd = trained(lambda p: FusedSGD(p, lr=0.1, momentum=0.9), grads)
    buf = grads[1][1]
    expected = torch.ones(2) - 0.1 * buf
    expected = expected - 0.1 * (0.9 * buf + grads[2][1])
    torch.testing.assert_close(sgd[1], expected)
    # FusedLAMB leaves .grad alone; NovoGrad keeps a 0-d norm per parameter.
    w = torch.ones(3, requires_grad=True)
    w.grad = torch.full((3,), 0.5)
    FusedLAMB([w]).step()
    assert torch.equal(w.grad, torch.full((3,), 0.5))
    novo = FusedNovoGrad([w])
    novo.step()
    assert novo.state[w]["exp_avg_sq"].shape == () and float(novo.state[w]["exp_avg_sq"]) > 0
    x = torch.randn(2, 8)
    ln, ln_eff = normalization.FusedLayerNorm(8), normalization.FusedLayerNorm(
        8, memory_efficient=True)
    assert torch.equal(ln(x), ln_eff(x))


@pytest.mark.parametrize("make", [
    lambda p: FusedAdam(p, lr=0.1, adam_w_mode=False, weight_decay=0.1, set_grad_none=False),
    lambda p: FusedSGD(p, lr=0.1, momentum=0.9, weight_decay=0.1, wd_after_momentum=True),
    lambda p: FusedLAMB(p, adam_w_mode=False, use_nvlamb=True),
    lambda p: FusedNovoGrad(p, reg_inside_moment=True, weight_decay=0.1),
    lambda p: larc.LARC(torch.optim.SGD(p, lr=0.1, weight_decay=0.1), clip=False),
], ids=["adam", "sgd", "lamb", "novograd", "larc"])
def test_optimizers_deepcopy_and_pickle_with_their_options(make: Callable) -> None:
    model = nn.Linear(3, 2)
    opt = make(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    copied_model = copy.deepcopy(model)
    twin = copy.deepcopy({"model": model, "opt": opt})  # the optimizer follows its params
    assert vars(pickle.loads(pickle.dumps(opt))).keys() >= {
        k for k in vars(opt) if not k.startswith("_")}
    twin_model, twin_opt = twin["model"], twin["opt"]
    for m, o in ((model, opt), (twin_model, twin_opt)):
        o.zero_grad(set_to_none=True)
        m(torch.ones(4, 3)).sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(),
                                                     copied_model.parameters()))


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


# -- apex.normalization -------------------------------------------------------------------------

def ref_layer_norm(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, dims: int,
                   eps: float) -> torch.Tensor:
    """apex's layer norm contract: float32 statistics (biased variance), then the affine."""
    xf = x.float()
    axes = tuple(range(-dims, 0))
    mean = xf.mean(axes, keepdim=True)
    var = ((xf - mean) ** 2).mean(axes, keepdim=True)
    out = (xf - mean) / torch.sqrt(var + eps)
    return out if w is None else out * w.float() + b.float()  # type: ignore[union-attr]


def ref_rms_norm(x: torch.Tensor, w: torch.Tensor | None, dims: int, eps: float
                 ) -> torch.Tensor:
    xf = x.float()
    out = xf / torch.sqrt(xf.pow(2).mean(tuple(range(-dims, 0)), keepdim=True) + eps)
    return out if w is None else out * w.float()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [8, [4, 8]], ids=str)
def test_fused_layer_norm(shape: Any, dtype: torch.dtype) -> None:
    layer = normalization.FusedLayerNorm(shape, eps=1e-5)
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"]
    layer.load_state_dict(nn.LayerNorm(shape).state_dict())  # checkpoints load both ways
    nn.LayerNorm(shape).load_state_dict(layer.state_dict())
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    x = torch.randn(3, 4, 8).to(dtype).requires_grad_()
    out = layer(x)
    assert out.dtype == dtype
    dims = len(layer.normalized_shape)
    _close(out.detach(), ref_layer_norm(x.detach(), layer.weight, layer.bias, dims, 1e-5)
           .to(dtype))
    out.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == dtype and layer.weight.grad is not None
    if dtype == torch.float32:  # the same as torch's layer norm
        torch.testing.assert_close(out, F.layer_norm(x, layer.normalized_shape, layer.weight,
                                                     layer.bias, 1e-5))
    plain = normalization.FusedLayerNorm(shape, elementwise_affine=False)
    assert list(plain.parameters()) == [] and plain.weight is None
    _close(plain(x).detach(), ref_layer_norm(x.detach(), None, None, dims, 1e-5).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_rms_norm(dtype: torch.dtype) -> None:
    layer = normalization.FusedRMSNorm(8, eps=1e-6)
    with torch.no_grad():
        layer.weight.normal_()
    x = torch.randn(5, 8).to(dtype)
    out = layer(x)
    assert out.dtype == dtype
    _close(out, ref_rms_norm(x, layer.weight, 1, 1e-6).to(dtype))
    torch_rms = nn.RMSNorm(8, eps=1e-6)
    torch_rms.load_state_dict(layer.state_dict())
    torch.testing.assert_close(layer(x.float()), torch_rms(x.float()))
    assert list(normalization.FusedRMSNorm(8, elementwise_affine=False).parameters()) == []


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=str)
def test_mixed_fused_norms_return_the_parameter_dtype(half: torch.dtype) -> None:
    x = torch.randn(4, 8).to(half)
    ln = normalization.MixedFusedLayerNorm(8)
    rms = normalization.MixedFusedRMSNorm(8)
    assert ln(x).dtype == torch.float32 and rms(x).dtype == torch.float32
    torch.testing.assert_close(ln(x), ref_layer_norm(x, ln.weight, ln.bias, 1, 1e-5))
    torch.testing.assert_close(rms(x), ref_rms_norm(x, rms.weight, 1, 1e-5))
    assert normalization.FusedLayerNorm(8)(x).dtype == half  # the non-mixed one: input dtype
    ln.to(half)
    assert ln(x.float()).dtype == half
    with pytest.warns(UserWarning, match="does not support `elementwise_affine`"):
        normalization.MixedFusedLayerNorm(8, elementwise_affine=True)
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="= False"):
        normalization.MixedFusedRMSNorm(8, elementwise_affine=False)
    with pytest.raises(TypeError, match="unexpected keyword"):
        normalization.MixedFusedLayerNorm(8, bogus=1)


def test_fused_layer_norm_under_o1_keeps_fp32_statistics() -> None:
    model = nn.Sequential(nn.Linear(8, 8), normalization.FusedLayerNorm(8), nn.Linear(8, 2))
    opt = FusedAdam(model.parameters(), lr=1e-3)
    model, opt = ampx.initialize(model, opt, opt_level="O1", dtype="bf16", verbosity=0)
    x = torch.randn(4, 8)
    hidden = model[0](x)
    assert hidden.dtype == torch.bfloat16
    normed = model[1](hidden)
    assert normed.dtype == torch.bfloat16  # apex's fused kernel: the input's dtype
    _close(normed.detach(), ref_layer_norm(hidden.detach(), model[1].weight, model[1].bias, 1,
                                           1e-5).bfloat16())
    ampx.restore()


# -- apex.fp16_utils ----------------------------------------------------------------------------

def _bn_net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def test_network_to_half_and_bn_convert_float() -> None:
    net = fp16_utils.network_to_half(_bn_net())
    assert isinstance(net[0], fp16_utils.tofp16)
    inner = net[1]
    assert inner[0].weight.dtype == torch.float16 and inner[3].weight.dtype == torch.float16
    assert inner[1].weight.dtype == torch.float32 and inner[1].running_mean.dtype == torch.float32
    assert net(torch.randn(6, 4)).dtype == torch.float16  # float input cast by tofp16
    assert fp16_utils.BN_convert_float(_bn_net().half())[1].weight.dtype == torch.float32


def test_convert_network_and_fp16_model() -> None:
    net = fp16_utils.convert_network(_bn_net(), torch.bfloat16)
    assert net[0].weight.dtype == torch.bfloat16 and net[1].weight.dtype == torch.float32
    model = fp16_utils.FP16Model(_bn_net())
    assert model(torch.randn(3, 4)).dtype == torch.float16
    module = fp16_utils.FP16_Module(nn.Linear(4, 2))
    out = module(torch.randn(3, 4))
    assert out.dtype == torch.float32 and module.module.weight.dtype == torch.float16
    assert set(module.state_dict()) == {"weight", "bias"}
    assert fp16_utils.fp32_to_fp16([torch.ones(1), (torch.ones(1, dtype=torch.int64),)])[0] \
        .dtype == torch.float16
    assert fp16_utils.to_python_float(torch.tensor(2.5)) == 2.5
    assert fp16_utils.to_python_float([3.0]) == 3.0


@pytest.mark.parametrize("flat", [False, True], ids=["lists", "flat"])
def test_manual_master_params(flat: bool, half_dtype: torch.dtype) -> None:
    model = nn.Linear(4, 3).to(half_dtype)
    model_params, masters = fp16_utils.prep_param_lists(model, flat_master=flat)
    assert model_params == list(model.parameters())
    assert all(m.dtype == torch.float32 and m.requires_grad for m in masters)
    assert len(masters) == (1 if flat else 2)
    if flat:
        assert torch.equal(masters[0].grad, torch.zeros_like(masters[0]))
        mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to(half_dtype))
        with pytest.raises(TypeError, match="flat_master=False"):
            fp16_utils.prep_param_lists(mixed, flat_master=True)
    model(torch.randn(2, 4, dtype=half_dtype)).float().sum().backward()
    fp16_utils.model_grads_to_master_grads(model_params, masters, flat_master=flat)
    grads = torch.cat([p.grad.float().flatten() for p in model_params])
    got = torch.cat([m.grad.flatten() for m in masters])  # type: ignore[union-attr]
    assert torch.equal(got, grads)
    with torch.no_grad():
        for m in masters:
            m.add_(1.0)
    fp16_utils.master_params_to_model_params(model_params, masters, flat_master=flat)
    values = torch.cat([p.detach().flatten() for p in model_params])
    assert torch.equal(values, torch.cat([m.detach().flatten() for m in masters]).to(half_dtype))


def _fp16_reference(model: nn.Module, batches: list, lr: float, scale: float
                    ) -> list[torch.Tensor]:
    """FP16_Optimizer's documented steps by hand: loss.float()*scale, backward, copy the half
    grads into float32 masters, divide by the scale, SGD on the masters, copy back."""
    masters = [p.detach().float().clone() for p in model.parameters()]
    for x in batches:
        model.zero_grad()
        (model(x).float().pow(2).mean() * scale).backward()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                m -= lr * (p.grad.float() / scale)
                p.copy_(m)
    return masters


def test_fp16_optimizer_static_scale_matches_reference(half_dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    base = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ref_model = _copy_model(base).to(half_dtype)
    model = _copy_model(base).to(half_dtype)
    batches = [torch.randn(8, 4, dtype=half_dtype) for _ in range(4)]
    expected = _fp16_reference(ref_model, batches, 0.1, 128.0)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=128.0,
                         verbose=False)
    for x in batches:
        opt.zero_grad()
        opt.backward(model(x).float().pow(2).mean())
        opt.step()
    masters = [p for g in opt.fp32_from_fp16_groups for p in g]
    for got, want in zip(masters, expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for p, m in zip(model.parameters(), masters):
        assert p.dtype == half_dtype and torch.equal(p.detach(), m.detach().to(half_dtype))


def _copy_model(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_fp16_optimizer_moves_existing_state_to_the_masters() -> None:
    model = nn.Linear(3, 2).half()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    inner.step()  # momentum buffers exist, keyed by the half parameters
    opt = FP16_Optimizer(inner, verbose=False)
    masters = [p for g in opt.fp32_from_fp16_groups for p in g]
    assert set(inner.state) == set(masters)
    assert all(inner.state[m]["momentum_buffer"].dtype == torch.float32 for m in masters)
    assert all(p not in inner.state for p in model.parameters())


def test_fp16_optimizer_dynamic_scale_skips_and_grows() -> None:
    model = nn.Linear(4, 2).half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                         dynamic_loss_args={"init_scale": 2.0**4, "scale_window": 2},
                         verbose=False)
    x = torch.randn(3, 4).half()
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    opt.backward(model(x).float().sum() * float("inf"))
    assert opt.overflow and opt.clip_master_grads(1.0) == -1
    assert opt.inspect_master_grad_data() is None
    assert opt.step() is None  # skipped
    assert opt.loss_scale == 8.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    scales = []
    for _ in range(4):
        opt.zero_grad()
        opt.backward(model(x).float().pow(2).mean())
        assert not opt.overflow
        norm = opt.clip_master_grads(1e-3)
        assert float(norm) > 0
        masters = [p for g in opt.param_groups for p in g["params"]]
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(m.grad)
                                                      for m in masters]))
        assert float(total) <= 1e-3 * (1 + 1e-5)
        grads = opt.inspect_master_grad_data()
        assert grads is not None and all(g[0] is not None for g in grads)
        opt.step()
        scales.append(opt.loss_scale)
    # apex's rule: after the overflow at iteration 0, grow when (iter - 0) % window == 0.
    assert scales == [8.0, 16.0, 16.0, 32.0]
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(TypeError, match="closure"):
        opt.step(lambda: None)


def test_fp16_optimizer_state_dict_round_trip(half_dtype: torch.dtype) -> None:
    def make(model: nn.Module) -> FP16_Optimizer:
        inner = torch.optim.Adam(model.parameters(), lr=1e-2)
        return FP16_Optimizer(inner, dynamic_loss_scale=True, verbose=False,
                              dynamic_loss_args={"init_scale": 2.0**8})

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).to(half_dtype)
    opt = make(model)
    x = torch.randn(5, 4, dtype=half_dtype)

    def train(m: nn.Module, o: FP16_Optimizer) -> None:
        o.zero_grad(set_grads_to_None=True)
        o.backward(m(x).float().pow(2).mean())
        o.step()

    for _ in range(3):
        train(model, opt)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # plain data only
    clone = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).to(half_dtype)
    clone.load_state_dict(saved["model"])
    clone_opt = make(clone)
    clone_opt.load_state_dict(saved["opt"])
    assert clone_opt.loss_scale == opt.loss_scale
    for _ in range(2):
        train(model, opt)
        train(clone, clone_opt)
    for a, b in zip(model.parameters(), clone.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="state_dict"):
        pickle.dumps(opt)


def test_fp16_optimizer_loads_apex_scaler_objects_and_refuses_bad_input() -> None:
    model = nn.Linear(4, 2).half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                         verbose=False)
    state = opt.state_dict()
    apex_scaler = fp16_utils.DynamicLossScaler(init_scale=512.0, scale_window=7)
    apex_scaler.cur_iter, apex_scaler.last_overflow_iter = 40, 33
    opt.load_state_dict({**state, "loss_scaler": apex_scaler})  # apex pickled the object
    assert opt.loss_scale == 512.0 and opt.loss_scaler.cur_iter == 40  # type: ignore[attr-defined]
    assert opt.loss_scaler is not apex_scaler
    before = opt.state_dict()
    bad_masters = {**state, "fp32_from_fp16": [[torch.zeros(3)]]}
    with pytest.raises(ValueError, match="fp32_from_fp16"):
        opt.load_state_dict(bad_masters)
    with pytest.raises(ValueError, match="missing key"):
        opt.load_state_dict({"overflow": False})
    with pytest.raises(ValueError, match="cur_scale"):
        opt.load_state_dict({**state, "loss_scaler": {"scale": 2.0}})
    assert opt.state_dict()["loss_scaler"] == before["loss_scaler"]  # nothing changed
    with pytest.raises(TypeError, match="float32 or half"):
        FP16_Optimizer(torch.optim.SGD([torch.zeros(2, dtype=torch.float64,
                                                    requires_grad=True)], lr=0.1))


def test_fp16_optimizer_static_closure_and_verbose_logging(caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    model = nn.Linear(4, 2).half()
    with caplog.at_level("INFO", logger="ampx"):
        opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                             static_loss_scale=4.0)
    assert "FP16_Optimizer processing param group 0:" in caplog.text
    x = torch.randn(3, 4).half()

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        opt.backward(loss)
        return loss

    before = model.weight.detach().clone()
    loss = opt.step(closure)
    assert loss is not None and not torch.equal(before, model.weight)


# -- apex.parallel: LARC ------------------------------------------------------------------------

def ref_larc_sgd(p: torch.Tensor, g: torch.Tensor, lr: float, weight_decay: float,
                 trust: float, clip: bool, eps: float) -> torch.Tensor:
    """apex/parallel/LARC.py's step on SGD (momentum 0): the gradient is rescaled, then SGD."""
    pn, gn = float(p.norm()), float(g.norm())
    if pn != 0 and gn != 0:
        rate = trust * pn / (gn + pn * weight_decay + eps)
        if clip:
            rate = min(rate / lr, 1.0)
        g = (g + weight_decay * p) * rate
    return p - lr * g


@pytest.mark.parametrize("clip", [True, False], ids=["clip", "scale"])
def test_larc_matches_apex_rule(clip: bool) -> None:
    params = _params(torch.float32)
    with torch.no_grad():
        params[1].zero_()  # a zero-norm parameter: left alone (no decay either), as in apex
    inner = torch.optim.SGD(params, lr=0.5, weight_decay=0.01)
    opt = larc.LARC(inner, trust_coefficient=0.02, clip=clip)
    expected = [p.detach().clone() for p in params]
    for _ in range(4):
        grads = _grads(params)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        expected = [ref_larc_sgd(e, g, 0.5, 0.01, 0.02, clip, 1e-8)
                    for e, g in zip(expected, grads)]
        for p, e in zip(params, expected):
            torch.testing.assert_close(p.detach(), e, rtol=2e-6, atol=2e-7)
    assert inner.param_groups[0]["weight_decay"] == 0.01  # restored after each step
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    assert opt.state_dict() == inner.state_dict()


def test_larc_restores_weight_decay_when_the_step_raises() -> None:
    class Broken(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            raise KeyboardInterrupt

    p = torch.ones(3, requires_grad=True)
    p.grad = torch.ones(3)
    opt = larc.LARC(Broken([p], lr=0.1, weight_decay=0.5))
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert opt.param_groups[0]["weight_decay"] == 0.5


def test_larc_with_ampx_initialize_and_a_scheduler() -> None:
    model = nn.Linear(4, 2)
    opt = larc.LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    model, opt = ampx.initialize(model, opt, opt_level="O1", dtype="bf16", verbosity=0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    before = model.weight.detach().clone()
    for _ in range(2):
        opt.zero_grad()
        with ampx.scale_loss(model(torch.randn(8, 4)).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        scheduler.step()
    assert not torch.equal(before, model.weight)
    assert opt.optim.param_groups[0]["lr"] == pytest.approx(0.025)
    ampx.restore()


# -- apex.parallel: DistributedDataParallel, SyncBatchNorm (single-process gloo group) ------------

@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One single-rank gloo group for the module's DDP/SyncBatchNorm tests.

    Created once: DDP reducers that outlive their process group (freed later by the garbage
    collector) made gloo's worker threads abort the whole test process now and then, so the
    group lives until every such object is collected.
    """
    store = tmp_path_factory.mktemp("gloo") / "store"
    excepthook = sys.excepthook  # init_process_group prefixes it with "[rank0]:" for good
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()  # DDP reducers go while their group is still alive
        dist.destroy_process_group()
        sys.excepthook = excepthook


def _grads_of(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    model(x).float().pow(2).mean().backward()
    return [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


def test_ddp_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        parallel.DistributedDataParallel(nn.Linear(2, 2))


@pytest.mark.parametrize(("kwargs", "factor"), [
    ({}, 1.0),
    ({"delay_allreduce": True, "shared_param": True, "allreduce_trigger_params": [],
      "retain_allreduce_buffers": True, "num_allreduce_streams": 2, "prof": True}, 1.0),
    ({"gradient_predivide_factor": 4.0}, 1.0),
    ({"gradient_average": False, "gradient_predivide_factor": 2.0}, 0.5),
    ({"gradient_average": False, "gradient_average_split_factor": 4.0}, 0.25),
    ({"allreduce_always_fp32": True}, 1.0),
], ids=["default", "no-op-options", "predivide", "no-average", "split-factor", "fp32"])
def test_ddp_reduces_like_apex(gloo: None, kwargs: dict, factor: float,
                               half_dtype: torch.dtype) -> None:
    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(half_dtype)
    ddp = parallel.DistributedDataParallel(_copy_model(plain), **kwargs)
    assert isinstance(ddp, nn.parallel.DistributedDataParallel)
    x = torch.randn(6, 4, dtype=half_dtype)
    for _ in range(2):  # the first backward builds torch's buckets
        got = _grads_of(ddp, x)
    for g, ref in zip(got, _grads_of(plain, x)):
        torch.testing.assert_close(g, ref * factor, rtol=0, atol=0)
    assert ddp.bucket_bytes_cap == 10000000 * 4 and ddp.message_size == 10000000


def test_sync_batch_norm_single_process_equals_batch_norm(gloo: None) -> None:
    reference = nn.BatchNorm2d(3)
    sync = parallel.SyncBatchNorm(3)
    sync.load_state_dict(reference.state_dict())
    for _ in range(2):
        x = torch.randn(4, 3, 5, 5)
        torch.testing.assert_close(sync(x), reference(x))
    torch.testing.assert_close(sync.running_mean, reference.running_mean)
    torch.testing.assert_close(sync.running_var, reference.running_var)
    sync.eval()
    reference.eval()
    torch.testing.assert_close(sync(x), reference(x))


def test_sync_batch_norm_channel_last_fuse_relu_and_half_input() -> None:
    sync = parallel.SyncBatchNorm(3, channel_last=True, fuse_relu=True)
    reference = nn.BatchNorm2d(3)
    x = torch.randn(2, 5, 5, 3)
    z = torch.randn(2, 5, 5, 3)
    expected = F.relu(reference(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1) + z)
    torch.testing.assert_close(sync(x, z), expected)
    bn = parallel.SyncBatchNorm(3)
    assert bn(torch.randn(4, 3, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_convert_syncbn_model() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4),
                          nn.Sequential(nn.BatchNorm1d(4, momentum=0.3, eps=1e-3)))
    with torch.no_grad():
        model[1].weight.fill_(2.0)
    model[1](torch.randn(2, 4, 3, 3))  # running statistics to carry over
    model.eval()
    bn = model[1]
    converted = parallel.convert_syncbn_model(model, channel_last=False)
    assert converted is model  # converted in place, as in apex
    new_bn, new_inner = converted[1], converted[2][0]
    assert type(new_bn) is parallel.SyncBatchNorm and type(new_inner) is parallel.SyncBatchNorm
    assert new_bn.running_mean is bn.running_mean and new_bn.running_var is bn.running_var
    assert torch.equal(new_bn.weight, bn.weight) and new_bn.weight is not bn.weight
    assert (new_inner.momentum, new_inner.eps) == (0.3, 1e-3)
    assert not new_bn.training and isinstance(converted[0], nn.Conv2d)
    assert new_bn.num_batches_tracked is bn.num_batches_tracked
    frozen = nn.BatchNorm1d(2)
    frozen.weight.requires_grad_(False)
    assert not parallel.convert_syncbn_model(frozen).weight.requires_grad
    single = parallel.convert_syncbn_model(nn.BatchNorm1d(2))
    assert isinstance(single, parallel.SyncBatchNorm)


TWO_RANKS = textwrap.dedent("""
    import gc
    import sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch import nn
    from ampx.compat.apex import parallel

    def worker(rank, store):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        torch.manual_seed(0)
        full = torch.randn(8, 3, 4)                    # both ranks' batches
        x = full[rank * 4:(rank + 1) * 4].clone().requires_grad_()
        # SyncBatchNorm: statistics and input gradients over the whole batch
        sync, ref = parallel.SyncBatchNorm(3), nn.BatchNorm1d(3)
        xr = full.clone().requires_grad_()
        weights = torch.linspace(0.5, 2.0, 8 * 3 * 4).view(8, 3, 4)
        (sync(x) * weights[rank * 4:(rank + 1) * 4]).sum().backward()
        (ref(xr) * weights).sum().backward()
        torch.testing.assert_close(sync.running_var, ref.running_var)
        torch.testing.assert_close(sync.running_mean, ref.running_mean)
        torch.testing.assert_close(x.grad, xr.grad[rank * 4:(rank + 1) * 4], rtol=1e-4,
                                   atol=1e-5)
        summed = sync.weight.grad.clone()        # each rank holds its share (DDP sums)
        dist.all_reduce(summed)
        torch.testing.assert_close(summed, ref.weight.grad, rtol=1e-4, atol=1e-5)
        # DDP: the gradients are the average of the ranks' (apex's gradient_average)
        torch.manual_seed(1)
        model = nn.Linear(4, 2)
        ddp = parallel.DistributedDataParallel(model, delay_allreduce=True,
                                               allreduce_always_fp32=True)
        data = torch.randn(8, 4)
        ddp(data[rank * 4:(rank + 1) * 4]).pow(2).sum().backward()
        ref_model = nn.Linear(4, 2)
        ref_model.load_state_dict(model.state_dict())
        ref_model(data).pow(2).sum().backward()
        torch.testing.assert_close(model.weight.grad, ref_model.weight.grad / 2)
        # buffers: broadcast from rank 0 at construction, then never again (as apex)
        bn = nn.BatchNorm1d(4)
        bn.running_mean.fill_(float(rank))
        ddp_bn = parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), bn))
        assert float(bn.running_mean[0]) == 0.0
        ddp_bn(torch.randn(4, 4) + rank)
        means = [torch.zeros(4), torch.zeros(4)]
        dist.all_gather(means, bn.running_mean.clone())
        assert not torch.equal(means[0], means[1])
        # Free the DDP reducers and autograd's collective handles while the group lives, and
        # let both ranks finish before it goes: gloo work still referenced at interpreter exit
        # aborts the process ("terminate called without an active exception").
        del ddp, ddp_bn, sync
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(sys.argv[1],), nprocs=2)
        print("two ranks ok")
""")


@pytest.mark.slow
def test_two_gloo_ranks_sync_batch_norm_and_ddp(tmp_path: Path) -> None:
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "two ranks ok" in proc.stdout


# -- a legacy script under `ampx run` -----------------------------------------------------------

LEGACY_SCRIPT = textwrap.dedent("""
    import sys

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    try:
        import apex
        from apex import amp
        from apex.fp16_utils import FP16_Optimizer, network_to_half, to_python_float
        from apex.normalization import FusedLayerNorm
        from apex.optimizers import FusedAdam, FusedLAMB
        from apex.parallel import DistributedDataParallel as DDP, convert_syncbn_model
        from apex.parallel.LARC import LARC
        has_apex = True
    except ImportError:
        has_apex = False
    print(f"has_apex={has_apex}")

    mode, store = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    losses = []
    if mode == "fp16_utils":          # the pre-amp recipe: half model + FP16_Optimizer
        model = network_to_half(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(),
                                              nn.Linear(16, 4)))
        optimizer = FP16_Optimizer(LARC(torch.optim.SGD(model.parameters(), lr=0.5)),
                                   dynamic_loss_scale=True, verbose=False,
                                   dynamic_loss_args={"init_scale": 2.0**8})
        for step in range(8):
            loss = F.cross_entropy(model(x).float(), y)
            optimizer.zero_grad()
            optimizer.backward(loss)
            optimizer.clip_master_grads(5.0)
            optimizer.step()
            losses.append(to_python_float(loss))
        logits = model(x)
    else:                             # amp + FusedAdam + FusedLayerNorm (+ apex DDP)
        model = nn.Sequential(nn.Linear(8, 16), FusedLayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
        optimizer = FusedAdam(model.parameters(), lr=1e-2)
        model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
        if mode == "ddp":             # world_size 1, as `torchrun --nproc_per_node 1` gives
            dist.init_process_group("gloo", init_method="file://" + store, rank=0,
                                    world_size=1)
            model = DDP(convert_syncbn_model(model), delay_allreduce=True)
        for step in range(8):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad()
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
            losses.append(to_python_float(loss))
        print("ddp", type(model).__module__, dist.is_initialized())
    preds = logits.detach().cpu().numpy()   # bf16 under O1: .cpu() gives float32, as in apex
    print("preds", preds.dtype, preds.shape)
    print("losses", " ".join(f"{v:.4f}" for v in losses))
    print("learned", losses[-1] < losses[0])
""")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["amp", "ddp", "fp16_utils"])
def test_legacy_script_runs_with_every_companion(tmp_path: Path, mode: str) -> None:
    script = tmp_path / "legacy_train.py"
    script.write_text(LEGACY_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "ampx", "run", "-q", "-O", "O1", "--dtype", "bf16", str(script),
         mode, str(tmp_path / "store")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "has_apex=True" in out
    # O1 with bf16: .cpu() gives float32; the fp16_utils recipe has no O1 (a half model).
    assert f"preds {'float16' if mode == 'fp16_utils' else 'float32'} (32, 4)" in out
    assert "learned True" in out
    if mode == "ddp":
        assert "ddp ampx.compat.apex.parallel True" in out
