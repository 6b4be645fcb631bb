"""torch.distributed on CPU: 2 gloo processes, DDP at every opt level, the fairseq-style wrapper
with no_sync accumulation, FSDP2, and rank-0-only logging.

One launch of two worker processes (this file run as a script) covers every scenario; the tests
below check its results. Inf is injected on rank 1 only, after DDP has reduced the gradients, so
only rank 1's unscale sees it: both ranks must still skip the same step (ampx all-reduces its
overflow flag) and end with bitwise identical parameters and state dicts.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import sys
from datetime import timedelta
from typing import Any

import pytest
import torch
from _two_ranks import WORLD, finish, launch
from torch import nn

POISON_STEP = 2
# (case name, opt level, dtype, whether rank 1 gets an inf at POISON_STEP, sync_overflow)
DDP_CASES = [
    ("O0", "O0", "fp16", False, True),
    ("O1-fp16", "O1", "fp16", True, True),
    ("O2-fp16", "O2", "fp16", True, True),
    ("O2-bf16", "O2", "bf16", True, True),
    ("O3-fp16", "O3", "fp16", False, True),  # static scale 1.0: apex's no-check path
    ("O3-bf16", "O3", "bf16", True, True),
    ("O2-fp16-unsynced", "O2", "fp16", True, False),  # the negative control
]


# -- the worker ------------------------------------------------------------------------------------

def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        h.update(str(t.dtype).encode())
        h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _canon(obj: Any) -> Any:
    """A JSON-able, comparable form of a state dict (tensors become digests)."""
    if isinstance(obj, torch.Tensor):
        return _digest([obj])
    if isinstance(obj, dict):
        return {str(k): _canon(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple)):
        return [_canon(v) for v in obj]
    return obj if isinstance(obj, (int, float, str, bool, type(None))) else repr(obj)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _batch(rank: int, step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(n, 6, generator=gen), torch.randn(n, 3, generator=gen)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x).float() - y).pow(2).mean()


def _poison(param: torch.Tensor) -> None:
    grad = param.grad
    assert grad is not None
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    local.view(-1)[0] = float("inf")


def _ddp_case(rank: int, level: str, dtype: str, poison: bool, sync: bool) -> dict[str, Any]:
    import ampx

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    amp = ampx.Amp(opt_level=level, dtype=dtype, init_scale=2.0**8, verbosity=0,
                   sync_overflow=sync)
    model, opt = amp.initialize(model, opt)
    ddp = nn.parallel.DistributedDataParallel(model)
    skipped = []
    for step in range(4):
        opt.zero_grad()
        with amp.scale_loss(_loss(ddp, *_batch(rank, step)), opt) as scaled:
            scaled.backward()
            if poison and rank == 1 and step == POISON_STEP:
                _poison(next(model.parameters()))  # already all-reduced: only rank 1 sees it
        opt.step()
        skipped.append(amp.step_was_skipped(opt))
    return {"skipped": skipped, "params": _digest(list(model.state_dict().values())),
            "masters": _digest(list(ampx.master_params(opt))),
            "amp": _canon(amp.state_dict()), "optimizer": _canon(opt.state_dict())}


def _wrapper_case(rank: int) -> dict[str, Any]:
    """fairseq's loop: update-freq 2 with DDP no_sync, clip_grad_norm, OverflowError."""
    import ampx
    from ampx.compat.fairseq.optimizer import AmpOptimizer

    model = _model()
    amp = ampx.Amp(opt_level="O2", init_scale=2.0**8, growth_interval=2, verbosity=0)
    model, opt = amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ddp = nn.parallel.DistributedDataParallel(model)
    wrapper = AmpOptimizer(opt, amp)
    outcomes, norms = [], []
    for update in range(5):
        wrapper.zero_grad()
        for micro in range(2):
            x, y = _batch(rank, 10 * update + micro)
            sync = ddp.no_sync() if micro == 0 else contextlib.nullcontext()
            with sync:
                loss = _loss(ddp, x, y)
                if update == 1 and micro == 0 and rank == 0:
                    loss = loss * float("inf")  # rank-local, accumulated, reduced at micro 1
                wrapper.backward(loss)
        if update == 3 and rank == 1:
            _poison(next(model.parameters()))  # after the reduction: rank 1 only
        try:
            wrapper.multiply_grads(0.5)
            norms.append(float(wrapper.clip_grad_norm(1.0)))
            wrapper.step()
            outcomes.append("ok")
        except OverflowError:
            outcomes.append("overflow")
            wrapper.zero_grad()
    return {"outcomes": outcomes, "norms": norms, "scale": wrapper.loss_scale,
            "params": _digest(list(model.state_dict().values())),
            "state_dict": _canon(wrapper.state_dict())}


def _fsdp2_case(rank: int) -> dict[str, Any]:
    import ampx
    from ampx.compat.fairseq.optimizer import AmpOptimizer

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError as exc:  # pragma: no cover - older torch
        return {"unsupported": repr(exc)}
    out: dict[str, Any] = {}
    # ampx.Amp directly: O1 over FSDP2's sharded fp32 parameters
    model = _model()
    fully_shard(model)
    amp = ampx.Amp(opt_level="O1", init_scale=2.0**8, verbosity=0)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    skipped = []
    for step in range(4):
        opt.zero_grad()
        with amp.scale_loss(_loss(model, *_batch(rank, step)), opt) as scaled:
            scaled.backward()
            if rank == 1 and step == POISON_STEP:
                _poison(next(model.parameters()))  # rank 1's shard only
        opt.step()
        skipped.append(amp.step_was_skipped(opt))
    out["skipped"] = skipped
    out["params"] = _digest(list(model.parameters()))  # full tensors
    out["scale"] = amp.loss_scale()
    amp.restore()
    # the fairseq-style wrapper: norm over DTensor shards equals the full gradients' norm
    model = _model()
    fully_shard(model)
    amp = ampx.Amp(opt_level="O1", init_scale=2.0**8, verbosity=0)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    wrapper = AmpOptimizer(opt, amp)
    wrapper.backward(_loss(model, *_batch(rank, 0)))
    norm = wrapper.clip_grad_norm(0.0)
    full = torch.cat([p.grad.full_tensor().reshape(-1) for p in model.parameters()])
    out["norm"] = float(norm)
    out["full_norm"] = float(torch.linalg.vector_norm(full))
    wrapper.step()
    out["wrapper_params"] = _digest(list(model.parameters()))
    amp.restore()
    return out


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname}:{record.getMessage()}")


def _worker(rank: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=90))
    records = _Records()
    ampx_logger = logging.getLogger("ampx")
    ampx_logger.addHandler(records)
    ampx_logger.setLevel(logging.DEBUG)  # verbosity=0 logs skipped steps at DEBUG (apex: silent)
    results: dict[str, Any] = {"ddp": {}}
    for name, level, dtype, poison, sync in DDP_CASES:
        results["ddp"][name] = _ddp_case(rank, level, dtype, poison, sync)
    results["wrapper"] = _wrapper_case(rank)
    results["fsdp2"] = _fsdp2_case(rank)
    results["logs"] = records.lines
    finish(rank, results, out_dir)


# -- the tests -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    return launch(__file__, tmp_path_factory.mktemp("dist"))


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in DDP_CASES if c[4]], ids=lambda c: c[0])
def test_ddp_after_initialize_at_every_level(results: list, case: tuple) -> None:
    name, _, _, poison, _ = case
    rank0, rank1 = (r["ddp"][name] for r in results)
    expected = [step == POISON_STEP and poison for step in range(4)]
    assert rank0["skipped"] == rank1["skipped"] == expected
    assert rank0["params"] == rank1["params"]  # bitwise
    assert rank0["masters"] == rank1["masters"]
    assert rank0["amp"] == rank1["amp"] and rank0["optimizer"] == rank1["optimizer"]


@pytest.mark.slow
def test_without_sync_overflow_ranks_diverge(results: list) -> None:
    """The negative control: the injected inf is really seen by rank 1 only."""
    rank0, rank1 = (r["ddp"]["O2-fp16-unsynced"] for r in results)
    assert rank0["skipped"] == [False] * 4
    assert rank1["skipped"] == [step == POISON_STEP for step in range(4)]
    assert rank0["params"] != rank1["params"]


@pytest.mark.slow
def test_wrapper_with_no_sync_accumulation(results: list) -> None:
    rank0, rank1 = (r["wrapper"] for r in results)
    assert rank0["outcomes"] == rank1["outcomes"] == ["ok", "overflow", "ok", "overflow", "ok"]
    assert rank0["norms"] == rank1["norms"]
    assert rank0["scale"] == rank1["scale"] == 2.0**6
    assert rank0["params"] == rank1["params"]
    assert rank0["state_dict"] == rank1["state_dict"]  # identical checkpoints on every rank


@pytest.mark.slow
def test_fsdp2(results: list) -> None:
    rank0, rank1 = (r["fsdp2"] for r in results)
    if "unsupported" in rank0:
        pytest.skip(f"FSDP2 unavailable: {rank0['unsupported']}")
    assert rank0["skipped"] == rank1["skipped"] == [s == POISON_STEP for s in range(4)]
    assert rank0["params"] == rank1["params"] and rank0["scale"] == rank1["scale"] == 128.0
    assert rank0["norm"] == rank1["norm"]
    assert rank0["norm"] == pytest.approx(rank0["full_norm"], rel=1e-5)
    assert rank0["wrapper_params"] == rank1["wrapper_params"]


@pytest.mark.slow
def test_rank_zero_only_logging(results: list) -> None:
    rank0, rank1 = (r["logs"] for r in results)
    assert any("Gradient overflow" in line for line in rank0)
    # rank 1 logs nothing below ERROR once the session's filter is in (the DEBUG lines of
    # loading the kernels and installing the patches come before it)
    assert not [line for line in rank1
                if line.startswith(("INFO", "WARNING")) or "Gradient overflow" in line]


def test_rank_zero_filter_single_process() -> None:
    from ampx.distributed import RankZeroFilter

    record = logging.LogRecord("ampx", logging.INFO, __file__, 1, "msg", None, None)
    assert RankZeroFilter().filter(record)  # not distributed: rank 0


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])


def test_gloo_flag_reduction_returns_only_after_the_worker_released_the_flag(monkeypatch):
    """gloo's worker thread drops its reference to the flag after wait(); ampx waits for it,
    so that thread never frees the Python object (a SIGABRT at interpreter exit)."""
    import torch.distributed as dist

    from ampx import distributed as ampx_dist

    parked: list[torch.Tensor] = []
    looks: list[int] = []
    count = ampx_dist._references

    def fake_all_reduce(t, op=None, group=None):
        parked.append(t.view(-1))  # a view holds a C++ reference to its base

    def references(t):  # "the worker" lets go while ampx looks for the third time
        looks.append(1)
        if len(looks) == 3:
            parked.clear()
        return count(t)

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    monkeypatch.setattr(ampx_dist, "_references", references)
    flag = torch.zeros(1)
    before = flag._use_count()
    ampx_dist.reduce_found_inf_(flag)
    assert flag._use_count() == before and not parked and len(looks) == 3
