"""`Client` against the fake TGI server (uvicorn on a free port) and httpx MockTransport."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from textgate.client import Client, errors
from textgate.client.openai_types import ChatCompletion, Completion
from textgate.client.types import FinishReason, StreamResponse

USER = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture
def client(fake_server: Any) -> Client:
    return Client(fake_server.url, timeout=5)


def test_generate(client: Client) -> None:
    answer = client.generate("Why is the sky blue?")
    assert answer.generated_text == " The sky is blue."
    assert answer.details.finish_reason is FinishReason.EndOfSequenceToken
    assert answer.details.generated_tokens == len(answer.details.tokens) == 6
    assert answer.details.tokens[-1].special
    assert answer.details.prefill == [] and answer.details.seed is None


def test_generate_parameters_reach_the_server(client: Client, fake_server: Any) -> None:
    answer = client.generate(
        "Why is the sky",
        stop_sequences=[" is"],
        return_full_text=True,
        decoder_input_details=True,
        top_n_tokens=2,
        ignore_eos=True,
        min_new_tokens=1,
    )
    assert answer.generated_text == "Why is the sky The sky is"
    assert answer.details.finish_reason is FinishReason.StopSequence
    assert [t.text for t in answer.details.prefill] == ["Why", "is", "the", "sky"]
    assert answer.details.top_tokens is not None
    assert [len(step) for step in answer.details.top_tokens] == [2, 2, 2]
    sent = fake_server.requests[-1]
    assert sent["path"] == "/generate"
    assert sent["json"]["parameters"]["stop"] == [" is"]
    assert sent["json"]["parameters"]["ignore_eos"] is True


def test_generate_sampling_best_of(client: Client) -> None:
    answer = client.generate("Hi", do_sample=True, best_of=2, max_new_tokens=2)
    assert answer.details.finish_reason is FinishReason.Length
    assert answer.details.seed == 1234
    assert answer.details.best_of_sequences is not None
    assert len(answer.details.best_of_sequences) == 1


def test_generate_stream(client: Client) -> None:
    events = list(client.generate_stream("Hi", top_n_tokens=3, max_new_tokens=4))
    assert all(isinstance(event, StreamResponse) for event in events)
    assert [event.is_final for event in events] == [False, False, False, True]
    assert "".join(e.token.text for e in events if not e.token.special) == events[-1].generated_text
    assert all(len(event.top_tokens or []) == 3 for event in events)
    final = events[-1].details
    assert final is not None
    assert (final.finish_reason, final.generated_tokens) == (FinishReason.Length, 4)


def test_generate_stream_can_stop_early(client: Client) -> None:
    stream = client.generate_stream("Hi")
    assert next(stream).token.text == " The"
    stream.close()  # type: ignore[attr-defined]


def test_chat(client: Client) -> None:
    answer = client.chat(USER, max_tokens=3)
    assert isinstance(answer, ChatCompletion)
    assert answer.choices[0].message.content == " The sky is"
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == 3


def test_chat_stream(client: Client, fake_server: Any) -> None:
    chunks = list(client.chat_stream(USER, temperature=0.5, stop=[" blue"]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == " The sky is blue"
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"
    body = fake_server.requests[-1]["json"]
    assert body["stream"] is True and body["stop"] == [" blue"] and body["model"] == "tgi"
    via_flag = client.chat(USER, stream=True)
    assert not isinstance(via_flag, ChatCompletion)
    assert len(list(via_flag)) == 6


def test_completion(client: Client) -> None:
    answer = client.completion("Hi", max_tokens=2)
    assert isinstance(answer, Completion)
    assert answer.choices[0].text == " The sky"
    chunks = list(client.completion_stream(["Hi"], max_tokens=2))  # CRLF-framed stream
    assert "".join(c.choices[0].text for c in chunks) == " The sky"
    via_flag = client.completion("Hi", stream=True)
    assert not isinstance(via_flag, Completion)
    assert len(list(via_flag)) == 6


def _calls(client: Client, prompt: str) -> dict[str, Callable[[], Any]]:
    messages = [{"role": "user", "content": prompt}]
    return {
        "generate": lambda: client.generate(prompt),
        "generate_stream": lambda: list(client.generate_stream(prompt)),
        "chat": lambda: client.chat(messages),
        "chat_stream": lambda: list(client.chat_stream(messages)),
        "completion": lambda: client.completion(prompt),
        "completion_stream": lambda: list(client.completion_stream(prompt)),
    }


def test_error_answers_are_mapped(client: Client, error_case: tuple[str, str, str]) -> None:
    prompt, class_name, message = error_case
    for route, call in _calls(client, prompt).items():
        with pytest.raises(errors.TextGateError) as caught:
            call()
        assert type(caught.value).__name__ == class_name, route
        assert caught.value.message == message, route


def _stream(client: Client, route: str, prompt: str) -> Iterator[Any]:
    if route == "chat_stream":
        return client.chat_stream([{"role": "user", "content": prompt}])
    return client.generate_stream(prompt)


@pytest.mark.parametrize("route", ["generate_stream", "chat_stream"])
def test_error_event_mid_stream(client: Client, route: str) -> None:
    received = []
    with pytest.raises(errors.GenerationError, match="fake failure mid-stream"):
        for item in _stream(client, route, "fail mid-stream"):
            received.append(item)
    assert len(received) == 2


@pytest.mark.parametrize("route", ["generate_stream", "chat_stream"])
def test_stream_cut_short_is_incomplete(client: Client, route: str) -> None:
    with pytest.raises(errors.IncompleteGenerationError):
        list(_stream(client, route, "cut stream"))


def test_server_validation_error_sent_as_stream_event(client: Client) -> None:
    # TGI reports validation failures of /generate_stream as an event of a 200 stream.
    with pytest.raises(errors.ValidationError, match="max_new_tokens") as caught:
        list(client.generate_stream("Hi", max_new_tokens=600))
    assert caught.value.status_code == 200


def test_client_side_validation_sends_nothing(client: Client, fake_server: Any) -> None:
    before = len(fake_server.requests)
    with pytest.raises(errors.ValidationError, match="`temperature` must be strictly positive"):
        client.generate("Hi", temperature=0)
    with pytest.raises(errors.ValidationError, match="`top_p`"):
        client.generate_stream("Hi", top_p=1.0)
    with pytest.raises(errors.ValidationError, match="`max_tokens`"):
        client.chat(USER, max_tokens=0)
    assert len(fake_server.requests) == before


def test_api_key_headers_and_cookies(fake_server_with_key: Any) -> None:
    with pytest.raises(errors.UnauthorizedError, match="Unauthorized"):
        Client(fake_server_with_key.url).generate("Hi")
    client = Client(
        fake_server_with_key.url,
        headers={"X-Trace": "t1"},
        cookies={"session": "s1"},
        api_key="secret",
    )
    assert client.generate("Hi", max_new_tokens=1).generated_text == " The"
    sent = fake_server_with_key.requests[-1]
    assert sent["headers"]["authorization"] == "Bearer secret"
    assert sent["headers"]["x-trace"] == "t1"
    assert sent["cookies"] == {"session": "s1"}


def test_timeout(fake_server: Any) -> None:
    with pytest.raises(errors.ClientTimeoutError, match=r"timeout 0\.1s"):
        Client(fake_server.url, timeout=0.1).generate("sleep 0.5")


def test_unreachable_server(closed_port_url: str) -> None:
    with pytest.raises(errors.ConnectionFailedError, match="cannot connect"):
        Client(closed_port_url).generate("Hi")


def test_unknown_route_is_not_found(fake_server: Any) -> None:
    with pytest.raises(errors.NotFoundError):
        Client(fake_server.url + "/nowhere").generate("Hi")


def test_shared_pool_inside_with(fake_server: Any) -> None:
    with Client(fake_server.url) as client:
        pool = client._http
        assert client.generate("Hi", max_new_tokens=1).generated_text == " The"
        assert len(list(client.generate_stream("Hi", max_new_tokens=2))) == 2
        assert client._http is pool is not None
    assert client._http is None
    assert client.generate("Hi", max_new_tokens=1).generated_text == " The"


def test_stream_read_one_byte_at_a_time() -> None:
    events = [
        b": keep-alive\r\n\r\n",
        b'data: {"index":1,"token":{"id":1,"text":" caf\xc3\xa9","logprob":-1.0,"special":false}}\r\n\r\n',
        b'data: {"index":2,"token":{"id":2,"text":"</s>","logprob":null,"special":true},'
        b'"generated_text":" caf\xc3\xa9","details":{"finish_reason":"eos_token","generated_tokens":2}}\r\n\r\n',
    ]
    body = b"".join(events)

    def handler(request: httpx.Request) -> httpx.Response:
        chunks = (body[i : i + 1] for i in range(len(body)))
        return httpx.Response(200, content=chunks, headers={"content-type": "text/event-stream"})

    client = Client("http://fake", transport=httpx.MockTransport(handler))
    stream = list(client.generate_stream("Hi"))
    assert [e.token.text for e in stream] == [" café", "</s>"]
    assert stream[-1].generated_text == " café"


def test_request_shape_matches_tgi() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(422, json={"error": "no", "error_type": "validation"})

    client = Client("http://fake/", transport=httpx.MockTransport(handler))
    with pytest.raises(errors.ValidationError):
        client.generate("Hi", stop_sequences=["."], seed=4)
    request = seen[0]
    assert (request.method, str(request.url)) == ("POST", "http://fake/generate")
    assert request.headers["content-type"] == "application/json"
    body = httpx.Response(200, content=request.content).json()
    assert body["inputs"] == "Hi"
    assert body["parameters"]["stop"] == ["."] and body["parameters"]["seed"] == 4
