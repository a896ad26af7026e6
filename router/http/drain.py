"""Graceful drain: on SIGTERM stop admitting, let what runs finish, then exit.

On the first SIGTERM (or SIGINT) the router keeps its socket open but answers 503 with
TGI's error body to `/health` (so Kubernetes' readiness probe and load balancers take it
out of rotation) and to every new request but `/metrics` and `/info`; requests already
admitted, streams included, run to their end. Once none is left, or after
`--graceful-termination-timeout` seconds, uvicorn is told to exit. At the timeout the
engine is closed first, so each stream still open ends with a final error event instead
of a cut connection. A second SIGINT exits at once (uvicorn's force exit).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from textgate.router.http.errors import error_api, error_response

log = logging.getLogger("textgate.router")

SHUTTING_DOWN = "shutting_down"
"""The `error_type` of the 503 a draining router answers."""
# Routes that keep answering while draining: scrapers still read the last numbers.
OPEN_WHILE_DRAINING = frozenset({"/metrics", "/info"})
# Requests that do not hold the drain open (probes and scrapes end at once anyway).
UNCOUNTED = frozenset({"/health", "/ping", "/metrics", "/info"})
# After the timeout closed the engine: time for the streams to write their final event.
FINAL_EVENT_GRACE_S = 5.0


class Drain:
    """Whether the router is draining, and how many requests it is still serving."""

    def __init__(self) -> None:
        self.draining = False
        self._num_active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_active(self) -> int:
        """Requests admitted and not yet answered in full (probes and scrapes aside)."""
        return self._num_active

    def begin(self) -> None:
        self.draining = True

    def enter(self) -> None:
        self._num_active += 1
        self._idle.clear()

    def leave(self) -> None:
        self._num_active -= 1
        if self._num_active == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Until no request is active (True), or `timeout_s` passed (False)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True


class DrainMiddleware:
    """Answers 503 `shutting_down` to new requests while draining; counts active ones."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self._app = app
        self._drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        path = scope.get("path", "")
        if self._drain.draining and path not in OPEN_WHILE_DRAINING:
            response = error_response(
                "The server is shutting down", SHUTTING_DOWN, 503, api=error_api(path)
            )
            await response(scope, receive, send)
            return
        if path in UNCOUNTED:
            await self._app(scope, receive, send)
            return
        self._drain.enter()
        try:
            await self._app(scope, receive, send)
        finally:
            self._drain.leave()


class DrainingServer(uvicorn.Server):
    """uvicorn, whose first exit signal drains (`Drain`) before it stops serving."""

    def __init__(
        self,
        config: uvicorn.Config,
        drain: Drain,
        timeout_s: float,
        end_requests: Callable[[], Awaitable[Any]],
    ) -> None:
        """`end_requests` gives every request still running its final event (the engine's
        close); it runs when `timeout_s` passes with requests left."""
        super().__init__(config)
        self.drain = drain
        self.timeout_s = timeout_s
        self._end_requests = end_requests
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.drain.draining and sig == signal.SIGINT:
            # Ctrl-C again: exit now, the requests still running are cut.
            self.should_exit = self.force_exit = True
            return
        # Before serving there is nothing to drain; a second SIGTERM is uvicorn's to handle.
        if self.drain.draining or not self.started or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self.drain.begin()
        # A signal handler runs between the loop's callbacks: schedule, do not run, the drain.
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._run_drain())

    async def _run_drain(self) -> None:
        log.info(
            "Draining: %d requests in flight get up to %.0fs to finish; new ones get 503",
            self.drain.num_active,
            self.timeout_s,
        )
        if not await self.drain.wait_idle(self.timeout_s):
            log.warning(
                "Drain timeout: ending the %d requests still in flight", self.drain.num_active
            )
            await self._end_requests()
            await self.drain.wait_idle(FINAL_EVENT_GRACE_S)
        log.info("Drained")
        self.should_exit = True
