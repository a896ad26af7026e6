"""Shared fixtures of the kernel tests."""

from __future__ import annotations

import pytest

from textgate.kernels.cpu_build import load_library


@pytest.fixture
def fresh_library():
    """load_library() builds (or fails) anew inside the test, and is reset after it."""
    load_library.cache_clear()
    yield
    load_library.cache_clear()
