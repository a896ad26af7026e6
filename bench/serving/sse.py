"""Server-sent events: turn a stream of lines into the `data` payloads of its events.

Only what TGI and OpenAI-style servers send is needed: `data:` fields (joined with a
newline when an event has several), comments (`:` lines, used as keep-alive pings) and
other fields ignored, an event dispatched at the blank line that ends it. A last event
without its blank line (a server that closes right after writing it) is still delivered
by `flush`.
"""

from __future__ import annotations


class SseParser:
    """Feed lines (without their line terminator); collect completed events' data."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """Consume one line; return the event's data when this line completes an event."""
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            # The spec strips exactly one space after the colon.
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        """The data of an event left open when the stream ended, if any."""
        return self._dispatch()

    def _dispatch(self) -> str | None:
        if not self._data:
            return None
        data = "\n".join(self._data)
        self._data = []
        return data
