"""The router's access-log record: what one request did, filled while it runs.

The log format itself is every process's: `textgate.logs`.
"""

from __future__ import annotations

import dataclasses
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import Any

QUIET_PATHS = frozenset({"/health", "/ping", "/metrics", "/info", "/favicon.ico"})
"""Probe and scrape routes: their access-log lines are debug-level and they get no span."""


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
    adapter: str | None = None
    """The LoRA adapter it ran with; None: the base model."""
    tenant: str | None = None
    """The tenant of its API key; None: no keys are required."""
    finish_reason: str | None = None
    """Why its (last) generation ended: stop, length, ..."""
    prompt: str | None = field(default=None, metadata={"text": True})
    """Its prompt text, for the audit log's `--audit-log-content` only (never logged here)."""
    outputs: list[str] = field(default_factory=list, metadata={"text": True})
    """The text each of its generations ended with, likewise for the audit log only."""

    def fields(self) -> dict[str, Any]:
        """The facts known, without the unset ones (nor the prompt and output text)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None and not f.metadata.get("text")
        }


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
