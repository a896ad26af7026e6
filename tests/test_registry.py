"""The one registry helper: register once per name, look up with a clear error."""

from __future__ import annotations

import pytest

from textgate.registry import Registry


class Missing(ValueError):
    pass


def test_entries_register_under_every_name_once():
    shapes: Registry[type] = Registry("shape")

    @shapes.register("square", "box")
    class Square:
        pass

    assert shapes.lookup("box") is Square and shapes.names() == ["box", "square"]
    with pytest.raises(ValueError, match="shape 'square' is already registered"):
        shapes.register("square")(int)


def test_an_unknown_name_says_what_is_known_in_the_registrys_words():
    shapes: Registry[type] = Registry("shape", "no {noun} {name!r}; try {known}", Missing)
    shapes.register("b", "a")(int)
    with pytest.raises(Missing, match="no shape 'c'; try a, b"):
        shapes.lookup("c")
    with pytest.raises(Missing, match="no shape None"):
        shapes.lookup(None)


def test_a_copy_keeps_the_messages_and_leaves_the_original_alone():
    shapes: Registry[type] = Registry("shape", error=Missing)
    shapes.register("a")(int)
    clone = shapes.copy()
    clone.register("b")(str)
    assert shapes.names() == ["a"] and clone.names() == ["a", "b"]
    with pytest.raises(Missing, match="unknown shape 'z'; known: a, b"):
        clone.lookup("z")
