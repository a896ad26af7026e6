"""One log line per HTTP request: route, status, time, and what generation did.

Handlers never log requests themselves: the middleware opens a `RequestRecord` for the
request's task, the metrics calls the pipeline already makes fill it (tokens in and
out, queue and inference time, failure), and the line is written once the response's
last byte is sent — after the stream, for SSE. Probes and scrapes log at DEBUG only.
With `--audit-log` the same moment writes the request's audit line (router/http/audit_log.py),
for every request but probes, scrapes and other GETs.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from textgate.router.http.audit_log import AuditLog
from textgate.router.request_record import (
    QUIET_PATHS,
    RequestRecord,
    end_request_record,
    start_request_record,
)

log = logging.getLogger("textgate.router.access")


class AccessLogMiddleware:
    """Logs `METHOD path status seconds` plus the request's generation facts, and gives
    `audit` (if any) the request's audit line; `model_id` is the served model's name."""

    def __init__(self, app: ASGIApp, audit: AuditLog | None = None, model_id: str = "") -> None:
        self._app = app
        self._audit = audit
        self._model_id = model_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        started = time.monotonic()
        record, token = start_request_record()
        status = 500
        logged = False

        def write() -> None:
            nonlocal logged
            if logged:
                return
            logged = True
            method, path = scope.get("method", ""), scope.get("path", "")
            fields = {"method": method, "path": path, "status": status}
            fields["duration_s"] = round(time.monotonic() - started, 4)
            fields.update(record.fields())
            quiet = path in QUIET_PATHS or path.startswith("/docs") or method in ("GET", "HEAD")
            facts = " ".join(f"{k}={_short(v)}" for k, v in record.fields().items())
            log.log(
                logging.DEBUG if quiet and status < 400 else logging.INFO,
                "%s %s %d %.3fs%s",
                method,
                path,
                status,
                fields["duration_s"],
                f" {facts}" if facts else "",
                extra={"request": fields},
            )
            if self._audit is not None and not quiet:
                entry = audit_entry(scope, status, fields["duration_s"], record, self._model_id)
                self._audit.write(entry)

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                write()

        try:
            await self._app(scope, receive, send_and_watch)
        finally:
            write()  # a client that left, or an error before the last byte
            end_request_record(token)


def _short(value: object) -> str:
    return f"{value:.3f}s" if isinstance(value, float) else str(value)


def audit_entry(
    scope: Scope, status: int, duration_s: float, record: RequestRecord, model_id: str
) -> dict[str, Any]:
    """The audit log's fields of one request (None ones are left out by the writer)."""
    headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
    request_id = next((v.decode("latin-1") for k, v in headers if k == b"x-request-id"), None)
    outputs = record.outputs
    return {
        "tenant": record.tenant,
        "method": scope.get("method", ""),
        "route": scope.get("path", ""),
        "model": model_id,
        "adapter": record.adapter,
        "prompt_tokens": record.input_tokens,
        "generated_tokens": record.generated_tokens,
        "status": status,
        "latency_ms": round(duration_s * 1000, 1),
        "finish_reason": record.finish_reason,
        "error_type": record.error_type,
        "cancelled": record.cancelled,
        "request_id": request_id,
        "prompt": record.prompt,
        "output": (outputs[0] if len(outputs) == 1 else outputs) if outputs else None,
    }
