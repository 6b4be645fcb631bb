"""The extension build: cache keys, failure reporting, progress, a missing compiler, and the
CUDA sources under nvcc.

Nothing here builds the real extension (CI does that with ``ampx build-ext`` before
pytest, and tests/test_wheel.py from an installed wheel); the failure test compiles a
one-line broken source, and the nvcc test compiles each ``ampx/csrc/*.cu`` to an
object file (skipped where nvcc is absent).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ampx import _build, _ext
from ampx.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "ampx" / "csrc"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("AMPX_CACHE_DIR", str(path))
    return path


def test_cache_dir_follows_env(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _build.cache_dir() == cache
    monkeypatch.delenv("AMPX_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache / "xdg"))
    assert _build.cache_dir() == cache / "xdg" / "ampx" / "ext"


def test_sources_are_found_inside_the_package() -> None:
    src = _build.source_dir()
    assert src is not None and src.resolve() == CSRC.resolve()
    assert src.parent == Path(_build.__file__).resolve().parent  # ships with the package
    names = {p.name for p in _build.source_files(src)}
    assert {"ampx.cpp", "kernels_cpu.cpp", "kernels_cuda.cu", "ampx.h"} <= names


def test_missing_compiler_is_named_and_can_be_skipped(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/bin/c++ -O2")
    assert _build.find_compiler() == ("/nonexistent/bin/c++ -O2", None)
    missing = _build.missing_compiler()
    assert missing is not None and "CXX='/nonexistent/bin/c++ -O2' is not found" in missing
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler: CXX="):
        _build.build()
    assert not cache.exists()  # nothing started, nothing left behind

    assert cli.main(["build-ext"]) == 1
    err = capsys.readouterr().err
    assert "ampx: build failed: ampx build-ext: no C++ compiler: CXX=" in err
    assert cli.main(["build-ext", "--skip-without-compiler"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("ampx build-ext: SKIPPED, no C++ compiler: CXX=")
    assert "pure-torch kernels" in err

    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is not None:
        monkeypatch.setenv("CXX", compiler)
        assert _build.missing_compiler() is None
    monkeypatch.delenv("CXX")
    assert _build.find_compiler()[0] == ("cl" if sys.platform == "win32" else "c++")


def test_heartbeat_reports_elapsed_time_and_objects(tmp_path: Path) -> None:
    lines: list[str] = []
    with _build._heartbeat(tmp_path, 2, lines.append, interval=0.05):
        time.sleep(0.12)
        (tmp_path / "ampx.o").write_bytes(b"")
        time.sleep(0.2)
    count = len(lines)
    time.sleep(0.15)
    assert len(lines) == count  # stopped with the block
    assert lines[0].endswith("0 of 2 objects compiled")
    assert lines[-1].endswith("1 of 2 objects compiled")
    with _build._heartbeat(tmp_path, 2, None, interval=0.01):
        time.sleep(0.05)  # no callback: no thread, nothing reported


def test_publish_replaces_atomically(tmp_path: Path) -> None:
    work = tmp_path / "build"
    work.mkdir()
    built = work / "ampx_C_x.so"
    built.write_bytes(b"new")
    old = tmp_path / "ampx_C_x.so"
    old.write_bytes(b"old")
    with old.open("rb") as loaded:  # a process holding the old library keeps it intact
        assert _build._publish(built, tmp_path) == old
        assert loaded.read() == b"old"
    assert old.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ampx_C_x.so", "build"]


def test_key_tracks_torch_python_and_sources(tmp_path: Path) -> None:
    src = tmp_path / "csrc"
    shutil.copytree(CSRC, src)
    key = _build._key(src, "AVX2", None)
    assert torch.__version__.replace("+", "_") in key
    assert f"py{sys.version_info[0]}{sys.version_info[1]}" in key
    assert "avx2" in key and "-cpu-" in key
    sm90 = _build._key(src, "AVX2", ["9.0"])
    assert "-cuda_90-" in sm90 and sm90 != key  # the arch list is part of the key
    assert "-cuda_80_90p-" in _build._key(src, "AVX2", ["8.0", "9.0+PTX"])
    (src / "kernels_cpu.cpp").write_text((src / "kernels_cpu.cpp").read_text() + "\n// edit\n")
    assert _build._key(src, "AVX2", None) != key


def test_find_built_is_none_in_an_empty_cache(cache: Path) -> None:
    assert _build.find_built() is None
    assert _build.last_build_error() is None


def test_flags_fix_numerics_and_isa() -> None:
    cflags, cuda_cflags, _ = _build.build_flags("AVX512", ["8.0", "9.0a+PTX"])
    assert "-ffp-contract=off" in cflags and "-DCPU_CAPABILITY_AVX512" in cflags
    assert "-DAMPX_WITH_CUDA" in cflags and "--fmad=false" in cuda_cflags
    assert "-DAMPX_CUDA_ARCHS=80_90ap" in cflags  # what ampx._C.cuda_archs() reports
    # every arch named, so torch's own detection (which needs a GPU) is never asked
    assert [f for f in cuda_cflags if f.startswith("-gencode")] == [
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_90a,code=compute_90a"]
    cflags, cuda_cflags, _ = _build.build_flags("DEFAULT", None)
    assert not any(f.startswith("-m") for f in cflags) and cuda_cflags == []


@pytest.mark.slow
def test_build_failure_is_reported(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    pytest.importorskip("ninja")
    src = tmp_path / "broken"
    src.mkdir()
    (src / "ampx.cpp").write_text('#error "ampx-test: deliberately broken source"\n')
    with pytest.raises(RuntimeError, match="deliberately broken source"):
        _build.build(src=src)
    saved = _build.last_build_error(src)
    assert saved is not None and "deliberately broken source" in saved
    # What `ampx info` shows: the reference is used and the build error is the reason.
    monkeypatch.setattr(_build, "source_dir", lambda: src)
    monkeypatch.delenv("AMPX_DISABLE_EXT", raising=False)
    native, _, reason = _ext._find()
    if native is None:  # an ahead-of-time ampx._C would take precedence
        assert reason is not None and "deliberately broken source" in reason


def _torch_include() -> Path:
    return Path(torch.__file__).resolve().parent / "include"


@pytest.mark.slow
@pytest.mark.parametrize("source", ["kernels_cuda.cu", "compensated_cuda.cu"])
def test_cuda_kernels_compile_with_nvcc(tmp_path: Path, source: str) -> None:
    """Compile each CUDA source for real (-c) against torch's headers."""
    if os.environ.get("AMPX_DISABLE_EXT") == "1":
        pytest.skip("compiled in the native leg of CI; the sources do not depend on the env")
    nvcc = _build._nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    include = _torch_include()
    if not (include / "c10" / "cuda" / "CUDAStream.h").is_file():
        pytest.skip("this torch wheel ships no c10/cuda headers")
    shim = tmp_path / "shim"
    macros = include / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    if not macros.is_file():
        # CPU wheels lack this generated header; its whole content is this macro.
        target = shim / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
        target.parent.mkdir(parents=True)
        target.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    cmd = [
        nvcc, "-std=c++20", "-c", str(CSRC / source), "-o", str(tmp_path / "k.o"),
        f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}", f"-I{shim}",
        f"-I{CSRC}", "-DAMPX_WITH_CUDA", "--fmad=false", "-Xcompiler", "-fPIC",
        "-arch=sm_80", "-w",
    ]
    # a limit for a hung compiler, not a speed check: nvcc takes minutes on a loaded 2-core box
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "k.o").stat().st_size > 0


def test_ninja_comes_from_the_native_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ninja = pytest.importorskip("ninja")
    monkeypatch.setenv("PATH", str(tmp_path))  # a venv used without activating it
    with _build._ninja_on_path():
        assert Path(shutil.which("ninja") or "").parent == Path(ninja.BIN_DIR)
    assert os.environ["PATH"] == str(tmp_path)

    monkeypatch.setitem(sys.modules, "ninja", None)  # not installed
    with pytest.raises(RuntimeError, match=r"ninja is missing.*pip install 'torch-ampx\[native\]'"):
        with _build._ninja_on_path():
            pass
    assert os.environ["PATH"] == str(tmp_path)


def _no_gpu(monkeypatch: pytest.MonkeyPatch, archs: list[str]) -> None:
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: archs)


def test_arch_list_without_a_gpu_is_every_arch_torch_has(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_gpu(monkeypatch, ["sm_75", "sm_80", "sm_90", "sm_120", "compute_120"])
    assert _build.cuda_arch_list() == ["7.5", "8.0", "9.0", "12.0+PTX"]
    _no_gpu(monkeypatch, [])
    with pytest.raises(RuntimeError, match="no GPU is visible.*set TORCH_CUDA_ARCH_LIST"):
        _build.cuda_arch_list()


def test_arch_list_follows_env_then_visible_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_gpu(monkeypatch, ["sm_80", "sm_90"])
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6 9.0a;10.0+PTX")
    assert _build.cuda_arch_list() == ["8.6", "9.0a", "10.0+PTX"]
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "Hopper")
    with pytest.raises(ValueError, match="cannot read CUDA architecture 'Hopper'"):
        _build.cuda_arch_list()
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    caps = [(9, 0), (8, 0), (12, 1)]  # 12.1 is newer than this torch: capped at 9.0
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: caps[i])
    assert _build.cuda_arch_list() == ["8.0", "9.0+PTX"]


@pytest.mark.parametrize(("token", "capability", "runs"), [
    ("80_90p", (8, 0), True), ("80_90p", (8, 6), True), ("80_90p", (9, 0), True),
    ("80_90p", (12, 0), True),  # PTX 9.0 is JIT-compiled for newer GPUs
    ("90", (8, 0), False), ("90", (10, 0), False), ("90", (9, 0), True),
    ("75_80_86_90_100_120p", (7, 0), False), ("90a", (9, 0), True), ("90ap", (10, 0), False),
    ("", (9, 0), False),
])
def test_arch_runs_on(token: str, capability: tuple[int, int], runs: bool) -> None:
    assert _build.arch_runs_on(token, capability) is runs


def _toolkit(root: Path, libs: list[str]) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (root / "include").mkdir()
    (root / "include" / "cuda_runtime.h").write_text("")
    (root / "lib").mkdir()
    for name in libs:
        (root / "lib" / name).write_bytes(b"")
    return root


def test_pip_cudart_gets_a_link_torch_can_use(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    home = _toolkit(tmp_path / "cu13", ["libcudart.so.13"])  # pip's nvidia-cuda-runtime
    monkeypatch.setenv("CUDA_HOME", str(home))
    assert _build.cuda_home() == home
    flags = _build.cuda_link_flags(tmp_path / "work")
    assert flags == [f"-L{tmp_path / 'work' / 'cudart'}"]
    link = tmp_path / "work" / "cudart" / "libcudart.so"
    assert link.resolve() == (home / "lib" / "libcudart.so.13").resolve()
    assert _build.cuda_link_flags(tmp_path / "work") == flags  # idempotent
    (home / "lib" / "libcudart.so").write_bytes(b"")  # a full toolkit links by itself
    assert _build.cuda_link_flags(tmp_path / "work2") == []


def test_cuda_home_needs_headers_and_names_what_is_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wrapper = tmp_path / "usr" / "bin"  # /usr/local/bin/nvcc, a script: no headers above
    wrapper.mkdir(parents=True)
    (wrapper / "nvcc").write_text("#!/bin/sh\n")
    (wrapper / "nvcc").chmod(0o755)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(wrapper))
    monkeypatch.setattr(_build._cuda, "_pip_cuda_homes", lambda: [])
    found = _build.cuda_home()
    assert found is None or found == Path("/usr/local/cuda")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nowhere"))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    why = _build.cuda_why_not()
    assert why is not None and "nvcc not found in $CUDA_HOME/bin" in why
    assert not _build.cuda_wanted()
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "built without CUDA" in (_build.cuda_why_not() or "")


@pytest.mark.parametrize("torch_cuda", [None, "13.0"])
def test_require_cuda_fails_loudly_when_cuda_cannot_be_built(
        torch_cuda: str | None, cache: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    monkeypatch.setenv("CUDA_HOME", str(cache / "no-toolkit"))
    monkeypatch.setattr(_build, "missing_compiler", lambda: None)
    with pytest.raises(RuntimeError, match="--require-cuda: cannot build the CUDA kernels"):
        _build.build(require_cuda=True)
    assert cli.main(["build-ext", "--require-cuda"]) == 1
    err = capsys.readouterr().err
    expected = "built without CUDA" if torch_cuda is None else "nvcc not found"
    assert "ampx: build failed: ampx build-ext --require-cuda: cannot build" in err
    assert expected in err
    assert not cache.exists()  # failed before compiling anything


def test_setup_py_require_cuda_exits_nonzero(tmp_path: Path) -> None:
    env = {**os.environ, "AMPX_BUILD_EXT": "require-cuda", "CUDA_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(ROOT / "setup.py"), "--version"], env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0
    assert "AMPX_BUILD_EXT=require-cuda but the CUDA kernels cannot be built" in proc.stderr


def test_find_built_prefers_the_widest_cuda_build(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    src, cap = CSRC, _build.cpu_capability()

    def fake(archs: list[str] | None) -> Path:
        key = _build._key(src, cap, archs)
        (cache / key).mkdir(parents=True)
        library = cache / key / f"{_build._module_name(key)}.so"
        library.write_bytes(b"")
        return library

    cpu = fake(None)
    assert _build.find_built() == cpu
    narrow, wide = fake(["9.0"]), fake(["8.0", "9.0", "10.0+PTX"])
    assert _build.find_built() == wide  # no CUDA initialised: the broadest build first
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert _build.find_built() == narrow  # the one asked for
    (cache / narrow.parent.name / _build.BUILD_ERROR_FILE).write_text("nvcc exploded\n")
    assert _build.last_build_error() == "nvcc exploded\n"


def test_build_ext_says_when_a_cuda_torch_got_cpu_kernels_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    built = tmp_path / "torch2_cu130-py311-avx2-cpu-0123" / "ampx_C_x.so"
    monkeypatch.setattr(_build, "missing_compiler", lambda: None)
    monkeypatch.setattr(_build, "build", lambda **kwargs: built)
    monkeypatch.setattr(_build._cuda, "torch_has_cuda", lambda: True)
    monkeypatch.setattr(_build._cuda, "cuda_why_not", lambda: "nvcc not found in PATH")
    assert cli.main(["build-ext"]) == 0
    out = capsys.readouterr().out
    assert out == (f"built ampx._C: {built} (CPU kernels only: nvcc not found in PATH; "
                   "--require-cuda makes this an error)\n")
    monkeypatch.setattr(_build._cuda, "torch_has_cuda", lambda: False)  # a CPU torch: no note
    assert cli.main(["build-ext"]) == 0
    assert capsys.readouterr().out == f"built ampx._C: {built}\n"
