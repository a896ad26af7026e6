"""Logging for the router process: text lines, or JSON lines with `--json-output`."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from contextvars import ContextVar, Token
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any


class JsonFormatter(logging.Formatter):
    """One JSON object per line: timestamp, level, target (logger name), message, and the
    access log's `request` fields when the record carries them."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "timestamp": datetime.fromtimestamp(record.created, timezone.utc).isoformat(),
            "level": record.levelname,
            "target": record.name,
            "message": record.getMessage(),
        }
        request = getattr(record, "request", None)
        if isinstance(request, dict):
            line["request"] = request
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


def setup_logging(json_output: bool, level: int = logging.INFO) -> None:
    """Route every logger (uvicorn's included) to stderr in the chosen format."""
    handler = logging.StreamHandler(sys.stderr)
    if json_output:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


@dataclass
class RequestRecord:
    """What one HTTP request did, filled while it runs; the access log's line."""

    input_tokens: int | None = None
    max_new_tokens: int | None = None
    generated_tokens: int | None = None
    queue_s: float | None = None
    inference_s: float | None = None
    error_type: str | None = None
    cancelled: str | None = None

    def fields(self) -> dict[str, Any]:
        """The facts known, without the unset ones."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


_current: ContextVar[RequestRecord | None] = ContextVar("textgate_request", default=None)


def start_request_record() -> tuple[RequestRecord, Token[RequestRecord | None]]:
    """A new record for the request the current task serves; `end_request_record` resets."""
    record = RequestRecord()
    return record, _current.set(record)


def end_request_record(token: Token[RequestRecord | None]) -> None:
    _current.reset(token)


def current_request() -> RequestRecord | None:
    """The record of the request this task (or the stream it spawned) serves, if any."""
    return _current.get()
