"""The shard's spans: one per Step RPC, a child of the router's step span, whose W3C
`traceparent` arrives in the call's gRPC metadata::

    shard step                       SERVER span: the whole call, model-lock wait included
    ├── forward                      the forward pass, sampling included (`forward_ns`)
    └── decode                       tokens to Generations: detokenizing, stopping (`decode_ns`)

The two phases are placed after the call from the durations the model measured (the
proto's `forward_ns`, `decode_ns`), ending where the call ended: the model thread adds
no tracing work to a step. Off (every hook returns at once) until `install` gets a
provider; `__main__` installs one for `--otlp-endpoint`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, Protocol

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from textgate.telemetry import extract

TRACER_NAME = "textgate.shard"

_tracer: trace.Tracer | None = None


class StepTimes(Protocol):
    """What every step RPC's answer reports of its time (proto/generate.proto)."""

    forward_ns: int
    decode_ns: int
    total_ns: int


def install(provider: trace.TracerProvider | None) -> None:
    """Trace with `provider` from now on; None turns tracing off."""
    global _tracer
    _tracer = None if provider is None else provider.get_tracer(TRACER_NAME)


@contextlib.contextmanager
def rpc_span(context: Any, method: str) -> Iterator[trace.Span | None]:
    """The span of one step RPC (`method`), a child of the caller's trace context in the
    gRPC `context`'s metadata; None while tracing is off."""
    tracer = _tracer
    if tracer is None:
        yield None
        return
    parent = extract(context.invocation_metadata() or ())
    span = tracer.start_span(f"shard {method}", parent, kind=SpanKind.SERVER)
    with trace.use_span(span, end_on_exit=True, record_exception=True):
        yield span


def record_phases(span: trace.Span | None, response: StepTimes, num_generations: int) -> None:
    """Add the model's forward and decode phases under `span` (the call just ended)."""
    tracer = _tracer
    if span is None or tracer is None:
        return
    end = time.time_ns()
    decode_start = end - response.decode_ns
    forward_start = decode_start - response.forward_ns
    parent = trace.set_span_in_context(span)
    tracer.start_span("forward", parent, start_time=forward_start).end(end_time=decode_start)
    tracer.start_span("decode", parent, start_time=decode_start).end(end_time=end)
    span.set_attribute("textgate.num_generations", num_generations)
    span.set_attribute("textgate.forward_ns", response.forward_ns)
    span.set_attribute("textgate.decode_ns", response.decode_ns)
