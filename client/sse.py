"""Incremental Server-Sent Events decoding, fed with byte chunks cut anywhere.

Follows the WHATWG event-stream rules: lines end with CRLF, LF or CR; a blank line
dispatches the event; `data` lines of one event are joined with `\\n`; lines starting
with `:` are comments (keep-alives); one space after the field's colon is dropped.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass

_LINE_END = re.compile(r"\r\n|\r|\n")
_BOM = "\ufeff"


@dataclass(frozen=True)
class SseEvent:
    """One dispatched event."""

    data: str
    event: str = "message"
    id: str | None = None


class SseDecoder:
    """Turns arbitrary chunks of an event-stream body into `SseEvent`s.

    Chunk boundaries may fall inside a line, a CRLF pair or a multi-byte UTF-8 character.
    """

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buffer = ""
        self._started = False
        self._data: list[str] = []
        self._event = ""
        self._last_id: str | None = None

    def feed(self, chunk: bytes) -> list[SseEvent]:
        """Decode one chunk; return the events it completes."""
        return self._consume(self._utf8.decode(chunk), final=False)

    def close(self) -> list[SseEvent]:
        """End of the body: return what is left, including a last event with no blank line.

        The spec drops such an unterminated event; a client loses nothing by keeping it,
        and a proxy that trims the trailing blank line would otherwise eat the final token.
        """
        events = self._consume(self._utf8.decode(b"", final=True), final=True)
        if self._buffer:
            events.extend(self._process_line(self._buffer))
            self._buffer = ""
        events.extend(self._process_line(""))
        return events

    def _consume(self, text: str, *, final: bool) -> list[SseEvent]:
        if not self._started and text:
            self._started = True
            text = text.removeprefix(_BOM)
        self._buffer += text
        events: list[SseEvent] = []
        pos = 0
        while match := _LINE_END.search(self._buffer, pos):
            # A CR at the very end may be the first half of a CRLF split across chunks.
            if match.group() == "\r" and match.end() == len(self._buffer) and not final:
                break
            events.extend(self._process_line(self._buffer[pos : match.start()]))
            pos = match.end()
        self._buffer = self._buffer[pos:]
        return events

    def _process_line(self, line: str) -> list[SseEvent]:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return []
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id" and "\0" not in value:
            self._last_id = value
        return []

    def _dispatch(self) -> list[SseEvent]:
        if not self._data:
            self._event = ""
            return []
        event = SseEvent("\n".join(self._data), self._event or "message", self._last_id)
        self._data = []
        self._event = ""
        return [event]
