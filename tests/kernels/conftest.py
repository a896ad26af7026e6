"""Shared fixtures of the kernel tests."""

from __future__ import annotations

import os
import sys

import pytest

from textgate.kernels.cpu_build import load_kernels

# TRITON_INTERPRET is chosen in tests/conftest.py, before any test module is imported.

#: Where the Triton tests run: "cuda" marked `gpu`, "cpu" in the interpreter (skipped when
#: the programs are compiled for a GPU in this process).
TRITON_DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            os.environ.get("TRITON_INTERPRET") != "1", reason="triton is not interpreting"
        ),
    ),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


@pytest.fixture
def fresh_library():
    """load_library() builds (or fails) anew inside the test, and is reset after it."""
    load_kernels.cache_clear()
    yield
    load_kernels.cache_clear()


@pytest.fixture(params=TRITON_DEVICES)
def triton_device(request: pytest.FixtureRequest) -> str:
    """The device a Triton test runs on (parametrized: cpu under the interpreter, cuda)."""
    if sys.platform != "linux":  # triton ships Linux wheels only; elsewhere a dev dep is absent
        pytest.importorskip("triton")
    return str(request.param)
