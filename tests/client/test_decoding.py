from __future__ import annotations

import json

import pytest

from textgate.client.decoding import EventStream, error_from_body, parse_body
from textgate.client.errors import (
    GenerationError,
    IncompleteGenerationError,
    OverloadedError,
    UnknownError,
    ValidationError,
)
from textgate.client.openai_types import Completion
from textgate.client.types import Response, StreamResponse

TOKEN = {"id": 5, "text": " a", "logprob": -0.1, "special": False}
ANSWER = {
    "generated_text": " a",
    "details": {"finish_reason": "length", "generated_tokens": 1, "prefill": [], "tokens": [TOKEN]},
}
COMPLETION = {"id": "", "created": 1, "model": "m", "choices": [{"index": 0, "text": "x"}]}


def sse(payload: object) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def test_parse_body_object_and_compat_list() -> None:
    assert parse_body(200, json.dumps(ANSWER).encode(), Response).generated_text == " a"
    assert parse_body(200, json.dumps([ANSWER]).encode(), Response).generated_text == " a"


def test_parse_body_errors() -> None:
    with pytest.raises(OverloadedError, match="busy"):
        parse_body(429, b'{"error": "busy", "error_type": "overloaded"}', Response)
    with pytest.raises(UnknownError, match="not JSON"):
        parse_body(200, b"<html>", Response)
    with pytest.raises(UnknownError, match="does not match Response"):
        parse_body(200, b'{"generated_text": 3}', Response)


def test_error_from_body_without_json() -> None:
    assert str(error_from_body(500, b"")) == "HTTP 500"
    assert str(error_from_body(502, b"  bad gateway \n")) == "bad gateway"


def test_tgi_stream_completes_on_final_event() -> None:
    stream = EventStream(StreamResponse, until_done=False)
    first = {"index": 1, "token": TOKEN}
    final = {**first, "index": 2, "generated_text": " a a", "details": ANSWER["details"]}
    items = stream.feed(sse(first) + sse(final)[:10]) + stream.feed(sse(final)[10:])
    items += stream.close()
    assert [item.is_final for item in items] == [False, True]


def test_tgi_stream_without_final_event_is_incomplete() -> None:
    stream = EventStream(StreamResponse, until_done=False)
    assert len(stream.feed(sse({"index": 1, "token": TOKEN}) + b"data: [DONE]\n\n")) == 1
    with pytest.raises(IncompleteGenerationError):
        stream.close()


@pytest.mark.parametrize("until_done", [True, False])
def test_error_event_raises_mapped_error(until_done: bool) -> None:
    stream = EventStream(StreamResponse, until_done=until_done)
    stream.feed(sse({"index": 1, "token": TOKEN}))
    with pytest.raises(GenerationError, match="boom") as caught:
        stream.feed(sse({"error": "boom", "error_type": "generation"}))
    assert caught.value.status_code == 200


def test_openai_error_event() -> None:
    stream = EventStream(Completion, until_done=True)
    with pytest.raises(ValidationError, match="too long"):
        stream.feed(sse({"error": {"message": "too long", "type": "validation"}}))


def test_openai_stream_needs_done_and_ignores_what_follows() -> None:
    stream = EventStream(Completion, until_done=True)
    assert len(stream.feed(sse(COMPLETION) + b"data: [DONE]\n\n" + sse({"junk": 1}))) == 1
    assert stream.close() == []
    cut = EventStream(Completion, until_done=True)
    cut.feed(sse(COMPLETION))
    with pytest.raises(IncompleteGenerationError, match="before its final event"):
        cut.close()


def test_malformed_event() -> None:
    stream = EventStream(Completion, until_done=True)
    with pytest.raises(UnknownError, match="not JSON"):
        stream.feed(b"data: {oops\n\n")
