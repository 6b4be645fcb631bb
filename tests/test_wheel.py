"""From source tree to a working install: sdist, wheel, a fresh environment, the native build.

One test, as a user would meet ampx: build the sdist from a copy of the checkout, build the
wheel from the unpacked sdist (so the sdist is known to be complete), install the wheel into
a fresh virtual environment that cannot see the checkout, then run `ampx build-ext`,
`ampx info` and a three-line O2 loop on the native kernels there. The environment reuses
this interpreter's site-packages (torch) through a .pth file placed after its own, so the
installed wheel, not the checkout or an editable install, is what gets imported.

It compiles the extension from scratch (about 30 s on 2 idle cores, over 5 minutes at load
average 12), so it runs once: in the native half of the test command, not under
AMPX_DISABLE_EXT=1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

from ampx import _build, _version

ROOT = Path(__file__).resolve().parents[1]
VERSION = _version.__version__
DIST = "torch_ampx"  # the distribution torch-ampx, as sdist and wheel file names spell it
BUILD = """
import sys, warnings
warnings.simplefilter("always")
from setuptools import build_meta
print(getattr(build_meta, sys.argv[1])(sys.argv[2]))
"""
O2_LOOP = textwrap.dedent("""
    import sys
    import torch
    import ampx
    from ampx import _ext

    assert ampx.__file__.startswith(sys.prefix), ampx.__file__  # the wheel, not the checkout
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = ampx.initialize(model, optimizer, opt_level="O2", dtype="bf16")
    for _ in range(3):
        loss = model(torch.randn(8, 16)).float().pow(2).mean()
        with ampx.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert _ext.BACKEND == "native", _ext.IMPORT_ERROR
    print("O2 loop on", _ext.BACKEND, "kernels:", _ext.describe()["extension_path"])
    ampx.restore()
""")
_SAFE = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
_IGNORE = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__",
                                 ".*_cache", "sweep-out", "*.so")


def _run(args: list[str], *, cwd: Path, env: dict[str, str],
         timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run a step; the limits catch a hang, they are no speed check (a loaded box is slow)."""
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, f"{args}\n{proc.stdout}\n{proc.stderr}"
    return proc


def _build_dists(tmp: Path, env: dict[str, str]) -> tuple[Path, Path]:
    """sdist from a copy of the checkout, wheel from the unpacked sdist; no warnings."""
    src, dist = tmp / "src", tmp / "dist"
    shutil.copytree(ROOT, src, ignore=_IGNORE)
    sdist = _run([sys.executable, "-c", BUILD, "build_sdist", str(dist)], cwd=src, env=env)
    with tarfile.open(dist / f"{DIST}-{VERSION}.tar.gz") as tar:
        tar.extractall(tmp / "unpacked", **_SAFE)
    unpacked = tmp / "unpacked" / f"{DIST}-{VERSION}"
    wheel = _run([sys.executable, "-c", BUILD, "build_wheel", str(dist)], cwd=unpacked, env=env)
    for proc in (sdist, wheel):  # setuptools' deprecation notices arrive as warnings
        assert "Warning" not in proc.stderr, proc.stderr
    return unpacked, dist / f"{DIST}-{VERSION}-py3-none-any.whl"


def _fresh_env(tmp: Path, wheel: Path, env: dict[str, str]) -> Path:
    """A venv holding only the wheel; this interpreter's site-packages come after its own."""
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp, env=env)
    python = venv / "bin" / "python"
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                   cwd=tmp, env=env).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(purelib) / "zz_outer_site.pth").write_text("\n".join(sorted(ours)) + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
          "--no-index", str(wheel)], cwd=tmp, env=env)
    return venv


@pytest.mark.slow
def test_wheel_installs_builds_and_trains_on_native_kernels(tmp_path: Path) -> None:
    if os.environ.get("AMPX_DISABLE_EXT") == "1":
        pytest.skip("runs once, in the native half of the test command")
    if _build.missing_compiler() is not None:
        pytest.skip(_build.missing_compiler())
    pytest.importorskip("ninja")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AMPX_", "PYTHON", "PIP_REQUIRE"))}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", AMPX_CACHE_DIR=str(tmp_path / "cache"))
    unpacked, wheel = _build_dists(tmp_path, env)

    for name in ("tests/conftest.py", "docs/native-kernels.md", "LICENSE", "benchmarks",
                 "examples/fairseq_style/train.py", "ampx/csrc/kernels_cpu.cpp"):
        assert (unpacked / name).exists(), f"the sdist lacks {name}"
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        metadata = whl.read(f"{DIST}-{VERSION}.dist-info/METADATA").decode()
    assert {f"ampx/csrc/{n}" for n in ("ampx.cpp", "ampx.h", "kernels_cpu.cpp",
                                       "kernels_cuda.cu")} <= names
    assert f"{DIST}-{VERSION}.dist-info/licenses/LICENSE" in names
    assert "Name: torch-ampx" in metadata.splitlines()
    assert "License-Expression: BSD-3-Clause" in metadata and f"Version: {VERSION}" in metadata
    assert 'Requires-Dist: ninja; extra == "native"' in metadata

    venv = _fresh_env(tmp_path, wheel, env)
    work = tmp_path / "work"  # not the checkout: nothing there is importable
    work.mkdir()
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    built = _run([str(venv / "bin" / "ampx"), "build-ext"], cwd=work, env=env, timeout=1200)
    assert "ampx build-ext: compiling" in built.stderr
    assert built.stdout.startswith(f"built ampx._C: {tmp_path / 'cache'}")

    info = json.loads(_run([str(venv / "bin" / "ampx"), "info", "--json"], cwd=work,
                           env=env).stdout)
    assert info["ampx"] == VERSION
    assert info["kernels"]["backend"] == "native", info["kernels"]
    assert info["kernels"]["extension_path"].startswith(str(tmp_path / "cache"))

    loop = _run([str(venv / "bin" / "python"), "-c", O2_LOOP], cwd=work, env=env)
    assert loop.stdout.startswith("O2 loop on native kernels:")
