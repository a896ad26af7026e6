"""End to end: `huggingface_hub.InferenceClient.chat_completion` against the launcher."""

from __future__ import annotations

import pytest
from huggingface_hub import InferenceClient

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "Name the capital of France."}]


def test_chat_completion_answers_paris(live_server: str) -> None:
    client = InferenceClient(base_url=live_server, timeout=120)
    answer = client.chat_completion(QUESTION, max_tokens=20, temperature=0)
    assert "Paris" in (answer.choices[0].message.content or "")
    assert answer.usage.completion_tokens > 0


def test_chat_completion_stream_answers_paris(live_server: str) -> None:
    client = InferenceClient(base_url=live_server, timeout=120)
    chunks = list(client.chat_completion(QUESTION, max_tokens=20, temperature=0, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in content
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
