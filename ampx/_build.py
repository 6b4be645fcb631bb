"""Build ``csrc/`` into a versioned cache with ``torch.utils.cpp_extension``.

``ampx build-ext`` calls :func:`build`; :mod:`ampx._ext` calls :func:`find_built` to
load what an earlier build left in the cache. Nothing here runs at ``import ampx``:
importing this module is cheap (``torch.utils.cpp_extension`` is imported inside
:func:`build` only), and only :func:`build` ever starts a compiler.

The cache key is the torch version, the Python version, the CPU instruction set the
kernels are compiled for, whether CUDA kernels are included, and a hash of the
sources, so a torch upgrade or an edit to ``csrc/`` never loads a stale binary.

This module uses no relative imports so that ``setup.py`` can load it by path
(for the ahead-of-time route) without importing the ``ampx`` package.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import sysconfig
from pathlib import Path

__all__ = [
    "build",
    "build_flags",
    "cache_dir",
    "cpu_capability",
    "cuda_wanted",
    "find_built",
    "source_dir",
    "source_files",
]

_log = logging.getLogger("ampx")

#: File left in the key directory when the last build failed; ``ampx info`` shows it.
BUILD_ERROR_FILE = "build-error.txt"
_SOURCE_SUFFIXES = (".cpp", ".cu", ".h", ".cuh")
_PACKAGE_DIR = Path(__file__).resolve().parent


def source_dir() -> Path | None:
    """Return the directory holding the C++/CUDA sources, or None if none ships.

    The repository's ``csrc/`` (editable installs and source checkouts) comes first,
    then ``ampx/csrc`` (where a wheel may ship them).
    """
    for candidate in (_PACKAGE_DIR.parent / "csrc", _PACKAGE_DIR / "csrc"):
        if (candidate / "ampx.cpp").is_file():
            return candidate
    return None


def source_files(src: Path) -> list[Path]:
    """Return the kernel sources and headers under ``src``, sorted by name."""
    return sorted(p for p in src.iterdir() if p.is_file() and p.suffix in _SOURCE_SUFFIXES)


def _source_hash(src: Path) -> str:
    digest = hashlib.sha256()
    for path in source_files(src):
        digest.update(path.name.encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    """Return the root of the extension cache.

    ``$AMPX_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/ampx/ext`` (default
    ``~/.cache/ampx/ext``).
    """
    explicit = os.environ.get("AMPX_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "ampx" / "ext"


def cpu_capability() -> str:
    """Return the CPU instruction set to compile the CPU kernels for.

    One of ``"AVX512"``, ``"AVX2"`` or ``"DEFAULT"``: the best level torch itself uses
    on this machine (``torch.backends.cpu.get_cpu_capability()``), so the kernels use
    the same ``at::vec::Vectorized`` code paths as torch's own kernels.
    """
    import torch

    try:
        cap = str(torch.backends.cpu.get_cpu_capability()).upper()
    except Exception:  # pragma: no cover - very old or unusual torch builds
        return "DEFAULT"
    if cap.startswith("AVX512"):
        return "AVX512"
    if cap == "AVX2":
        return "AVX2"
    return "DEFAULT"


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


def cuda_wanted() -> bool:
    """Return whether to compile the CUDA kernels: torch has CUDA and nvcc exists."""
    import torch

    return torch.version.cuda is not None and _nvcc() is not None


def _key(src: Path, cap: str, cuda: bool) -> str:
    import torch

    torch_version = torch.__version__.replace("+", "_")
    py = f"py{sys.version_info[0]}{sys.version_info[1]}"
    device = "cuda" if cuda else "cpu"
    return f"torch{torch_version}-{py}-{cap.lower()}-{device}-{_source_hash(src)}"


def _module_name(key: str) -> str:
    return "ampx_C_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def build_flags(cap: str, cuda: bool) -> tuple[list[str], list[str], list[str]]:
    """Return ``(cflags, cuda_cflags, ldflags)`` for the given instruction set.

    The flags define the ``CPU_CAPABILITY_*`` macros ATen's ``Vectorized`` needs and
    the matching ``-m`` options, turn off floating-point contraction (the kernels must
    round every multiply and add separately to match the reference bit for bit), and
    enable OpenMP when torch's parallel backend is OpenMP (``at::parallel_for`` is
    inlined into the extension).

    Args:
        cap: ``"AVX512"``, ``"AVX2"`` or ``"DEFAULT"``.
        cuda: Whether the CUDA kernels are compiled too.
    """
    import torch

    cflags = ["-O3", "-ffp-contract=off", f"-DCPU_CAPABILITY=AMPX_{cap}"]
    if cap == "AVX512":
        cflags += [
            "-DCPU_CAPABILITY_AVX512",
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512dq",
            "-mfma",
            "-mf16c",
        ]
    elif cap == "AVX2":
        cflags += ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"]
    ldflags: list[str] = []
    if sys.platform.startswith("linux") and getattr(torch._C, "has_openmp", False):
        cflags.append("-fopenmp")
        ldflags.append("-fopenmp")
    cuda_cflags = ["-O3", "--fmad=false", "-DAMPX_WITH_CUDA"] if cuda else []
    if cuda:
        cflags.append("-DAMPX_WITH_CUDA")
    return cflags, cuda_cflags, ldflags


def _ext_suffix() -> str:
    return str(sysconfig.get_config_var("EXT_SUFFIX") or ".so")


def find_built(src: Path | None = None) -> Path | None:
    """Return the cached extension built from the current sources, or None.

    Cheap: hashes the sources and checks for a file; never compiles.

    Args:
        src: Source directory; defaults to :func:`source_dir`.
    """
    src = src or source_dir()
    if src is None:
        return None
    cap = cpu_capability()
    import torch

    variants = [True, False] if torch.version.cuda is not None else [False]
    for cuda in variants:
        key = _key(src, cap, cuda)
        name = _module_name(key)
        for suffix in (".so", _ext_suffix(), ".pyd"):
            path = cache_dir() / key / f"{name}{suffix}"
            if path.is_file():
                return path
    return None


def last_build_error(src: Path | None = None) -> str | None:
    """Return the error text left by the last failed :func:`build`, if any."""
    src = src or source_dir()
    if src is None:
        return None
    cap = cpu_capability()
    for cuda in (True, False):
        path = cache_dir() / _key(src, cap, cuda) / BUILD_ERROR_FILE
        if path.is_file():
            return path.read_text(errors="replace")
    return None


def _compile(src: Path, cap: str, cuda: bool, verbose: bool) -> Path:
    key = _key(src, cap, cuda)
    name = _module_name(key)
    out = cache_dir() / key
    out.mkdir(parents=True, exist_ok=True)
    error_file = out / BUILD_ERROR_FILE
    sources = [str(p) for p in source_files(src) if p.suffix == ".cpp"]
    if cuda:
        sources += [str(p) for p in source_files(src) if p.suffix == ".cu"]
    cflags, cuda_cflags, ldflags = build_flags(cap, cuda)
    _log.info("ampx: building %s (%s) in %s", name, key, out)

    from torch.utils import cpp_extension

    try:
        cpp_extension.load(
            name=name,
            sources=sources,
            extra_cflags=cflags,
            extra_cuda_cflags=cuda_cflags,
            extra_ldflags=ldflags,
            extra_include_paths=[str(src)],
            build_directory=str(out),
            with_cuda=cuda,
            verbose=verbose,
            is_python_module=True,
        )
    except Exception as exc:  # compiler errors arrive as RuntimeError, others vary
        message = str(exc).strip() or type(exc).__name__
        error_file.write_text(message + "\n")
        raise RuntimeError(f"ampx build-ext failed ({key}):\n{message}") from exc
    error_file.unlink(missing_ok=True)
    for suffix in (".so", _ext_suffix(), ".pyd"):
        path = out / f"{name}{suffix}"
        if path.is_file():
            return path
    raise RuntimeError(f"ampx build-ext: the compiler succeeded but no {name} library is in {out}")


def build(verbose: bool = False, *, src: Path | None = None) -> Path:
    """Compile ``csrc/`` against the installed torch and return the built module's path.

    A cached build for the same key is reused (ninja rebuilds nothing). CUDA kernels
    are included when :func:`cuda_wanted` is true; if that build fails, the CPU-only
    build is tried and the CUDA error stays in the cache for ``ampx info``.

    Args:
        verbose: Show the compiler command lines and output.
        src: Source directory; defaults to :func:`source_dir`.

    Returns:
        Path of the shared library, loadable by :mod:`ampx._ext`.

    Raises:
        RuntimeError: The sources are missing or the compiler failed; the message
            holds the compiler's output, which is also saved for ``ampx info``.
    """
    src = src or source_dir()
    if src is None:
        raise RuntimeError(
            "ampx build-ext: no C++ sources found (looked for csrc/ next to the ampx "
            "package and for ampx/csrc); build from a source checkout or an sdist"
        )
    cap = cpu_capability()
    if cuda_wanted():
        try:
            return _compile(src, cap, True, verbose)
        except RuntimeError as exc:
            _log.warning("ampx: the CUDA build failed; building the CPU kernels only: %s", exc)
    return _compile(src, cap, False, verbose)
