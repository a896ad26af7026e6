from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from textgate.client.sse import SseDecoder, SseEvent

BODY = (
    ": keep-alive\n\n"
    'data: {"token": "h\u00e9llo \u2603"}\n\n'
    "event: custom\r\nid: 7\r\ndata: first\r\ndata:second\r\n\r\n"
    "retry: 100\rdata: cr only\r\r"
    "data: [DONE]\n\n"
).encode()

EXPECTED = [
    SseEvent('{"token": "h\u00e9llo \u2603"}'),
    SseEvent("first\nsecond", "custom", "7"),
    SseEvent("cr only", "message", "7"),
    SseEvent("[DONE]", "message", "7"),
]


def decode(chunks: list[bytes]) -> list[SseEvent]:
    decoder = SseDecoder()
    events = [event for chunk in chunks for event in decoder.feed(chunk)]
    return events + decoder.close()


def test_whole_body() -> None:
    assert decode([BODY]) == EXPECTED


def test_one_byte_at_a_time() -> None:
    # Splits land inside CRLF pairs and inside multi-byte UTF-8 characters.
    assert decode([BODY[i : i + 1] for i in range(len(BODY))]) == EXPECTED


@given(st.lists(st.integers(min_value=0, max_value=len(BODY)), max_size=12))
def test_any_split(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(BODY)]
    chunks = [BODY[a:b] for a, b in itertools.pairwise(bounds)]
    assert decode(chunks) == EXPECTED


def test_comments_and_empty_events_dispatch_nothing() -> None:
    assert decode([b": ping\n\n: ping\n\n\n\nevent: x\n\n"]) == []


def test_last_event_without_blank_line_is_kept() -> None:
    assert decode([b"data: a\n\ndata: b"]) == [SseEvent("a"), SseEvent("b")]
    assert decode([b"data: a\r"]) == [SseEvent("a")]


def test_byte_order_mark_and_single_space_strip() -> None:
    assert decode(["\ufeffdata:  two spaces\n\n".encode()]) == [SseEvent(" two spaces")]


def test_field_without_colon_and_empty_data() -> None:
    assert decode([b"data\n\n"]) == [SseEvent("")]
