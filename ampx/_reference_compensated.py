"""Compensated (Kahan) half-weight updates in pure torch: the specification ``ampx._C`` matches.

A half-precision weight ``w`` (float16 or bfloat16) carries a compensation tensor ``c`` of
the same shape and dtype: together they hold the weight ``x = float32(w) + float32(c)``, about
twice the half dtype's precision, so an update smaller than half a unit in the last place of
``w`` is kept in ``c`` instead of being rounded away. Each update reads ``w``, ``c``, the
gradient and the optimizer's state, does the optimizer's math in float32 and writes back
``w = half(x)`` and ``c = half(x - float32(w))`` (round-to-nearest-even both), and the
state rounded to its own dtype. Float32 weights are never stored.

Numerics, which the native kernels reproduce bit for bit (NaN payloads aside): every step
below is one float32 operation rounded to float32 (no fused multiply-add: the native build
uses ``-ffp-contract=off`` / ``--fmad=false``), in the order written; Python float scalars
are rounded to float32 first (what torch does with a scalar operand of a float32 tensor).
The torch calls here use only ``mul``, ``add``, ``sub``, ``div``, ``neg`` and ``sqrt`` (no
``alpha=``, ``lerp`` or ``addcdiv``, whose vectorised CPU kernels may fuse). ``sqrt`` is the
correctly rounded float32 square root (IEEE, ``sqrtf``): torch's float32 CPU ``sqrt`` (MKL's
vector math) is off by one unit in the last place for about 1% of inputs, so the reference
takes the float64 root rounded once to float32, which is exact (:func:`_sqrt`).

SGD (``torch.optim.SGD``'s algorithm; ``first`` when the momentum buffer is new)::

    x = f(w) + f(c);  g = f(grad);  if maximize: g = -g
    if weight_decay: g = g + weight_decay * x
    if momentum:
        b = g if first else f(buf) * momentum + g * (1 - dampening);  buf = round(b)
        g = g + momentum * b if nesterov else b
    x = x - lr * g

Adam / AdamW (``decoupled``), with ``t`` the step count after this step::

    x = f(w) + f(c);  g = f(grad);  if maximize: g = -g
    if decoupled: x = x * (1 - lr * weight_decay)     # the factor computed in double
    elif weight_decay: g = g + weight_decay * x
    m = f(exp_avg) * beta1 + g * (1 - beta1);  exp_avg = round(m)
    v = f(exp_avg_sq) * beta2 + (g * g) * (1 - beta2);  exp_avg_sq = round(v)
    x = x - (m / (sqrt(v) / bias2_sqrt + eps)) * step_size

where ``step_size = lr / (1 - beta1**t)`` and ``bias2_sqrt = sqrt(1 - beta2**t)`` are
computed in double by the caller. The update uses ``m`` and ``v`` before their rounding
to the state's dtype (the registers), so float32 and half optimizer state both work.
Then, for both: ``w = round(x); c = round(x - f(w))``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["compensated_adam_", "compensated_sgd_"]

Tensors = Sequence[torch.Tensor]

_F32 = torch.float32
_HALF = (torch.float16, torch.bfloat16)


def _check(api: str, params: Tensors, comps: Tensors, grads: Tensors,
           state: dict[str, Tensors]) -> None:
    """The arguments' checks (the native kernels raise the same types and messages).

    ``grads`` and each ``state`` list hold float32 or the parameter's dtype (the kernels'
    instantiations); the two Adam moments share a dtype; parameters are contiguous too.
    """
    lists = (params, comps, grads, *state.values())
    if any(len(items) != len(params) for items in lists):
        raise ValueError(f"ampx.{api}: the tensor lists differ in length "
                         f"({', '.join(str(len(items)) for items in lists)})")
    named = {"grads": grads, **state}
    for i, p in enumerate(params):
        if p.dtype not in _HALF:
            raise TypeError(f"ampx.{api}: params[{i}] is {p.dtype}; compensated updates "
                            "are for float16/bfloat16 weights")
        if not p.is_contiguous():
            raise ValueError(f"ampx.{api}: tensor {i} is not contiguous")
        for items in lists[1:]:
            t = items[i]
            if t.shape != p.shape or t.device != p.device:
                raise ValueError(f"ampx.{api}: tensor {i} differs from its parameter in "
                                 "shape or device")
            if not t.is_contiguous():
                raise ValueError(f"ampx.{api}: tensor {i} is not contiguous")
        if comps[i].dtype != p.dtype:
            raise TypeError(f"ampx.{api}: comps[{i}] is {comps[i].dtype}, not {p.dtype}")
        for name, items in named.items():
            if items[i].dtype not in (_F32, p.dtype):
                raise TypeError(f"ampx.{api}: {name}[{i}] is {items[i].dtype}; expected "
                                f"torch.float32 or {p.dtype}")
        if "exp_avg_sqs" in state and state["exp_avg_sqs"][i].dtype != state["exp_avgs"][i].dtype:
            raise TypeError(f"ampx.{api}: exp_avg_sqs[{i}] is {state['exp_avg_sqs'][i].dtype}, "
                            f"not {state['exp_avgs'][i].dtype} like exp_avgs[{i}]")


def _f32(value: float) -> torch.Tensor:
    """A Python float rounded to a float32 0-d tensor (one rounding, as the kernels take it)."""
    return torch.tensor(value, dtype=_F32)


def _sqrt(v: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root of float32 `v`.

    The float64 root of a float32 value is within a unit of float64's last place, which can
    never straddle a float32 rounding boundary (an exact root lies at least about 2**-50
    relative away from the nearest float32 midpoint), so rounding it to float32 gives the
    IEEE result that the kernels' ``sqrtf`` / ``_mm512_sqrt_ps`` / ``__fsqrt_rn`` compute.
    """
    return torch.sqrt(v.double()).float()


def _write_back(w: torch.Tensor, c: torch.Tensor, x: torch.Tensor) -> None:
    high = x.to(w.dtype)
    w.copy_(high)
    c.copy_(torch.sub(x, high.to(_F32)).to(c.dtype))


def compensated_sgd_(params: Tensors, comps: Tensors, grads: Tensors, momentum_bufs: Tensors,
                     *, lr: float, weight_decay: float, momentum: float, dampening: float,
                     nesterov: bool, maximize: bool, first: bool) -> None:
    """One SGD step on compensated half weights, in place (see the module docstring).

    ``momentum_bufs`` is empty when ``momentum`` is 0, else one buffer per parameter (its
    contents are ignored when ``first``).
    """
    _check("compensated_sgd_", params, comps, grads,
           {"momentum_bufs": momentum_bufs} if momentum else {})
    lr_, wd, mu = _f32(lr), _f32(weight_decay), _f32(momentum)
    keep = _f32(1.0 - dampening)
    with torch.no_grad():
        for i, (w, c, grad) in enumerate(zip(params, comps, grads)):
            x = torch.add(w.to(_F32), c.to(_F32))
            g = grad.to(_F32)
            if maximize:
                g = torch.neg(g)
            if weight_decay != 0:
                g = torch.add(g, torch.mul(x, wd))
            if momentum != 0:
                buf = momentum_bufs[i]
                b = g if first else torch.add(torch.mul(buf.to(_F32), mu), torch.mul(g, keep))
                buf.copy_(b)
                g = torch.add(g, torch.mul(b, mu)) if nesterov else b
            x = torch.sub(x, torch.mul(g, lr_))
            _write_back(w, c, x)


def compensated_adam_(params: Tensors, comps: Tensors, grads: Tensors, exp_avgs: Tensors,
                      exp_avg_sqs: Tensors, *, lr: float, beta1: float, beta2: float,
                      eps: float, weight_decay: float, decoupled: bool, maximize: bool,
                      step_size: float, bias2_sqrt: float) -> None:
    """One Adam (``decoupled``: AdamW) step on compensated half weights, in place.

    ``step_size`` and ``bias2_sqrt`` are the step's bias corrections (module docstring).
    """
    _check("compensated_adam_", params, comps, grads,
           {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs})
    b1, b2 = _f32(beta1), _f32(beta2)
    one_b1, one_b2 = _f32(1.0 - beta1), _f32(1.0 - beta2)
    eps_, wd, decay = _f32(eps), _f32(weight_decay), _f32(1.0 - lr * weight_decay)
    size, root2 = _f32(step_size), _f32(bias2_sqrt)
    with torch.no_grad():
        for w, c, grad, m_s, v_s in zip(params, comps, grads, exp_avgs, exp_avg_sqs):
            x = torch.add(w.to(_F32), c.to(_F32))
            g = grad.to(_F32)
            if maximize:
                g = torch.neg(g)
            if decoupled:
                x = torch.mul(x, decay)
            elif weight_decay != 0:
                g = torch.add(g, torch.mul(x, wd))
            m = torch.add(torch.mul(m_s.to(_F32), b1), torch.mul(g, one_b1))
            v = torch.add(torch.mul(v_s.to(_F32), b2), torch.mul(torch.mul(g, g), one_b2))
            m_s.copy_(m)
            v_s.copy_(v)
            denom = torch.add(torch.div(_sqrt(v), root2), eps_)
            x = torch.sub(x, torch.mul(torch.div(m, denom), size))
            _write_back(w, c, x)
