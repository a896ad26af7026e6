from __future__ import annotations

import re
from typing import Any

import pytest

from textgate.client.errors import ValidationError
from textgate.client.openai_types import Message
from textgate.client.payloads import (
    chat_payload,
    completion_payload,
    generate_payload,
    method_arguments,
)
from textgate.client.types import Grammar, GrammarType


def test_generate_body_defaults() -> None:
    body = generate_payload("Hi", {}, stream=False)
    assert body == {
        "inputs": "Hi",
        "parameters": {
            "do_sample": False,
            "max_new_tokens": 20,
            "return_full_text": False,
            "stop": [],
            "watermark": False,
            "details": True,
            "decoder_input_details": False,
        },
    }


def test_generate_body_all_parameters() -> None:
    params = {
        "stop_sequences": ["\n"],
        "do_sample": True,
        "temperature": 0.7,
        "top_k": 5,
        "top_p": 0.9,
        "typical_p": 0.5,
        "repetition_penalty": 1.1,
        "frequency_penalty": -0.5,
        "seed": 3,
        "truncate": 10,
        "top_n_tokens": 2,
        "ignore_eos": True,
        "min_new_tokens": 4,
        "grammar": Grammar(type=GrammarType.Json, value={"type": "object"}),
    }
    sent = generate_payload("Hi", params, stream=True)["parameters"]
    assert sent["stop"] == ["\n"] and "stop_sequences" not in sent
    assert sent["grammar"] == {"type": "json", "value": {"type": "object"}}
    assert (sent["ignore_eos"], sent["min_new_tokens"], sent["seed"]) == (True, 4, 3)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"temperature": 0}, "`temperature` must be strictly positive"),
        ({"temperature": -1.0}, "`temperature` must be strictly positive"),
        ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
        ({"top_p": 0.0}, "`top_p` must be > 0.0 and < 1.0"),
        ({"typical_p": 1.5}, "`typical_p` must be > 0.0 and < 1.0"),
        ({"top_k": 0}, "`top_k` must be strictly positive"),
        ({"repetition_penalty": 0}, "`repetition_penalty` must be strictly positive"),
        ({"frequency_penalty": 2.5}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
        ({"seed": -1}, "`seed` must be positive"),
        ({"truncate": 0}, "`truncate` must be strictly positive"),
        ({"top_n_tokens": 0}, "`top_n_tokens` must be strictly positive"),
        ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
        ({"min_new_tokens": -1}, "`min_new_tokens` must be positive"),
        ({"min_new_tokens": 30}, "`min_new_tokens` must be <= `max_new_tokens`"),
        ({"best_of": 0}, "`best_of` must be strictly positive"),
        ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
        (
            {"best_of": 2, "do_sample": True, "seed": 1},
            "`seed` must not be set when `best_of` is > 1",
        ),
        (
            {"grammar": {"type": "regex", "value": ""}},
            "`value` cannot be empty for `regex` grammar",
        ),
        ({"max_new_tokens": "many"}, "`max_new_tokens`: Input should be a valid integer"),
    ],
)
def test_generate_rejects_before_sending(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match="^" + re.escape(message)):
        generate_payload("Hi", params, stream=False)


def test_generate_rejects_empty_prompt_and_best_of_stream() -> None:
    with pytest.raises(ValidationError, match="`inputs` cannot be empty"):
        generate_payload("", {}, stream=False)
    with pytest.raises(ValidationError, match="not supported when `stream` == True"):
        generate_payload("Hi", {"best_of": 2, "do_sample": True}, stream=True)
    assert generate_payload("Hi", {"best_of": 2, "temperature": 0.5}, stream=False)


def test_chat_body() -> None:
    messages: list[Any] = [
        {"role": "system", "content": "Be brief."},
        Message(role="user", content="Hi"),
    ]
    tools = [{"function": {"name": "f", "parameters": {}}}]
    params = {"model": "tgi", "max_tokens": 5, "temperature": 0.0, "stop": None, "tools": tools}
    body = chat_payload(messages, params, stream=False)
    assert body == {
        "model": "tgi",
        "max_tokens": 5,
        "temperature": 0.0,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "stream": False,
    }


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"max_tokens": 0}, "`max_tokens` must be strictly positive"),
        ({"temperature": -0.1}, "`temperature` must be >= 0.0"),
        ({"top_p": 1.5}, "`top_p` must be > 0.0 and <= 1.0"),
        ({"n": 0}, "`n` must be strictly positive"),
        ({"presence_penalty": 3}, "`presence_penalty` must be >= -2.0 and <= 2.0"),
    ],
)
def test_openai_rules(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        chat_payload([{"role": "user", "content": "Hi"}], params, stream=False)
    with pytest.raises(ValidationError, match=re.escape(message)):
        completion_payload("Hi", params, stream=True)


def test_chat_and_completion_reject_empty_input() -> None:
    with pytest.raises(ValidationError, match="`messages` cannot be empty"):
        chat_payload([], {}, stream=False)
    with pytest.raises(ValidationError, match=re.escape("`messages[0].role`: Field required")):
        chat_payload([{"content": "no role"}], {}, stream=False)
    for prompt in ("", [], ["ok", ""]):
        with pytest.raises(ValidationError, match="`prompt` cannot be empty"):
            completion_payload(prompt, {}, stream=False)


def test_completion_body() -> None:
    body = completion_payload(
        ("a", "b"), {"model": "tgi", "seed": None, "max_tokens": 3}, stream=True
    )
    assert body == {"model": "tgi", "max_tokens": 3, "prompt": ["a", "b"], "stream": True}


def test_method_arguments_skips_self_and_named() -> None:
    assert method_arguments({"self": 1, "prompt": "p", "seed": 2}, "prompt") == {"seed": 2}
