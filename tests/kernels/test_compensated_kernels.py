"""Compensated (Kahan) half-weight SGD/Adam: native kernels against the reference, bit for bit.

``ampx._reference_compensated`` is the specification; it is itself checked against an
independent numpy float32 oracle (numpy's float32 add/sub/mul/div/sqrt are IEEE, and the
half conversions go through torch's round-to-nearest-even ``.to()``). The native legs skip
when the extension is not active (not built, or ``AMPX_DISABLE_EXT=1``).

"Bit for bit": equal bit patterns for every non-NaN value and NaN at the same positions
(NaN payloads are not part of the contract).
"""

from __future__ import annotations

import itertools
import math
import os
from typing import Any, Callable

import numpy as np
import pytest
import torch

from ampx import _ext
from ampx import _reference_compensated as spec

pytestmark = pytest.mark.kernel_backend

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
HALVES = [BF16, F16]
SIZES = [1, 7, 33, 1000, 40_003]  # tail only, vector + tail, several work items
_BITS = {F32: torch.int32, F16: torch.int16, BF16: torch.int16}


def native_or_skip() -> Any:
    if os.environ.get("AMPX_DISABLE_EXT", "").strip().lower() in ("1", "true", "yes", "on"):
        pytest.skip("AMPX_DISABLE_EXT is set: native kernels disabled")
    mod = _ext._native_module()
    if mod is None:
        pytest.skip(f"ampx._C not active: {_ext.IMPORT_ERROR}")
    return mod


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    a_nan, e_nan = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(a_nan, e_nan), f"{what}: NaN positions differ"
    a = actual.view(_BITS[actual.dtype])[~a_nan]
    e = expected.view(_BITS[expected.dtype])[~e_nan]
    if not torch.equal(a, e):
        i = (a != e).nonzero()[0].item()
        raise AssertionError(f"{what}: element {i} differs: {actual[~a_nan][i]!r} vs "
                             f"{expected[~e_nan][i]!r}")


def make_state(n: int, dtype: torch.dtype, grad_dtype: torch.dtype, state_dtype: torch.dtype,
               seed: int, plant: float | None = None) -> list[torch.Tensor]:
    """w, c (a real compensation: the rounding error of a float32 weight), grad, s1, s2."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen)
    w = x.to(dtype)
    c = (x - w.float()).to(dtype)
    grad = (torch.randn(n, generator=gen) * 0.5).to(grad_dtype)
    if plant is not None:
        grad[n // 2] = plant
    s1 = (torch.randn(n, generator=gen) * 0.1).to(state_dtype)
    s2 = (torch.rand(n, generator=gen) * 0.01).to(state_dtype)
    return [w, c, grad, s1, s2]


SGD_OPTIONS = [
    dict(lr=0.01, weight_decay=wd, momentum=mu, dampening=damp, nesterov=nest, maximize=mx,
         first=first)
    for mu, nest, damp, wd, mx, first in itertools.product(
        (0.0, 0.9), (False, True), (0.0, 0.1), (0.0, 1e-2), (False, True), (False, True))
    if not (nest and (mu == 0 or damp)) and not (first and mu == 0)
]
ADAM_OPTIONS = [
    dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd, decoupled=dec,
         maximize=mx, step_size=1e-3 / (1 - 0.9**t), bias2_sqrt=math.sqrt(1 - 0.999**t))
    for dec, wd, mx, t in itertools.product((False, True), (0.0, 0.1), (False, True), (1, 7))
]


def run_sgd(fn: Callable[..., None], tensors: list[torch.Tensor], opts: dict) -> list:
    w, c, g, b, _ = [t.clone() for t in tensors]
    fn([w], [c], [g], [b] if opts["momentum"] else [], **opts)
    return [w, c, g, b]


def run_adam(fn: Callable[..., None], tensors: list[torch.Tensor], opts: dict) -> list:
    out = [t.clone() for t in tensors]
    fn(*([t] for t in out), **opts)
    return out


def assert_all_same(actual: list, expected: list, what: str) -> None:
    for name, a, e in zip("w c grad s1 s2".split(), actual, expected):
        assert_same_bits(a, e, f"{what} {name}")


# ---------------------------------------------------------------------------
# The reference against an independent oracle
# ---------------------------------------------------------------------------


def _np(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy()


def _to(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(a).to(dtype)


def oracle_adam(tensors: list[torch.Tensor], o: dict) -> list[torch.Tensor]:
    f = np.float32
    w, c, grad, m_s, v_s = tensors
    x = _np(w) + _np(c)
    g = -_np(grad) if o["maximize"] else _np(grad)
    if o["decoupled"]:
        x = x * f(1.0 - o["lr"] * o["weight_decay"])
    elif o["weight_decay"]:
        g = g + x * f(o["weight_decay"])
    m = _np(m_s) * f(o["beta1"]) + g * f(1.0 - o["beta1"])
    v = _np(v_s) * f(o["beta2"]) + (g * g) * f(1.0 - o["beta2"])
    x = x - (m / (np.sqrt(v) / f(o["bias2_sqrt"]) + f(o["eps"]))) * f(o["step_size"])
    high = _to(x, w.dtype)
    low = _to(x - _np(high), w.dtype)
    return [high, low, grad, _to(m, m_s.dtype), _to(v, v_s.dtype)]


def oracle_sgd(tensors: list[torch.Tensor], o: dict) -> list[torch.Tensor]:
    f = np.float32
    w, c, grad, buf = tensors[:4]
    x = _np(w) + _np(c)
    g = -_np(grad) if o["maximize"] else _np(grad)
    if o["weight_decay"]:
        g = g + x * f(o["weight_decay"])
    b_out = buf
    if o["momentum"]:
        b = g if o["first"] else _np(buf) * f(o["momentum"]) + g * f(1.0 - o["dampening"])
        b_out = _to(b, buf.dtype)
        g = g + b * f(o["momentum"]) if o["nesterov"] else b
    x = x - g * f(o["lr"])
    high = _to(x, w.dtype)
    return [high, _to(x - _np(high), w.dtype), grad, b_out]


@pytest.mark.parametrize("dtype", HALVES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("state_dtype", [None, F32], ids=["half_state", "fp32_state"])
def test_reference_matches_the_float32_oracle(dtype: torch.dtype, state_dtype: Any) -> None:
    # 40k elements: a float32 torch.sqrt (MKL on CPU) is off by an ulp for ~1% of inputs;
    # the spec's square root is the correctly rounded one.
    tensors = make_state(40_000, dtype, F32, state_dtype or dtype, seed=3)
    with np.errstate(all="ignore"):
        for o in ADAM_OPTIONS:
            assert_all_same(run_adam(spec.compensated_adam_, tensors, o),
                            oracle_adam(tensors, o), f"adam {o}")
        for o in SGD_OPTIONS:
            assert_all_same(run_sgd(spec.compensated_sgd_, tensors, o),
                            oracle_sgd(tensors, o), f"sgd {o}")


# ---------------------------------------------------------------------------
# Native against the reference
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_f32", [False, True], ids=["half_grad", "fp32_grad"])
@pytest.mark.parametrize("state_f32", [False, True], ids=["half_state", "fp32_state"])
@pytest.mark.parametrize("dtype", HALVES, ids=["bf16", "fp16"])
def test_native_adam_bitwise(dtype: torch.dtype, state_f32: bool, grad_f32: bool,
                             n: int) -> None:
    native = native_or_skip()
    tensors = make_state(n, dtype, F32 if grad_f32 else dtype, F32 if state_f32 else dtype,
                         seed=n)
    for o in ADAM_OPTIONS:
        assert_all_same(run_adam(native.compensated_adam_, tensors, o),
                        run_adam(spec.compensated_adam_, tensors, o), f"{o}")


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_f32", [False, True], ids=["half_grad", "fp32_grad"])
@pytest.mark.parametrize("state_f32", [False, True], ids=["half_state", "fp32_state"])
@pytest.mark.parametrize("dtype", HALVES, ids=["bf16", "fp16"])
def test_native_sgd_bitwise(dtype: torch.dtype, state_f32: bool, grad_f32: bool,
                            n: int) -> None:
    native = native_or_skip()
    tensors = make_state(n, dtype, F32 if grad_f32 else dtype, F32 if state_f32 else dtype,
                         seed=n + 1)
    for o in SGD_OPTIONS:
        assert_all_same(run_sgd(native.compensated_sgd_, tensors, o),
                        run_sgd(spec.compensated_sgd_, tensors, o), f"{o}")


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("dtype", HALVES, ids=["bf16", "fp16"])
def test_non_finite_gradients_propagate_alike(dtype: torch.dtype, value: float) -> None:
    native = native_or_skip()
    tensors = make_state(100, dtype, dtype, F32, seed=5, plant=value)
    tensors[1][3] = value  # a non-finite compensation too
    for o in ADAM_OPTIONS[:4]:
        assert_all_same(run_adam(native.compensated_adam_, tensors, o),
                        run_adam(spec.compensated_adam_, tensors, o), f"{o}")
    for o in SGD_OPTIONS[::5]:
        assert_all_same(run_sgd(native.compensated_sgd_, tensors, o),
                        run_sgd(spec.compensated_sgd_, tensors, o), f"{o}")


def _mixed_lists(seed: int) -> list[list[torch.Tensor]]:
    """One call's lists: several tensors, every (param, grad, state) dtype mix, odd sizes."""
    combos = list(itertools.product(HALVES, (None, F32), (None, F32)))
    parts = [make_state(n, d, g or d, s or d, seed=seed + k)
             for k, ((d, g, s), n) in enumerate(zip(combos * 2, [0, 1, 17, 70_001] * 4))]
    return [list(column) for column in zip(*parts)]


@pytest.mark.parametrize("threads", [1, 2])
def test_lists_of_mixed_tensors_and_threads(threads: int) -> None:
    """One call over many tensors of every dtype mix gives each tensor's own result, on
    one thread and on several (a 70001-element tensor spans several work items)."""
    native = native_or_skip()
    torch.set_num_threads(threads)
    lists = _mixed_lists(seed=11)
    for o in (ADAM_OPTIONS[5], ADAM_OPTIONS[-1]):
        got = [[t.clone() for t in column] for column in lists]
        want = [[t.clone() for t in column] for column in lists]
        native.compensated_adam_(*got, **o)
        spec.compensated_adam_(*want, **o)
        for gc, wc in zip(got, want):
            for i, (a, e) in enumerate(zip(gc, wc)):
                assert_same_bits(a, e, f"tensor {i}")
    o = SGD_OPTIONS[3]
    got = [[t.clone() for t in column] for column in lists[:4]]
    want = [[t.clone() for t in column] for column in lists[:4]]
    native.compensated_sgd_(*got, **o)
    spec.compensated_sgd_(*want, **o)
    for gc, wc in zip(got, want):
        for i, (a, e) in enumerate(zip(gc, wc)):
            assert_same_bits(a, e, f"sgd tensor {i}")


def test_ext_dispatch_matches_the_reference() -> None:
    """`ampx._ext`'s public functions (whatever backend is active) give the spec's bits."""
    lists = _mixed_lists(seed=17)
    o = ADAM_OPTIONS[6]
    got = [[t.clone() for t in column] for column in lists]
    want = [[t.clone() for t in column] for column in lists]
    _ext.compensated_adam_(*got, **o)
    spec.compensated_adam_(*want, **o)
    for gc, wc in zip(got, want):
        for i, (a, e) in enumerate(zip(gc, wc)):
            assert_same_bits(a, e, f"tensor {i}")
    _ext.compensated_sgd_([], [], [], [], **SGD_OPTIONS[0])  # nothing to do
    o = SGD_OPTIONS[0]
    got = [[t.clone() for t in column] for column in lists[:3]]
    want = [[t.clone() for t in column] for column in lists[:3]]
    _ext.compensated_sgd_(*got, [], **o)
    spec.compensated_sgd_(*want, [], **o)
    for gc, wc in zip(got, want):
        for i, (a, e) in enumerate(zip(gc, wc)):
            assert_same_bits(a, e, f"sgd tensor {i}")


# ---------------------------------------------------------------------------
# Argument errors: same type and message on both backends
# ---------------------------------------------------------------------------


def _bad_cases() -> dict[str, tuple[str, Callable[[list], None]]]:
    def set_(col: int, i: int, make: Callable[[torch.Tensor], torch.Tensor]):
        def edit(lists: list) -> None:
            lists[col][i] = make(lists[col][i])
        return edit

    return {
        "length": ("adam", lambda lists: lists[2].pop()),
        "param_dtype": ("adam", set_(0, 1, lambda t: t.float())),
        "param_layout": ("adam", set_(0, 1, lambda t: torch.stack([t, t], 1)[:, 0])),
        "shape": ("adam", set_(3, 1, lambda t: t[:-1])),
        "state_layout": ("sgd", set_(3, 1, lambda t: torch.stack([t, t], 1)[:, 0])),
        "comp_dtype": ("adam", set_(1, 0, lambda t: t.float())),
        "grad_dtype": ("sgd", set_(2, 1, lambda t: t.double())),
        "buf_dtype": ("sgd", set_(3, 0, lambda t: t.to(F16 if t.dtype == BF16 else BF16))),
        "moment_dtypes": ("adam", set_(4, 1, lambda t: t.float())),
        "moment_int": ("adam", set_(3, 0, lambda t: t.to(torch.int32))),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_argument_errors_alike(case: str) -> None:
    native = native_or_skip()
    kind, edit = _bad_cases()[case]
    parts = [make_state(5, BF16, BF16, BF16, seed=1), make_state(5, BF16, F32, BF16, seed=2)]
    errors = []
    for impl in (spec, native):
        lists = [list(column) for column in zip(*parts)]
        edit(lists)
        before = [t.clone() for column in lists for t in column]
        with pytest.raises((TypeError, ValueError)) as info:
            if kind == "adam":
                impl.compensated_adam_(*lists, **ADAM_OPTIONS[0])
            else:
                impl.compensated_sgd_(*lists[:4], **SGD_OPTIONS[-1])
        errors.append((type(info.value), str(info.value)))
        for a, b in zip(before, (t for column in lists for t in column)):
            assert torch.equal(a, b) or (a.isnan() == b.isnan()).all()  # nothing written
    assert errors[0] == errors[1]
    assert "ampx.compensated_" in errors[0][1]


def test_sgd_without_momentum_ignores_the_buffers() -> None:
    """momentum=0: momentum_bufs is not read or checked (an empty list is usual)."""
    native = native_or_skip()
    tensors = make_state(9, F16, F16, F16, seed=4)
    o = SGD_OPTIONS[0]
    assert o["momentum"] == 0
    w, c = tensors[0].clone(), tensors[1].clone()
    native.compensated_sgd_([w], [c], [tensors[2]], [], **o)
    expected = run_sgd(spec.compensated_sgd_, tensors, o)
    assert_same_bits(w, expected[0])
    assert_same_bits(c, expected[1])


# ---------------------------------------------------------------------------
# What the compensation is for
# ---------------------------------------------------------------------------


def test_compensated_adam_tracks_float32_adam() -> None:
    """Many small AdamW steps: bf16 weights with compensation stay close to a float32 run;
    plain bf16 weights (the update rounded away) do not."""
    torch.manual_seed(0)
    n, steps, lr = 4096, 300, 1e-4
    x0 = torch.randn(n)
    target = torch.randn(n)
    master = x0.clone().requires_grad_()
    ref = torch.optim.AdamW([master], lr=lr, weight_decay=0.01, foreach=False)
    plain = x0.to(BF16).requires_grad_()
    plain_opt = torch.optim.AdamW([plain], lr=lr, weight_decay=0.01, foreach=False)
    w = x0.to(BF16)
    c = (x0 - w.float()).to(BF16)
    m, v = torch.zeros(n), torch.zeros(n)
    for t in range(1, steps + 1):
        for p, opt in ((master, ref), (plain, plain_opt)):
            opt.zero_grad()
            (0.5 * ((p.float() - target) ** 2).sum()).backward()
            opt.step()
        grad = w.float() + c.float() - target
        _ext.compensated_adam_([w], [c], [grad], [m], [v], lr=lr, beta1=0.9, beta2=0.999,
                               eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False,
                               step_size=lr / (1 - 0.9**t),
                               bias2_sqrt=math.sqrt(1 - 0.999**t))
    exact = master.detach()
    moved = (exact - x0).abs().mean()
    err_comp = (w.float() + c.float() - exact).abs().mean()
    err_plain = (plain.detach().float() - exact).abs().mean()
    assert err_comp < 0.01 * moved, (err_comp, moved)
    assert err_plain > 0.3 * moved, (err_plain, moved)
    assert err_comp < 0.02 * err_plain


def test_ext_groups_by_device() -> None:
    """Lists spanning two devices: one call per device (here cpu and meta, which the
    reference serves), the cpu tensors' results the spec's; an error names the index in
    the whole lists."""
    cpu = make_state(33, BF16, F32, F32, seed=8)
    meta = [t.to("meta") for t in make_state(33, F16, F16, F16, seed=9)]
    lists = [[m, c.clone()] for m, c in zip(meta, cpu)]
    o = ADAM_OPTIONS[2]
    _ext.compensated_adam_(*lists, **o)
    assert_all_same([column[1] for column in lists], run_adam(spec.compensated_adam_, cpu, o),
                    "cpu part")
    assert all(column[0].is_meta for column in lists)
    lists[2][1] = lists[2][1].double()
    with pytest.raises(TypeError, match=r"grads\[1\] is torch.float64"):
        _ext.compensated_adam_(*lists, **o)


# ---------------------------------------------------------------------------
# CUDA (benchmarks/gpu_check.sh runs this file on a GPU machine)
# ---------------------------------------------------------------------------


def _cuda_or_skip() -> Any:
    native = native_or_skip()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not native.has_cuda():
        pytest.skip("this ampx._C build has no CUDA kernels")
    return native


@pytest.mark.parametrize("many", [False, True], ids=["mixed", "many_tensors"])
def test_cuda_kernels_match_the_cpu_spec(many: bool) -> None:
    """The CUDA kernels give the CPU spec's bits: every dtype mix, odd sizes, chunk edges
    (65536 elements per block), more tensors than one launch holds, every option."""
    native = _cuda_or_skip()
    if many:  # 70 tensors > 32 per launch; one spans 3 chunks (carried across launches)
        parts = []
        for k, n in enumerate([3, 65, 1000] * 23 + [2 * 65536 + 3]):
            w = BF16 if k % 2 else F16
            parts.append(make_state(n, w, F32 if k % 3 else w, F32 if k % 5 else w, seed=k))
        lists = [list(column) for column in zip(*parts)]
    else:
        lists = _mixed_lists(seed=23)
    cases = [("adam", o) for o in ADAM_OPTIONS] + [("sgd", o) for o in SGD_OPTIONS]
    for kind, o in cases:
        cols = lists if kind == "adam" else lists[:4]
        if kind == "sgd" and not o["momentum"]:
            cols = [*lists[:3], []]
        want = [[t.clone() for t in column] for column in cols]
        got = [[t.cuda() for t in column] for column in cols]
        fn = "compensated_adam_" if kind == "adam" else "compensated_sgd_"
        getattr(spec, fn)(*want, **o)
        getattr(native, fn)(*got, **o)
        for gc, wc in zip(got, want):
            for i, (a, e) in enumerate(zip(gc, wc)):
                assert_same_bits(a.cpu(), e, f"{kind} {o} tensor {i}")


def test_cuda_non_finite_and_dispatch() -> None:
    """Non-finite gradients propagate as on the CPU; `ampx._ext` sends CUDA lists to the
    CUDA kernels."""
    _cuda_or_skip()
    for value in (math.inf, -math.inf, math.nan):
        tensors = make_state(1001, BF16, F32, BF16, seed=6, plant=value)
        o = ADAM_OPTIONS[3]
        want = run_adam(spec.compensated_adam_, tensors, o)
        got = [t.cuda() for t in tensors]
        _ext.compensated_adam_(*([t] for t in got), **o)
        assert_all_same([t.cpu() for t in got], want, f"{value}")


def test_native_step_allocates_no_tensor() -> None:
    """The fused step reads and writes in place: torch's allocator sees no allocation (no
    float32 copy of the weights, no per-parameter temporaries), unlike the reference's."""
    native = native_or_skip()
    from torch.profiler import ProfilerActivity, profile

    tensors = make_state(50_000, BF16, BF16, F32, seed=12)
    lists = [[t] for t in tensors]
    for impl, expect_none in ((native, True), (spec, False)):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            impl.compensated_adam_(*lists, **ADAM_OPTIONS[4])
        allocated = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
        assert (allocated == 0) == expect_none, (impl, allocated)
