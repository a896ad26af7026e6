"""uvicorn's HTTP/1.1 protocol with a deadline on each request's headers (slow-loris).

uvicorn closes a keep-alive connection that stays idle, but any byte re-arms that
timer, and a fresh connection has no timer at all: a client that trickles its headers
a byte at a time holds its connection (a file descriptor, buffers) for as long as it
likes. Here a connection must deliver a request's complete headers within
`header_timeout_s` of opening (or of its previous response); otherwise it is closed.
The body has its own deadline (`request_io.BODY_READ_TIMEOUT_S`, answered 408).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

HEADER_TIMEOUT_S = 30.0


class GuardedH11Protocol(H11Protocol):
    """H11Protocol that closes connections whose request headers arrive too slowly."""

    header_timeout_s = HEADER_TIMEOUT_S

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
