"""textgate.kernels: compute kernels, each beside a pure-PyTorch reference.

Attention backends are registered by name; `get_attention_backend("sdpa")` is the
reference that runs everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from textgate.kernels.attention import AttentionBackend, AttentionMetadata, SdpaAttentionBackend

DEFAULT_ATTENTION_BACKEND = "sdpa"

_ATTENTION_BACKENDS: dict[str, type[AttentionBackend[Any]]] = {}


def register_attention_backend(
    name: str,
) -> Callable[[type[AttentionBackend[Any]]], type[AttentionBackend[Any]]]:
    """Class decorator: make an `AttentionBackend` available as `name`."""

    def wrap(cls: type[AttentionBackend[Any]]) -> type[AttentionBackend[Any]]:
        if name in _ATTENTION_BACKENDS:
            raise ValueError(f"attention backend {name!r} is already registered")
        _ATTENTION_BACKENDS[name] = cls
        return cls

    return wrap


def get_attention_backend(name: str = DEFAULT_ATTENTION_BACKEND) -> AttentionBackend[Any]:
    """A new instance of the backend registered as `name`."""
    if name not in _ATTENTION_BACKENDS:
        known = ", ".join(sorted(_ATTENTION_BACKENDS))
        raise ValueError(f"unknown attention backend {name!r}; known: {known}")
    return _ATTENTION_BACKENDS[name]()


register_attention_backend("sdpa")(SdpaAttentionBackend)

__all__ = [
    "DEFAULT_ATTENTION_BACKEND",
    "AttentionBackend",
    "AttentionMetadata",
    "SdpaAttentionBackend",
    "get_attention_backend",
    "register_attention_backend",
]
