from __future__ import annotations

import json

import pytest

from textgate.bench.serving.backends import GenerationSettings, StreamChunk, get_backend
from textgate.bench.serving.workload import BenchRequest

REQUEST = BenchRequest(prompt="Hello there", prompt_len=2)
SETTINGS = GenerationSettings(output_len=16, ignore_eos=True, model="m")


def test_tgi_payload_forces_length_greedy_with_details() -> None:
    body = get_backend("tgi").payload(REQUEST, SETTINGS)
    assert body == {
        "inputs": "Hello there",
        "parameters": {
            "max_new_tokens": 16,
            "do_sample": False,
            "details": True,
            "ignore_eos": True,
        },
    }


def test_ignore_eos_is_left_out_when_disabled() -> None:
    settings = GenerationSettings(output_len=4, ignore_eos=False)
    assert "ignore_eos" not in get_backend("tgi").payload(REQUEST, settings)["parameters"]
    assert "ignore_eos" not in get_backend("openai-completions").payload(REQUEST, settings)
    assert "ignore_eos" not in get_backend("openai-chat").payload(REQUEST, settings)


def test_openai_payloads() -> None:
    completions = get_backend("openai-completions").payload(REQUEST, SETTINGS)
    assert completions["prompt"] == "Hello there"
    chat = get_backend("openai-chat").payload(REQUEST, SETTINGS)
    assert chat["messages"] == [{"role": "user", "content": "Hello there"}]
    for body in (completions, chat):
        assert body["model"] == "m"
        assert body["max_tokens"] == 16
        assert body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True
        assert body["temperature"] == 0.0


def test_chat_payload_sends_the_conversation_messages() -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    request = BenchRequest(prompt="rendered", prompt_len=3, messages=messages)
    assert get_backend("openai-chat").payload(request, SETTINGS)["messages"] == messages


def tgi_event(text: str, final: bool = False, special: bool = False) -> str:
    return json.dumps(
        {
            "index": 1,
            "token": {"id": 5, "text": text, "logprob": -0.1, "special": special},
            "generated_text": "all" if final else None,
            "details": {"finish_reason": "length", "generated_tokens": 7, "seed": None}
            if final
            else None,
        }
    )


def test_tgi_events() -> None:
    tgi = get_backend("tgi")
    assert tgi.parse(tgi_event(" hi")) == StreamChunk(is_token=True, text=" hi")
    assert tgi.parse(tgi_event("!", final=True)) == StreamChunk(
        is_token=True, text="!", final=True, output_tokens=7
    )
    assert tgi.parse(tgi_event("</s>", special=True)).text == ""


def test_tgi_error_event() -> None:
    chunk = get_backend("tgi").parse('{"error": "out of memory", "error_type": "generation"}')
    assert chunk.error == "generation: out of memory"
    assert not chunk.is_token


def test_completions_events() -> None:
    b = get_backend("openai-completions")
    token = b.parse('{"choices": [{"index": 0, "text": " a", "finish_reason": null}]}')
    assert token == StreamChunk(is_token=True, text=" a")
    special = b.parse('{"choices": [{"index": 0, "text": "", "finish_reason": null}]}')
    assert special.is_token
    closing = b.parse('{"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}')
    assert closing == StreamChunk(final=True)  # complete even if `[DONE]` never follows
    last = b.parse('{"choices": [{"index": 0, "text": " z", "finish_reason": "length"}]}')
    assert last == StreamChunk(is_token=True, text=" z", final=True)
    usage = b.parse('{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9}}')
    assert usage == StreamChunk(output_tokens=9, prompt_tokens=3)
    assert b.parse("[DONE]") == StreamChunk(final=True)


def test_chat_events_skip_role_and_closing_deltas() -> None:
    b = get_backend("openai-chat")
    role = b.parse('{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}')
    assert not role.is_token
    tgi_style = b.parse(
        '{"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}}]}'
    )
    assert tgi_style == StreamChunk(is_token=True, text="Hi")
    closing = b.parse('{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}')
    assert closing == StreamChunk(final=True)  # complete even if `[DONE]` never follows
    assert b.parse('{"choices": [{"delta": {"content": "x"}}], "usage": null}').is_token


def test_openai_error_event() -> None:
    chunk = get_backend("openai-chat").parse(
        '{"error": {"message": "too long", "type": "validation"}}'
    )
    assert chunk.error == "validation: too long"


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="openai-chat"):
        get_backend("grpc")
