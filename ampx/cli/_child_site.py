"""The `sitecustomize` of Python processes started under `ampx run` (copied, not imported).

One job: carry `ampx run`'s apex alias and forced options into child processes (DataLoader
spawn workers, `torch.multiprocessing.spawn`, any `python` the script starts). `ampx run`
copies this file as `sitecustomize.py` into a temporary directory that it puts first on the
children's PYTHONPATH, next to the options in `AMPX_RUN_CHILD`. The file uses only the
standard library and imports nothing of ampx or torch up front: it first runs the
sitecustomize it hides (if any), then waits for the process's first `import apex` or
`import ampx` and only then calls `ampx.cli.run.apply_child_config`. Processes that never
import either pay one dictionary lookup per import.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, Callable, Optional

_ENV = "AMPX_RUN_CHILD"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _chain() -> None:
    """Run the sitecustomize that would have run without this one."""
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def _find(name: str, path: Optional[Sequence[str]], target: Any) -> Any:
    for finder in list(sys.meta_path):
        find_spec = getattr(finder, "find_spec", None)
        spec = find_spec(name, path, target) if find_spec is not None else None
        if spec is not None:
            return spec
    return None


class _AfterExec:
    """A loader that runs `then` once the real loader has executed the module."""

    def __init__(self, loader: Any, then: Callable[[], None]) -> None:
        self._loader = loader
        self._then = then

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._then()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _FirstImport:
    """A meta-path finder waiting for the first `import apex` or `import ampx`."""

    def __init__(self, config: dict) -> None:
        self.config = config

    def _make_importable(self) -> None:
        """Fall back to the parent's ampx when this interpreter cannot find one."""
        root = self.config.get("ampx_root")
        if root and _find("ampx", None, None) is None:
            sys.path.append(root)

    def _apply(self) -> None:
        self._make_importable()
        import ampx.cli.run

        ampx.cli.run.apply_child_config(self.config)

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in ("apex", "ampx"):
            return None
        while self in sys.meta_path:
            sys.meta_path.remove(self)
        if name == "apex":
            self._apply()  # imports ampx, installs the alias finder
            return _find(name, path, target)
        self._make_importable()
        spec = _find(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _AfterExec(spec.loader, self._apply)
        return spec


def _install() -> None:
    _chain()
    text = os.environ.get(_ENV)
    if not text:
        return
    try:
        config = json.loads(text)
    except ValueError:
        return
    if isinstance(config, dict):
        sys.meta_path.insert(0, _FirstImport(config))


_install()
