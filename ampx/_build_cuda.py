"""The CUDA side of the extension build: toolkit, architectures, runtime link, device fit.

Finds the CUDA toolkit (``$CUDA_HOME``, ``PATH``, pip's ``nvidia-cuda-nvcc``,
``/usr/local/cuda``), chooses the architectures to compile for without needing a GPU
(:func:`cuda_arch_list`), names them in one word for cache keys and the binary
(:func:`arch_token`), tells whether a build runs on a GPU of a given capability
(:func:`arch_runs_on`, :func:`device_problem`), and makes pip's ``libcudart.so.13`` linkable.
:mod:`ampx._build` re-exports these. No relative imports: ``setup.py`` loads it by path.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

__all__ = [
    "arch_runs_on",
    "arch_token",
    "check_device",
    "cpu_only_note",
    "cuda_arch_list",
    "cuda_home",
    "cuda_home_for_torch",
    "cuda_link_flags",
    "cuda_why_not",
    "device_problem",
    "gencode_flags",
    "nvcc",
    "torch_has_cuda",
]


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


def nvcc() -> str | None:
    """Return the path of nvcc in :func:`cuda_home`, or None."""
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
    if nvcc() is None:
        if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
            where = "$CUDA_HOME/bin (CUDA_HOME is set, so only there)"
        else:
            where = "PATH, pip's nvidia-cuda-nvcc package or /usr/local/cuda"
        return (f"nvcc not found in {where}; install the CUDA {torch.version.cuda} toolkit "
                f"(e.g. `pip install 'cuda-toolkit[nvcc,cccl]=={torch.version.cuda}.*'`) "
                "or set CUDA_HOME")
    return None


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


def gencode_flags(archs: list[str]) -> list[str]:
    """nvcc ``-gencode`` flags for every arch (so torch's detection, which needs a GPU, is
    never asked), plus the PTX flag for those marked ``+PTX``."""
    flags = []
    for arch in archs:
        major, minor, suffix, ptx = _parse_arch(arch)
        num = f"{major}{minor}{suffix}"
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


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
def cuda_home_for_torch(home: Path | None) -> Iterator[None]:
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


def device_problem(native: Any, index: int) -> Optional[str]:
    """Why the loaded extension ``native`` cannot run on cuda:``index`` (None when it can).

    First its compiled architectures against the device's capability, then the CUDA
    runtime's own lookup of the kernel image (``native.cuda_probe``).
    """
    import torch

    archs = str(native.cuda_archs()) if hasattr(native, "cuda_archs") else ""
    major, minor = torch.cuda.get_device_capability(index)
    if archs and not arch_runs_on(archs, (major, minor)):
        return (f"the extension has CUDA code for {archs.replace('_', ' ')} (sm numbers, "
                f"p: PTX) but cuda:{index} is sm_{major}{minor}; rebuild with `ampx "
                "build-ext` on this machine or set TORCH_CUDA_ARCH_LIST")
    probe = str(native.cuda_probe(index)) if hasattr(native, "cuda_probe") else ""
    if probe:
        return f"the CUDA runtime cannot run the extension's kernels on cuda:{index}: {probe}"
    return None


def check_device(native: Any, index: int, problems: dict[int, Optional[str]],
                 lock: threading.Lock) -> None:
    """Record :func:`device_problem` for cuda:``index`` in ``problems``; warn once if any."""
    with lock:
        if index in problems:
            return
        try:
            problems[index] = problem = device_problem(native, index)
        except Exception as exc:  # a failed check must not break training
            problems[index] = problem = f"checking cuda:{index} failed: {exc}"
    if problem is not None:
        warnings.warn(f"ampx: {problem}; using the pure-torch reference kernels on "
                      f"cuda:{index}", RuntimeWarning, stacklevel=6)


def cpu_only_note(built: Path) -> str:
    """What ``ampx build-ext`` adds after the path of a CPU-only build of a CUDA torch."""
    if "-cuda_" in built.parent.name or not torch_has_cuda():
        return ""
    why = cuda_why_not() or "the CUDA build failed (`ampx info` shows why)"
    return f" (CPU kernels only: {why}; --require-cuda makes this an error)"
