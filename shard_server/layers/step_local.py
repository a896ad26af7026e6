"""A value one forward pass shares with every module it runs, set around the pass.

Modules deep inside a model (a LoRA linear, transformers' attention callback) need the
step's own data (which rows take which adapter, the step's KV cache and plan) without it
threading through every `forward` signature. `StepLocal` holds it in a ContextVar for
the length of a `with`, so it never outlives the step or leaks into another thread.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class StepLocal(Generic[T]):
    """`with local.bound(value):` makes `local.get()` return value inside, None outside."""

    def __init__(self, name: str) -> None:
        self._var: contextvars.ContextVar[T | None] = contextvars.ContextVar(name, default=None)

    def get(self) -> T | None:
        return self._var.get()

    @contextlib.contextmanager
    def bound(self, value: T | None) -> Iterator[None]:
        token = self._var.set(value)
        try:
            yield
        finally:
            self._var.reset(token)
