"""Per-step telemetry as JSON lines: the writer (`ampx run`) and the reader (`ampx sweep`).

Off unless the environment variable `AMPX_TELEMETRY` names a file; then each process appends
records to it (a per-rank suffix is added for ranks other than 0). When off, the only cost is
one attribute check per optimizer step. Record formats: docs/internals.md. The module imports
no torch and works where the `resource` module does not exist (Windows: peak memory is then
recorded as null).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Optional

try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]

if TYPE_CHECKING:
    import torch

__all__ = ["ENV_VAR", "Tail", "Telemetry", "log_metric", "parse_records", "peak_memory_bytes",
           "read_metrics", "read_telemetry", "sink"]

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
        """Write one `step` record (with the overflow report of a skipped step, when given)."""
        self._steps += 1
        fields: dict[str, Any] = {"overflow": overflow} if overflow is not None else {}
        self.emit("step", step=self._steps, optimizer=optimizer, step_time_s=step_time_s,
                  loss=loss, loss_scale=loss_scale, skipped=skipped,
                  peak_mem_bytes=peak_memory_bytes(device), **fields)


    def metric(self, name: str, value: float, step: int | None = None) -> None:
        """Write one `metric` record (`step`: by default the steps recorded so far)."""
        self.emit("metric", name=name, value=value, step=self._steps if step is None else step)


def log_metric(name: str, value: Any, step: Optional[int] = None) -> None:
    """Report an evaluation metric (a held-out loss, an accuracy) to `ampx sweep`.

    One call after each evaluation, e.g. ``ampx.log_metric("val_acc", acc, step=step)``;
    ``ampx sweep train.py --metric val_acc --higher-is-better`` then judges the opt levels by
    it (table, sweep.json, CSV, figure, verdict). Outside a sweep (or `ampx run
    --telemetry-file`) it returns at once: it reads one environment variable and imports
    nothing.

    Args:
        name: The metric's name (what `--metric` takes).
        value: A number (a 0-d tensor is read with `.item()`).
        step: The optimizer step it was measured after (default: the steps recorded so far
            in this process).

    Raises:
        TypeError: `value` is not a number.
    """
    if not os.environ.get(ENV_VAR):
        return
    if hasattr(value, "item"):
        value = value.item()
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"ampx.log_metric: {name!r} must be a number, not "
                        f"{type(value).__name__}; pass float(value).")
    writer = sink()
    if writer is not None:
        writer.metric(str(name), float(value), None if step is None else int(step))


def peak_memory_bytes(device: torch.device | None) -> Optional[int]:
    """CUDA: max allocated on `device`; elsewhere: the process's peak resident set size.

    Returns None where neither is known (no `resource` module, as on Windows).
    """
    if device is not None and device.type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    if resource is None:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB


_REGISTRY: list[Any] = []  # ampx.registry.SESSIONS, once imported (sink runs every step)


def _load_registry() -> Any:
    from .registry import SESSIONS  # not at import: the sweep's reader needs no torch

    _REGISTRY.append(SESSIONS)
    return SESSIONS


def sink() -> Telemetry | None:
    """The process's telemetry writer, or None when `AMPX_TELEMETRY` is unset."""
    registry = _REGISTRY[0] if _REGISTRY else _load_registry()
    path = os.environ.get(ENV_VAR) or None
    if path != registry.telemetry_path:
        if registry.telemetry is not None:
            registry.telemetry.close()
        registry.telemetry_path = path
        registry.telemetry = Telemetry(path) if path else None
    return registry.telemetry


def parse_records(text: str) -> list[dict[str, Any]]:
    """The JSON-object lines of `text`; lines that are not (a torn last line) are skipped."""
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_telemetry(path: Path) -> tuple[Optional[dict[str, Any]], list[dict[str, Any]]]:
    """Read a telemetry file (rank 0's; other ranks write `path.N`).

    Args:
        path: The JSONL file.

    Returns:
        The last `init` record (or None) and the `step` records of the first optimizer that
        follow it. Lines that are not valid JSON (a run killed mid-write) are ignored.
    """
    if not path.exists():
        return None, []
    init: Optional[dict[str, Any]] = None
    steps: list[dict[str, Any]] = []
    for record in parse_records(path.read_text(encoding="utf-8")):
        if record.get("event") == "init":
            init, steps = record, []  # a second initialize starts a new series
        elif record.get("event") == "step":
            steps.append(record)
    if steps:
        first = min(int(r.get("optimizer", 0) or 0) for r in steps)
        steps = [r for r in steps if int(r.get("optimizer", 0) or 0) == first]
    return init, steps


def read_metrics(path: Path) -> tuple[dict[str, list[dict[str, Any]]], Optional[dict[str, Any]]]:
    """The `metric` records of a telemetry file by name (each `{"step", "value", "time"}`, in
    the order written; those before the last `init` are dropped, as in `read_telemetry`), and
    the last `data` record (what a built-in example trained on), or None."""
    metrics: dict[str, list[dict[str, Any]]] = {}
    data: Optional[dict[str, Any]] = None
    if not path.exists():
        return metrics, data
    for record in parse_records(path.read_text(encoding="utf-8")):
        event = record.get("event")
        if event == "init":
            metrics = {}
        elif event == "data":
            data = {k: v for k, v in record.items() if k not in ("event", "time", "pid", "rank")}
        elif event == "metric" and isinstance(record.get("value"), (int, float)):
            metrics.setdefault(str(record.get("name")), []).append(
                {"step": record.get("step"), "value": float(record["value"]),
                 "time": record.get("time")})
    return metrics, data


class Tail:
    """Follows a telemetry file while it is written: counts the step records."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.steps = 0
        self.last_step_s: Optional[float] = None
        self._optimizer: Optional[int] = None

    def poll(self) -> bool:
        """Read what was appended; True when new step records arrived."""
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read()
        except OSError:
            return False
        end = chunk.rfind(b"\n") + 1  # only complete lines
        self.offset += end
        before = self.steps
        for record in parse_records(chunk[:end].decode("utf-8", "replace")):
            if record.get("event") == "init":
                self.steps, self._optimizer = 0, None
            elif record.get("event") == "step":
                optimizer = int(record.get("optimizer", 0) or 0)
                if self._optimizer is None:
                    self._optimizer = optimizer
                if optimizer == self._optimizer:
                    self.steps += 1
                    value = record.get("step_time_s")
                    self.last_step_s = float(value) if isinstance(value, (int, float)) else None
        return self.steps != before
