"""Build ``ampx/csrc/`` into a versioned cache with ``torch.utils.cpp_extension``.

``ampx build-ext`` calls :func:`build`; :mod:`ampx._ext` calls :func:`find_built` to
load what an earlier build left in the cache. Nothing here runs at ``import ampx``:
importing this module is cheap (``torch.utils.cpp_extension`` is imported inside
:func:`build` only), and only :func:`build` ever starts a compiler.

The cache key is the torch version, the Python version, the CPU instruction set the
kernels are compiled for, the CUDA architectures (or ``cpu``), and a hash of the
sources, so a torch upgrade or an edit to ``ampx/csrc/`` never loads a stale binary. The
sources ship inside the package (package data), so a wheel install builds too.

CUDA builds need no GPU: the architectures are ``$TORCH_CUDA_ARCH_LIST``, else those
of the visible GPUs, else every one this torch was built for (:func:`cuda_arch_list`).
nvcc is looked up in ``$CUDA_HOME``, on ``PATH``, in pip's ``nvidia-cuda-nvcc`` package
and in ``/usr/local/cuda``.

This module uses no relative imports so that ``setup.py`` can load it by path
(for the ahead-of-time route) without importing the ``ampx`` package.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shlex
import shutil
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

__all__ = [
    "build",
    "build_flags",
    "cache_dir",
    "cpu_capability",
    "cuda_wanted",
    "find_built",
    "find_compiler",
    "missing_compiler",
    "source_dir",
    "source_files",
]

#: Receives one line of build progress (``ampx build-ext`` prints it to stderr).
Progress = Callable[[str], None]

_log = logging.getLogger("ampx")

#: File left in the key directory when the last build failed; ``ampx info`` shows it.
BUILD_ERROR_FILE = "build-error.txt"
_SOURCE_SUFFIXES = (".cpp", ".cu", ".h", ".cuh")
_PACKAGE_DIR = Path(__file__).resolve().parent


def source_dir() -> Path | None:
    """Return ``ampx/csrc``, the C++/CUDA sources shipped in the package, or None if absent."""
    candidate = _PACKAGE_DIR / "csrc"
    return candidate if (candidate / "ampx.cpp").is_file() else None


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


def _load_cuda_helpers() -> ModuleType:
    """``_build_cuda.py`` loaded by path, as setup.py loads this module (no ampx package)."""
    path = Path(__file__).with_name("_build_cuda.py")
    spec = importlib.util.spec_from_file_location("_ampx_build_cuda", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __package__:
    from . import _build_cuda as _cuda
else:
    _cuda = _load_cuda_helpers()
# The CUDA toolkit and architecture helpers, re-exported (callers and tests use _build.*).
arch_runs_on, arch_token, cuda_arch_list = (_cuda.arch_runs_on, _cuda.arch_token,
                                            _cuda.cuda_arch_list)
cuda_home, cuda_link_flags, gencode_flags = (_cuda.cuda_home, _cuda.cuda_link_flags,
                                             _cuda.gencode_flags)
torch_has_cuda, cuda_why_not, _nvcc = _cuda.torch_has_cuda, _cuda.cuda_why_not, _cuda.nvcc
_cuda_home_for_torch = _cuda.cuda_home_for_torch


def cuda_wanted() -> bool:
    """Return whether to compile the CUDA kernels: torch has CUDA and nvcc exists."""
    return cuda_why_not() is None


def find_compiler() -> tuple[str, str | None]:
    """Return ``(command, path)`` of the C++ compiler torch will call; path is None if missing.

    torch's builder runs ``$CXX`` (default ``c++``; ``cl`` on Windows).
    """
    command = os.environ.get("CXX") or ("cl" if sys.platform == "win32" else "c++")
    try:
        program = shlex.split(command)[0]
    except (ValueError, IndexError):
        return command, None
    return command, shutil.which(program)


def missing_compiler() -> str | None:
    """Return why no C++ compiler can be run (naming it), or None when one is found."""
    command, path = find_compiler()
    if path is not None:
        return None
    where = "CXX=" + repr(command) if os.environ.get("CXX") else repr(command)
    return f"no C++ compiler: {where} is not found (install g++ or clang++, or set CXX)"


@contextmanager
def _ninja_on_path() -> Iterator[None]:
    """Put the ``ninja`` of the ``ninja`` package on PATH if PATH has none (venv not active)."""
    old = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError as exc:
            raise RuntimeError(
                "ampx build-ext: ninja is missing; install the build's needs with "
                "`pip install 'torch-ampx[native]'` (or `pip install ninja`)"
            ) from exc
        os.environ["PATH"] = os.pathsep.join([str(ninja.BIN_DIR), old])
    try:
        yield
    finally:
        os.environ["PATH"] = old


@contextmanager
def _heartbeat(
    out: Path, objects: int, progress: Progress | None, interval: float = 5.0
) -> Iterator[None]:
    """Report elapsed time and compiled objects every ``interval`` seconds while compiling.

    The compiler's own output is hidden unless ``--verbose``; this keeps a long build from
    looking stuck. Objects are counted as the ``.o`` files ninja writes into ``out``.
    """
    if progress is None:
        yield
        return
    start = time.time()
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(interval):
            done = sum(1 for p in out.glob("*.o") if p.stat().st_mtime >= start - 1)
            progress(f"  ... {time.time() - start:.0f} s, {done} of {objects} objects compiled")

    thread = threading.Thread(target=beat, name="ampx-build-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _key(src: Path, cap: str, archs: list[str] | None) -> str:
    """The cache key; ``archs`` is the CUDA arch list, or None for a CPU-only build."""
    import torch

    torch_version = torch.__version__.replace("+", "_")
    py = f"py{sys.version_info[0]}{sys.version_info[1]}"
    device = f"cuda_{arch_token(archs)}" if archs else "cpu"
    return f"torch{torch_version}-{py}-{cap.lower()}-{device}-{_source_hash(src)}"


def _module_name(key: str) -> str:
    return "ampx_C_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def build_flags(cap: str, archs: list[str] | None) -> tuple[list[str], list[str], list[str]]:
    """Return ``(cflags, cuda_cflags, ldflags)`` for the given instruction set.

    The flags define the ``CPU_CAPABILITY_*`` macros ATen's ``Vectorized`` needs and
    the matching ``-m`` options, turn off floating-point contraction (the kernels must
    round every multiply and add separately to match the reference bit for bit), and
    enable OpenMP when torch's parallel backend is OpenMP (``at::parallel_for`` is
    inlined into the extension).

    The CUDA flags name every architecture with ``-gencode`` (so torch's own arch
    detection, which needs a GPU, is not asked) and record the list in the binary
    (``ampx._C.cuda_archs()``) for the load-time check in :mod:`ampx._ext`.

    Args:
        cap: ``"AVX512"``, ``"AVX2"`` or ``"DEFAULT"``.
        archs: CUDA architectures (:func:`cuda_arch_list`), or None for CPU only.
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
    if not archs:
        return cflags, [], ldflags
    defines = ["-DAMPX_WITH_CUDA", f"-DAMPX_CUDA_ARCHS={arch_token(archs)}"]
    return cflags + defines, ["-O3", "--fmad=false", *defines, *gencode_flags(archs)], ldflags


def _ext_suffix() -> str:
    return str(sysconfig.get_config_var("EXT_SUFFIX") or ".so")


def _candidate_keys(src: Path, cap: str) -> list[str]:
    """Keys :func:`find_built` tries, best first: CUDA builds (the arch list asked for by
    ``$TORCH_CUDA_ARCH_LIST`` first, then those with the most architectures), then CPU.

    Never initialises CUDA: which GPU a build fits is checked by :mod:`ampx._ext` when
    CUDA tensors first reach it.
    """
    import torch

    cpu_key = _key(src, cap, None)
    if torch.version.cuda is None:
        return [cpu_key]
    head, _, tail = cpu_key.partition("-cpu-")
    found = [p.name for p in cache_dir().glob(f"{head}-cuda_*-{tail}") if p.is_dir()]
    found.sort(key=lambda k: (-len(k.split("-cuda_")[1].split("_")), k))
    try:
        env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
        wanted = [_key(src, cap, cuda_arch_list())] if env and env != "native" else []
    except ValueError:
        wanted = []
    return list(dict.fromkeys([*wanted, *found, cpu_key]))


def find_built(src: Path | None = None) -> Path | None:
    """Return the cached extension built from the current sources, or None.

    Cheap: hashes the sources and checks for files; never compiles.

    Args:
        src: Source directory; defaults to :func:`source_dir`.
    """
    src = src or source_dir()
    if src is None:
        return None
    for key in _candidate_keys(src, cpu_capability()):
        path = _library(cache_dir() / key, _module_name(key))
        if path is not None:
            return path
    return None


def last_build_error(src: Path | None = None) -> str | None:
    """Return the error text left by the last failed :func:`build`, if any."""
    src = src or source_dir()
    if src is None:
        return None
    for key in _candidate_keys(src, cpu_capability()):
        path = cache_dir() / key / BUILD_ERROR_FILE
        if path.is_file():
            return path.read_text(errors="replace")
    return None


def _library(directory: Path, name: str) -> Path | None:
    for suffix in (".so", _ext_suffix(), ".pyd"):
        path = directory / f"{name}{suffix}"
        if path.is_file():
            return path
    return None


def _publish(built: Path, out: Path) -> Path:
    """Copy the built library into ``out`` atomically and return its path there.

    Builds run in ``out/build``; readers (:func:`find_built`, other processes sharing the
    cache) only ever see a complete file, never one the linker is still writing, and a
    process that has the old file loaded keeps its copy (a rename, not an overwrite).
    """
    target = out / built.name
    partial = out / f".{built.name}.{os.getpid()}.partial"
    shutil.copy2(built, partial)
    os.replace(partial, target)
    return target


def _compile(src: Path, cap: str, archs: list[str] | None, verbose: bool,
             progress: Progress | None) -> Path:
    key = _key(src, cap, archs)
    name = _module_name(key)
    out = cache_dir() / key
    work = out / "build"  # ninja's files and objects; torch's own lock serialises builders
    work.mkdir(parents=True, exist_ok=True)
    error_file = out / BUILD_ERROR_FILE
    suffixes = (".cpp", ".cu") if archs else (".cpp",)
    sources = [p for p in source_files(src) if p.suffix in suffixes]
    cflags, cuda_cflags, ldflags = build_flags(cap, archs)
    if archs:
        ldflags = cuda_link_flags(work) + ldflags
    _log.info("ampx: building %s (%s) in %s", name, key, out)
    if progress is not None:
        kind = f"CPU and CUDA {';'.join(archs)}" if archs else "CPU"
        progress(f"ampx build-ext: compiling {', '.join(p.name for p in sources)} ({kind} "
                 f"kernels, {cap}) in {work}")
    start = time.time()

    from torch.utils import cpp_extension

    try:
        with _heartbeat(work, len(sources), None if verbose else progress), \
                _cuda_home_for_torch(cuda_home() if archs else None):
            module = cpp_extension.load(
                name=name, sources=[str(p) for p in sources], extra_cflags=cflags,
                extra_cuda_cflags=cuda_cflags, extra_ldflags=ldflags,
                extra_include_paths=[str(src)], build_directory=str(work),
                with_cuda=bool(archs), verbose=verbose, is_python_module=True,
            )
    except Exception as exc:  # compiler errors arrive as RuntimeError, others vary
        message = str(exc).strip() or type(exc).__name__
        error_file.write_text(message + "\n")
        raise RuntimeError(f"ampx build-ext failed ({key}):\n{message}") from exc
    error_file.unlink(missing_ok=True)
    if archs and not module.has_cuda():
        raise RuntimeError(f"ampx build-ext: {name} was compiled for CUDA but reports no CUDA "
                           "kernels")
    built = _library(work, name)
    if built is None:
        raise RuntimeError(f"ampx build-ext: the compiler succeeded but no {name} library "
                           f"is in {work}")
    if progress is not None:
        progress(f"ampx build-ext: compiled and loaded in {time.time() - start:.0f} s")
    return _publish(built, out)


def build(
    verbose: bool = False, *, src: Path | None = None, progress: Progress | None = None,
    require_cuda: bool = False,
) -> Path:
    """Compile ``ampx/csrc/`` against the installed torch and return the built module's path.

    A cached build for the same key is reused (ninja rebuilds nothing). CUDA kernels are
    included when :func:`cuda_wanted`; if that build fails, the CPU-only build is tried
    (unless ``require_cuda``), the CUDA error kept in the cache for ``ampx info``.

    Args:
        verbose: Show the compiler command lines and output.
        src: Source directory; defaults to :func:`source_dir`.
        progress: Called with a line when compiling starts, every few seconds while it
            runs (unless ``verbose``: then the compiler's output shows progress), and
            when it is done.
        require_cuda: Fail instead of building CPU kernels only when the CUDA kernels
            cannot be built (torch without CUDA, nvcc missing, a compile error).

    Returns:
        Path of the shared library, loadable by :mod:`ampx._ext`.

    Raises:
        RuntimeError: The sources, the compiler or ninja are missing, the compiler
            failed, or (``require_cuda``) no CUDA build was made; the message says which
            (and holds the compiler's output, which is also saved for ``ampx info``).
    """
    src = src or source_dir()
    if src is None:
        raise RuntimeError(
            f"ampx build-ext: no C++ sources in {_PACKAGE_DIR / 'csrc'}; this ampx install "
            "is incomplete, reinstall it"
        )
    missing = missing_compiler()
    if missing is not None:
        raise RuntimeError(f"ampx build-ext: {missing}; ampx keeps using its pure-torch kernels")
    why_not = cuda_why_not()
    if why_not is not None and require_cuda:
        raise RuntimeError(f"ampx build-ext --require-cuda: cannot build the CUDA kernels: "
                           f"{why_not}")
    cap = cpu_capability()
    with _ninja_on_path():
        if why_not is None:
            try:
                return _compile(src, cap, cuda_arch_list(), verbose, progress)
            except (RuntimeError, ValueError) as exc:
                if require_cuda:
                    raise RuntimeError(f"ampx build-ext --require-cuda: the CUDA build failed: "
                                       f"{exc}") from exc
                _log.warning("ampx: the CUDA build failed; building the CPU kernels only: %s",
                             exc)
        return _compile(src, cap, None, verbose, progress)
