"""The Messages routes end to end: uvicorn -> the router app -> engine -> fake shard.

The toy chat template joins the turns' contents and adds " w9", so "w5" is answered
" t10 t11 ..." (each token the last one plus one).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from anthropic import AsyncAnthropic

from textgate.tests.router.fake_shard import FakeShard
from textgate.tests.router.openai.routes_helpers import ChatFakeTokenizer, StartRouter


def message(content: Any = "w5", **fields: Any) -> dict[str, Any]:
    """A /v1/messages body with one user turn, plus `fields`."""
    return {
        "model": "tgi",
        "max_tokens": 3,
        "messages": [{"role": "user", "content": content}],
        **fields,
    }


async def events(client: httpx.AsyncClient, body: dict[str, Any]) -> list[tuple[str, Any]]:
    """POST a streamed request; every (event name, data) pair, in order."""
    pairs: list[tuple[str, Any]] = []
    async with client.stream("POST", "/v1/messages", json=body) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")
        name = ""
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == name
                pairs.append((name, data))
    return pairs


async def test_a_message_answers_in_one_text_block(client: httpx.AsyncClient) -> None:
    answer = (await client.post("/v1/messages", json=message(metadata={"user_id": "u"}))).json()
    assert answer["id"].startswith("msg_")
    assert answer["type"] == "message" and answer["role"] == "assistant"
    assert answer["model"] == "fake-model"
    assert answer["content"] == [{"type": "text", "text": " t10 t11 t12"}]
    assert answer["stop_reason"] == "max_tokens" and answer["stop_sequence"] is None
    assert answer["usage"] == {"input_tokens": 2, "output_tokens": 3}


async def test_system_blocks_and_turns_go_through_the_template(
    client: httpx.AsyncClient, fake: FakeShard
) -> None:
    body = message(
        system=[{"type": "text", "text": "w3"}],
        max_tokens=1,
    )
    body["messages"] = [
        {"role": "user", "content": [{"type": "text", "text": "w4"}]},
        {"role": "assistant", "content": "w5"},
        {"role": "user", "content": [{"type": "text", "text": "w6", "cache_control": {}}]},
    ]
    answer = (await client.post("/v1/messages", json=body)).json()
    (received,) = fake.received_requests()
    assert list(received.input_ids) == [3, 4, 5, 6, 9]
    assert answer["content"][0]["text"] == " t10"


async def test_a_last_assistant_turn_is_continued(
    client: httpx.AsyncClient, fake: FakeShard
) -> None:
    body = message(max_tokens=1)
    body["messages"].append({"role": "assistant", "content": "w7"})
    answer = (await client.post("/v1/messages", json=body)).json()
    (received,) = fake.received_requests()
    assert list(received.input_ids) == [5, 7]  # no generation prompt
    assert answer["content"][0]["text"] == " t8"


async def test_end_of_sequence_is_end_turn(client: httpx.AsyncClient, fake: FakeShard) -> None:
    fake.eos_after = 2
    answer = (await client.post("/v1/messages", json=message(max_tokens=5))).json()
    assert answer["content"] == [{"type": "text", "text": " t10 t11"}]
    assert answer["stop_reason"] == "end_turn"
    assert answer["usage"]["output_tokens"] == 3


async def test_a_stop_sequence_ends_the_text_before_it_and_is_named(
    client: httpx.AsyncClient,
) -> None:
    body = message(max_tokens=5, stop_sequences=["nothing", " t12"])
    answer = (await client.post("/v1/messages", json=body)).json()
    assert answer["content"] == [{"type": "text", "text": " t10 t11"}]
    assert answer["stop_reason"] == "stop_sequence"
    assert answer["stop_sequence"] == " t12"


async def test_greedy_and_sampling_parameters_reach_the_shard(
    client: httpx.AsyncClient, fake: FakeShard
) -> None:
    await client.post("/v1/messages", json=message(temperature=0, top_k=5))
    await client.post("/v1/messages", json=message(temperature=0.5, top_p=0.9, top_k=5))
    greedy, sampled = (r.parameters for r in fake.received_requests())
    assert not greedy.do_sample and greedy.top_k == 0
    assert sampled.do_sample and sampled.top_k == 5
    assert sampled.temperature == pytest.approx(0.5) and sampled.top_p == pytest.approx(0.9)


async def test_the_stream_is_anthropics_event_sequence(client: httpx.AsyncClient) -> None:
    body = message(stream=True, stop_sequences=[" t12"], max_tokens=5)
    pairs = await events(client, body)
    names = [name for name, _ in pairs]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = pairs[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == []
    assert start["stop_reason"] is None and start["usage"]["input_tokens"] == 2
    assert pairs[1][1]["content_block"] == {"type": "text", "text": ""}
    text = "".join(data["delta"]["text"] for name, data in pairs if name == "content_block_delta")
    answer = (await client.post("/v1/messages", json={**body, "stream": False})).json()
    assert text == answer["content"][0]["text"] == " t10 t11"
    delta = pairs[-2][1]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": " t12"}
    assert delta["usage"] == {"input_tokens": 2, "output_tokens": 3}


async def test_a_shard_error_ends_the_stream_with_an_error_event(
    client: httpx.AsyncClient, fake: FakeShard
) -> None:
    fake.fail["Step"] = 1
    pairs = await events(client, message(stream=True))
    name, data = pairs[-1]
    assert name == "error"
    assert data["type"] == "error" and data["error"]["type"] == "api_error"


async def test_a_shard_error_without_stream_is_api_error(
    client: httpx.AsyncClient, fake: FakeShard
) -> None:
    fake.fail["Step"] = 1
    response = await client.post("/v1/messages", json=message())
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "api_error"


async def test_count_tokens_counts_the_templated_prompt(client: httpx.AsyncClient) -> None:
    body = {
        "model": "fake-model",
        "system": "w3 w4",
        "messages": [{"role": "user", "content": "w5"}],
    }
    response = await client.post("/v1/messages/count_tokens", json=body)
    assert response.json() == {"input_tokens": 4}


INVALID: list[tuple[dict[str, Any], str]] = [
    (message(max_tokens=0), "`max_tokens` must be >= 1"),
    (message(temperature=1.5), "`temperature` must be >= 0 and <= 1"),
    (message(top_p=0), "`top_p` must be > 0 and <= 1"),
    (message(max_tokens=1000), "max_tokens"),
    (message([{"type": "image", "source": {}}]), "type 'image' are not supported"),
    (message(tool_choice={"type": "any"}), '"any" needs `tools`'),
    (message(tools=[{"name": "bad name", "input_schema": {}}]), "`tools[0]`.name must be"),
    (message(tools=[{"name": "web", "type": "web_search_20250305"}]), "are not supported"),
    ({"model": "tgi", "messages": []}, "max_tokens"),
]


@pytest.mark.parametrize(("body", "expected"), INVALID)
async def test_bad_requests_are_invalid_request_errors(
    client: httpx.AsyncClient, body: dict[str, Any], expected: str
) -> None:
    response = await client.post("/v1/messages", json=body)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert expected in error["error"]["message"]


async def test_an_unknown_model_is_not_found(client: httpx.AsyncClient) -> None:
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        response = await client.post(path, json=message(model="claude-opus"))
        assert response.status_code == 404
        assert response.json()["error"]["type"] == "not_found_error"


async def test_a_full_server_is_overloaded(start_router: StartRouter, fake: FakeShard) -> None:
    base_url = await start_router(ChatFakeTokenizer(), max_concurrent_requests=1)
    fake.step_delay_s = 0.05
    long = message(stream=True, max_tokens=50)
    async with (
        httpx.AsyncClient(base_url=base_url, timeout=10) as client,
        client.stream("POST", "/v1/messages", json=long),
    ):
        response = await client.post("/v1/messages", json=message())
    assert response.status_code == 529
    assert response.json()["error"]["type"] == "overloaded_error"


async def test_the_api_key_may_come_as_x_api_key(start_router: StartRouter) -> None:
    base_url = await start_router(ChatFakeTokenizer(), api_key="secret")
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        refused = await client.post("/v1/messages", json=message())
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "authentication_error"
        keyed = await client.post("/v1/messages", json=message(), headers={"x-api-key": "secret"})
        assert keyed.status_code == 200
        # Elsewhere the key is only a bearer token, as before.
        other = await client.post(
            "/generate", json={"inputs": "w5"}, headers={"x-api-key": "secret"}
        )
        assert other.status_code == 401


async def test_the_apps_own_errors_take_anthropics_shape_too(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/messages")  # the app's 405, not the route's
    assert response.status_code == 405
    assert response.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "Method Not Allowed"},
    }
    elsewhere = await client.get("/v1/chat/completions")
    assert elsewhere.json()["error"]["type"] == "method_not_allowed"  # OpenAI's, as before


async def test_thinking_is_a_thinking_block_through_the_sdk(
    start_router: StartRouter, toy_reasoning: str, fake: FakeShard
) -> None:
    fake.eos_after = 5
    base_url = await start_router(ChatFakeTokenizer(), reasoning_parser=toy_reasoning)
    # A thinking block sent back in a later turn is dropped from the prompt.
    earlier: Any = {"type": "thinking", "thinking": "w7", "signature": ""}
    turns: Any = [
        {"role": "user", "content": "w5"},
        {"role": "assistant", "content": [earlier, {"type": "text", "text": "w6"}]},
        {"role": "user", "content": "w5"},
    ]
    fields: Any = {"model": "tgi", "max_tokens": 9, "messages": turns}
    async with AsyncAnthropic(base_url=base_url, api_key="-", max_retries=0) as sdk:
        answer = await sdk.messages.create(**fields)
        async with sdk.messages.stream(**fields) as stream:
            streamed = await stream.get_final_message()
    assert [list(r.input_ids) for r in fake.received_requests()] == [[5, 6, 5, 9]] * 2
    for message_ in (answer, streamed):
        thought, text = message_.content
        assert thought.type == "thinking" and thought.thinking == " t10 t11"
        assert text.type == "text" and text.text == "t13 t14"
        assert message_.stop_reason == "end_turn"
