"""OpenTelemetry plumbing the router and the shards share: the OTLP exporter, the W3C
trace-context carrier for their gRPC hop, and wall-clock times for spans placed after
the fact.

Tracing is off unless a process is given a collector endpoint (`--otlp-endpoint`): no
SDK object exists then, and the span hooks return at their first line. When it is on,
spans leave through a `BatchSpanProcessor` (a bounded queue drained by a background
thread, so a request never waits for the collector) and an OTLP/gRPC exporter with a
short timeout; a collector that is down only costs that thread its retries, and the
spans that do not fit the queue are dropped. Failed exports are logged once a minute,
not once a batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

log = logging.getLogger("textgate.telemetry")

EXPORT_TIMEOUT_S = 2.0
"""One export's deadline, retries included (the exporter's default is 10 s)."""
MAX_QUEUE_SIZE = 8192
"""Spans waiting for export; beyond it new spans are dropped rather than held."""
SHUTDOWN_TIMEOUT_S = 3.0
"""What flushing the last spans may add to a process's exit."""
FAILURE_LOG_INTERVAL_S = 60.0

_PROPAGATOR = TraceContextTextMapPropagator()


Install = Callable[["TracerProvider | None"], None]
"""A process's tracing hook: trace with this provider from now on (None: stop tracing)."""


def _nothing_installed(_: TracerProvider | None) -> None:
    pass


@dataclass
class Telemetry:
    """One process's tracer provider and the processor that exports its spans."""

    provider: TracerProvider
    processor: BatchSpanProcessor
    install: Install = field(default=_nothing_installed)
    """Where the provider was installed (`start_tracing`); `stop_tracing` uninstalls it."""

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Export what is queued, for at most `timeout_s`, and stop the export thread.

        The SDK's own shutdown may wait 30 s; it runs in a daemon thread that is given
        `timeout_s` (the export thread is a daemon too: neither holds the exit)."""
        flush = threading.Thread(target=self.processor.shutdown, name="otel-flush", daemon=True)
        flush.start()
        flush.join(timeout_s)


def start_otlp(endpoint: str, service_name: str, **attributes: str) -> Telemetry:
    """Spans of this process go to the OTLP/gRPC collector at `endpoint` (http:// =
    plaintext, https:// = TLS) as `service_name`; `attributes` join the resource."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # The exporter logs every failed batch; _RateLimitedExporter says it once a minute.
    logging.getLogger("opentelemetry.exporter.otlp.proto.grpc.exporter").setLevel(logging.CRITICAL)
    exporter = OTLPSpanExporter(
        endpoint=endpoint, insecure=endpoint.startswith("http://"), timeout=EXPORT_TIMEOUT_S
    )
    processor = BatchSpanProcessor(
        _RateLimitedExporter(exporter, endpoint),
        max_queue_size=MAX_QUEUE_SIZE,
        export_timeout_millis=EXPORT_TIMEOUT_S * 1000,
    )
    resource = Resource.create({"service.name": service_name, **attributes})
    # No atexit hook: the SDK's would wait up to 30 s for a collector that is down.
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(processor)
    log.info("Tracing to %s as %s", endpoint, service_name)
    return Telemetry(provider, processor)


def start_tracing(
    endpoint: str | None, service_name: str, install: Install, **attributes: str
) -> Telemetry | None:
    """Export this process's spans to `endpoint` and `install` the provider (the router's
    or the shard's tracing module); with no endpoint, tracing stays off (None)."""
    if endpoint is None:
        return None
    telemetry = start_otlp(endpoint, service_name, **attributes)
    telemetry.install = install
    install(telemetry.provider)
    return telemetry


def stop_tracing(telemetry: Telemetry | None) -> None:
    """Turn tracing off and flush the last spans (bounded: SHUTDOWN_TIMEOUT_S)."""
    if telemetry is None:
        return
    telemetry.install(None)
    telemetry.shutdown()


class _RateLimitedExporter:
    """An exporter that logs its failures at most once per FAILURE_LOG_INTERVAL_S."""

    def __init__(self, exporter: SpanExporter, endpoint: str) -> None:
        self._exporter = exporter
        self._endpoint = endpoint
        self._last_logged = -FAILURE_LOG_INTERVAL_S

    def export(self, spans: Sequence[ReadableSpan]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        try:
            result = self._exporter.export(spans)
        except Exception as exc:
            result, reason = SpanExportResult.FAILURE, f"{type(exc).__name__}: {exc}"
        else:
            reason = "the collector did not accept them"
        if result is not SpanExportResult.SUCCESS:
            now = time.monotonic()
            if now - self._last_logged >= FAILURE_LOG_INTERVAL_S:
                self._last_logged = now
                log.warning(
                    "Dropped %d spans: export to %s failed (%s); said once a minute",
                    len(spans),
                    self._endpoint,
                    reason,
                )
        return result

    def shutdown(self, timeout_millis: float = 30_000) -> None:
        self._exporter.shutdown(timeout_millis=timeout_millis)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return bool(self._exporter.force_flush(timeout_millis))


def inject(context: Context | None = None) -> list[tuple[str, str]]:
    """The W3C `traceparent` (and `tracestate`) of `context` (default: the current one) as
    gRPC metadata; empty when there is no span to carry."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return list(carrier.items())


def extract(headers: Iterable[tuple[str | bytes, str | bytes]]) -> Context:
    """The parent context carried by W3C headers (ASGI's are bytes) or gRPC metadata (an
    empty context if none)."""
    carrier: dict[str, str] = {}
    for key, value in headers:
        name = (key.decode("latin-1") if isinstance(key, bytes) else key).lower()
        if name in ("traceparent", "tracestate"):
            carrier[name] = value.decode("latin-1") if isinstance(value, bytes) else value
    return _PROPAGATOR.extract(carrier)


class WallClock:
    """Converts `time.monotonic()` readings into the epoch nanoseconds spans take, for
    spans placed after the fact from recorded times."""

    def __init__(self) -> None:
        self._monotonic_offset_ns = time.time_ns() - time.monotonic_ns()

    def from_monotonic(self, seconds: float) -> int:
        return int(seconds * 1e9) + self._monotonic_offset_ns
