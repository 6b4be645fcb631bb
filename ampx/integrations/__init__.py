"""ampx inside training frameworks: `ampx.integrations.lightning`, `ampx.integrations.accelerate`.

Each submodule imports its framework when it is imported itself (the frameworks are optional
extras: ``pip install 'torch-ampx[lightning]'``, ``'torch-ampx[accelerate]'``); importing ampx
or this package imports neither, and ampx's core never imports this package.
"""

from __future__ import annotations

__all__: list[str] = []
