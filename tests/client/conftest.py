"""Fixtures for the client tests: the fake TGI server, served by uvicorn on a free port."""

from __future__ import annotations

import importlib.util
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import uvicorn
from starlette.applications import Starlette


def _load_fake_tgi() -> ModuleType:
    # Test folders are not packages (--import-mode=importlib), so load the helper by path.
    path = Path(__file__).with_name("fake_tgi.py")
    spec = importlib.util.spec_from_file_location("textgate_tests_fake_tgi", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


fake_tgi = _load_fake_tgi()


class ServedApp:
    """An ASGI app served by uvicorn in a background thread."""

    def __init__(self, app: Starlette) -> None:
        self.app = app
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        port = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(
            app, lifespan="off", ws="none", http="h11", log_level="warning", access_log=False
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    def __enter__(self) -> ServedApp:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()

    @property
    def requests(self) -> list[dict]:
        """What the server received, oldest first."""
        return self.app.state.requests


@pytest.fixture(scope="session")
def fake_server() -> Iterator[ServedApp]:
    """The fake TGI server (no API key)."""
    with ServedApp(fake_tgi.create_app()) as served:
        yield served


@pytest.fixture(scope="session")
def fake_server_with_key() -> Iterator[ServedApp]:
    """The fake TGI server wanting `Authorization: Bearer secret`."""
    with ServedApp(fake_tgi.create_app(api_key="secret")) as served:
        yield served


# (prompt steering the fake server, expected error class name, expected message)
ERROR_CASES = [
    ("error 422 validation", "ValidationError", "fake validation error"),
    ("error 424 generation", "GenerationError", "fake generation error"),
    ("error 429 overloaded", "OverloadedError", "fake overloaded error"),
    (
        "error 500 incomplete_generation",
        "IncompleteGenerationError",
        "fake incomplete_generation error",
    ),
    ("error 503 unhealthy", "ShardNotReadyError", "fake unhealthy error"),
    ("error 400 -", "BadRequestError", "fake - error"),
    ("error 401 -", "UnauthorizedError", "fake - error"),
    ("error 404 -", "NotFoundError", "fake - error"),
    ("error 424 -", "ShardNotReadyError", "fake - error"),
    ("error 429 -", "RateLimitExceededError", "fake - error"),
    ("error 504 -", "ShardTimeoutError", "fake - error"),
    ("error 500 -", "UnknownError", "fake - error"),
    ("text 502", "UnknownError", "<html>bad gateway</html>"),
    ("openai-error 400 invalid_request_error", "BadRequestError", "fake invalid_request_error"),
]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run every test taking `error_case` once per row of ERROR_CASES."""
    if "error_case" in metafunc.fixturenames:
        metafunc.parametrize("error_case", ERROR_CASES, ids=[case[0] for case in ERROR_CASES])


@pytest.fixture
def closed_port_url() -> str:
    """A URL on which nothing listens."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"
