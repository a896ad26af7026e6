"""Slow clients and limits: a client trickling its headers or body cannot hold a
connection or a request open past the deadlines `--header-timeout` and `--body-timeout`
set, and huge prompts and stop sequences are refused before any tokenizer time is spent
on them."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from textgate import launcher
from textgate.router import server
from textgate.router.config import RouterConfig
from textgate.router.generation.schemas import GenerateRequest
from textgate.router.generation.validation import MAX_CHARS_PER_TOKEN, ValidationError, Validator
from textgate.router.http.guarded_h11 import guarded_h11
from textgate.tests.router.reliability.conftest import ThreadedRouter

HEADER_DEADLINE_S = 0.4
BODY_DEADLINE_S = 0.8
MARGIN_S = 1.5
"""How late a cut may come on a loaded 2-core machine."""


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
    protocol = guarded_h11(HEADER_DEADLINE_S, BODY_DEADLINE_S)
    with serve_in_thread(uvicorn_options={"http": protocol}) as served:
        yield served


def test_the_deadlines_are_flags_that_reach_the_http_server(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = launcher.parse_args(["--header-timeout", "2.5"], env={"BODY_TIMEOUT": "7"})
    limits = {"max_input_tokens": 100, "max_total_tokens": 200}
    monkeypatch.setattr(launcher, "model_limits", lambda path, config: limits)
    settings = launcher.router_config(Path("/model"), flags)
    config = RouterConfig.from_json(json.dumps(settings))
    assert (config.header_timeout, config.body_timeout) == (2.5, 7.0)
    defaults = RouterConfig.from_json(
        json.dumps(launcher.router_config(Path("/model"), launcher.parse_args([], env={})))
    )
    assert (defaults.header_timeout, defaults.body_timeout) == (30.0, 60.0)
    # run_http hands uvicorn the protocol with those deadlines.
    given: dict[str, Any] = {}

    class Given(Exception):
        pass

    def capture(app: object, **options: Any) -> None:
        given.update(options)
        raise Given

    monkeypatch.setattr(server.uvicorn, "Config", capture)
    with pytest.raises(Given):
        asyncio.run(server.run_http(object(), config))  # type: ignore[arg-type]
    assert (given["http"].header_timeout_s, given["http"].body_timeout_s) == (2.5, 7.0)
    for flag in ("--header-timeout", "--body-timeout"):
        with pytest.raises(SystemExit):
            launcher.parse_args([flag, "0"], env={})
        assert f"{flag} must be > 0 seconds" in capsys.readouterr().err
    with pytest.raises(ValueError, match="body_timeout must be > 0"):
        RouterConfig(model_id="m", tokenizer_path="t", body_timeout=-1)


def test_trickled_headers_are_cut_off_at_the_header_deadline(router: ThreadedRouter) -> None:
    with connect(router) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /generate HTTP/1.1\r\n")
        # One header byte every 0.05 s: uvicorn's keep-alive timer alone would never fire.
        for byte in b"Host: x\r\nX-Slow: " + b"a" * 1000:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.05)
            if time.monotonic() - started > HEADER_DEADLINE_S + MARGIN_S:
                break
        received, _ = read_until_closed(sock, patience_s=MARGIN_S)
        cut_after = time.monotonic() - started
        assert received == b""
        print(f"trickled headers cut after {cut_after:.2f} s (deadline {HEADER_DEADLINE_S} s)")
        assert HEADER_DEADLINE_S <= cut_after < HEADER_DEADLINE_S + MARGIN_S
    assert httpx.get(f"{router.url}/health").status_code == 200


def test_a_silent_connection_is_closed_and_a_kept_alive_one_serves(router: ThreadedRouter) -> None:
    with connect(router) as sock:
        received, waited = read_until_closed(sock, patience_s=5)
        assert received == b"" and HEADER_DEADLINE_S <= waited < HEADER_DEADLINE_S + MARGIN_S
    # Requests that arrive in time on one kept-alive connection are all served.
    with httpx.Client(base_url=router.url) as client:
        for _ in range(3):
            assert client.get("/health").status_code == 200
            time.sleep(HEADER_DEADLINE_S / 2)


def trickle_body(sock: socket.socket, interval_s: float) -> float:
    """Send a declared 1,000-byte body a byte per `interval_s` until the server answers;
    when its answer began (time.monotonic())."""
    sock.settimeout(interval_s)
    for _ in range(1000):
        try:
            sock.sendall(b" ")
            if sock.recv(1, socket.MSG_PEEK):
                break
        except TimeoutError:
            continue
        except OSError:
            break
    return time.monotonic()


def test_a_trickled_body_is_408_at_the_body_deadline(router: ThreadedRouter) -> None:
    for path, openai in (("/generate", False), ("/v1/completions", True)):
        with connect(router) as sock:
            head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            sock.sendall(f"{head}Content-Length: 1000\r\n\r\n{{".encode())
            started = time.monotonic()
            # A byte every 0.05 s: well within the header deadline each time, never done.
            cut_after = trickle_body(sock, interval_s=0.05) - started
            received, _ = read_until_closed(sock, patience_s=5)
        status_line, _, rest = received.partition(b"\r\n")
        assert status_line == b"HTTP/1.1 408 Request Timeout", received
        body = rest.partition(b"\r\n\r\n")[2]
        expected = b'"error_type":"request_timeout"'
        assert expected in body and (b'"message"' in body) == openai, body
        print(f"{path}: trickled body answered 408 after {cut_after:.2f} s")
        assert BODY_DEADLINE_S <= cut_after < BODY_DEADLINE_S + MARGIN_S
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
