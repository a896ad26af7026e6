"""TGI's compat routes and helpers over HTTP: `/`, /invocations, /tokenize, /ping, seeds, errors."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from textgate.tests.router.fake_shard import FakeShard

StartRouter = Callable[..., Awaitable[str]]


def sse_events(text: str) -> list[dict[str, Any]]:
    return [
        json.loads(line[len("data:") :]) for line in text.splitlines() if line.startswith("data:")
    ]


@pytest.mark.parametrize("path", ["/", "/invocations"])
async def test_compat_route_answers_a_one_element_list(
    router: httpx.AsyncClient, path: str
) -> None:
    body = {"inputs": "w5", "parameters": {"max_new_tokens": 2, "details": True}}
    response = await router.post(path, json=body)
    assert response.status_code == 200
    answer = response.json()
    assert isinstance(answer, list) and len(answer) == 1
    # TGI prepends the prompt on `/` unless the client says otherwise.
    assert answer[0]["generated_text"] == "w5 t6 t7"
    assert answer[0]["details"]["generated_tokens"] == 2
    assert response.headers["x-generated-tokens"] == "2"


async def test_compat_route_takes_the_tgi_clients_explicit_nulls(
    router: httpx.AsyncClient,
) -> None:
    # What text-generation==0.7.0 posts: every parameter present, unset ones null.
    parameters = dict.fromkeys(
        [
            "best_of",
            "frequency_penalty",
            "repetition_penalty",
            "seed",
            "temperature",
            "top_k",
            "top_p",
            "truncate",
            "typical_p",
            "top_n_tokens",
            "grammar",
            "adapter_id",
        ]
    )
    parameters |= {
        "details": True,
        "do_sample": False,
        "max_new_tokens": 3,
        "return_full_text": False,
        "stop": [],
        "watermark": False,
        "decoder_input_details": False,
    }
    response = await router.post(
        "/", json={"inputs": "w5", "parameters": parameters, "stream": False}
    )
    assert response.status_code == 200, response.text
    (answer,) = response.json()
    assert answer["generated_text"] == " t6 t7 t8"
    assert answer["details"]["seed"] is None


@pytest.mark.parametrize("path", ["/", "/invocations"])
async def test_compat_route_streams_when_asked(router: httpx.AsyncClient, path: str) -> None:
    body = {
        "inputs": "w5",
        "stream": True,
        "parameters": {"max_new_tokens": 3, "details": True, "return_full_text": False},
    }
    response = await router.post(path, json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert [e["index"] for e in events] == [1, 2, 3]
    assert events[-1]["generated_text"] == " t6 t7 t8"
    assert events[-1]["details"]["finish_reason"] == "length"


async def test_compat_route_rejects_like_generate(router: httpx.AsyncClient) -> None:
    bad = await router.post("/", json={"inputs": "w5", "parameters": {"top_k": 0}})
    assert bad.status_code == 422
    assert bad.json() == {"error": "`top_k` must be strictly positive", "error_type": "validation"}
    stream = await router.post("/", json={"inputs": "", "stream": True})
    assert stream.status_code == 422
    ok = await router.post("/", json={"inputs": "w5", "parameters": {"max_new_tokens": 1}})
    assert ok.status_code == 200


async def test_greedy_requests_report_no_seed_and_sampled_ones_do(
    router: httpx.AsyncClient,
) -> None:
    # The shard reports a seed for every request; TGI shows it only when sampling.
    for parameters, sampled in [({}, False), ({"seed": 42}, False), ({"top_k": 5}, True)]:
        body = {"inputs": "w5", "parameters": {"max_new_tokens": 1, "details": True, **parameters}}
        details = (await router.post("/generate", json=body)).json()["details"]
        streamed = sse_events((await router.post("/generate_stream", json=body)).text)
        final = streamed[-1]["details"]
        if sampled:
            assert details["seed"] is not None and final["seed"] is not None
        else:
            assert details["seed"] is None and final["seed"] is None
    body = {"inputs": "w5", "parameters": {"max_new_tokens": 1, "details": True, "seed": 7}}
    body["parameters"]["do_sample"] = True
    assert (await router.post("/generate", json=body)).json()["details"]["seed"] == 7


async def test_best_of_returns_the_other_candidates(router: httpx.AsyncClient) -> None:
    body = {
        "inputs": "w5",
        "parameters": {
            "max_new_tokens": 2,
            "best_of": 2,
            "do_sample": True,
            "details": True,
            "return_full_text": True,
        },
    }
    (answer,) = (await router.post("/", json=body)).json()
    (other,) = answer["details"]["best_of_sequences"]
    assert answer["generated_text"].startswith("w5")
    assert other["generated_text"].startswith("w5")
    assert set(other) == {
        "generated_text",
        "finish_reason",
        "generated_tokens",
        "seed",
        "prefill",
        "tokens",
    }


async def test_tokenize_gives_ids_and_spans(router: httpx.AsyncClient) -> None:
    response = await router.post("/tokenize", json={"inputs": "w5  hello w7"})
    assert response.status_code == 200
    assert response.json() == [
        {"id": 5, "text": "w5", "start": 0, "stop": 2},
        {"id": 8, "text": "hello", "start": 4, "stop": 9},
        {"id": 7, "text": "w7", "start": 10, "stop": 12},
    ]
    truncated = await router.post(
        "/tokenize", json={"inputs": "w5 w6 w7", "parameters": {"truncate": 2}}
    )
    assert [t["id"] for t in truncated.json()] == [6, 7]
    bad = await router.post("/tokenize", json={"parameters": {}})
    assert bad.status_code == 422


async def test_ping_and_get_root_follow_health(router: httpx.AsyncClient, fake: FakeShard) -> None:
    assert (await router.get("/ping")).status_code == 200
    assert (await router.get("/")).status_code == 200
    fake.healthy = False
    for path in ("/ping", "/"):
        response = await router.get(path)
        assert response.status_code == 503
        assert response.json() == {"error": "unhealthy", "error_type": "healthcheck"}


async def test_unknown_routes_and_methods_get_json_errors(router: httpx.AsyncClient) -> None:
    missing = await router.get("/nope")
    assert missing.status_code == 404
    assert missing.json() == {"error": "Not Found", "error_type": "not_found"}
    wrong_method = await router.get("/generate")
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error_type"] == "method_not_allowed"


async def test_payload_limit_applies_to_every_body_route(start_router: StartRouter) -> None:
    base_url = await start_router(payload_limit=100)
    async with httpx.AsyncClient(base_url=base_url) as client:
        for path in ("/", "/generate_stream", "/invocations", "/tokenize"):
            response = await client.post(path, json={"inputs": "w5 " * 100})
            assert response.status_code == 413, path
            assert response.json() == {
                "error": "Payload too large: the body exceeds 100 bytes",
                "error_type": "payload_too_large",
            }


async def test_cors_preflight(start_router: StartRouter) -> None:
    base_url = await start_router(cors_allow_origin=("https://example.com",), api_key="k")
    preflight = {
        "Origin": "https://example.com",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization",
    }
    async with httpx.AsyncClient(base_url=base_url) as client:
        allowed = await client.options("/generate", headers=preflight)
        assert allowed.status_code == 200, "preflights carry no API key and must pass"
        assert allowed.headers["access-control-allow-origin"] == "https://example.com"
        assert "POST" in allowed.headers["access-control-allow-methods"]
        assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
        refused = await client.options("/generate", headers={**preflight, "Origin": "https://x.y"})
        assert refused.status_code == 400
        assert "access-control-allow-origin" not in refused.headers
        answer = await client.post(
            "/generate",
            json={"inputs": "w5", "parameters": {"max_new_tokens": 1}},
            headers={"Origin": "https://example.com", "Authorization": "Bearer k"},
        )
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == "https://example.com"


async def test_a_request_without_a_length_generates_the_default(start_router: StartRouter) -> None:
    async with httpx.AsyncClient(base_url=await start_router(default_max_new_tokens=5)) as http:
        tgi = await http.post("/generate", json={"inputs": "w5", "parameters": {"details": True}})
        assert tgi.json()["details"]["generated_tokens"] == 5
        # OpenAI's legacy completions document their own default, 16 tokens.
        answer = await http.post("/v1/completions", json={"prompt": "w5", "temperature": 0})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 16
        given = await http.post(
            "/generate", json={"inputs": "w5", "parameters": {"max_new_tokens": 7, "details": True}}
        )
        assert given.json()["details"]["generated_tokens"] == 7


async def test_skip_special_tokens_false_keeps_the_eos_text_in_generated_text(
    router: httpx.AsyncClient, fake: FakeShard
) -> None:
    fake.eos_after = 2
    body: dict[str, Any] = {"inputs": "w5", "parameters": {"max_new_tokens": 10, "details": True}}
    default = (await router.post("/generate", json=body)).json()
    assert default["generated_text"] == " t6 t7"
    assert default["details"]["tokens"][-1]["special"] is True
    body["parameters"]["skip_special_tokens"] = False
    kept = (await router.post("/generate", json=body)).json()
    assert kept["generated_text"] == " t6 t7</s>"
    assert kept["details"]["tokens"][-1] == {
        **default["details"]["tokens"][-1],
        "special": False,
    }
