"""What the fresh-process benchmarks (bench_startup, bench_memory) share: the resident set
and one training step, written once so both time and measure the same step.

Imports nothing heavy at module level: bench_startup times `import torch` after importing it.
"""

from __future__ import annotations

import os
from typing import Any


def rss_mib() -> float:
    """This process's resident set, in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def train_step(model: Any, opt: Any, x: Any, y: Any, amp: Any = None,
               autocast_dtype: Any = None) -> None:
    """One MSE training step: under `amp.scale_loss` (an ampx session), or torch.autocast
    (`autocast_dtype`), or plain float32 when both are None."""
    import torch
    import torch.nn.functional as F

    opt.zero_grad(set_to_none=True)
    if autocast_dtype is not None:
        with torch.autocast("cpu", dtype=autocast_dtype):
            out = model(x)
    else:
        out = model(x)
    loss = F.mse_loss(out.float(), y)
    if amp is not None:
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    else:
        loss.backward()
    opt.step()
