"""Optional ahead-of-time build of the native kernels (``ampx._C``).

All metadata lives in pyproject.toml; this file only adds ``ext_modules`` when asked:

    AMPX_BUILD_EXT=1 pip install -v --no-build-isolation .      # try; fall back to pure torch
    AMPX_BUILD_EXT=require pip install -v --no-build-isolation .  # fail if it does not compile

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


def _extension_kwargs() -> dict[str, Any]:
    if FLAG in ("", "0", "false", "no", "off"):
        return {}
    required = FLAG == "require"
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    build = _load_build_module()
    cap = build.cpu_capability()
    cuda = build.cuda_wanted()
    cflags, cuda_cflags, ldflags = build.build_flags(cap, cuda)
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
        """A failed compile still installs (pure torch), unless AMPX_BUILD_EXT=require."""

        def build_extension(self, ext: Any) -> None:
            print(f"ampx: compiling {ext.name} from {len(ext.sources)} sources (about a minute "
                  "on 2 cores; `pip install -v` shows each step)", file=sys.stderr, flush=True)
            try:
                super().build_extension(ext)
            except Exception as exc:
                if required:
                    raise
                log.warning(
                    "ampx: building %s failed; installing without it (the pure-torch "
                    "kernels are used; `ampx info` reports this). Error: %s", ext.name, exc
                )

    ext = factory(
        "ampx._C",
        sources,
        include_dirs=[str(csrc)],
        extra_compile_args=extra_compile_args,
        extra_link_args=ldflags,
    )
    return {"ext_modules": [ext], "cmdclass": {"build_ext": OptionalBuildExtension}}


setup(**_extension_kwargs())
