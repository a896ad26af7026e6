"""vLLM's /tokenize (prompt or messages) and /detokenize, beside TGI's /tokenize."""

from __future__ import annotations

import httpx
import pytest

from textgate.router.openai.tokenize import is_vllm_tokenize
from textgate.tests.router.openai.routes_helpers import chat


@pytest.mark.parametrize(
    ("body", "vllm"),
    [
        (b'{"prompt": "hi"}', True),
        (b'{"messages": []}', True),
        (b'{"inputs": "hi"}', False),
        (b'{"inputs": "hi", "prompt": "hi"}', False),  # TGI's whenever it has `inputs`
        (b"[1, 2]", False),
        (b"{not json", False),
    ],
)
def test_the_body_shape_picks_the_api(body: bytes, vllm: bool) -> None:
    assert is_vllm_tokenize(body) is vllm


async def test_a_prompt_body_gets_vllms_answer(client: httpx.AsyncClient) -> None:
    answer = (await client.post("/tokenize", json={"prompt": "w5 hello w7"})).json()
    # max_model_len is --max-total-tokens (the test router's: 128).
    assert answer == {"count": 3, "max_model_len": 128, "tokens": [5, 8, 7]}


async def test_an_inputs_body_keeps_tgis_answer(client: httpx.AsyncClient) -> None:
    answer = (await client.post("/tokenize", json={"inputs": "w5 w7"})).json()
    assert [t["id"] for t in answer] == [5, 7]


async def test_messages_are_tokenized_as_chat_renders_them(client: httpx.AsyncClient) -> None:
    body = chat("w5 w6")
    answer = (await client.post("/tokenize", json=body)).json()
    templated = (await client.post("/chat_tokenize", json=body)).json()
    assert answer["tokens"] == [t["id"] for t in templated["tokenize_response"]] == [5, 6, 9]
    assert answer["count"] == 3
    bare = (await client.post("/tokenize", json={**body, "add_generation_prompt": False})).json()
    assert bare["tokens"] == [5, 6]


async def test_detokenize_gives_the_text_back(client: httpx.AsyncClient) -> None:
    answer = (await client.post("/detokenize", json={"tokens": [5, 7]})).json()
    assert answer == {"prompt": "w5 w7"}


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/detokenize", {"tokens": [5, 100000]}, "`tokens` token id 100000 is not in the vocab"),
        ("/detokenize", {"tokens": "w5"}, "tokens"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": "w5"}, "messages"),
    ],
)
async def test_bad_bodies_are_tgis_422(
    client: httpx.AsyncClient, path: str, body: dict[str, object], message: str
) -> None:
    response = await client.post(path, json=body)
    assert response.status_code == 422
    error = response.json()
    assert error["error_type"] == "validation" and message in error["error"]
