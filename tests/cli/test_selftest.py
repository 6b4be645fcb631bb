"""`ampx selftest`: passes on this CPU, and fails when a kernel or a training check is wrong."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ampx import _ext, _reference
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


class _LaterLaunchBug:
    """The reference, except that unscale_ loses the per-tensor flags past the 3rd tensor:
    a packing bug that only lists longer than one launch (3 tensors here) can show."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_reference, name)

    @staticmethod
    def unscale_(grads: list[torch.Tensor], inv: torch.Tensor, found: torch.Tensor,
                 per: Any = None) -> None:
        _reference.unscale_(grads, inv, found, per)
        if per is not None:
            per[3:] = 0


_SMALL = {"chunk": 8, "max_tensors": 3, "max_blocks": 4, "pack_bytes": 16}


def test_batching_cases_are_sized_from_the_kernel_limits() -> None:
    sizes = selftest_kernels.batching_sizes(_SMALL)
    assert {8 - 1, 8, 8 + 1} <= set(sizes["chunk edges"])
    assert len(sizes["more tensors than a launch"]) > _SMALL["max_tensors"]
    blocks = sum(-(-n // 8) for n in sizes["more blocks than a launch, carried over"])
    assert blocks > 2 * _SMALL["max_blocks"]  # several launches, a tensor split across two
    result = selftest_kernels.compare_batching(_reference, torch.device("cpu"), _SMALL)
    assert result["mismatches"] == [] and result["cases"] > 50


def test_batching_cases_catch_a_bug_in_a_later_launch() -> None:
    check = selftest.kernel_check("cpu", native=_LaterLaunchBug(), limits=_SMALL)
    assert check.status == "FAIL" and "unscale_[more tensors than a launch" in check.detail
    assert selftest.kernel_check("cpu", native=_LaterLaunchBug()).status == "pass"  # too short


def _gpu_visible_without(monkeypatch: pytest.MonkeyPatch, describe: dict[str, Any]) -> None:
    """A machine with cuda:0 whose ampx._C lacks usable CUDA kernels (faked on the CPU)."""
    monkeypatch.setattr(_ext, "_disabled", lambda: False)
    monkeypatch.setattr(_ext, "_native_module", lambda: _reference)
    monkeypatch.setattr(_ext, "describe", lambda: describe)
    monkeypatch.setattr(_ext, "_impl", lambda device: "the reference")  # never the module


def test_selftest_fails_when_a_gpu_is_visible_but_cuda_kernels_are_absent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _gpu_visible_without(monkeypatch, {"cuda_kernels": False, "cuda_unusable": {}})
    check = selftest.kernel_check("cuda:0")
    assert check.status == "FAIL"
    assert "a GPU is visible but the loaded extension has no CUDA kernels" in check.detail
    assert "ampx build-ext --require-cuda" in check.detail
    assert selftest.format_report([check]).endswith("FAIL: 1 of 1 checks failed")


def test_selftest_fails_when_the_dispatcher_does_not_route_cuda(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _gpu_visible_without(monkeypatch, {"cuda_kernels": True,
                                       "cuda_unusable": {"cuda:0": "built for sm_90 only"}})
    check = selftest.kernel_check("cuda:0")
    assert check.status == "FAIL" and "not used on cuda:0: built for sm_90 only" in check.detail


def test_selftest_skips_cuda_kernels_when_the_reference_is_asked_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMPX_DISABLE_EXT", "1")
    monkeypatch.setattr(selftest_kernels, "native_for",
                        lambda device: (None, "native kernels not loaded (disabled)"))
    assert selftest.kernel_check("cuda:0").status == "skip"
