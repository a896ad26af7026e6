"""uvicorn's HTTP/1.1 protocol with deadlines on each request's headers and body (slow-loris).

uvicorn closes a keep-alive connection that stays idle, but any byte re-arms that
timer, and a fresh connection has no timer at all: a client that trickles its headers
a byte at a time holds its connection (a file descriptor, buffers) for as long as it
likes. Here a connection must deliver a request's complete headers within
`header_timeout_s` of opening (or of its previous response); otherwise it is closed.
The body has its own deadline, `body_timeout_s`: the protocol hands it to the app in
each request's ASGI `state`, and `request_io.read_body` answers 408 when it passes.
`guarded_h11(header_timeout_s, body_timeout_s)` is the class uvicorn is given (`http=`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle
from uvicorn.server import ServerState

from textgate.router.http.request_io import BODY_TIMEOUT_S, BODY_TIMEOUT_STATE_KEY

HEADER_TIMEOUT_S = 30.0
"""Seconds a request's headers may take to arrive by default (`--header-timeout`)."""


class GuardedH11Protocol(H11Protocol):
    """H11Protocol that closes connections whose request headers arrive too slowly and
    tells the app how long a request's body may take."""

    header_timeout_s = HEADER_TIMEOUT_S
    body_timeout_s = BODY_TIMEOUT_S

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        # Each request's ASGI `state` starts as a copy of `app_state` (uvicorn's lifespan
        # state): the body deadline travels there to `request_io.read_body`.
        app_state = {**app_state, BODY_TIMEOUT_STATE_KEY: self.body_timeout_s}
        super().__init__(config, server_state, app_state, _loop)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def _arm_header_deadline(self) -> None:
        self.loop.call_later(self.header_timeout_s, self._close_if_no_request, self.cycle)

    def _close_if_no_request(self, armed_at: RequestResponseCycle | None) -> None:
        """Close the connection when no new request's headers arrived since `armed_at`."""
        waiting = armed_at is None or armed_at.response_complete
        if self.cycle is armed_at and waiting and not self.transport.is_closing():
            self.transport.close()


def guarded_h11(
    header_timeout_s: float = HEADER_TIMEOUT_S, body_timeout_s: float = BODY_TIMEOUT_S
) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn's `http=` with these deadlines (seconds, > 0)."""
    for name, value in (("header_timeout_s", header_timeout_s), ("body_timeout_s", body_timeout_s)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    attributes = {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s}
    return type(GuardedH11Protocol.__name__, (GuardedH11Protocol,), attributes)
