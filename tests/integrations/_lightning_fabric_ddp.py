"""Run by tests/integrations/test_lightning.py: Fabric(strategy="ddp", devices=2) with
AmpxPrecision, CPU/gloo, one worker per rank (``python _lightning_fabric_ddp.py RANK STORE OUT``).

`tests/_two_ranks.launch` starts both ranks; each initializes the gloo group itself and sets
LOCAL_RANK, so Fabric sees an externally launched job (as under torchrun) and starts nothing.
Every case trains a fresh model for 5 steps on batches seeded by rank (the ranks' gradients
differ: only DDP's all-reduce keeps their weights equal) and saves its parameters, O2's fp32
masters and the loss scale to OUT/rank<R>.pt; the per-step numbers go to results.json.

In the fp16 cases a DDP comm hook puts an inf into rank 1's gradient bucket *after* the
all-reduce, at step 2: rank 0's gradients stay finite, so rank 0 skips that step only because
ampx agrees on the overflow flag across ranks. The ``unsynced`` case skips DDP's gradient
all-reduce (`fabric.no_backward_sync`) and must end with the ranks' weights different.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from _two_ranks import WORLD, finish
from torch import nn

warnings.filterwarnings("ignore")  # Lightning's advice about CPU runs, not ours to act on

STEPS = 5
POISON_STEP = 2
CASES = {  # name: (opt_level, dtype, inf on rank 1 after the all-reduce, DDP all-reduce)
    "O1-bf16": ("O1", "bf16", False, True),
    "O2-bf16": ("O2", "bf16", False, True),
    "O1-fp16": ("O1", "fp16", True, True),
    "O2-fp16": ("O2", "fp16", True, True),
    "O2-bf16-unsynced": ("O2", "bf16", False, False),
}


def _net() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on both ranks (DDP also broadcasts them)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _poison_after_all_reduce(state: dict[str, bool], bucket):
    """DDP's default all-reduce (average), then an inf in this rank's result when asked.

    Unannotated: DDP checks the annotations against the real classes, and this module's are
    strings (``from __future__ import annotations``).
    """
    buffer = bucket.buffer().div_(WORLD)
    future = dist.all_reduce(buffer, async_op=True).get_future()

    def then(done: Any) -> torch.Tensor:
        reduced = done.value()[0]
        if state["poison"]:
            state["poison"] = False  # one bucket: the inf is in one place on one rank
            reduced.view(-1)[0] = math.inf
        return reduced

    return future.then(then)


def _case(rank: int, level: str, dtype: str, poison: bool, sync: bool
          ) -> tuple[dict[str, Any], dict[str, Any]]:
    import lightning.fabric as lf

    import ampx
    from ampx.integrations.lightning import AmpxPrecision

    precision = AmpxPrecision(opt_level=level, dtype=dtype)
    fabric = lf.Fabric(accelerator="cpu", devices=WORLD, strategy="ddp", plugins=[precision])
    fabric.launch()  # LOCAL_RANK is set: joins the existing group, spawns nothing
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = fabric.setup(*precision.initialize(model, opt))
    hook_state = {"poison": False}
    if poison:
        model._forward_module.register_comm_hook(hook_state, _poison_after_all_reduce)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    losses, skipped, local_inf = [], [], []
    for step in range(STEPS):
        x, y = torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        hook_state["poison"] = poison and rank == 1 and step == POISON_STEP
        opt.zero_grad()
        with fabric.no_backward_sync(model, enabled=not sync):
            loss = nn.functional.cross_entropy(model(x).float(), y)
            fabric.backward(loss)
        opt.step()
        losses.append(loss.item())
        skipped.append(ampx.step_was_skipped(opt))
        report = ampx.last_overflow(opt) if skipped[-1] else None  # a report outlives its step
        # the parameters whose gradients held the inf on *this* rank (rank-local)
        local_inf.append(list(report.as_dict()["inf_params"]) if report is not None else [])
    amp = precision.amp
    assert amp is not None
    module = model.module
    tensors = {
        # parameters; batchnorm's running stats are per rank under DDP (each its own batches)
        "params": [p.detach().clone() for p in module.parameters()],
        "masters": [p.detach().clone() for p in ampx.master_params(opt)],
    }
    numbers = {"losses": losses, "skipped": skipped, "local_inf": local_inf,
               "loss_scale": amp.loss_scale(), "steps": amp.optimizers[0]._ampx.steps,
               "param_dtype": str(module[0].weight.dtype)}
    amp.restore()
    return numbers, tensors


def _worker(rank: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)  # Lightning's sign of an external launcher
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=90))
    results, tensors = {}, {}
    for name, case in CASES.items():
        results[name], tensors[name] = _case(rank, *case)
    torch.save(tensors, os.path.join(out_dir, f"rank{rank}.pt"))
    finish(rank, results, out_dir)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
