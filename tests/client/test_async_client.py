"""`AsyncClient` against the fake TGI server (uvicorn on a free port) and httpx MockTransport."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import httpx
import pytest

from textgate.client import AsyncClient, errors
from textgate.client.openai_types import ChatCompletion, Completion
from textgate.client.types import FinishReason

USER = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture
def client(fake_server: Any) -> AsyncClient:
    return AsyncClient(fake_server.url, timeout=5)


async def collect(items: AsyncIterator[Any]) -> list[Any]:
    return [item async for item in items]


async def test_generate(client: AsyncClient) -> None:
    answer = await client.generate("Hi", max_new_tokens=3, decoder_input_details=True)
    assert answer.generated_text == " The sky is"
    assert answer.details.finish_reason is FinishReason.Length
    assert [t.text for t in answer.details.prefill] == ["Hi"]


async def test_generate_stream(client: AsyncClient) -> None:
    events = await collect(client.generate_stream("Hi", top_n_tokens=2))
    assert [event.is_final for event in events] == [False] * 5 + [True]
    assert events[-1].generated_text == " The sky is blue."
    assert events[-1].details is not None
    assert events[-1].details.finish_reason is FinishReason.EndOfSequenceToken


async def test_generate_stream_can_stop_early(client: AsyncClient) -> None:
    async with aclosing(client.generate_stream("Hi")) as stream:  # type: ignore[type-var]
        async for event in stream:
            assert event.token.text == " The"
            break


async def test_chat(client: AsyncClient) -> None:
    answer = await client.chat(USER, max_tokens=2)
    assert isinstance(answer, ChatCompletion)
    assert answer.choices[0].message.content == " The sky"
    chunks = await collect(client.chat_stream(USER))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == " The sky is blue."
    # The text_generation way: `await chat(stream=True)` gives an async iterator.
    via_flag = await client.chat(USER, stream=True)
    assert not isinstance(via_flag, ChatCompletion)
    assert len(await collect(via_flag)) == 6


async def test_completion(client: AsyncClient) -> None:
    answer = await client.completion("Hi", max_tokens=1)
    assert isinstance(answer, Completion) and answer.choices[0].text == " The"
    chunks = await collect(client.completion_stream("Hi", max_tokens=2))
    assert "".join(c.choices[0].text for c in chunks) == " The sky"
    via_flag = await client.completion("Hi", stream=True)
    assert not isinstance(via_flag, Completion)
    assert len(await collect(via_flag)) == 6


def _calls(client: AsyncClient, prompt: str) -> dict[str, Callable[[], Awaitable[Any]]]:
    messages = [{"role": "user", "content": prompt}]
    return {
        "generate": lambda: client.generate(prompt),
        "generate_stream": lambda: collect(client.generate_stream(prompt)),
        "chat": lambda: client.chat(messages),
        "chat_stream": lambda: collect(client.chat_stream(messages)),
        "completion": lambda: client.completion(prompt),
        "completion_stream": lambda: collect(client.completion_stream(prompt)),
    }


async def test_error_answers_are_mapped(
    client: AsyncClient, error_case: tuple[str, str, str]
) -> None:
    prompt, class_name, message = error_case
    for route, call in _calls(client, prompt).items():
        with pytest.raises(errors.TextGateError) as caught:
            await call()
        assert type(caught.value).__name__ == class_name, route
        assert caught.value.message == message, route


async def test_error_event_mid_stream(client: AsyncClient) -> None:
    received = []
    with pytest.raises(errors.GenerationError, match="fake failure mid-stream"):
        async for event in client.generate_stream("fail mid-stream"):
            received.append(event)
    assert len(received) == 2
    with pytest.raises(errors.GenerationError):
        await collect(client.chat_stream([{"role": "user", "content": "fail mid-stream"}]))


async def test_stream_cut_short_is_incomplete(client: AsyncClient) -> None:
    with pytest.raises(errors.IncompleteGenerationError):
        await collect(client.generate_stream("cut stream"))
    with pytest.raises(errors.IncompleteGenerationError):
        await collect(client.chat_stream([{"role": "user", "content": "cut stream"}]))


async def test_server_validation_error_sent_as_stream_event(client: AsyncClient) -> None:
    with pytest.raises(errors.ValidationError, match="max_new_tokens"):
        await collect(client.generate_stream("Hi", max_new_tokens=600))


async def test_client_side_validation_is_eager(client: AsyncClient, fake_server: Any) -> None:
    before = len(fake_server.requests)
    with pytest.raises(errors.ValidationError, match="`temperature`"):
        await client.generate("Hi", temperature=0.0)
    with pytest.raises(errors.ValidationError, match="`best_of`"):
        await client.generate("Hi", best_of=2)
    # Raised when called, before any iteration.
    with pytest.raises(errors.ValidationError, match="`typical_p`"):
        client.generate_stream("Hi", typical_p=2.0)
    assert len(fake_server.requests) == before


async def test_api_key(fake_server_with_key: Any) -> None:
    with pytest.raises(errors.UnauthorizedError):
        await AsyncClient(fake_server_with_key.url).generate("Hi")
    keyed = AsyncClient(fake_server_with_key.url, api_key="secret", cookies={"c": "1"})
    assert (await keyed.generate("Hi", max_new_tokens=1)).generated_text == " The"
    sent = fake_server_with_key.requests[-1]
    assert sent["headers"]["authorization"] == "Bearer secret"
    assert sent["cookies"] == {"c": "1"}


async def test_timeout(fake_server: Any) -> None:
    with pytest.raises(errors.ClientTimeoutError):
        await AsyncClient(fake_server.url, timeout=0.1).generate("sleep 0.5")


async def test_unreachable_server(closed_port_url: str) -> None:
    with pytest.raises(errors.ConnectionFailedError):
        await AsyncClient(closed_port_url).generate("Hi")


async def test_shared_pool_inside_async_with(fake_server: Any) -> None:
    async with AsyncClient(fake_server.url) as client:
        pool = client._http
        assert (await client.generate("Hi", max_new_tokens=1)).generated_text == " The"
        assert len(await collect(client.generate_stream("Hi", max_new_tokens=2))) == 2
        assert client._http is pool is not None
    assert client._http is None


async def test_mock_transport_stream() -> None:
    body = (
        b'data: {"id":"","object":"text_completion","created":1,"model":"m",'
        b'"choices":[{"index":0,"text":"ok","finish_reason":"length"}]}\n\n'
        b": comment\n\ndata: [DONE]\n\n"
    )

    async def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/completions"
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    client = AsyncClient("http://fake", transport=httpx.MockTransport(handler))
    chunks = await collect(client.completion_stream("Hi"))
    assert [c.choices[0].text for c in chunks] == ["ok"]
