"""`ampx selftest`: passes on this CPU, and fails when a kernel or a training check is wrong."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ampx import _reference
from ampx.cli import main as cli
from ampx.cli import selftest, selftest_kernels
from ampx.frontend import Amp


class _OffByOne:
    """The reference kernels, except that copy_ is wrong in its first element."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_reference, name)

    @staticmethod
    def copy_(src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
        _reference.copy_(src, dst)
        dst[0].view(-1)[0] += 1


def test_selftest_passes_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["selftest"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].split() == ["device", "check", "status", "detail"]
    checks = {" ".join(line.split()[1:4]): line for line in lines[2:] if line.startswith("cpu")}
    for level in ("O1", "O2"):
        for dtype in ("fp16", "bf16"):
            line = checks[f"train {level} {dtype}"]
            assert " pass " in line and "skipped [10]" in line
    assert "scale 65536 -> 32768" in checks["train O1 fp16"]
    kernels = next(line for line in lines if line.startswith("cpu     kernels"))
    assert " pass " in kernels or " skip " in kernels  # skip: extension not built/disabled
    speed = next(line for line in lines if "speed bf16" in line)
    assert "O1/autocast" in speed and "O2/autocast" in speed
    assert lines[-1].startswith("PASS: ")
    assert "ampx selftest: cpu train O2 bf16: pass" in captured.err


def test_kernel_comparison_finds_a_wrong_kernel() -> None:
    check = selftest.kernel_check("cpu", native=_OffByOne())
    assert check.status == "FAIL" and "copy_(to float32)[float32, none]" in check.detail
    assert selftest.kernel_check("cpu", native=_reference).status == "pass"
    result = selftest_kernels.compare_backends(_reference, torch.device("cpu"))
    assert result["mismatches"] == [] and result["cases"] > 100


def test_selftest_exits_1_on_a_mismatch(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(selftest, "devices", lambda: ["cpu"])
    monkeypatch.setattr(selftest_kernels, "native_for", lambda device: (_OffByOne(), None))
    monkeypatch.setattr(selftest, "speed_check",
                        lambda device, dtype: selftest.Check(device, "speed", "info", "-"))
    assert selftest.main() == 1
    out = capsys.readouterr().out
    assert "cpu     kernels" in out and "FAIL" in out
    assert out.splitlines()[-1] == "FAIL: 1 of 6 checks failed"


def test_training_check_fails_when_the_overflow_step_is_not_skipped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Amp, "step_was_skipped", lambda self, optimizer: False)
    check = selftest.training_check("cpu", "O2", "bf16")
    assert check.status == "FAIL" and "overflow step 10 was not skipped" in check.detail


def test_selftest_json_lists_every_check(monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    import json

    monkeypatch.setattr(selftest, "devices", lambda: ["cpu"])
    monkeypatch.setattr(selftest_kernels, "native_for", lambda device: (_reference, None))
    assert cli.main(["selftest", "--json"]) == 0
    checks = json.loads(capsys.readouterr().out)
    assert [c["check"] for c in checks] == ["kernels", "train O1 fp16", "train O2 fp16",
                                            "train O1 bf16", "train O2 bf16", "speed bf16"]
    assert {c["status"] for c in checks} == {"pass", "info"}
