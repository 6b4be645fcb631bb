"""The CUDA build for real: compile, link and load ``ampx._C`` with CUDA kernels, no GPU needed.

Runs where a CUDA torch and nvcc are present (skipped otherwise, with the reason: CI has
neither). It goes through ``ampx build-ext --require-cuda``'s code path with one
architecture (to keep it to a few minutes on two cores), with no ``-w``: the compiler's
output for ampx's own sources must hold no warning. With a GPU present it also runs the
selftest's kernel comparison on it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from ampx import _build, _ext
from ampx._build_cuda import device_problem

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cuda_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    why_not = _build.cuda_why_not() or _build.missing_compiler()
    if why_not is not None:
        pytest.skip(f"no CUDA build here: {why_not}")
    pytest.importorskip("ninja")
    cache = tmp_path_factory.mktemp("cuda-cache")
    old = {k: os.environ.get(k) for k in ("AMPX_CACHE_DIR", "TORCH_CUDA_ARCH_LIST")}
    os.environ["AMPX_CACHE_DIR"] = str(cache)
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0+PTX"
    log = cache / "compiler-output.txt"
    saved = os.dup(1)
    try:
        with log.open("w") as sink:  # the compiler writes to fd 1 (verbose mode)
            os.dup2(sink.fileno(), 1)
            try:
                path = _build.build(verbose=True, require_cuda=True)
            finally:
                os.dup2(saved, 1)
    finally:
        os.close(saved)
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return path, log.read_text(errors="replace")


def test_cuda_build_compiles_links_and_loads(cuda_build: tuple[Path, str]) -> None:
    path, log = cuda_build
    assert "-cuda_90p-" in path.parent.name, path
    module = _ext._load_from_path(path)
    assert module.has_cuda() and module.cuda_archs() == "90p"
    limits = dict(module.cuda_limits())
    assert set(limits) == {"chunk", "max_tensors", "max_blocks", "threads", "pack_bytes"}
    assert limits["chunk"] % limits["threads"] == 0
    # the compiler's output, no -w: no warning from ampx's own sources (torch's headers aside)
    assert "nvcc" in log and "kernels_cuda.cu" in log
    ours = [line for line in log.splitlines()
            if re.search(r"(kernels_cuda\.cu|ampx\.cpp|kernels_cpu\.cpp|ampx\.h|"
                         r"compensated(_cuda)?\.(cpp|cu|h)).*warning", line)]
    assert ours == []


def test_the_loaded_build_checks_the_device_capability(
        cuda_build: tuple[Path, str], monkeypatch: pytest.MonkeyPatch) -> None:
    module = _ext._load_from_path(cuda_build[0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    problem = device_problem(module, 0)  # an sm_90 build on an A100
    assert problem is not None and "cuda:0 is sm_80" in problem
    if not torch.cuda.is_available():
        return
    monkeypatch.undo()
    if torch.cuda.get_device_capability(0) >= (9, 0):
        assert device_problem(module, 0) is None
