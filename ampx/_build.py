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

__all__ = [
    "arch_runs_on",
    "build",
    "build_flags",
    "cache_dir",
    "cpu_capability",
    "cuda_arch_list",
    "cuda_home",
    "cuda_link_flags",
    "cuda_wanted",
    "cuda_why_not",
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


def _pip_cuda_homes() -> list[Path]:
    """CUDA homes that pip's ``nvidia-cuda-nvcc`` wheels install (``nvidia/cu13``, ...)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    return sorted((h for r in roots for h in Path(r).glob("cu[0-9]*")), reverse=True)


def _toolkit(home: Path) -> bool:
    return (home / "bin" / "nvcc").is_file() and (home / "include" / "cuda_runtime.h").is_file()


def cuda_home() -> Path | None:
    """Return the CUDA toolkit directory (``bin/nvcc`` and ``include/cuda_runtime.h``), or None.

    ``$CUDA_HOME``/``$CUDA_PATH`` when set (and only it), else the directory above the
    ``nvcc`` on ``PATH`` (through symlinks), else pip's ``nvidia/cu*`` packages (which
    match a pip-installed CUDA torch), else ``/usr/local/cuda``. A directory without the
    headers (``/usr/local`` for a ``/usr/local/bin/nvcc`` wrapper script) is passed over.
    """
    explicit = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if explicit:
        return Path(explicit) if _toolkit(Path(explicit)) else None
    found = shutil.which("nvcc")
    candidates = [Path(found).resolve().parent.parent] if found else []
    candidates += [*_pip_cuda_homes(), Path("/usr/local/cuda")]
    return next((h for h in candidates if _toolkit(h)), None)


def _nvcc() -> str | None:
    home = cuda_home()
    return str(home / "bin" / "nvcc") if home is not None else None


def torch_has_cuda() -> bool:
    """Whether the installed torch is a CUDA build (a GPU need not be present)."""
    import torch

    return torch.version.cuda is not None


def cuda_why_not() -> str | None:
    """Return why the CUDA kernels cannot be compiled here, or None when they can."""
    import torch

    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    if _nvcc() is None:
        if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
            where = "$CUDA_HOME/bin (CUDA_HOME is set, so only there)"
        else:
            where = "PATH, pip's nvidia-cuda-nvcc package or /usr/local/cuda"
        return (f"nvcc not found in {where}; install the CUDA {torch.version.cuda} toolkit "
                f"(e.g. `pip install 'cuda-toolkit[nvcc,cccl]=={torch.version.cuda}.*'`) "
                "or set CUDA_HOME")
    return None


def cuda_wanted() -> bool:
    """Return whether to compile the CUDA kernels: torch has CUDA and nvcc exists."""
    return cuda_why_not() is None


def _parse_arch(arch: str) -> tuple[int, int, str, bool]:
    """``"9.0a+PTX"`` -> (9, 0, "a", True)."""
    body, ptx = (arch[:-4], True) if arch.upper().endswith("+PTX") else (arch, False)
    suffix = body[-1] if body and body[-1].isalpha() else ""
    major, _, minor = body.rstrip(suffix).partition(".")
    if not (major.isdigit() and minor.isdigit() and len(minor) == 1):
        raise ValueError(f"cannot read CUDA architecture {arch!r}; expected e.g. 8.0, 9.0a "
                         "or 9.0+PTX (set TORCH_CUDA_ARCH_LIST accordingly)")
    return int(major), int(minor), suffix, ptx


def cuda_arch_list() -> list[str]:
    """Return the CUDA architectures to compile for, in torch's notation (``"9.0+PTX"``).

    ``$TORCH_CUDA_ARCH_LIST`` (``;`` or space separated) when set and not ``native``;
    else the visible GPUs' capabilities (capped at the newest this torch supports); else,
    with no GPU visible, every ``sm_*`` of ``torch.cuda.get_arch_list()``. The newest
    gets ``+PTX`` in the last two cases, so newer GPUs can still JIT the kernels.
    """
    import torch

    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env and env != "native":
        archs = [a for a in env.replace(" ", ";").split(";") if a]
        for arch in archs:
            _parse_arch(arch)
        return archs
    built = sorted((int(a[3:-1]), int(a[-1])) for a in torch.cuda.get_arch_list()
                   if a.startswith("sm_") and a[3:].isdigit())
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        newest = built[-1] if built else (99, 9)
        caps = sorted({min(torch.cuda.get_device_capability(i), newest)
                       for i in range(torch.cuda.device_count())})
    else:
        caps = built
    if not caps:
        raise RuntimeError("ampx build-ext: no GPU is visible and this torch lists no CUDA "
                           "architectures; set TORCH_CUDA_ARCH_LIST (e.g. '9.0')")
    archs = [f"{major}.{minor}" for major, minor in caps]
    archs[-1] += "+PTX"
    return archs


def arch_token(archs: list[str]) -> str:
    """The arch list as one word for cache keys and ``-D``: ``["8.0", "9.0+PTX"]`` -> ``80_90p``."""
    words = []
    for arch in archs:
        major, minor, suffix, ptx = _parse_arch(arch)
        words.append(f"{major}{minor}{suffix}{'p' if ptx else ''}")
    return "_".join(words)


def _token_archs(token: str) -> list[tuple[int, int, str, bool]]:
    out = []
    for word in token.split("_"):
        ptx = word.endswith("p")
        word = word[:-1] if ptx else word
        suffix = word[-1] if word and word[-1].isalpha() else ""
        digits = word.rstrip(suffix)
        if digits.isdigit() and len(digits) >= 2:
            out.append((int(digits[:-1]), int(digits[-1]), suffix, ptx))
    return out


def arch_runs_on(token: str, capability: tuple[int, int]) -> bool:
    """Whether a build for ``token`` (:func:`arch_token`) has code a GPU of ``capability`` runs.

    An ``sm_XY`` binary runs on X.Y and later minor versions of the same major (an
    ``a`` variant only on X.Y exactly); PTX for X.Y is JIT-compiled on X.Y and anything newer.
    """
    for major, minor, suffix, ptx in _token_archs(token):
        if suffix and (major, minor) != tuple(capability):
            continue
        if major == capability[0] and minor <= capability[1]:
            return True
        if ptx and (major, minor) <= tuple(capability):
            return True
    return False


def cuda_link_flags(work: Path) -> list[str]:
    """Linker flags that make torch's ``-lcudart`` resolve against pip's CUDA runtime.

    pip's ``nvidia-cuda-runtime`` ships only ``libcudart.so.13`` (no ``libcudart.so``
    link), so a ``libcudart.so`` symlink is made in ``work/cudart`` and searched first.
    Empty when the toolkit has its own link or none is found.
    """
    home = cuda_home()
    if home is None or sys.platform == "win32":
        return []
    libs = [home / d for d in ("lib64", "lib") if (home / d).is_dir()]
    if any((d / "libcudart.so").exists() for d in libs):
        return []
    versioned = sorted(p for d in libs for p in d.glob("libcudart.so.[0-9]*"))
    if not versioned:
        return []
    link_dir = work / "cudart"
    link_dir.mkdir(parents=True, exist_ok=True)
    link = link_dir / "libcudart.so"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(versioned[0])
    return [f"-L{link_dir}"]


@contextmanager
def _cuda_home_for_torch(home: Path | None) -> Iterator[None]:
    """Point torch's builder (which reads CUDA_HOME once, at import) at ``home``."""
    from torch.utils import cpp_extension

    old_env, old_attr = os.environ.get("CUDA_HOME"), cpp_extension.CUDA_HOME
    if home is not None:
        os.environ["CUDA_HOME"] = str(home)
        cpp_extension.CUDA_HOME = str(home)
    try:
        yield
    finally:
        cpp_extension.CUDA_HOME = old_attr
        if old_env is None:
            os.environ.pop("CUDA_HOME", None)
        else:
            os.environ["CUDA_HOME"] = old_env


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
                "`pip install 'ampx[native]'` (or `pip install ninja`)"
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
    cuda_cflags = ["-O3", "--fmad=false", *defines]
    for arch in archs:
        major, minor, suffix, ptx = _parse_arch(arch)
        num = f"{major}{minor}{suffix}"
        cuda_cflags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            cuda_cflags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return cflags + defines, cuda_cflags, ldflags


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

    A cached build for the same key is reused (ninja rebuilds nothing). CUDA kernels
    are included when :func:`cuda_wanted` is true; if that build fails, the CPU-only
    build is tried (unless ``require_cuda``) and the CUDA error stays in the cache for
    ``ampx info``.

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
