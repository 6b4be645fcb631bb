"""Telemetry: the writer works without `resource` (Windows), the reader and the live tail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ampx import telemetry

ROOT = Path(__file__).resolve().parents[2]


def test_import_ampx_without_the_resource_module() -> None:
    code = ("import sys; sys.modules['resource'] = None\n"
            "import ampx, ampx.telemetry as t\n"
            "print(t.resource is None, t.peak_memory_bytes(None))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "None"]


def test_peak_memory_is_the_process_rss_on_cpu() -> None:
    peak = telemetry.peak_memory_bytes(None)
    assert peak is not None and peak > 10 * 2**20  # torch alone is far above 10 MiB


def test_tail_counts_complete_step_lines_as_they_arrive(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    tail = telemetry.Tail(path)
    assert tail.poll() is False  # no file yet
    init = json.dumps({"event": "init"})
    step = json.dumps({"event": "step", "optimizer": 0, "step_time_s": 0.25})
    other = json.dumps({"event": "step", "optimizer": 1, "step_time_s": 9.0})
    path.write_text(f"{init}\n{step}\n{other}\n{step[:10]}")  # the last line is torn
    assert tail.poll() is True and tail.steps == 1 and tail.last_step_s == 0.25
    with open(path, "a") as handle:
        handle.write(f"{step[10:]}\n{step}\n")
    assert tail.poll() is True and tail.steps == 3
    assert tail.poll() is False


def test_read_telemetry_keeps_the_first_optimizer_of_the_last_session(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    records = [{"event": "init", "n": 1}, {"event": "step", "optimizer": 0, "loss": 9.0},
               {"event": "init", "n": 2}, {"event": "step", "optimizer": 1, "loss": 1.0},
               {"event": "step", "optimizer": 2, "loss": 2.0}]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n[1, 2]\n")
    init, steps = telemetry.read_telemetry(path)
    assert init == {"event": "init", "n": 2}
    assert [s["loss"] for s in steps] == [1.0]


def test_step_records_carry_the_overflow_report_of_skipped_steps(tmp_path: Path) -> None:
    writer = telemetry.Telemetry(str(tmp_path / "t.jsonl"))
    writer.step(optimizer=0, step_time_s=0.1, loss=1.0, loss_scale=2.0, skipped=True,
                device=None, overflow={"modules": [["fc2", 1]]})
    writer.step(optimizer=0, step_time_s=0.1, loss=1.0, loss_scale=2.0, skipped=False,
                device=None)
    writer.close()
    _, steps = telemetry.read_telemetry(tmp_path / "t.jsonl")
    assert steps[0]["overflow"] == {"modules": [["fc2", 1]]} and "overflow" not in steps[1]
