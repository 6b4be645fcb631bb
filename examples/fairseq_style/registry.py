"""fairseq-style registries: `@register_model("name")`, `@register_optimizer("name")`."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

T = TypeVar("T")

MODEL_REGISTRY: dict[str, Any] = {}
OPTIMIZER_REGISTRY: dict[str, Any] = {}


def _register(registry: dict[str, Any], kind: str, name: str) -> Callable[[T], T]:
    def decorate(cls: T) -> T:
        if name in registry:
            raise ValueError(f"cannot register duplicate {kind} ({name})")
        registry[name] = cls
        return cls

    return decorate


def register_model(name: str) -> Callable[[T], T]:
    """Class decorator: make a model available as `--arch name`."""
    return _register(MODEL_REGISTRY, "model", name)


def register_optimizer(name: str) -> Callable[[T], T]:
    """Class decorator: make an optimizer available as `--optimizer name`."""
    return _register(OPTIMIZER_REGISTRY, "optimizer", name)
