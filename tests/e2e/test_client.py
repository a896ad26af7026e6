"""End to end: the project's own client (`textgate.client`) against the embedded model."""

from __future__ import annotations

import pytest

from textgate.client import AsyncClient, Client, ValidationError

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"
TIMEOUT_S = 120


def test_client_generates_and_streams_the_same_greedy_text(live_server: str) -> None:
    client = Client(live_server, timeout=TIMEOUT_S)
    answer = client.generate(PROMPT, max_new_tokens=8)
    assert answer.details is not None
    assert 1 <= answer.details.generated_tokens <= 8
    assert answer.details.seed is None
    events = list(client.generate_stream(PROMPT, max_new_tokens=8))
    assert events[-1].generated_text == answer.generated_text
    assert "".join(e.token.text for e in events if not e.token.special) == answer.generated_text


def test_client_maps_a_server_rejection_to_validation_error(live_server: str) -> None:
    client = Client(live_server, timeout=TIMEOUT_S)
    with pytest.raises(ValidationError) as caught:
        client.generate(PROMPT, max_new_tokens=10**6)
    assert caught.value.status_code == 422
    assert caught.value.error_type == "validation"
    assert client.generate(PROMPT, max_new_tokens=1).details is not None


async def test_async_client_generates_streams_and_maps_errors(live_server: str) -> None:
    async with AsyncClient(live_server, timeout=TIMEOUT_S) as client:
        answer = await client.generate(PROMPT, max_new_tokens=6)
        events = [e async for e in client.generate_stream(PROMPT, max_new_tokens=6)]
        assert events[-1].generated_text == answer.generated_text
        with pytest.raises(ValidationError) as caught:
            async for _ in client.generate_stream(PROMPT, max_new_tokens=10**6):
                pass
        assert caught.value.status_code == 422
