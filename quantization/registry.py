"""Weights loaders by quantization method name: `@register("gptq")` on a `WeightsLoader`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from textgate.quantization.base import WeightsLoader
from textgate.registry import Registry

UNQUANTIZED = "unquantized"


class UnsupportedQuantizationError(ValueError):
    """No loader is registered for the requested quantization method."""


_LOADERS: Registry[type[WeightsLoader]] = Registry(
    "quantization method",
    "{noun} {name!r} is not supported; known methods: {known}",
    UnsupportedQuantizationError,
)


def register(*names: str) -> Callable[[type[WeightsLoader]], type[WeightsLoader]]:
    """Class decorator: serve quantization methods `names` with this loader."""
    return _LOADERS.register(*names)


def registered_methods() -> list[str]:
    """Names accepted by `get_weights_loader`, sorted."""
    return _LOADERS.names()


def loader_class(method: str | None) -> type[WeightsLoader]:
    """The loader class registered for `method` (None: plain floating-point weights)."""
    return _LOADERS.lookup(method or UNQUANTIZED)


def get_weights_loader(
    method: str | None, quantization_config: Mapping[str, Any] | None = None
) -> WeightsLoader:
    """The loader for `method` (None: plain floating-point weights)."""
    return loader_class(method).from_config(quantization_config or {})
