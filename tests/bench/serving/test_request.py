from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from textgate.bench.serving.backends import GenerationSettings, StreamChunk, get_backend
from textgate.bench.serving.request import StreamRecorder, send_request
from textgate.bench.serving.workload import BenchRequest

TOKEN = StreamChunk(is_token=True, text="x")


def test_recorder_times_tokens_from_the_request_start() -> None:
    rec = StreamRecorder(start_time=10.0, prompt_len=4, one_token_per_event=True)
    rec.on_chunk(StreamChunk(), 10.05)  # e.g. a role announcement: not a token
    rec.on_chunk(TOKEN, 10.2)
    rec.on_chunk(TOKEN, 10.25)
    rec.on_chunk(TOKEN, 10.4)
    rec.on_chunk(StreamChunk(final=True), 10.9)  # end marker does not extend E2E
    out = rec.outcome()
    assert out.success
    assert out.ttft == pytest.approx(0.2)
    assert out.itl == pytest.approx([0.05, 0.15])
    assert out.latency == pytest.approx(0.4)
    assert (out.output_tokens, out.prompt_len, out.start_time) == (3, 4, 10.0)


def test_recorder_signals_the_first_token_only() -> None:
    first = asyncio.Event()
    rec = StreamRecorder(0.0, prompt_len=4, one_token_per_event=True, first_token=first)
    rec.on_chunk(StreamChunk(prompt_tokens=4), 0.1)
    assert not first.is_set()
    rec.on_chunk(StreamChunk(is_token=True, text="a"), 0.2)
    assert first.is_set()


def test_recorder_prefers_the_servers_token_counts() -> None:
    rec = StreamRecorder(0.0, prompt_len=4, one_token_per_event=False)
    rec.on_chunk(TOKEN, 1.0)
    rec.on_chunk(StreamChunk(output_tokens=5, prompt_tokens=9), 1.1)
    rec.on_chunk(StreamChunk(final=True), 1.2)
    out = rec.outcome(count_tokens=lambda text: 100)
    assert (out.output_tokens, out.prompt_len) == (5, 9)


def test_recorder_tokenizes_bundled_openai_text_without_usage() -> None:
    rec = StreamRecorder(0.0, prompt_len=4, one_token_per_event=False)
    rec.on_chunk(StreamChunk(is_token=True, text="a b c"), 1.0)
    rec.on_chunk(StreamChunk(final=True), 1.1)
    assert rec.outcome(count_tokens=lambda text: len(text.split())).output_tokens == 3
    assert rec.outcome(count_tokens=None).output_tokens == 1


@pytest.mark.parametrize(
    ("chunks", "error"),
    [
        ([StreamChunk(final=True)], "before the first token"),
        ([TOKEN], "without the server's final event"),
        ([TOKEN, StreamChunk(error="generation: boom"), StreamChunk(final=True)], "boom"),
    ],
)
def test_recorder_failures(chunks: list[StreamChunk], error: str) -> None:
    rec = StreamRecorder(0.0, prompt_len=1, one_token_per_event=True)
    for i, chunk in enumerate(chunks):
        rec.on_chunk(chunk, float(i))
    out = rec.outcome()
    assert not out.success
    assert error in out.error


SETTINGS = GenerationSettings(output_len=6, ignore_eos=True, model="fake-model")


@pytest.mark.parametrize("backend", ["tgi", "openai-completions", "openai-chat"])
async def test_send_request_against_fake_server(fake_server, backend: str) -> None:
    url, fake = fake_server
    async with httpx.AsyncClient() as client:
        out = await send_request(
            client, url, get_backend(backend), BenchRequest("hello", 3), SETTINGS
        )
    assert out.success, out.error
    assert out.output_tokens == 6
    assert len(out.itl) == 5
    assert 0 < out.ttft <= out.latency
    assert out.prompt_len == (3 if backend == "tgi" else 7)  # OpenAI usage reports 7
    assert fake.bodies[-1].get(
        "ignore_eos", fake.bodies[-1].get("parameters", {}).get("ignore_eos")
    )


@pytest.mark.parametrize("backend", ["tgi", "openai-completions", "openai-chat"])
async def test_send_request_reports_http_errors(fake_server, backend: str) -> None:
    url, _ = fake_server
    async with httpx.AsyncClient() as client:
        out = await send_request(
            client, url, get_backend(backend), BenchRequest("FAIL", 1), SETTINGS
        )
    assert not out.success
    assert out.error.startswith("HTTP 422")
    assert "bad input" in out.error


@pytest.mark.parametrize("backend", ["tgi", "openai-completions", "openai-chat"])
async def test_send_request_flags_truncated_streams(fake_server, backend: str) -> None:
    url, _ = fake_server
    async with httpx.AsyncClient() as client:
        out = await send_request(
            client, url, get_backend(backend), BenchRequest("CUT", 1), SETTINGS
        )
    assert not out.success
    assert "final event" in out.error


async def test_send_request_reports_connection_errors() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens here
    async with httpx.AsyncClient() as client:
        out = await send_request(
            client, f"http://127.0.0.1:{port}", get_backend("tgi"), BenchRequest("x", 1), SETTINGS
        )
    assert not out.success
    assert "ConnectError" in out.error


NO_IGNORE_EOS = GenerationSettings(output_len=6, ignore_eos=False, model="fake-model")


@pytest.mark.parametrize("backend", ["openai-completions", "openai-chat"])
async def test_stream_closed_after_finish_reason_is_complete(fake_server, backend: str) -> None:
    # `transformers serve` ends the stream after the finish_reason chunk, without `[DONE]`.
    url, fake = fake_server
    fake.transformers_serve = True
    async with httpx.AsyncClient() as client:
        out = await send_request(
            client, url, get_backend(backend), BenchRequest("hello", 3), NO_IGNORE_EOS
        )
    assert out.success, out.error
    assert out.output_tokens == 6
    assert len(out.itl) == 5
    assert "ignore_eos" not in fake.bodies[-1]


@pytest.mark.parametrize("backend", ["openai-completions", "openai-chat"])
async def test_stream_closed_before_finish_reason_fails(fake_server, backend: str) -> None:
    url, fake = fake_server
    fake.transformers_serve = True
    async with httpx.AsyncClient() as client:
        out = await send_request(
            client, url, get_backend(backend), BenchRequest("CUT", 1), NO_IGNORE_EOS
        )
    assert not out.success
    assert "final event" in out.error


@pytest.mark.parametrize("backend", ["openai-completions", "openai-chat"])
async def test_server_refusing_ignore_eos_fails_the_request(fake_server, backend: str) -> None:
    url, fake = fake_server
    fake.transformers_serve = True
    async with httpx.AsyncClient() as client:
        out = await send_request(
            client, url, get_backend(backend), BenchRequest("hello", 1), SETTINGS
        )
    assert not out.success
    assert out.error.startswith("HTTP 422")
