"""Per-step telemetry as JSON lines, for `ampx run` and `ampx sweep`.

Off unless the environment variable `AMPX_TELEMETRY` names a file; then each process appends
records to it (a per-rank suffix is added for ranks other than 0). When off, the only cost is
one attribute check per optimizer step. Record formats: docs/internals.md.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import IO, Any

import torch

__all__ = ["ENV_VAR", "Telemetry", "sink"]

ENV_VAR = "AMPX_TELEMETRY"


class Telemetry:
    """An append-only JSONL writer (one per process)."""

    def __init__(self, path: str) -> None:
        rank = int(os.environ.get("RANK", "0") or 0)
        self.rank = rank
        self.path = path if rank == 0 else f"{path}.{rank}"
        self._file: IO[str] = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._steps = 0

    def emit(self, event: str, **fields: Any) -> None:
        """Write one record and flush it (so a crash keeps what came before)."""
        if self._file.closed:
            return
        record = {"event": event, "time": time.time(), "pid": os.getpid(), "rank": self.rank}
        record.update(fields)
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file; later records are dropped."""
        self._file.close()

    def step(self, *, optimizer: int, step_time_s: float, loss: float | None, loss_scale: float,
             skipped: bool, device: torch.device | None,
             overflow: dict[str, Any] | None = None) -> None:
        """Write one `step` record (with `overflow`, the OverflowReport of a skipped step)."""
        self._steps += 1
        extra = {"overflow": overflow} if overflow is not None else {}
        self.emit("step", step=self._steps, optimizer=optimizer, step_time_s=step_time_s,
                  loss=loss, loss_scale=loss_scale, skipped=skipped,
                  peak_mem_bytes=peak_memory_bytes(device), **extra)


def peak_memory_bytes(device: torch.device | None) -> int:
    """CUDA: max allocated on `device`; elsewhere: the process's peak resident set size."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB


_SINK: Telemetry | None = None
_SINK_PATH: str | None = None


def sink() -> Telemetry | None:
    """The process's telemetry writer, or None when `AMPX_TELEMETRY` is unset."""
    global _SINK, _SINK_PATH
    path = os.environ.get(ENV_VAR) or None
    if path != _SINK_PATH:
        if _SINK is not None:
            _SINK.close()
        _SINK_PATH = path
        _SINK = Telemetry(path) if path else None
    return _SINK
