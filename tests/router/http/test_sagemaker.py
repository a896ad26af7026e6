"""SageMaker's /invocations: the body's shape picks TGI's generate, chat or completions."""

from __future__ import annotations

import json

import httpx
import pytest

from textgate.router.generation.chat_template import NO_TEMPLATE
from textgate.router.http.sagemaker import CHAT_PATH, COMPLETIONS_PATH, GENERATE_PATH, api_path


@pytest.mark.parametrize(
    ("body", "path"),
    [
        ({"inputs": "w5"}, GENERATE_PATH),
        ({"inputs": "w5", "stream": True}, GENERATE_PATH),
        ({"messages": [{"role": "user", "content": "hi"}]}, CHAT_PATH),
        ({"prompt": "w5", "max_tokens": 2}, COMPLETIONS_PATH),
        (["not", "an", "object"], GENERATE_PATH),
    ],
)
def test_the_body_shape_picks_the_api(body: object, path: str) -> None:
    assert api_path(json.dumps(body).encode()) == path


def test_unreadable_bodies_go_to_generate_which_rejects_them() -> None:
    assert api_path(b"not json") == GENERATE_PATH


async def test_a_completion_body_gets_a_completion(router: httpx.AsyncClient) -> None:
    response = await router.post("/invocations", json={"prompt": "w5", "max_tokens": 2})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "text_completion"
    assert answer["choices"][0]["text"] == " t6 t7"


async def test_a_chat_body_goes_to_chat_completions(router: httpx.AsyncClient) -> None:
    # The fake tokenizer has no chat template: the chat route's own error proves the dispatch.
    body = {"messages": [{"role": "user", "content": "hi"}]}
    response = await router.post("/invocations", json=body)
    assert response.status_code == 422
    assert response.json()["error"] == NO_TEMPLATE


async def test_a_generate_body_streams_like_root(router: httpx.AsyncClient) -> None:
    body = {"inputs": "w5", "stream": True, "parameters": {"max_new_tokens": 2}}
    response = await router.post("/invocations", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.count("data:") == 2
    bad = await router.post("/invocations", content=b"not json")
    assert bad.status_code == 422
    assert bad.json()["error"].startswith("Failed to deserialize the JSON body")
