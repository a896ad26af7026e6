"""textgate.kernels: compute kernels, each beside a pure-PyTorch reference.

Attention backends are registered by name: "sdpa" is the pure-PyTorch reference that
runs everywhere; "cpu" (the default) runs a C kernel on CPU tensors and SDPA elsewhere.
`cpu_layers` holds fused C versions of the layers' small ops; `cpu_build` compiles all
the C kernels on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from textgate.kernels.attention import AttentionBackend, AttentionMetadata, SdpaAttentionBackend
from textgate.kernels.cpu_attention import CpuAttentionBackend

DEFAULT_ATTENTION_BACKEND = "cpu"

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
register_attention_backend("cpu")(CpuAttentionBackend)

__all__ = [
    "DEFAULT_ATTENTION_BACKEND",
    "AttentionBackend",
    "AttentionMetadata",
    "CpuAttentionBackend",
    "SdpaAttentionBackend",
    "get_attention_backend",
    "register_attention_backend",
]
