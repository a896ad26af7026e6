"""The router's spans: one per HTTP request, one per engine step, carried to the shards.

A trace of one generation request reads::

    POST /generate_stream            SERVER span, child of the caller's W3C `traceparent`
    ├── validation                   received -> admitted (parse, tokenize, check)
    ├── queue                        admitted -> first step that computes it
    └── inference                    first step -> final token (tokens, finish reason)

    step (prefill | decode)          one per engine step, linked to every request it serves
    └── shard Step / Prefill / ...   each shard's span (shard_server/tracing.py)
        ├── forward
        └── decode

A step serves many requests and a request spans many steps, so steps are not children of
requests: each step is a root span with a link to every request it computes, which is how
TGI and vLLM draw a batch. The request's children are placed from the times its channel
and the engine recorded, when it ends; nothing is added to a step but the one span.

Tracing is off until `install` gets a tracer provider (the router's `serve` installs one
for `--otlp-endpoint`): every hook then returns at its first line, and `_tracer` is the
one switch. It is module state rather than OpenTelemetry's global provider, which can be
set once per process; tests install an in-memory exporter and remove it again.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from textgate.router.request_record import QUIET_PATHS
from textgate.router.request_record import current_request as current_record
from textgate.telemetry import WallClock, extract, inject

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

TRACER_NAME = "textgate.router"

_tracer: trace.Tracer | None = None
_current: ContextVar[RequestTrace | None] = ContextVar("textgate_trace", default=None)


def install(provider: trace.TracerProvider | None) -> None:
    """Trace with `provider` from now on; None turns tracing off."""
    global _tracer
    _tracer = None if provider is None else provider.get_tracer(TRACER_NAME)


def enabled() -> bool:
    return _tracer is not None


class Timed(Protocol):
    """What a request's channel knows of its times (router.engine.channel.Channel)."""

    @property
    def queued_at(self) -> float: ...

    @property
    def started_at(self) -> float | None: ...


class Done(Protocol):
    """How a request finished (router.engine.channel.Finished)."""

    @property
    def generated_tokens(self) -> int: ...

    @property
    def finish_reason(self) -> str: ...


@dataclass
class Outcome:
    """How one engine request (one best_of candidate) of an HTTP request went."""

    queued_at: float
    started_at: float | None
    ended_at: float
    input_tokens: int
    generated_tokens: int | None = None
    finish_reason: str | None = None
    error_type: str | None = None
    error: str | None = None


@dataclass(eq=False)
class RequestTrace:
    """The span of one HTTP request, and what the engine recorded for it."""

    span: trace.Span
    received_at: float = field(default_factory=time.monotonic)
    clock: WallClock = field(default_factory=WallClock)
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def span_context(self) -> trace.SpanContext:
        return self.span.get_span_context()

    def finished(self, channel: Timed, input_tokens: int, done: Done) -> None:
        """The engine routed the request's final token (`done`)."""
        self.outcomes.append(
            Outcome(
                channel.queued_at,
                channel.started_at,
                time.monotonic(),
                input_tokens,
                generated_tokens=done.generated_tokens,
                finish_reason=done.finish_reason,
            )
        )

    def failed(self, channel: Timed, input_tokens: int, message: str, error_type: str) -> None:
        """The engine ended the request with an error event."""
        self.outcomes.append(
            Outcome(
                channel.queued_at,
                channel.started_at,
                time.monotonic(),
                input_tokens,
                error_type=error_type,
                error=message,
            )
        )

    def end(self, status: int, record: Mapping[str, Any]) -> None:
        """Close the span once the response's last byte is out: its attributes, the
        children placed from the recorded times, and an error status for 4xx/5xx."""
        assert _tracer is not None
        span = self.span
        span.set_attribute("http.response.status_code", status)
        keys = (
            "input_tokens",
            "max_new_tokens",
            "generated_tokens",
            "cancelled",
            "adapter",
            "tenant",
        )
        for key in keys:
            if key in record:
                span.set_attribute(f"textgate.{key}", record[key])
        error_type = record.get("error_type")
        for outcome in self.outcomes:
            self._children(_tracer, outcome)
            error_type = error_type or outcome.error_type
        reasons = [o.finish_reason for o in self.outcomes if o.finish_reason]
        if reasons:
            span.set_attribute("textgate.finish_reason", reasons[-1])
        if error_type is not None:
            span.set_attribute("error.type", str(error_type))
        if status >= 500 or error_type is not None:
            span.set_status(Status(StatusCode.ERROR, str(error_type or status)))
        span.end()

    def _children(self, tracer: trace.Tracer, outcome: Outcome) -> None:
        parent = trace.set_span_in_context(self.span)
        at = self.clock.from_monotonic
        started = outcome.started_at if outcome.started_at is not None else outcome.ended_at
        validation = tracer.start_span(
            "validation", parent, start_time=at(self.received_at), attributes=_validation(outcome)
        )
        validation.end(end_time=at(outcome.queued_at))
        tracer.start_span("queue", parent, start_time=at(outcome.queued_at)).end(
            end_time=at(started)
        )
        if outcome.started_at is None:
            return  # failed or cancelled before it reached the shards
        inference = tracer.start_span(
            "inference", parent, start_time=at(started), attributes=_inference(outcome)
        )
        if outcome.error_type is not None:
            inference.set_status(Status(StatusCode.ERROR, outcome.error or outcome.error_type))
        inference.end(end_time=at(outcome.ended_at))


def _validation(outcome: Outcome) -> dict[str, Any]:
    return {"textgate.input_tokens": outcome.input_tokens}


def _inference(outcome: Outcome) -> dict[str, Any]:
    attributes: dict[str, Any] = {"textgate.input_tokens": outcome.input_tokens}
    if outcome.generated_tokens is not None:
        attributes["textgate.generated_tokens"] = outcome.generated_tokens
    if outcome.finish_reason is not None:
        attributes["textgate.finish_reason"] = outcome.finish_reason
    if outcome.error_type is not None:
        attributes["error.type"] = outcome.error_type
    return attributes


def current_request() -> RequestTrace | None:
    """The trace of the HTTP request this task serves (None when tracing is off)."""
    return _current.get()


class TracingMiddleware:
    """Opens each HTTP request's span (a child of its `traceparent`, if any) and closes it
    after the response's last byte; a pass-through while tracing is off."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracer = _tracer
        path = scope.get("path", "")
        # Probes and scrapes come every few seconds and say nothing about a request.
        if tracer is None or scope["type"] != "http" or path in QUIET_PATHS:
            await self._app(scope, receive, send)
            return
        method = scope.get("method", "")
        span = tracer.start_span(
            f"{method} {path}",
            extract(scope.get("headers", [])),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path},
        )
        request = RequestTrace(span)
        token = _current.set(request)
        status = 500

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            with trace.use_span(span, end_on_exit=False, record_exception=True):
                await self._app(scope, receive, send_and_watch)
        finally:
            _current.reset(token)
            record = current_record()
            request.end(status, record.fields() if record is not None else {})


@contextlib.contextmanager
def step_span(method: str, requests: Iterable[RequestTrace | None]) -> Iterator[None]:
    """The span of one engine step (`method`: prefill or decode), linked to the requests
    it serves, current while the step's RPCs run so that they carry it to the shards."""
    tracer = _tracer
    if tracer is None:
        yield
        return
    links = [Link(r.span_context) for r in requests if r is not None]
    # A root span: the engine's task may carry the context of whichever request started it.
    span = tracer.start_span(
        method,
        Context(),
        kind=SpanKind.CLIENT,
        links=links,
        attributes={"textgate.batch_size": len(links)},
    )
    with trace.use_span(span, end_on_exit=True, record_exception=True):
        yield


def grpc_metadata() -> list[tuple[str, str]] | None:
    """The current step's trace context for a shard call's metadata; None when off."""
    if _tracer is None:
        return None
    return inject() or None
