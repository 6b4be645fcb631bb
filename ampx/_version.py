"""ampx's version, written once: pyproject.toml reads it and ``ampx.__version__`` is it."""

__version__ = "0.1.0"
