"""Native model classes by config.json `model_type`: `@register("llama", "mistral")`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch import nn

from textgate.registry import Registry

ModelT = TypeVar("ModelT", bound=type[nn.Module])


class UnsupportedModelError(ValueError):
    """No native implementation exists for a model type."""


_MODELS: Registry[type[nn.Module]] = Registry(
    "model type",
    "{noun} {name!r} has no native implementation; supported: {known}",
    UnsupportedModelError,
)


def register(*model_types: str) -> Callable[[ModelT], ModelT]:
    """Class decorator: serve `model_types` with this model class."""
    return _MODELS.register(*model_types)


def supported_model_types() -> list[str]:
    """Model types with a native implementation, sorted."""
    return _MODELS.names()


def get_model_class(model_type: str | None) -> type[nn.Module]:
    """The native class for `model_type`, or UnsupportedModelError."""
    return _MODELS.lookup(model_type)
