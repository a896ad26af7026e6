"""Slow clients and limits: a client trickling its headers or body cannot hold a
connection or a request open, and huge prompts and stop sequences are refused before
any tokenizer time is spent on them."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from textgate.router.http import request_io
from textgate.router.http.guarded_h11 import GuardedH11Protocol
from textgate.router.http.validation import MAX_CHARS_PER_TOKEN, ValidationError, Validator
from textgate.router.tgi.schemas import GenerateRequest
from textgate.tests.router.reliability.conftest import ThreadedRouter

DEADLINE_S = 0.5


class _FastDeadline(GuardedH11Protocol):
    header_timeout_s = DEADLINE_S


def connect(router: ThreadedRouter) -> socket.socket:
    host, port = router.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    return sock


def read_until_closed(sock: socket.socket, patience_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes; and when it closed (seconds)."""
    started = time.monotonic()
    sock.settimeout(patience_s)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received, time.monotonic() - started


@pytest.fixture
def router(serve_in_thread: Callable[..., Any]) -> Any:
    with serve_in_thread(uvicorn_options={"http": _FastDeadline}) as served:
        yield served


def test_trickled_headers_are_cut_off_at_the_deadline(router: ThreadedRouter) -> None:
    with connect(router) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /generate HTTP/1.1\r\n")
        closed = False
        # One header byte every 0.1 s: uvicorn's keep-alive timer alone would never fire.
        for byte in b"Host: x\r\nX-Slow: " + b"a" * 100:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.1)
            if time.monotonic() - started > 5 * DEADLINE_S:
                break
        if not closed:
            received, _ = read_until_closed(sock, patience_s=DEADLINE_S)
            assert received == b""
        assert time.monotonic() - started < 5 * DEADLINE_S + 0.5
    assert httpx.get(f"{router.url}/health").status_code == 200


def test_a_silent_connection_is_closed_and_a_kept_alive_one_serves(router: ThreadedRouter) -> None:
    with connect(router) as sock:
        received, waited = read_until_closed(sock, patience_s=5)
        assert received == b"" and DEADLINE_S <= waited < DEADLINE_S + 1.5
    # Requests that arrive in time on one kept-alive connection are all served.
    with httpx.Client(base_url=router.url) as client:
        for _ in range(3):
            assert client.get("/health").status_code == 200
            time.sleep(DEADLINE_S / 2)


def test_a_trickled_body_is_408(router: ThreadedRouter, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_io, "BODY_READ_TIMEOUT_S", DEADLINE_S)
    for path, openai in (("/generate", False), ("/v1/completions", True)):
        with connect(router) as sock:
            head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            sock.sendall(f"{head}Content-Length: 1000\r\n\r\n{{".encode())
            received, waited = read_until_closed(sock, patience_s=5)
        status_line, _, rest = received.partition(b"\r\n")
        assert status_line == b"HTTP/1.1 408 Request Timeout", received
        body = rest.partition(b"\r\n\r\n")[2]
        expected = b'"error_type":"request_timeout"'
        assert expected in body and (b'"message"' in body) == openai, body
        assert waited < DEADLINE_S + 1.5
    after = httpx.post(f"{router.url}/generate", json={"inputs": "w5"})
    assert after.status_code == 200


class _RefusingTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise AssertionError("the prompt was tokenized")


async def test_a_huge_prompt_is_refused_before_tokenizing(
    make_config: Callable[..., Any],
) -> None:
    config = make_config()
    validator = Validator(config, _RefusingTokenizer())
    try:
        huge = "w" * (config.max_input_tokens * MAX_CHARS_PER_TOKEN + 1)
        with pytest.raises(ValidationError, match=r"Given: 6401 characters, more than 64 tokens"):
            await validator.validate(GenerateRequest(inputs=huge))
    finally:
        validator.close()


def test_huge_prompts_and_stop_sequences_are_422_at_once(router: ThreadedRouter) -> None:
    huge = "w5" + " " * (64 * MAX_CHARS_PER_TOKEN)
    response = httpx.post(f"{router.url}/generate", json={"inputs": huge})
    assert response.status_code == 422
    assert "characters, more than 64 tokens hold" in response.json()["error"]
    # With `truncate` the prompt is tokenized and its last tokens kept.
    body = {"inputs": huge, "parameters": {"truncate": 8, "max_new_tokens": 2}}
    assert httpx.post(f"{router.url}/generate", json=body).status_code == 200
    stop = "x" * (128 * MAX_CHARS_PER_TOKEN + 1)
    body = {"inputs": "w5", "parameters": {"stop": [stop]}}
    response = httpx.post(f"{router.url}/generate", json=body)
    assert response.status_code == 422
    assert response.json()["error"] == (
        "`stop` sequences must have at most 12800 characters (longer ones could never match). "
        "Given: 12801"
    )
