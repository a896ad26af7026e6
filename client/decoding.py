"""From HTTP answers to typed objects or mapped errors; shared by `Client` and `AsyncClient`."""

from __future__ import annotations

import json
from typing import Any, Generic, TypeVar

import pydantic

from textgate.client.errors import IncompleteGenerationError, UnknownError, parse_error
from textgate.client.sse import SseDecoder, SseEvent

T = TypeVar("T", bound=pydantic.BaseModel)

DONE = "[DONE]"


def is_success(status_code: int) -> bool:
    """True for 2xx answers."""
    return 200 <= status_code < 300


def error_from_body(status_code: int, body: bytes) -> Exception:
    """The mapped error for a non-2xx answer, whatever its body holds (JSON, HTML, nothing)."""
    try:
        payload: Any = json.loads(body)
    except ValueError:
        payload = body.decode("utf-8", errors="replace").strip() or f"HTTP {status_code}"
    return parse_error(status_code, payload)


def parse_body(status_code: int, body: bytes, item_type: type[T]) -> T:
    """Validate a 2xx JSON body as `item_type`, or raise the mapped error.

    A one-element list is unwrapped: TGI's `/` route answers `[response]`.
    """
    if not is_success(status_code):
        raise error_from_body(status_code, body)
    try:
        payload = json.loads(body)
    except ValueError as err:
        raise UnknownError(f"answer is not JSON: {body[:200]!r}", status_code=status_code) from err
    if isinstance(payload, list) and len(payload) == 1:
        payload = payload[0]
    return _validate(payload, item_type, status_code)


def _validate(payload: Any, item_type: type[T], status_code: int) -> T:
    if isinstance(payload, dict) and "error" in payload:
        raise parse_error(status_code, payload)
    try:
        return item_type.model_validate(payload)
    except pydantic.ValidationError as err:
        raise UnknownError(
            f"answer does not match {item_type.__name__}: {err}", status_code=status_code
        ) from err


class EventStream(Generic[T]):
    """Decodes an SSE body into `item_type` items, raising mapped errors on error events.

    A stream is complete when it has delivered its final event: `data: [DONE]` when
    `until_done` (OpenAI routes), else an item for which `item.is_final` is true (TGI's
    `/generate_stream`). `close` raises `IncompleteGenerationError` for a stream cut short.
    """

    def __init__(self, item_type: type[T], *, until_done: bool, status_code: int = 200) -> None:
        self._item_type = item_type
        self._until_done = until_done
        self._status_code = status_code
        self._sse = SseDecoder()
        self._complete = False
        self._done = False

    def feed(self, chunk: bytes) -> list[T]:
        """Items completed by this chunk of the body."""
        return self._items(self._sse.feed(chunk))

    def close(self) -> list[T]:
        """Items left at the end of the body; raises if the stream never completed."""
        items = self._items(self._sse.close())
        if not self._complete:
            raise IncompleteGenerationError(
                "the stream ended before its final event", status_code=self._status_code
            )
        return items

    def _items(self, events: list[SseEvent]) -> list[T]:
        items = []
        for event in events:
            item = self._item(event)
            if item is not None:
                items.append(item)
        return items

    def _item(self, event: SseEvent) -> T | None:
        if self._done:
            return None
        if event.data.strip() == DONE:
            # Only OpenAI streams end with [DONE]; after TGI's final event one is harmless.
            if self._until_done:
                self._complete = True
            self._done = self._complete
            return None
        try:
            payload = json.loads(event.data)
        except ValueError as err:
            raise UnknownError(
                f"stream event is not JSON: {event.data[:200]!r}", status_code=self._status_code
            ) from err
        item = _validate(payload, self._item_type, self._status_code)
        if not self._until_done and getattr(item, "is_final", False):
            self._complete = True
        return item
