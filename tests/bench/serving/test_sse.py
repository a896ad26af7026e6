from __future__ import annotations

from textgate.bench.serving.sse import SseParser


def feed_all(lines: list[str]) -> list[str]:
    parser = SseParser()
    events = [d for d in map(parser.feed, lines) if d is not None]
    tail = parser.flush()
    return [*events, tail] if tail is not None else events


def test_events_end_at_blank_lines() -> None:
    assert feed_all(['data: {"a": 1}', "", 'data: {"b": 2}', ""]) == ['{"a": 1}', '{"b": 2}']


def test_comments_and_other_fields_are_ignored() -> None:
    lines = [": ping", "event: message", "id: 3", "data: x", "", ":keep-alive", ""]
    assert feed_all(lines) == ["x"]


def test_multiline_data_is_joined_with_newlines() -> None:
    assert feed_all(["data: a", "data: b", ""]) == ["a\nb"]


def test_only_one_leading_space_is_stripped() -> None:
    assert feed_all(["data:x", "", "data:  y", ""]) == ["x", " y"]


def test_an_unterminated_last_event_is_flushed() -> None:
    assert feed_all(["data: a", "", "data: [DONE]"]) == ["a", "[DONE]"]


def test_blank_lines_without_data_dispatch_nothing() -> None:
    assert feed_all(["", "", ""]) == []
