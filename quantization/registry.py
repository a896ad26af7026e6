"""Weights loaders by quantization method name: `@register("gptq")` on a `WeightsLoader`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from textgate.quantization.base import WeightsLoader

UNQUANTIZED = "unquantized"

_LOADERS: dict[str, type[WeightsLoader]] = {}


class UnsupportedQuantizationError(ValueError):
    """No loader is registered for the requested quantization method."""


def register(*names: str) -> Callable[[type[WeightsLoader]], type[WeightsLoader]]:
    """Class decorator: serve quantization methods `names` with this loader."""

    def wrap(cls: type[WeightsLoader]) -> type[WeightsLoader]:
        for name in names:
            if name in _LOADERS:
                raise ValueError(f"quantization method {name!r} is already registered")
            _LOADERS[name] = cls
        return cls

    return wrap


def registered_methods() -> list[str]:
    """Names accepted by `get_weights_loader`, sorted."""
    return sorted(_LOADERS)


def loader_class(method: str | None) -> type[WeightsLoader]:
    """The loader class registered for `method` (None: plain floating-point weights)."""
    name = method or UNQUANTIZED
    if name not in _LOADERS:
        raise UnsupportedQuantizationError(
            f"quantization method {name!r} is not supported; "
            f"known methods: {', '.join(registered_methods())}"
        )
    return _LOADERS[name]


def get_weights_loader(
    method: str | None, quantization_config: Mapping[str, Any] | None = None
) -> WeightsLoader:
    """The loader for `method` (None: plain floating-point weights)."""
    return loader_class(method).from_config(quantization_config or {})
