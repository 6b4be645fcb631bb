"""Native kernels (ampx._C) against the reference (ampx._reference), bit for bit.

Every contract test runs twice: ``[reference]`` checks the reference against an
independent per-tensor oracle written with plain torch ops, and ``[native]`` checks the
extension against the reference (and the oracle). The native leg skips with the reason
when the extension is not active (not built, or ``AMPX_DISABLE_EXT=1``).

The combinatorial tests run with one intra-op thread (fast and steady on a busy 2-core
box); ``test_threads_do_not_change_results`` runs every kernel multi-threaded on lists
large enough to be split across threads and checks the results do not change.

"Bit for bit" means equal bit patterns for every non-NaN value and NaN at exactly the
same positions; NaN payloads are not part of the contract (torch itself produces
different payloads in its vectorised and scalar paths).
"""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch

from ampx import _ext, _reference

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = [F32, F16, BF16]
DTYPE_IDS = {F32: "fp32", F16: "fp16", BF16: "bf16"}
INF, NAN = math.inf, math.nan
ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------


class Native:
    """The extension behind the reference's signatures."""

    def __init__(self, mod: Any) -> None:
        self.mod = mod

    def unscale_(self, *args: Any) -> None:
        self.mod.unscale_(*args)

    def unscale_into_(self, *args: Any, **kwargs: Any) -> None:
        self.mod.unscale_into_(*args, **kwargs)

    def copy_(self, *args: Any) -> None:
        self.mod.copy_(*args)

    def update_scale_(self, *args: Any) -> None:
        self.mod.update_scale_(*args)

    def l2norm(self, tensors: Sequence[torch.Tensor], per_tensor: bool = False) -> Any:
        total, norms = self.mod.l2norm(list(tensors), per_tensor)
        return (total, norms) if per_tensor else total


def native_or_skip() -> Native:
    if os.environ.get("AMPX_DISABLE_EXT", "").strip().lower() in ("1", "true", "yes", "on"):
        pytest.skip("AMPX_DISABLE_EXT is set: native kernels disabled, reference tested alone")
    mod = _ext._native_module()
    if mod is None:
        pytest.skip(f"ampx._C not active: {_ext.IMPORT_ERROR}")
    return Native(mod)


_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(_THREADS)


@pytest.fixture(params=["reference", "native"])
def impl(request: pytest.FixtureRequest) -> Any:
    """Each backend in turn; ``native`` skips when the extension is not active."""
    if request.param == "reference":
        return _reference
    return native_or_skip()


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------

_INT_VIEW = {F32: torch.int32, F16: torch.int16, BF16: torch.int16}


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Equal bit patterns except NaN payloads; NaN at the same positions."""
    assert actual.dtype == expected.dtype, what
    assert actual.shape == expected.shape, what
    a_nan, e_nan = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(a_nan, e_nan), f"{what}: NaN positions differ"
    a_bits = actual.contiguous().view(_INT_VIEW[actual.dtype])[~a_nan]
    e_bits = expected.contiguous().view(_INT_VIEW[expected.dtype])[~e_nan]
    if not torch.equal(a_bits, e_bits):
        bad = (a_bits != e_bits).nonzero()[0].item()
        raise AssertionError(
            f"{what}: first differing element {bad}: {actual[~a_nan][bad]!r} vs "
            f"{expected[~e_nan][bad]!r}"
        )


def assert_lists_same(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_same_bits(a, e, f"tensor {i}")


# A case: tensor sizes plus non-finite values to plant as (tensor, position, value),
# position being "first", "middle" or "last".
Plant = tuple[int, str, float]
CASES: dict[str, tuple[list[int], list[Plant]]] = {
    "empty_list": ([], []),
    "zero_numel": ([0], []),
    "one_element": ([1], []),
    "zeros_around_one": ([0, 1, 0], []),
    "odd_sizes": ([3, 17, 31, 33, 65, 1000, 4097], []),
    # > 32768 elements per tensor (several work items each) and > 65536 in all
    # (the native CPU kernels go multi-threaded)
    "chunked": ([32771, 33, 32769], []),
    "inf_first": ([100, 50], [(0, "first", INF)]),
    "ninf_middle": ([100, 51, 7], [(1, "middle", -INF)]),
    "nan_last": ([5, 100, 33], [(2, "last", NAN)]),
    "one_element_nan": ([1, 4], [(0, "first", NAN)]),
    "several": (
        [64, 0, 1000, 33, 33001, 9],
        [(0, "first", INF), (2, "middle", NAN), (4, "last", -INF), (4, "middle", INF)],
    ),
}
# Only for test_threads_do_not_change_results: big enough to be split across threads.
BIG_CASES: dict[str, tuple[list[int], list[Plant]]] = {
    "big_mixed": ([100003, 7, 65537, 0, 40000], [(0, "middle", NAN), (2, "last", INF)]),
}
SMALL_CASES = ["empty_list", "one_element", "odd_sizes", "chunked", "inf_first", "several"]


def make(case: str, dtype: torch.dtype, scale: float = 100.0, seed: int = 0) -> list[torch.Tensor]:
    sizes, plants = CASES[case] if case in CASES else BIG_CASES[case]
    g = torch.Generator().manual_seed(seed)
    tensors = [(torch.randn(n, generator=g) * scale).to(dtype) for n in sizes]
    for t, where, value in plants:
        n = tensors[t].numel()
        pos = {"first": 0, "middle": n // 2, "last": n - 1}[where]
        tensors[t][pos] = value
    return tensors


def nonfinite_flags(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.tensor(
        [0.0 if bool(torch.isfinite(t).all()) else 1.0 for t in tensors], dtype=F32
    )


def clone(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]


# ---------------------------------------------------------------------------
# unscale_
# ---------------------------------------------------------------------------


def oracle_unscale(grads: Sequence[torch.Tensor], inv: float) -> list[torch.Tensor]:
    if inv == 1.0:
        return clone(grads)
    inv_t = torch.tensor([inv], dtype=F32)
    return [(g.float() * inv_t).to(g.dtype) for g in grads]


def run_unscale(
    impl: Any, grads: list[torch.Tensor], inv: float, with_flags: bool
) -> tuple[list[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]:
    out = clone(grads)
    found = torch.zeros(1)
    flags = torch.zeros(len(grads)) if with_flags else None
    impl.unscale_(out, torch.tensor([inv], dtype=F32), found, flags)
    return out, found, flags


@pytest.mark.parametrize("inv", [2.0**-16, 1 / 3, 1.0], ids=["inv2^-16", "inv1/3", "inv1"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", list(CASES))
def test_unscale(impl: Any, case: str, dtype: torch.dtype, inv: float) -> None:
    grads = make(case, dtype)
    out, found, flags = run_unscale(impl, grads, inv, with_flags=True)
    assert_lists_same(out, oracle_unscale(grads, inv))
    expected_flags = nonfinite_flags(grads)
    assert flags is not None
    assert_same_bits(flags, expected_flags)
    assert found.item() == (1.0 if expected_flags.sum() > 0 else 0.0)
    if impl is not _reference:
        ref_out, ref_found, _ = run_unscale(_reference, grads, inv, with_flags=False)
        assert_lists_same(out, ref_out)
        assert_same_bits(found, ref_found)


def test_unscale_mixed_dtypes(impl: Any) -> None:
    grads = make("several", F32) + make("odd_sizes", F16) + make("nan_last", BF16)
    out, found, flags = run_unscale(impl, grads, 1 / 7, with_flags=True)
    assert_lists_same(out, oracle_unscale(grads, 1 / 7))
    assert flags is not None
    assert_same_bits(flags, nonfinite_flags(grads))
    assert found.item() == 1.0


def test_unscale_overflow_after_scaling_is_not_flagged(impl: Any) -> None:
    # Only inputs are checked: a finite fp16 value that overflows once multiplied is
    # written as inf but does not set found_inf (same as torch's GradScaler kernel).
    grads = [torch.full((40,), 60000.0, dtype=F16)]
    out, found, flags = run_unscale(impl, grads, 2.0, with_flags=True)
    assert torch.isinf(out[0]).all()
    assert found.item() == 0.0
    assert flags is not None and flags.item() == 0.0


def test_unscale_flags_are_never_cleared(impl: Any) -> None:
    grads = make("odd_sizes", F32)
    grads[4][3] = INF
    found = torch.ones(1)
    flags = torch.zeros(len(grads))
    flags[1] = 1.0
    flags[2] = 0.25  # only ever set to 1.0, never otherwise touched
    impl.unscale_(grads, torch.tensor([0.5]), found, flags)
    assert found.item() == 1.0
    assert flags.tolist() == [0.0, 1.0, 0.25, 0.0, 1.0, 0.0, 0.0]


def test_unscale_subnormal_results_round_identically(impl: Any) -> None:
    # fp16 values near 1 times 2^-20 land in fp16's subnormal range.
    g = torch.Generator().manual_seed(3)
    grads = [(torch.rand(4099, generator=g) * 4).to(F16), (torch.randn(77, generator=g)).to(F16)]
    out, _, _ = run_unscale(impl, grads, 2.0**-20 * 1.37, with_flags=False)
    assert_lists_same(out, oracle_unscale(grads, 2.0**-20 * 1.37))


# ---------------------------------------------------------------------------
# unscale_into_
# ---------------------------------------------------------------------------


def oracle_into(
    src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], inv: float, accumulate: bool
) -> list[torch.Tensor]:
    inv_t = torch.tensor([inv], dtype=F32)
    out = []
    for s, d in zip(src, dst):
        val = s.float().view(-1) * inv_t
        if accumulate:
            val = d.float().view(-1) + val
        out.append(val.to(d.dtype).view(d.shape))
    return out


def run_into(
    impl: Any,
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    inv: float,
    accumulate: bool,
    with_flags: bool = True,
) -> tuple[list[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]:
    out = clone(dst)
    found = torch.zeros(1)
    flags = torch.zeros(len(src)) if with_flags else None
    src_before = clone(src)
    impl.unscale_into_(src, out, torch.tensor([inv], dtype=F32), found, flags, accumulate)
    assert_lists_same(src, src_before)  # src is read only
    return out, found, flags


@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
@pytest.mark.parametrize("dst_dtype", DTYPES, ids=lambda d: "to_" + DTYPE_IDS[d])
@pytest.mark.parametrize("src_dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", SMALL_CASES + ["ninf_middle", "nan_last"])
def test_unscale_into(
    impl: Any, case: str, src_dtype: torch.dtype, dst_dtype: torch.dtype, accumulate: bool
) -> None:
    src = make(case, src_dtype, scale=300.0)
    dst = make(case, dst_dtype, scale=1.0, seed=1)
    dst = [torch.nan_to_num(d) for d in dst]  # non-finite values only in src
    inv = 1 / 3
    out, found, flags = run_into(impl, src, dst, inv, accumulate)
    assert_lists_same(out, oracle_into(src, dst, inv, accumulate))
    expected_flags = nonfinite_flags(src)
    assert flags is not None
    assert_same_bits(flags, expected_flags)
    assert found.item() == (1.0 if expected_flags.sum() > 0 else 0.0)
    if impl is not _reference:
        ref_out, ref_found, _ = run_into(_reference, src, dst, inv, accumulate, with_flags=False)
        assert_lists_same(out, ref_out)
        assert_same_bits(found, ref_found)


def test_unscale_into_other_shapes_and_mixed_dtypes(impl: Any) -> None:
    src = [torch.randn(6, 5).to(F16), torch.randn(7).to(BF16), torch.randn(3, 3)]
    dst = [torch.randn(30), torch.randn(7, 1), torch.randn(9).to(F16)]
    src[1][4] = NAN
    out, found, flags = run_into(impl, src, dst, 0.125, accumulate=True)
    assert_lists_same(out, oracle_into(src, dst, 0.125, accumulate=True))
    assert [o.shape for o in out] == [d.shape for d in dst]
    assert flags is not None and flags.tolist() == [0.0, 1.0, 0.0]
    assert found.item() == 1.0


# ---------------------------------------------------------------------------
# copy_
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dst_dtype", DTYPES, ids=lambda d: "to_" + DTYPE_IDS[d])
@pytest.mark.parametrize("src_dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", ["empty_list", "zeros_around_one", "odd_sizes", "chunked",
                                  "several"])
def test_copy(impl: Any, case: str, src_dtype: torch.dtype, dst_dtype: torch.dtype) -> None:
    src = make(case, src_dtype, scale=1e5)  # fp32 -> fp16 overflows to inf: propagated
    dst = [torch.zeros(t.shape, dtype=dst_dtype) for t in src]
    impl.copy_(src, dst)
    assert_lists_same(dst, [s.to(dst_dtype) for s in src])
    if impl is not _reference:
        ref = [torch.zeros(t.shape, dtype=dst_dtype) for t in src]
        _reference.copy_(src, ref)
        assert_lists_same(dst, ref)


@pytest.mark.skipif(_ext._native_module() is None, reason="copy_plain is native")
def test_copy_plain_takes_the_usual_lists_and_leaves_anything_else_untouched() -> None:
    """`_C.copy_plain` (what `_ext.copy_` tries first) copies plain contiguous lists on one
    device in one call, with `copy_`'s values; any other pair makes it return False before
    it writes anything, and `_ext.copy_`'s general path copies those."""
    native = _ext._native_module()
    src = make("several", F32, scale=1e5) + [torch.randn(3, 4).to(BF16)]
    dst = [torch.zeros(t.shape, dtype=d) for t, d in zip(src, [F16, BF16] * len(src))]
    ref = [t.clone() for t in dst]
    _reference.copy_(src, ref)
    assert native.copy_plain(src, dst) is True
    assert_lists_same(dst, ref)

    base = torch.zeros(4, 6)
    odd = {
        "non-contiguous destination": (torch.randn(4, 3), base[:, ::2]),
        "float64": (torch.randn(5, dtype=torch.float64), torch.zeros(5)),
        "sizes differ": (torch.randn(5), torch.zeros(6)),
        "another device": (torch.randn(5), torch.zeros(5, device="meta")),
    }
    for name, (s, d) in odd.items():
        sentinel = torch.full((7,), 3.0)
        before = base.clone()
        assert native.copy_plain([torch.ones(7), s], [sentinel, d]) is False, name
        assert torch.equal(sentinel, torch.full((7,), 3.0)), name  # nothing written
        assert torch.equal(base, before), name
    s, d = torch.randn(4, 3), base[:, ::2]
    _ext.copy_([s], [d])  # the general path stages the strided destination
    assert torch.equal(d, s)


def _plain(impl: Any) -> Callable[..., bool]:
    return impl.mod.copy_plain if isinstance(impl, Native) else impl.copy_plain


def test_copy_writes_like_an_inplace_op(impl: Any) -> None:
    """`copy_` and `copy_plain` move each destination's version counter once (as an in-place
    op: autograd's saved-tensor check and O1's weight cache read it), record no autograd graph
    from sources that require grad (O2's masters, outside the optimizer's no_grad), and write
    a Parameter that requires grad without `torch.no_grad()`."""
    src = [torch.randn(3, requires_grad=True), torch.randn(2, 2, requires_grad=True),
           torch.randn(4)]
    dst = [torch.nn.Parameter(torch.zeros(3, dtype=BF16)), torch.zeros(2, 2, dtype=F16),
           torch.zeros(4)]
    for copy in (impl.copy_, _plain(impl)):
        before = [d._version for d in dst]
        assert copy(src, dst) in (None, True)
        assert [d._version - v for d, v in zip(dst, before)] == [1, 1, 1]
        assert all(d.grad_fn is None for d in dst) and dst[0].is_leaf
        assert_lists_same(dst, [s.detach().to(d.dtype) for s, d in zip(src, dst)])
    with torch.inference_mode():
        frozen = torch.zeros(3)
    with pytest.raises(RuntimeError, match="inference tensor outside InferenceMode"):
        impl.copy_([torch.ones(3)], [frozen])


def test_reference_copy_plain_takes_the_usual_lists_and_leaves_anything_else_untouched(
        ) -> None:
    """The reference's `copy_plain` (`_ext.copy_`'s one pass without the extension): `copy_`'s
    values for plain tensors of one shape in any layout, or of one size when contiguous;
    anything else returns False before anything is written."""
    src = make("several", F32, scale=1e5) + [torch.randn(3, 4).to(BF16), torch.randn(4, 3)]
    dst = [torch.zeros(t.shape, dtype=d) for t, d in zip(src, [F16, BF16] * len(src))]
    dst[-1] = torch.zeros(4, 6, dtype=F16)[:, ::2]  # one shape, strided: element by element
    ref = [t.clone() for t in dst]
    _reference.copy_(src[:-1], ref[:-1])
    assert _reference.copy_plain(src, dst) is True
    assert_lists_same(dst[:-1], ref[:-1])
    assert torch.equal(dst[-1], src[-1].to(F16))
    flat = torch.zeros(12)
    assert _reference.copy_plain([src[-1]], [flat]) is True  # one size, contiguous
    assert torch.equal(flat, src[-1].view(-1))
    with torch.inference_mode():
        frozen = torch.zeros(5)
    odd = {
        "float64": (torch.randn(5, dtype=torch.float64), torch.zeros(5)),
        "sizes differ": (torch.randn(5), torch.zeros(6)),
        "strided, shapes differ": (torch.randn(6), torch.zeros(3, 4)[:, ::2]),
        "another device": (torch.randn(5), torch.zeros(5, device="meta")),
        "a subclass": (torch.randn(5), torch.zeros(5).as_subclass(_Sub)),
        "an inference tensor": (torch.randn(5), frozen),
    }
    for name, (s, d) in odd.items():
        sentinel = torch.full((7,), 3.0)
        assert _reference.copy_plain([torch.ones(7), s], [sentinel, d]) is False, name
        assert torch.equal(sentinel, torch.full((7,), 3.0)), name  # nothing written


class _Sub(torch.Tensor):
    pass


def test_drop_grads_sets_every_gradient_to_none() -> None:
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(4)]
    for p in params[:3]:
        p.grad = torch.ones(3)
    _ext.drop_grads(params)
    assert all(p.grad is None for p in params)


# ---------------------------------------------------------------------------
# l2norm
# ---------------------------------------------------------------------------


def oracle_norms(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    norms = torch.tensor([float(t.double().norm()) for t in tensors], dtype=torch.float64)
    total = norms.norm() if len(tensors) else torch.zeros((), dtype=torch.float64)
    return total.float(), norms.float()


def assert_norm_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == F32 and actual.shape == expected.shape
    assert torch.equal(torch.isnan(actual), torch.isnan(expected))
    assert torch.equal(torch.isposinf(actual), torch.isposinf(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(actual[finite], expected[finite], rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", list(CASES))
def test_l2norm(impl: Any, case: str, dtype: torch.dtype) -> None:
    tensors = make(case, dtype)
    total, norms = impl.l2norm(tensors, per_tensor=True)
    expected_total, expected_norms = oracle_norms(tensors)
    assert total.shape == () and norms.shape == (len(tensors),)
    assert_norm_close(norms, expected_norms)
    assert_norm_close(total, expected_total)
    only_total = impl.l2norm(tensors)
    assert isinstance(only_total, torch.Tensor)
    assert_same_bits(only_total, total)
    if impl is not _reference:
        ref_total, ref_norms = _reference.l2norm(tensors, per_tensor=True)
        assert_norm_close(total, ref_total)
        assert_norm_close(norms, ref_norms)


@pytest.mark.parametrize(
    ("values", "norm"),
    [
        ([INF, 1.0], INF),
        ([-INF, 1.0], INF),
        ([NAN, 1.0], NAN),
        ([INF, NAN], NAN),
        ([1e20, 1e20], math.sqrt(2) * 1e20),  # squares overflow fp32 but not the norm
        ([3e38, 3e38], INF),  # the norm itself overflows fp32
    ],
    ids=["inf", "ninf", "nan", "inf_nan", "big_finite", "too_big"],
)
def test_l2norm_nonfinite_and_extremes(impl: Any, values: list[float], norm: float) -> None:
    t = torch.zeros(1000)
    t[: len(values)] = torch.tensor(values)
    total, norms = impl.l2norm([torch.ones(3), t], per_tensor=True)
    if math.isnan(norm):
        assert math.isnan(norms[1].item()) and math.isnan(total.item())
    elif math.isinf(norm):
        assert norms[1].item() == INF and total.item() == INF
    else:
        assert norms[1].item() == pytest.approx(norm, rel=1e-6)
        assert total.item() == pytest.approx(math.hypot(norm, math.sqrt(3)), rel=1e-6)


def test_l2norm_long_tensor_accuracy(impl: Any) -> None:
    # A million same-sign squares: a plain float32 running sum drifts by ~1e-5.
    t = torch.rand(1_000_003, generator=torch.Generator().manual_seed(5)) + 0.5
    expected = float(t.double().norm())
    assert impl.l2norm([t]).item() == pytest.approx(expected, rel=2e-7)


# ---------------------------------------------------------------------------
# update_scale_
# ---------------------------------------------------------------------------


def f32(x: float) -> float:
    return float(struct.unpack("f", struct.pack("f", x))[0])


def f32_mul(a: float, b: float) -> float:
    return f32(f32(a) * f32(b))


def oracle_update(
    state: tuple[float, int, int], found: float, growth: float, backoff: float, interval: int,
    hysteresis: int, min_scale: float, max_scale: float,
) -> tuple[float, int, int]:
    """docs/internals.md, in float32 arithmetic with float32-rounded parameters."""
    scale, tracker, hyst = state
    lo, hi = f32(min_scale), f32(max_scale)
    if found > 0:
        tracker = 0
        if hyst <= 1:
            scale = min(max(f32_mul(scale, backoff), lo), hi)
        else:
            hyst -= 1
    else:
        tracker += 1
        if tracker >= interval:
            grown = f32_mul(scale, growth)
            if math.isfinite(grown):
                scale = min(grown, hi)
            tracker = 0
            hyst = hysteresis
    return scale, tracker, hyst


UPDATE_CONFIGS = {
    "apex_default": (65536.0, 2.0, 0.5, 3, 1, 0.0, 2.0**24),
    "odd_factors": (1000.0, 1.7, 0.3, 2, 1, 0.0, INF),
    "hysteresis": (1024.0, 2.0, 0.5, 4, 3, 1.0, 4096.0),
    "min_clamp": (4.0, 2.0, 0.25, 100, 1, 2.0, INF),
    "growth_to_inf": (3e38, 2.0, 0.5, 1, 1, 0.0, INF),
    "max_clamp": (6.0, 3.0, 0.5, 1, 2, 0.0, 20.0),
}


@pytest.mark.parametrize("config", list(UPDATE_CONFIGS))
def test_update_scale(impl: Any, config: str) -> None:
    init, growth, backoff, interval, hysteresis, min_scale, max_scale = UPDATE_CONFIGS[config]
    scale = torch.tensor([init], dtype=F32)
    tracker = torch.zeros(1, dtype=torch.int32)
    hyst = torch.full((1,), hysteresis, dtype=torch.int32)
    state = (f32(init), 0, hysteresis)
    g = torch.Generator().manual_seed(7)
    founds = [NAN, 0.0, 2.0] + [float(x) for x in (torch.rand(60, generator=g) < 0.3)]
    for step, fv in enumerate(founds):
        found = torch.tensor([fv], dtype=F32)
        impl.update_scale_(scale, tracker, hyst, found, growth, backoff, interval, hysteresis,
                           min_scale, max_scale)
        state = oracle_update(state, fv, growth, backoff, interval, hysteresis, min_scale,
                              max_scale)
        got = (scale.item(), int(tracker.item()), int(hyst.item()))
        assert got == state, f"step {step} (found_inf={fv}): {got} != {state}"


def _run_all(m: Any, case: str) -> list[torch.Tensor]:
    src = make(case, BF16, seed=11)
    grads = make(case, F32, seed=12)
    found, flags = torch.zeros(1), torch.zeros(len(grads))
    m.unscale_(grads, torch.tensor([1 / 3]), found, flags)
    masters = make(case, F32, seed=13)
    found2, flags2 = torch.zeros(1), torch.zeros(len(src))
    m.unscale_into_(src, masters, torch.tensor([0.1]), found2, flags2, True)
    params = [torch.empty(t.shape, dtype=F16) for t in masters]
    m.copy_(masters, params)
    total, norms = m.l2norm(masters, per_tensor=True)
    return [*grads, found, flags, *masters, found2, flags2, *params, total.view(1), norms]


@pytest.mark.parametrize("case", ["chunked", "big_mixed"])
def test_threads_do_not_change_results(case: str) -> None:
    """Multi-threaded native == single-threaded native == reference (l2norm: exactly)."""
    native = native_or_skip()
    if _THREADS < 2:
        pytest.skip("only one intra-op thread available")
    single = _run_all(native, case)
    ref = _run_all(_reference, case)
    torch.set_num_threads(_THREADS)
    multi = _run_all(native, case)
    assert_lists_same(multi, single)
    n = len(ref) - 1  # all but the per-tensor norms, compared with a tolerance
    assert_lists_same(multi[: n - 1], ref[: n - 1])
    assert_norm_close(multi[n - 1], ref[n - 1])
    assert_norm_close(multi[n], ref[n])


# ---------------------------------------------------------------------------
# Argument errors: same type and same message from both backends
# ---------------------------------------------------------------------------

ONE = torch.ones(1)
META = torch.device("meta")


def _g(*dtypes: torch.dtype) -> list[torch.Tensor]:
    return [torch.ones(4, dtype=d) for d in dtypes]


ERROR_CASES: dict[str, tuple[Callable[[Any], None], type, str]] = {
    "unscale_dtype": (
        lambda m: m.unscale_(_g(F32, F16, torch.float64), ONE, torch.zeros(1)),
        TypeError, r"ampx\.unscale_: grads\[2\] has dtype torch\.float64; expected",
    ),
    "unscale_int_dtype": (
        lambda m: m.unscale_(_g(F32) + [torch.ones(3, dtype=torch.int32)], ONE, torch.zeros(1)),
        TypeError, r"grads\[1\] has dtype torch\.int32",
    ),
    "unscale_device": (
        lambda m: m.unscale_(_g(F32, F32, F32) + [torch.ones(4, device=META)], ONE,
                             torch.zeros(1)),
        ValueError, r"ampx\.unscale_: grads\[3\] is on meta but grads\[0\] is on cpu",
    ),
    "unscale_noncontiguous": (
        lambda m: m.unscale_([torch.ones(4), torch.ones(4, 4).t()], ONE, torch.zeros(1)),
        ValueError, r"ampx\.unscale_: grads\[1\] is not contiguous",
    ),
    "unscale_inv_scale_dtype": (
        lambda m: m.unscale_(_g(F32), torch.ones(1, dtype=torch.float64), torch.zeros(1)),
        TypeError, r"inv_scale must be a torch\.float32 tensor; got torch\.float64",
    ),
    "unscale_inv_scale_numel": (
        lambda m: m.unscale_(_g(F32), torch.ones(2), torch.zeros(1)),
        ValueError, r"inv_scale must have 1 element; got 2",
    ),
    "unscale_found_inf_device": (
        lambda m: m.unscale_(_g(F32), ONE, torch.zeros(1, device=META)),
        ValueError, r"found_inf is on meta but grads\[0\] is on cpu",
    ),
    "unscale_per_tensor_numel": (
        lambda m: m.unscale_(_g(F32, F32, F32), ONE, torch.zeros(1), torch.zeros(2)),
        ValueError, r"per_tensor must have 3 elements \(one per tensor in grads\); got 2",
    ),
    "unscale_per_tensor_dtype": (
        lambda m: m.unscale_(_g(F32), ONE, torch.zeros(1), torch.zeros(1, dtype=F16)),
        TypeError, r"per_tensor must be a torch\.float32 tensor",
    ),
    "into_length": (
        lambda m: m.unscale_into_(_g(F16, F16), _g(F32), ONE, torch.zeros(1)),
        ValueError, r"ampx\.unscale_into_: src has 2 tensors but dst has 1",
    ),
    "into_length_empty": (
        lambda m: m.unscale_into_([], _g(F32), ONE, torch.zeros(1)),
        ValueError, r"src has 0 tensors but dst has 1",
    ),
    "into_numel": (
        lambda m: m.unscale_into_(_g(F16, F16), [torch.ones(4), torch.ones(5)], ONE,
                                  torch.zeros(1)),
        ValueError, r"ampx\.unscale_into_: dst\[1\] has 5 elements but src\[1\] has 4",
    ),
    "into_dst_device": (
        lambda m: m.unscale_into_(_g(F16), [torch.ones(4, device=META)], ONE, torch.zeros(1)),
        ValueError, r"dst\[0\] is on meta but src\[0\] is on cpu",
    ),
    "into_dst_dtype": (
        lambda m: m.unscale_into_(_g(F16, F16), _g(F32, torch.float64), ONE, torch.zeros(1)),
        TypeError, r"dst\[1\] has dtype torch\.float64",
    ),
    "into_dst_noncontiguous": (
        lambda m: m.unscale_into_([torch.ones(16, dtype=F16)], [torch.ones(4, 4).t()], ONE,
                                  torch.zeros(1)),
        ValueError, r"dst\[0\] is not contiguous",
    ),
    "copy_length": (
        lambda m: m.copy_(_g(F32), _g(F16, F16)),
        ValueError, r"ampx\.copy_: src has 1 tensors but dst has 2",
    ),
    "copy_numel": (
        lambda m: m.copy_(_g(F32, F32), [torch.ones(4, dtype=F16), torch.ones(3, dtype=F16)]),
        ValueError, r"ampx\.copy_: dst\[1\] has 3 elements but src\[1\] has 4",
    ),
    "copy_src_dtype": (
        lambda m: m.copy_([torch.ones(4, dtype=torch.int64)], _g(F16)),
        TypeError, r"ampx\.copy_: src\[0\] has dtype torch\.int64",
    ),
    "l2norm_device": (
        lambda m: m.l2norm(_g(BF16) + [torch.ones(4, dtype=BF16, device=META)]),
        ValueError, r"ampx\.l2norm: tensors\[1\] is on meta but tensors\[0\] is on cpu",
    ),
    "l2norm_noncontiguous": (
        lambda m: m.l2norm(_g(F32, F32) + [torch.ones(3, 3)[:, 0]]),
        ValueError, r"ampx\.l2norm: tensors\[2\] is not contiguous",
    ),
    "update_tracker_dtype": (
        lambda m: m.update_scale_(ONE.clone(), torch.zeros(1, dtype=torch.int64),
                                  torch.ones(1, dtype=torch.int32), torch.zeros(1),
                                  2.0, 0.5, 10, 1, 0.0, INF),
        TypeError, r"ampx\.update_scale_: growth_tracker must be a torch\.int32 tensor; got "
                   r"torch\.int64",
    ),
    "update_scale_numel": (
        lambda m: m.update_scale_(torch.ones(2), torch.zeros(1, dtype=torch.int32),
                                  torch.ones(1, dtype=torch.int32), torch.zeros(1),
                                  2.0, 0.5, 10, 1, 0.0, INF),
        ValueError, r"ampx\.update_scale_: scale must have 1 element; got 2",
    ),
    "update_found_device": (
        lambda m: m.update_scale_(ONE.clone(), torch.zeros(1, dtype=torch.int32),
                                  torch.ones(1, dtype=torch.int32),
                                  torch.zeros(1, device=META), 2.0, 0.5, 10, 1, 0.0, INF),
        ValueError, r"found_inf is on meta but scale is on cpu",
    ),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_argument_errors(impl: Any, case: str) -> None:
    call, exc_type, pattern = ERROR_CASES[case]
    with pytest.raises(exc_type, match=pattern) as info:
        call(impl)
    if impl is not _reference:
        with pytest.raises(exc_type) as ref_info:
            call(_reference)
        assert str(info.value).strip() == str(ref_info.value).strip()


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.unscale_([], torch.ones(2, dtype=torch.float64), torch.zeros(1)),
        lambda m: m.unscale_into_([], [], ONE, torch.zeros(1)),
        lambda m: m.copy_([], []),
    ],
    ids=["unscale_", "unscale_into_", "copy_"],
)
def test_empty_lists_are_noops(impl: Any, call: Callable[[Any], None]) -> None:
    call(impl)
    assert impl.l2norm([]).item() == 0.0
    total, norms = impl.l2norm([], per_tensor=True)
    assert total.item() == 0.0 and norms.shape == (0,)


# ---------------------------------------------------------------------------
# ampx._ext: selection, reporting, import behaviour
# ---------------------------------------------------------------------------


def test_ext_backend_is_reported() -> None:
    info = _ext.describe()
    assert info["backend"] == _ext.BACKEND
    assert info["import_error"] == _ext.IMPORT_ERROR
    assert (_ext.BACKEND == "native") == (_ext.IMPORT_ERROR is None)
    if os.environ.get("AMPX_DISABLE_EXT") == "1":
        assert _ext.BACKEND == "reference"
        assert "AMPX_DISABLE_EXT" in str(_ext.IMPORT_ERROR)
    for key in ("extension_path", "cuda_kernels", "cache_dir", "torch_version", "build_error",
                "python_version", "cpu_capability"):
        assert key in info


def test_ext_uses_reference_for_devices_without_kernels() -> None:
    assert _ext._impl(torch.device("meta")) is _reference
    expected = _reference if _ext.BACKEND == "reference" else _ext._native_module()
    assert _ext._impl(torch.device("cpu")) is expected


def test_ext_entry_points_match_reference() -> None:
    grads = make("several", BF16)
    ref = clone(grads)
    found, ref_found = torch.zeros(1), torch.zeros(1)
    _ext.unscale_(grads, torch.tensor([0.25]), found)
    _reference.unscale_(ref, torch.tensor([0.25]), ref_found)
    assert_lists_same(grads, ref)
    assert_same_bits(found, ref_found)
    masters = [torch.empty(t.shape) for t in grads]
    _ext.unscale_into_(grads, masters, torch.tensor([2.0]), found, None, False)
    assert_lists_same(masters, [t.float() * 2 for t in grads])
    back = [torch.empty_like(t) for t in grads]
    _ext.copy_(masters, back)
    total, norms = _ext.l2norm(masters, per_tensor=True)
    assert norms.shape == (len(masters),) and torch.isnan(total)
    assert _ext.l2norm([]).item() == 0.0
    scale, tracker, hyst = torch.tensor([8.0]), torch.zeros(1, dtype=torch.int32), \
        torch.ones(1, dtype=torch.int32)
    _ext.update_scale_(scale, tracker, hyst, torch.ones(1), 2.0, 0.5, 10, 1, 1.0, 1e9)
    assert scale.item() == 4.0


def test_importing_ampx_never_compiles_or_prints(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "AMPX_DISABLE_EXT"}
    env.update(AMPX_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    code = (
        "import sys, ampx, ampx._ext as e\n"
        "assert 'torch.utils.cpp_extension' not in sys.modules, 'cpp_extension imported'\n"
        "backend, err = e.BACKEND, e.IMPORT_ERROR\n"
        "assert 'torch.utils.cpp_extension' not in sys.modules, 'cpp_extension imported'\n"
        "open(sys.argv[1], 'w').write(backend + '|' + str(err))\n"
    )
    result_file = tmp_path / "result.txt"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(result_file)], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""
    backend, err = result_file.read_text().split("|", 1)
    if backend == "reference":  # nothing was built into the empty cache
        assert "not built" in err or "ampx._C" in err
        assert not cache.exists() or not any(cache.rglob("*.so"))


class _FakeCudaBuild:
    """A loaded extension with CUDA kernels for `archs` (only what `_ext` asks of it)."""

    def __init__(self, archs: str, probe: str = "") -> None:
        self.archs, self.probe, self.probed = archs, probe, 0

    def cuda_archs(self) -> str:
        return self.archs

    def cuda_probe(self, index: int) -> str:
        self.probed += 1
        return self.probe

    def has_cuda(self) -> bool:
        return True

    def cpu_capability(self) -> str:
        return "DEFAULT"


def _fake_state(monkeypatch: pytest.MonkeyPatch, native: Any,
                capability: tuple[int, int]) -> Any:
    state = _ext._State()
    state.loaded, state.native, state.has_cuda, state.path = True, native, True, "fake.so"
    monkeypatch.setattr(_ext, "_state", state)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    return state


def test_ext_falls_back_with_a_warning_on_a_gpu_the_build_lacks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An sm_90-only build on an A100 (sm_80): reference kernels and one warning, no launch."""
    native = _FakeCudaBuild("90")
    _fake_state(monkeypatch, native, (8, 0))
    with pytest.warns(RuntimeWarning, match=r"CUDA code for 90 .* cuda:0 is sm_80; rebuild"):
        assert _ext._impl(torch.device("cuda:0")) is _reference
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # checked once per device: no second warning
        assert _ext._impl(torch.device("cuda:0")) is _reference
    assert native.probed == 0  # the arch list already ruled it out
    assert "sm_80" in _ext.describe()["cuda_unusable"]["cuda:0"]
    assert _ext._impl(torch.device("cpu")) is native  # the CPU kernels are unaffected


def test_ext_uses_cuda_kernels_the_device_can_run(monkeypatch: pytest.MonkeyPatch) -> None:
    native = _FakeCudaBuild("80_90p")
    _fake_state(monkeypatch, native, (12, 0))  # newer than any sm_: PTX 9.0 is JIT-compiled
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _ext._impl(torch.device("cuda:1")) is native
    assert native.probed == 1 and _ext.describe()["cuda_unusable"] == {}
    assert _ext.describe()["cuda_archs"] == "80_90p"


def test_ext_falls_back_when_the_runtime_finds_no_kernel_image(
        monkeypatch: pytest.MonkeyPatch) -> None:
    native = _FakeCudaBuild("90", probe="no kernel image is available for execution")
    _fake_state(monkeypatch, native, (9, 0))
    with pytest.warns(RuntimeWarning, match="CUDA runtime cannot run .* no kernel image"):
        assert _ext._impl(torch.device("cuda:0")) is _reference
