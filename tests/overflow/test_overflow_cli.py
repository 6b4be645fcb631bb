"""`ampx run --explain-overflows` and `ampx sweep`'s culprit list: the provenance reaches the
command line through telemetry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ampx.cli import main as cli
from ampx.cli.sweep.report import format_table
from ampx.cli.sweep.stats import Row, summarize

SCRIPT = '''
import sys
import torch
from torch import nn
import ampx

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1))
with torch.no_grad():
    model[0].weight.fill_(1.0)
    model[1].weight.fill_(4e4)  # fp16 overflows in layer 1's output
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = ampx.initialize(model, opt, opt_level="O1")
for _ in range(int(sys.argv[1])):
    opt.zero_grad()
    loss = model(torch.randn(2, 4).abs()).float().sum()
    with ampx.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
'''


def _steps(path: Path) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in records if r["event"] == "step"]


@pytest.mark.parametrize("explain", [True, False])
def test_explain_overflows_names_the_forward_origin(tmp_path: Path, explain: bool) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    telemetry = tmp_path / "t.jsonl"
    flags = ["--explain-overflows"] if explain else []
    assert cli.main(["run", "-q", *flags, "--telemetry-file", str(telemetry), str(script),
                     "3"]) == 0
    steps = _steps(telemetry)
    assert [s["skipped"] for s in steps] == [True] * 3
    first = steps[0]["overflow"]
    assert first["forward_module"] == ("1" if explain else None)
    assert first["nan_params"] or first["inf_params"]
    row = summarize(Row(label="O1 fp16", opt_level="O1", dtype="fp16", status="ok"),
                          {"event": "init"}, steps)
    culprit = "1" if explain else first["modules"][0][0]
    assert row.skip_culprits == [[culprit, 3]]
    assert f"O1 fp16: skipped steps overflowed first in {culprit} (3)" in format_table([row])


def test_clean_runs_list_no_culprits(tmp_path: Path) -> None:
    row = summarize(Row(label="O0", opt_level="O0", dtype=None, status="ok"),
                          {"event": "init"}, [{"event": "step", "loss": 1.0, "skipped": False,
                                               "step_time_s": 0.1, "loss_scale": 1.0}])
    assert row.skip_culprits == [] and "overflowed first" not in format_table([row])
