"""Shared by the OpenAI route tests: a fake tokenizer with a chat template, and
helpers that build chat bodies and read SSE streams.

The fake chat template joins the messages' contents and adds " w9" as the generation
prompt, so with the fake model "w5" answers " t10 t11 …" (each token follows the last).
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from textgate.tests.router.fake_shard import FakeTokenizer

StartRouter = Callable[..., Awaitable[str]]


class ChatFakeTokenizer(FakeTokenizer):
    """The fake tokenizer with a toy chat template and offsets."""

    chat_template = "contents joined by spaces"

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        *,
        tokenize: bool,
        add_generation_prompt: bool,
        continue_final_message: bool,
    ) -> str:
        if any(m["role"] == "bad" for m in conversation):
            raise ValueError("roles must be user or assistant")
        text = " ".join(m["content"] for m in conversation)
        return text + " w9" if add_generation_prompt else text

    def __call__(
        self, text: str, add_special_tokens: bool, return_offsets_mapping: bool
    ) -> dict[str, list[Any]]:
        spans = [m.span() for m in re.finditer(r"\S+", text)]
        return {"input_ids": self.encode(text), "offset_mapping": spans}


def chat(content: str = "w5", **fields: Any) -> dict[str, Any]:
    """A /v1/chat/completions body with one user message, plus `fields`."""
    return {"model": "tgi", "messages": [{"role": "user", "content": content}], **fields}


async def sse(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[Any]:
    """POST a streamed request; every `data:` payload, "[DONE]" as the string."""
    events: list[Any] = []
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
    return events
