"""One log line per HTTP request: route, status, time, and what generation did.

Handlers never log requests themselves: the middleware opens a `RequestRecord` for the
request's task, the metrics calls the pipeline already makes fill it (tokens in and
out, queue and inference time, failure), and the line is written once the response's
last byte is sent — after the stream, for SSE. Probes and scrapes log at DEBUG only.
"""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from textgate.router.request_record import QUIET_PATHS, end_request_record, start_request_record

log = logging.getLogger("textgate.router.access")


class AccessLogMiddleware:
    """Logs `METHOD path status seconds` plus the request's generation facts."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

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
