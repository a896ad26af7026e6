"""POST /v1/responses end to end: uvicorn -> the router app -> engine -> fake shard.

The fake chat template joins the messages' contents and adds " w9"; the fake model
answers "w5" with " t10 t11 …" (routes_helpers).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from textgate.tests.router.fake_shard import FakeShard
from textgate.tests.router.openai.routes_helpers import StartRouter


def respond(input: Any = "w5", **fields: Any) -> dict[str, Any]:
    return {"model": "tgi", "input": input, **fields}


async def typed_events(client: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST a streamed request; each event's data, checked against its `event:` line."""
    async with client.stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")
        text = (await response.aread()).decode()
    events = []
    for frame in text.split("\n\n")[:-1]:
        name, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


async def test_a_text_input_is_answered_as_a_response_object(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/responses", json=respond(max_output_tokens=3, temperature=0))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("resp_")
    assert body["object"] == "response"
    assert isinstance(body["created_at"], int)
    assert body["model"] == "fake-model"
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["store"] is False
    (message,) = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["id"].startswith("msg_") and message["status"] == "incomplete"
    assert message["content"] == [
        {"type": "output_text", "text": " t10 t11 t12", "annotations": [], "logprobs": []}
    ]
    assert body["usage"] == {
        "input_tokens": 2,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 5,
    }
    assert body["max_output_tokens"] == 3 and body["temperature"] == 0
    assert body["tools"] == [] and body["tool_choice"] == "auto"


async def test_an_answer_that_ends_is_completed(client: httpx.AsyncClient, fake: FakeShard) -> None:
    fake.eos_after = 2
    body = (await client.post("/v1/responses", json=respond(max_output_tokens=10))).json()
    assert body["status"] == "completed" and body["incomplete_details"] is None
    assert body["output"][0]["content"][0]["text"] == " t10 t11"
    assert body["output"][0]["status"] == "completed"


async def test_instructions_and_items_make_the_prompt(
    client: httpx.AsyncClient, fake: FakeShard
) -> None:
    items = [
        {"role": "developer", "content": "w20"},
        {"role": "user", "content": [{"type": "input_text", "text": "w21"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "w22"},
    ]
    body = respond(items, instructions="w7", max_output_tokens=1, temperature=0.5, top_p=0.5)
    response = await client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    (request,) = fake.received_requests()
    # The fake template reads contents only: the call's (an assistant turn) is empty.
    assert request.inputs == "w7 w20 w21  w22 w9"
    assert request.parameters.do_sample and request.stopping_parameters.max_new_tokens == 1
    assert request.parameters.temperature == pytest.approx(0.5)
    assert request.parameters.top_p == pytest.approx(0.5)


async def test_a_json_schema_format_is_the_requests_grammar(
    client: httpx.AsyncClient, fake: FakeShard
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    text = {"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}}
    response = await client.post("/v1/responses", json=respond(text=text, max_output_tokens=2))
    assert response.status_code == 200, response.text
    (request,) = fake.received_requests()
    assert json.loads(request.grammar.value) == schema
    assert response.json()["text"]["format"]["name"] == "thing"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"previous_response_id": "resp_1"}, "`previous_response_id` is not supported"),
        ({"input": [{"type": "input_image"}]}, "not supported"),
        ({"tools": [{"type": "web_search"}]}, "only function tools"),
        ({"max_output_tokens": 1000}, "max_output_tokens"),
    ],
)
async def test_bad_requests_get_openais_error_shape(
    client: httpx.AsyncClient, fields: dict[str, Any], message: str
) -> None:
    response = await client.post("/v1/responses", json=respond(**fields))
    assert response.status_code == 422
    error = response.json()["error"]
    assert message in error["message"]
    assert error["type"] == "invalid_request_error"


async def test_another_model_is_404(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/responses", json=respond(model="gpt-4o"))
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


async def test_a_stream_sends_the_typed_events_of_the_same_answer(
    client: httpx.AsyncClient,
) -> None:
    body = respond(max_output_tokens=3, temperature=0)
    whole = (await client.post("/v1/responses", json=body)).json()
    events = await typed_events(client, {**body, "stream": True})
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert events[0]["response"]["status"] == "in_progress"
    assert events[0]["response"]["output"] == []
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    text = whole["output"][0]["content"][0]["text"]
    assert deltas == text == events[-4]["text"]
    last = events[-1]["response"]
    assert last["id"] == events[0]["response"]["id"]
    assert last["status"] == "incomplete" and last["usage"] == whole["usage"]
    assert last["output"][0]["content"] == whole["output"][0]["content"]
    assert last["output"][0]["id"] == events[2]["item"]["id"] == events[-2]["item"]["id"]


async def test_a_stream_that_ends_is_completed(client: httpx.AsyncClient, fake: FakeShard) -> None:
    fake.eos_after = 1
    events = await typed_events(client, respond(max_output_tokens=5, stream=True))
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["status"] == "completed"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == " t10"


async def test_a_shard_error_ends_the_stream_with_error_then_failed(
    client: httpx.AsyncClient, fake: FakeShard
) -> None:
    fake.fail["Step"] = 1
    events = await typed_events(client, respond(max_output_tokens=5, stream=True))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "generation"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"


async def test_a_shard_error_without_stream_is_424(
    client: httpx.AsyncClient, fake: FakeShard
) -> None:
    fake.fail["Step"] = 1
    response = await client.post("/v1/responses", json=respond(max_output_tokens=5))
    assert response.status_code == 424
    assert response.json()["error"]["type"] == "server_error"


async def test_thinking_is_a_reasoning_item_through_the_sdk(
    start_openai: StartRouter, toy_reasoning: str, fake: FakeShard
) -> None:
    fake.eos_after = 5
    base_url = await start_openai(reasoning_parser=toy_reasoning)
    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key="-", max_retries=0) as sdk:
        response = await sdk.responses.create(model="tgi", input="w5", max_output_tokens=9)
        async with sdk.responses.stream(model="tgi", input="w5", max_output_tokens=9) as stream:
            kinds = [event.type async for event in stream]
            streamed = await stream.get_final_response()
    for answer in (response, streamed):
        thought, message = answer.output
        assert thought.type == "reasoning" and thought.status == "completed"
        assert thought.content is not None and thought.content[0].text == " t10 t11"
        assert message.type == "message" and answer.output_text == "t13 t14"
        assert answer.usage is not None
        assert answer.usage.output_tokens_details.reasoning_tokens == 3
    assert kinds.count("response.reasoning_text.delta") == 2
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
