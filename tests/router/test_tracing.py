"""Router spans over real HTTP and a paged fake shard, read from an in-memory exporter."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from textgate.router import tracing
from textgate.tests.router.fake_shard import FakeShard

CALLER_TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
CALLER_SPAN_ID = 0xB7AD6B7169203331
TRACEPARENT = f"00-{CALLER_TRACE_ID:032x}-{CALLER_SPAN_ID:016x}-01"


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.install(None)


@pytest.fixture
def shard_metadata(fake: FakeShard, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict]]:
    """(method, gRPC metadata) of every call the fake shard receives."""
    seen: list[tuple[str, dict]] = []
    enter = fake._enter

    async def recording_enter(method: str, request: Any, context: Any) -> None:
        seen.append((method, dict(context.invocation_metadata())))
        await enter(method, request, context)

    monkeypatch.setattr(fake, "_enter", recording_enter)
    return seen


async def _spans_once(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    """Every span so far, once one named `name` has ended (the request span ends just
    after the response's last byte, in the server's task)."""
    for _ in range(200):
        spans = list(exporter.get_finished_spans())
        if any(s.name == name for s in spans):
            return spans
        await asyncio.sleep(0.01)
    raise AssertionError(f"no span {name!r}: {[s.name for s in exporter.get_finished_spans()]}")


async def test_a_streamed_request_makes_one_span_tree(
    start_router: Callable[..., Awaitable[str]],
    exporter: InMemorySpanExporter,
    shard_metadata: list[tuple[str, dict]],
) -> None:
    base_url = await start_router()
    body = {"inputs": "w5 w6 w7", "parameters": {"max_new_tokens": 4}}
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        response = await client.post(
            "/generate_stream", json=body, headers={"traceparent": TRACEPARENT}
        )
    assert response.status_code == 200
    final = json.loads([x for x in response.text.splitlines() if x.startswith("data:")][-1][5:])
    assert final["details"] is None and final["generated_text"] is not None

    spans = await _spans_once(exporter, "POST /generate_stream")
    (request,) = [s for s in spans if s.name == "POST /generate_stream"]
    # The caller's W3C context is the parent.
    assert request.kind is SpanKind.SERVER
    assert request.context.trace_id == CALLER_TRACE_ID
    assert request.parent is not None and request.parent.span_id == CALLER_SPAN_ID
    attributes = dict(request.attributes or {})
    assert attributes["http.response.status_code"] == 200
    assert attributes["textgate.input_tokens"] == 3
    assert attributes["textgate.generated_tokens"] == 4
    assert attributes["textgate.finish_reason"] == "length"
    assert request.status.status_code is StatusCode.UNSET

    children = {
        s.name: s for s in spans if s.parent and s.parent.span_id == request.context.span_id
    }
    assert set(children) == {"validation", "queue", "inference"}
    validation, queue, inference = (children[n] for n in ("validation", "queue", "inference"))
    assert all(s.context.trace_id == CALLER_TRACE_ID for s in children.values())
    # Placed one after the other, inside the request.
    assert request.start_time <= validation.start_time <= validation.end_time
    assert validation.end_time == queue.start_time <= queue.end_time == inference.start_time
    assert inference.end_time <= request.end_time
    assert dict(inference.attributes or {}) == {
        "textgate.input_tokens": 3,
        "textgate.generated_tokens": 4,
        "textgate.finish_reason": "length",
    }

    # One step span per token, each a root linked to the request it computed.
    steps = [s for s in spans if s.name in ("prefill", "decode")]
    assert [s.name for s in steps] == ["prefill", "decode", "decode", "decode"]
    for step in steps:
        assert step.parent is None and step.kind is SpanKind.CLIENT
        assert [link.context.span_id for link in step.links] == [request.context.span_id]
        assert dict(step.attributes or {}) == {"textgate.batch_size": 1}
    # Each Step RPC carried its step span's context to the shard.
    traceparents = [m.get("traceparent") for method, m in shard_metadata if method == "Step"]
    assert traceparents == [
        f"00-{s.context.trace_id:032x}-{s.context.span_id:016x}-{s.context.trace_flags:02x}"
        for s in steps
    ]


async def test_one_step_span_links_every_request_it_serves(
    start_router: Callable[..., Awaitable[str]], exporter: InMemorySpanExporter, fake: FakeShard
) -> None:
    fake.step_delay_s = 0.02
    base_url = await start_router()
    body = {"inputs": "w5 w6", "parameters": {"max_new_tokens": 6}}
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        responses = await asyncio.gather(*(client.post("/generate", json=body) for _ in range(3)))
    assert [r.status_code for r in responses] == [200, 200, 200]
    spans = await _spans_once(exporter, "POST /generate")
    for _ in range(100):  # all three request spans end
        spans = list(exporter.get_finished_spans())
        if sum(s.name == "POST /generate" for s in spans) == 3:
            break
        await asyncio.sleep(0.01)
    requests = {s.context.span_id for s in spans if s.name == "POST /generate"}
    assert len(requests) == 3
    linked = [{link.context.span_id for link in s.links} for s in spans if s.name == "decode"]
    # Continuous batching: some decode step served all three requests at once.
    assert requests in linked
    assert all(links <= requests for links in linked)


async def test_a_refused_request_has_an_error_span_without_inference(
    start_router: Callable[..., Awaitable[str]], exporter: InMemorySpanExporter
) -> None:
    base_url = await start_router()
    body = {"inputs": "w5", "parameters": {"max_new_tokens": 10_000}}
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        response = await client.post("/generate", json=body)
    assert response.status_code == 422
    spans = await _spans_once(exporter, "POST /generate")
    (request,) = spans
    assert request.parent is None, "no traceparent: a trace of its own"
    assert request.status.status_code is StatusCode.ERROR
    assert dict(request.attributes or {})["error.type"] == "validation"


async def test_the_span_names_the_tenant_of_the_api_key(
    start_router: Callable[..., Awaitable[str]], exporter: InMemorySpanExporter
) -> None:
    base_url = await start_router(api_key="secret")
    body = {"inputs": "w5", "parameters": {"max_new_tokens": 2}}
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        response = await client.post(
            "/generate", json=body, headers={"Authorization": "Bearer secret"}
        )
    assert response.status_code == 200
    (request,) = [
        s for s in await _spans_once(exporter, "POST /generate") if s.name == "POST /generate"
    ]
    assert dict(request.attributes or {})["textgate.tenant"] == "default"


async def test_tracing_off_adds_no_metadata(
    start_router: Callable[..., Awaitable[str]], shard_metadata: list[tuple[str, dict]]
) -> None:
    assert not tracing.enabled()
    base_url = await start_router()
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        body = {"inputs": "w5", "parameters": {"max_new_tokens": 2}}
        response = await client.post("/generate", json=body, headers={"traceparent": TRACEPARENT})
    assert response.status_code == 200
    assert shard_metadata and all("traceparent" not in m for _, m in shard_metadata)
