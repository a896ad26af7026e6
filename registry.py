"""Named implementations chosen by a decorator: the one registry helper every package uses.

    MODELS: Registry[type[nn.Module]] = Registry("model type", ...)

    @MODELS.register("llama", "mistral")
    class LlamaForCausalLM(nn.Module): ...

    MODELS.lookup("llama")  # the class; an unknown name raises with the known ones

A `Registry` is a dict of name -> entry (so tests may `monkeypatch.setitem` one), that
refuses a name registered twice and says what it knows when asked for an unknown one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
E = TypeVar("E")


class Registry(dict[str, T]):
    """Entries by name, filled by `register` and read by `lookup`."""

    def __init__(
        self,
        noun: str,
        unknown: str = "unknown {noun} {name!r}; known: {known}",
        error: type[Exception] = ValueError,
    ) -> None:
        """`noun` names an entry's kind in messages; `unknown` formats the error for a
        name never registered (fields noun, name, known), raised as `error`."""
        super().__init__()
        self.noun = noun
        self.unknown = unknown
        self.error = error

    def register(self, *names: str) -> Callable[[E], E]:
        """Decorator: register what it decorates under each of `names` (once each); the
        entry stored is `entry(decorated)`, by default the decorated object itself."""

        def wrap(decorated: E) -> E:
            for name in names:
                if name in self:
                    raise ValueError(f"{self.noun} {name!r} is already registered")
                self[name] = self.entry(decorated)
            return decorated

        return wrap

    def entry(self, decorated: object) -> T:
        """What `register` stores for `decorated` (itself; a subclass may build one)."""
        return decorated  # type: ignore[return-value]

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self)

    def lookup(self, name: str | None) -> T:
        """The entry registered as `name`; `error` (naming the known ones) otherwise."""
        if name is None or name not in self:
            known = ", ".join(self.names())
            raise self.error(self.unknown.format(noun=self.noun, name=name, known=known))
        return self[name]

    def copy(self) -> Registry[T]:  # type: ignore[override]
        """A registry with the same entries and messages (tests register into one)."""
        clone: Registry[T] = type(self)(self.noun, self.unknown, self.error)
        clone.update(self)
        return clone
