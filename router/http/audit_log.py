"""The audit log: one JSON line per finished request, of who used what (`--audit-log`).

Each line says when the request ended (ISO 8601, UTC), its tenant, route, model or adapter,
its tokens in and out, its status, its latency and, where known, its finish reason and the
client's `x-request-id`. The prompt and the output are left out unless asked for
(`--audit-log-content`). Lines are written off the event loop: `write` only puts the line
on a bounded queue, and a `logging.handlers.QueueListener` thread appends it to a
`RotatingFileHandler` (rotated past `max_bytes`, `backups` old files kept). A line that
cannot be written (a full queue, a disk error, an unwritable path) is dropped with one
warning: auditing never fails a request.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Mapping
from datetime import UTC, datetime
from logging.handlers import QueueListener, RotatingFileHandler
from typing import Any

log = logging.getLogger("textgate.router.audit")

DEFAULT_MAX_BYTES = 100 * 1024 * 1024
"""`--audit-log-max-bytes`' default: 100 MiB per file."""
BACKUPS = 5
"""Rotated files kept beside the current one (PATH.1 ... PATH.5)."""
MAX_QUEUED_LINES = 10_000
"""Lines waiting for the writer thread; past it new lines are dropped (and warned of)."""
TEXT_FIELDS = ("prompt", "output")
"""The fields only `--audit-log-content` writes."""


class _Warned:
    """Logs its warning the first time only (from any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False

    def __call__(self, message: str, *args: object) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        log.warning(message, *args)


class _AuditFileHandler(RotatingFileHandler):
    """A rotating file whose write errors are one warning, not a traceback per line."""

    def __init__(self, path: str, max_bytes: int, backups: int, warn: _Warned) -> None:
        # delay: the file opens at the first line, in the writer thread, so an unwritable
        # path is an error there (warned), not at startup.
        super().__init__(path, maxBytes=max_bytes, backupCount=backups, delay=True)
        self._warn = warn

    def handleError(self, record: logging.LogRecord) -> None:
        self._warn("Audit log lines are being dropped: cannot write %s", self.baseFilename)


class AuditLog:
    """Appends one JSON line per request to `path`, from a thread of its own."""

    def __init__(
        self,
        path: str,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        backups: int = BACKUPS,
        content: bool = False,
    ) -> None:
        if max_bytes < 1:
            raise ValueError(f"audit log max_bytes must be >= 1, got {max_bytes}")
        self.path = path
        self.content = content
        """Write the prompt and output text too."""
        self._warn = _Warned()
        self._queue: queue.Queue[logging.LogRecord] = queue.Queue(MAX_QUEUED_LINES)
        self._handler = _AuditFileHandler(path, max_bytes, backups, self._warn)
        self._listener = QueueListener(self._queue, self._handler)
        self._started = False

    def start(self) -> None:
        """Start the writer thread (lines written before it wait in the queue)."""
        if not self._started:
            self._listener.start()
            self._started = True

    def close(self) -> None:
        """Write what is queued, then stop the thread and close the file."""
        if self._started:
            self._listener.stop()
            self._started = False
        self._handler.close()

    def write(self, entry: Mapping[str, Any]) -> None:
        """Queue one request's line; never blocks, never raises."""
        fields = {"time": datetime.now(UTC).isoformat(timespec="milliseconds")}
        fields.update(
            (k, v)
            for k, v in entry.items()
            if v is not None and (self.content or k not in TEXT_FIELDS)
        )
        line = json.dumps(fields, ensure_ascii=False, default=str)
        try:
            self._queue.put_nowait(logging.makeLogRecord({"msg": line, "levelno": logging.INFO}))
        except queue.Full:
            self._warn(
                "Audit log lines are being dropped: its writer is %d lines behind", MAX_QUEUED_LINES
            )
