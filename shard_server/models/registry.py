"""Native model classes by config.json `model_type`: `@register("llama", "mistral")`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch import nn

ModelT = TypeVar("ModelT", bound=type[nn.Module])

_MODELS: dict[str, type[nn.Module]] = {}


class UnsupportedModelError(ValueError):
    """No native implementation exists for a model type."""


def register(*model_types: str) -> Callable[[ModelT], ModelT]:
    """Class decorator: serve `model_types` with this model class."""

    def wrap(cls: ModelT) -> ModelT:
        for model_type in model_types:
            if model_type in _MODELS:
                raise ValueError(f"model type {model_type!r} is already registered")
            _MODELS[model_type] = cls
        return cls

    return wrap


def supported_model_types() -> list[str]:
    """Model types with a native implementation, sorted."""
    return sorted(_MODELS)


def get_model_class(model_type: str | None) -> type[nn.Module]:
    """The native class for `model_type`, or UnsupportedModelError."""
    if model_type not in _MODELS:
        raise UnsupportedModelError(
            f"model type {model_type!r} has no native implementation; "
            f"supported: {', '.join(supported_model_types())}"
        )
    return _MODELS[model_type]
