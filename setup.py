"""Optional ahead-of-time build of the native kernels (``ampx._C``).

All metadata lives in pyproject.toml; this file only adds ``ext_modules`` when asked:

    AMPX_BUILD_EXT=1 pip install -v --no-build-isolation .      # try; fall back to pure torch
    AMPX_BUILD_EXT=require pip install -v --no-build-isolation .  # fail if it does not compile
    AMPX_BUILD_EXT=require-cuda pip install -v --no-build-isolation .  # ... or lacks CUDA

With a CUDA torch and nvcc the CUDA kernels are compiled too (no GPU needed: the
architectures come from ampx/_build.py's cuda_arch_list); if only they fail, ``1``
installs a CPU-only ``ampx._C`` instead of none.

``--no-build-isolation`` makes the build see the installed torch, which the extension
must match; ``-v`` lets pip show the compiler's progress (pip hides a build's output
otherwise). Without AMPX_BUILD_EXT this is a pure-Python install and torch is not
imported. The sources are ``ampx/csrc`` and the compiler flags come from ampx/_build.py
(loaded by path, so the ampx package itself is not imported); the JIT route is
``ampx build-ext``.

There is no setup.cfg: pyproject.toml holds all metadata and tool configuration, and the
one thing it cannot express, the optional extension, is this file's only job.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Any

from setuptools import setup

ROOT = Path(__file__).resolve().parent
FLAG = os.environ.get("AMPX_BUILD_EXT", "").strip().lower()
log = logging.getLogger("ampx.setup")


def _load_build_module() -> Any:
    spec = importlib.util.spec_from_file_location("_ampx_build", ROOT / "ampx" / "_build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cpu_only(ext: Any) -> None:
    """Strip the CUDA parts from a CUDAExtension, for the CPU-only retry."""
    ext.sources = [src for src in ext.sources if not src.endswith(".cu")]
    ext.extra_compile_args.pop("nvcc", None)
    ext.extra_compile_args["cxx"] = [f for f in ext.extra_compile_args["cxx"]
                                     if not f.startswith(("-DAMPX_WITH_CUDA", "-DAMPX_CUDA_ARCHS"))]
    ext.libraries = [lib for lib in ext.libraries
                     if lib not in ("cudart", "c10_cuda", "torch_cuda")]


def _extension_kwargs() -> dict[str, Any]:
    if FLAG in ("", "0", "false", "no", "off"):
        return {}
    required = FLAG in ("require", "require-cuda")
    build = _load_build_module()
    why_not = build.cuda_why_not()
    if FLAG == "require-cuda" and why_not is not None:
        raise SystemExit(f"ampx: AMPX_BUILD_EXT=require-cuda but the CUDA kernels cannot be "
                         f"built: {why_not}")
    cuda = why_not is None
    home = build.cuda_home() if cuda else None
    if home is not None:  # torch's builder reads CUDA_HOME once, when first imported
        os.environ.setdefault("CUDA_HOME", str(home))
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    cap = build.cpu_capability()
    archs = build.cuda_arch_list() if cuda else None
    cflags, cuda_cflags, ldflags = build.build_flags(cap, archs)
    if cuda:
        ldflags = build.cuda_link_flags(ROOT / "build" / "ampx-link") + ldflags
    csrc = ROOT / "ampx" / "csrc"
    sources = [str(p.relative_to(ROOT)) for p in build.source_files(csrc) if p.suffix == ".cpp"]
    extra_compile_args: dict[str, list[str]] = {"cxx": cflags}
    factory = CppExtension
    if cuda:
        sources += [
            str(p.relative_to(ROOT)) for p in build.source_files(csrc) if p.suffix == ".cu"
        ]
        extra_compile_args["nvcc"] = cuda_cflags
        factory = CUDAExtension

    class OptionalBuildExtension(BuildExtension):  # type: ignore[misc]
        """A failed compile still installs: CPU-only after a CUDA failure, else pure torch.

        AMPX_BUILD_EXT=require makes a missing ``ampx._C`` an error; require-cuda also a
        CUDA build failure.
        """

        def build_extension(self, ext: Any) -> None:
            kind = f"CPU and CUDA ({';'.join(archs)})" if archs else "CPU"
            print(f"ampx: compiling {ext.name} from {len(ext.sources)} sources, {kind} kernels "
                  "(a minute or more; `pip install -v` shows each step)", file=sys.stderr,
                  flush=True)
            try:
                super().build_extension(ext)
                return
            except Exception as exc:
                if FLAG == "require-cuda" or (required and not cuda):
                    raise
                if not cuda:
                    log.warning(
                        "ampx: building %s failed; installing without it (the pure-torch "
                        "kernels are used; `ampx info` reports this). Error: %s", ext.name, exc)
                    return
                log.warning("ampx: the CUDA build of %s failed; building the CPU kernels "
                            "only. Error: %s", ext.name, exc)
            _cpu_only(ext)
            try:
                super().build_extension(ext)
            except Exception as exc:
                if required:
                    raise
                log.warning("ampx: building %s failed; installing without it. Error: %s",
                            ext.name, exc)

    ext = factory(
        "ampx._C",
        sources,
        include_dirs=[str(csrc)],
        extra_compile_args=extra_compile_args,
        extra_link_args=ldflags,
    )
    return {"ext_modules": [ext], "cmdclass": {"build_ext": OptionalBuildExtension}}


setup(**_extension_kwargs())
