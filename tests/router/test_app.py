"""The HTTP routes end to end: uvicorn -> router app -> gRPC -> fake shard."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from textgate.tests.router.fake_shard import FakeShard

StartRouter = Callable[..., Awaitable[str]]
SPEC = "/api-doc/openapi.json"


async def stream_events(
    client: httpx.AsyncClient, body: dict[str, Any], started: asyncio.Event | None = None
) -> list[dict[str, Any]]:
    """POST /generate_stream and parse every SSE event; `started` is set at the first one."""
    events = []
    async with client.stream("POST", "/generate_stream", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
                if started is not None:
                    started.set()
    return events


async def test_generate_returns_text_and_tgi_headers(router: httpx.AsyncClient) -> None:
    response = await router.post(
        "/generate", json={"inputs": "w5 w6", "parameters": {"max_new_tokens": 3}}
    )
    assert response.status_code == 200
    assert response.json() == {"generated_text": " t7 t8 t9"}
    headers = response.headers
    assert headers["x-prompt-tokens"] == "2"
    assert headers["x-generated-tokens"] == "3"
    assert headers["x-compute-characters"] == "5"
    assert headers["x-compute-type"] == "cpu+optimized"
    assert float(headers["x-compute-time"]) >= 0, "TGI sends seconds here"
    for name in (
        "x-total-time",
        "x-validation-time",
        "x-queue-time",
        "x-inference-time",
        "x-time-per-token",
    ):
        assert int(headers[name]) >= 0


async def test_details_have_tgi_shape(router: httpx.AsyncClient) -> None:
    body = {
        "inputs": "w5 w6",
        "parameters": {
            "max_new_tokens": 2,
            "details": True,
            "decoder_input_details": True,
            "top_n_tokens": 2,
            "seed": 7,
        },
    }
    details = (await router.post("/generate", json=body)).json()["details"]
    assert details["finish_reason"] == "length"
    assert details["generated_tokens"] == 2
    assert details["seed"] is None, "greedy requests report no seed"
    assert details["prefill"] == [
        {"id": 5, "text": " t5", "logprob": None},
        {"id": 6, "text": " t6", "logprob": -1.0},
    ]
    assert details["tokens"][0] == {"id": 7, "text": " t7", "logprob": -0.5, "special": False}
    assert [[t["id"] for t in top] for top in details["top_tokens"]] == [[7, 8], [8, 9]]
    assert "best_of_sequences" not in details


async def test_details_are_left_out_unless_asked_for(router: httpx.AsyncClient) -> None:
    body = {"inputs": "w5", "parameters": {"max_new_tokens": 1, "details": True}}
    details = (await router.post("/generate", json=body)).json()["details"]
    assert details["prefill"] == []
    assert "top_tokens" not in details


async def test_return_full_text_prepends_the_prompt(router: httpx.AsyncClient) -> None:
    body = {"inputs": "w5", "parameters": {"max_new_tokens": 1, "return_full_text": True}}
    assert (await router.post("/generate", json=body)).json()["generated_text"] == "w5 t6"


async def test_stop_sequence_and_eos_finish_reasons(
    router: httpx.AsyncClient, fake: FakeShard
) -> None:
    body = {"inputs": "w5", "parameters": {"max_new_tokens": 9, "stop": [" t7"], "details": True}}
    answer = (await router.post("/generate", json=body)).json()
    assert answer["generated_text"] == " t6 t7"
    assert answer["details"]["finish_reason"] == "stop_sequence"
    fake.eos_after = 1
    body = {"inputs": "w5", "parameters": {"max_new_tokens": 9, "details": True}}
    answer = (await router.post("/generate", json=body)).json()
    assert answer["generated_text"] == " t6"
    assert answer["details"]["finish_reason"] == "eos_token"
    assert answer["details"]["tokens"][-1]["special"] is True


async def test_best_of_returns_the_most_likely_candidate(router: httpx.AsyncClient) -> None:
    body = {
        "inputs": "w5",
        "parameters": {"max_new_tokens": 2, "best_of": 2, "do_sample": True, "details": True},
    }
    details = (await router.post("/generate", json=body)).json()["details"]
    (other,) = details["best_of_sequences"]
    best_sum = sum(t["logprob"] for t in details["tokens"])
    assert best_sum >= sum(t["logprob"] for t in other["tokens"])
    assert details["seed"] is not None and other["seed"] is not None


async def test_generate_stream_sends_one_event_per_token(router: httpx.AsyncClient) -> None:
    body = {"inputs": "w5", "parameters": {"max_new_tokens": 3, "details": True}}
    events = await stream_events(router, body)
    assert [e["index"] for e in events] == [1, 2, 3]
    assert [e["token"]["text"] for e in events] == [" t6", " t7", " t8"]
    assert [e["generated_text"] for e in events] == [None, None, " t6 t7 t8"]
    assert [e["details"] for e in events[:-1]] == [None, None]
    assert events[-1]["details"] == {
        "finish_reason": "length",
        "generated_tokens": 3,
        "seed": None,
        "input_length": 1,
    }
    assert all("top_tokens" not in e for e in events)


async def test_stream_details_are_null_unless_asked_for(router: httpx.AsyncClient) -> None:
    events = await stream_events(router, {"inputs": "w5", "parameters": {"max_new_tokens": 1}})
    assert events[-1]["details"] is None
    assert events[-1]["generated_text"] == " t6"


async def test_a_shard_error_ends_the_stream_with_an_error_event(
    router: httpx.AsyncClient, fake: FakeShard
) -> None:

    async def fail_second_step() -> None:  # the first step (prompt + first token) succeeds
        while len(fake.calls_to("Step")) < 1:
            await asyncio.sleep(0.001)
        fake.fail["Step"] = 1

    fake.step_delay_s = 0.01
    failing = asyncio.create_task(fail_second_step())
    events = await stream_events(router, {"inputs": "w5", "parameters": {"max_new_tokens": 5}})
    await failing
    assert events[0]["token"]["id"] == 6
    assert events[-1] == {
        "error": "Request failed during generation: Server error: fake Step failure",
        "error_type": "generation",
    }
    after = await router.post("/generate", json={"inputs": "w5"})
    assert after.status_code == 200


async def test_a_shard_error_on_generate_is_424(router: httpx.AsyncClient, fake: FakeShard) -> None:
    fake.fail["Step"] = 1
    response = await router.post("/generate", json={"inputs": "w5"})
    assert response.status_code == 424
    assert response.json()["error_type"] == "generation"


async def test_eight_concurrent_streams_finish_with_their_own_lengths(
    router: httpx.AsyncClient, fake: FakeShard
) -> None:
    fake.step_delay_s = 0.005
    lengths = [1, 3, 5, 8, 13, 2, 21, 4]

    async def one(i: int, n: int) -> list[dict[str, Any]]:
        await asyncio.sleep(0.003 * i)
        body = {"inputs": f"w{10 * (i + 1)}", "parameters": {"max_new_tokens": n}}
        return await stream_events(router, body)

    results = await asyncio.gather(*(one(i, n) for i, n in enumerate(lengths)))
    for i, (n, events) in enumerate(zip(lengths, results, strict=True)):
        first = 10 * (i + 1) + 1
        assert [e["token"]["id"] for e in events] == list(range(first, first + n))
        assert events[-1]["generated_text"] == "".join(f" t{t}" for t in range(first, first + n))
    assert max(len(s.plan.scheduled) for s in fake.calls_to("Step")) > 1


async def test_a_disconnecting_stream_is_filtered_out(
    router: httpx.AsyncClient, fake: FakeShard
) -> None:
    fake.step_delay_s = 0.01
    started = asyncio.Event()
    staying = asyncio.create_task(
        stream_events(router, {"inputs": "w5", "parameters": {"max_new_tokens": 40}}, started)
    )
    await started.wait()
    async with router.stream(
        "POST", "/generate_stream", json={"inputs": "w100", "parameters": {"max_new_tokens": 40}}
    ) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                break
    events = await staying
    assert len(events) == 40
    assert events[-1]["generated_text"] is not None
    leaving_id = next(r.id for r in fake.received_requests() if list(r.input_ids) == [100])
    _assert_dropped_from_steps(fake, leaving_id)


async def test_a_client_leaving_generate_cancels_its_request(
    start_router: StartRouter, fake: FakeShard
) -> None:
    fake.step_delay_s = 0.01
    base_url = await start_router()
    async with httpx.AsyncClient(base_url=base_url) as client:
        with pytest.raises(httpx.ReadTimeout):
            body = {"inputs": "w5", "parameters": {"max_new_tokens": 100}}
            await client.post("/generate", json=body, timeout=0.1)
    for _ in range(200):
        if not fake.held_request_ids():
            break
        await asyncio.sleep(0.01)
    assert not fake.held_request_ids(), "the abandoned request was dropped from the shards"
    assert len(fake.calls_to("Step")) < 99


async def test_over_max_concurrent_requests_is_429(
    start_router: StartRouter, fake: FakeShard
) -> None:
    fake.step_delay_s = 0.02
    base_url = await start_router(max_concurrent_requests=1)
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        slow = asyncio.create_task(
            client.post("/generate", json={"inputs": "w5", "parameters": {"max_new_tokens": 10}})
        )
        await asyncio.sleep(0.05)
        response = await client.post("/generate", json={"inputs": "w5"})
        assert response.status_code == 429
        assert response.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
        stream = await client.post("/generate_stream", json={"inputs": "w5"})
        assert stream.status_code == 429
        assert (await slow).status_code == 200
        short = {"inputs": "w5", "parameters": {"max_new_tokens": 1}}
        assert (await client.post("/generate", json=short)).status_code == 200


async def test_health_follows_the_shards(router: httpx.AsyncClient, fake: FakeShard) -> None:
    assert (await router.get("/health")).status_code == 200
    fake.healthy = False
    response = await router.get("/health")
    assert response.status_code == 503
    assert response.json() == {"error": "unhealthy", "error_type": "healthcheck"}


async def test_info_describes_model_and_limits(router: httpx.AsyncClient, fake: FakeShard) -> None:
    info = (await router.get("/info")).json()
    assert info["model_id"] == "fake-model"
    assert info["max_input_tokens"] == info["max_input_length"] == 64
    assert info["max_total_tokens"] == 128
    assert info["max_concurrent_requests"] == 128
    assert info["max_best_of"] == 2
    assert info["max_stop_sequences"] == 4
    # The shards hold what their KV cache holds.
    assert info["max_batch_total_tokens"] == fake.num_blocks * fake.block_size
    assert info["max_batch_size"] is None
    assert info["model_sha"] is None
    assert {"model_dtype", "model_device_type", "version", "router", "sha"} <= set(info)


async def test_api_key_guards_the_generating_routes(start_router: StartRouter) -> None:
    base_url = await start_router(api_key="secret")
    body = {"inputs": "w5", "parameters": {"max_new_tokens": 1}}
    async with httpx.AsyncClient(base_url=base_url) as client:
        for path in ("/generate", "/generate_stream", "/", "/invocations", "/tokenize"):
            missing = await client.post(path, json=body)
            assert missing.status_code == 401, path
            assert missing.json() == {"error": "Unauthorized", "error_type": "unauthorized"}
            wrong = await client.post(path, json=body, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401, path
            right = await client.post(path, json=body, headers={"Authorization": "Bearer secret"})
            assert right.status_code == 200, path
        # Probes, scrapers and docs carry no key (TGI's open routes).
        for path in ("/", "/health", "/ping", "/info", "/metrics", "/docs", SPEC):
            assert (await client.get(path)).status_code == 200, path
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        for path in ("/v1/chat/completions", "/v1/completions"):
            assert (await client.post(path, json=chat)).status_code == 401, path
        assert (await client.get("/v1/models")).status_code == 200


async def test_cors_allows_configured_origins(start_router: StartRouter) -> None:
    base_url = await start_router(cors_allow_origin=("https://example.com",))
    async with httpx.AsyncClient(base_url=base_url) as client:
        allowed = await client.get("/info", headers={"Origin": "https://example.com"})
        assert allowed.headers["access-control-allow-origin"] == "https://example.com"
        other = await client.get("/info", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers


async def test_bodies_over_the_payload_limit_are_413(start_router: StartRouter) -> None:
    base_url = await start_router(payload_limit=100)
    async with httpx.AsyncClient(base_url=base_url) as client:
        response = await client.post("/generate", json={"inputs": "w5 " * 100})
        assert response.status_code == 413
        assert response.json()["error_type"] == "payload_too_large"
        assert (await client.post("/generate", json={"inputs": "w5"})).status_code == 200


@pytest.mark.parametrize(
    "body",
    [b"not json", b'{"parameters": {}}', b'{"inputs": "w5", "parameters": {"top_k": "x"}}'],
)
async def test_malformed_bodies_are_422(router: httpx.AsyncClient, body: bytes) -> None:
    response = await router.post(
        "/generate", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert response.json()["error_type"] == "validation"
    assert response.json()["error"].startswith("Failed to deserialize the JSON body")


def _assert_dropped_from_steps(fake: FakeShard, request_id: int) -> None:
    """Paged: a step's plan drops the request, and no later step schedules it."""
    steps = fake.calls_to("Step")
    dropping = next(i for i, s in enumerate(steps) if request_id in s.plan.finished_ids)
    assert all(
        request_id != scheduled.request_id
        for step in steps[dropping:]
        for scheduled in step.plan.scheduled
    )
