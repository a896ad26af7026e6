"""OTLP set up once for both processes: `telemetry.start_tracing` / `stop_tracing`."""

from __future__ import annotations

import time

from opentelemetry.sdk.trace import TracerProvider

from textgate.router import tracing as router_tracing
from textgate.shard_server import tracing as shard_tracing
from textgate.telemetry import SHUTDOWN_TIMEOUT_S, start_tracing, stop_tracing


def test_no_endpoint_leaves_tracing_off() -> None:
    installed: list[object] = []
    assert start_tracing(None, "textgate", installed.append) is None
    stop_tracing(None)
    assert installed == []


def test_an_endpoint_installs_a_provider_and_stopping_uninstalls_it() -> None:
    installed: list[TracerProvider | None] = []
    # Nothing listens there: export fails in the background, never in the caller.
    telemetry = start_tracing(
        "http://127.0.0.1:9",
        "textgate.shard",
        installed.append,
        **{"service.instance.id": "shard-1"},
    )
    assert telemetry is not None and installed == [telemetry.provider]
    attributes = telemetry.provider.resource.attributes
    assert attributes["service.name"] == "textgate.shard"
    assert attributes["service.instance.id"] == "shard-1"
    telemetry.provider.get_tracer("t").start_span("one").end()
    started = time.monotonic()
    stop_tracing(telemetry)
    assert installed == [telemetry.provider, None]
    assert time.monotonic() - started < SHUTDOWN_TIMEOUT_S + 1.0


def test_both_processes_tracing_modules_take_the_provider() -> None:
    telemetry = start_tracing("http://127.0.0.1:9", "textgate", router_tracing.install)
    assert router_tracing.enabled()
    stop_tracing(telemetry)
    assert not router_tracing.enabled()
    telemetry = start_tracing("http://127.0.0.1:9", "textgate.shard", shard_tracing.install)
    assert shard_tracing._tracer is not None
    stop_tracing(telemetry)
    assert shard_tracing._tracer is None
