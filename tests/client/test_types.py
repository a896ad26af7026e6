from __future__ import annotations

from textgate.client.openai_types import ChatCompletion, ChatCompletionChunk, Completion
from textgate.client.types import FinishReason, Response, StreamResponse

TOKEN = {"id": 5, "text": " Paris", "logprob": -0.1, "special": False}


def test_generate_answer_as_tgi_documents_it() -> None:
    answer = Response.model_validate(
        {
            "generated_text": " Paris",
            "details": {
                "finish_reason": "eos_token",
                "generated_tokens": 1,
                "seed": None,
                "prefill": [{"id": 1, "text": "The", "logprob": None}],
                "tokens": [TOKEN],
                "top_tokens": [[TOKEN]],
                "best_of_sequences": [
                    {
                        "generated_text": " Lyon",
                        "finish_reason": "length",
                        "generated_tokens": 1,
                        "seed": 7,
                        "prefill": [],
                        "tokens": [TOKEN],
                    }
                ],
            },
        }
    )
    assert answer.details.finish_reason is FinishReason.EndOfSequenceToken
    assert answer.details.prefill[0].logprob is None
    assert answer.details.best_of_sequences is not None
    assert answer.details.best_of_sequences[0].seed == 7


def test_stream_events() -> None:
    token = StreamResponse.model_validate(
        {"index": 1, "token": TOKEN, "top_tokens": [], "generated_text": None, "details": None}
    )
    final = StreamResponse.model_validate(
        {
            "index": 2,
            "token": {**TOKEN, "special": True},
            "generated_text": " Paris",
            "details": {"finish_reason": "length", "generated_tokens": 2, "input_length": 3},
        }
    )
    assert not token.is_final and final.is_final
    assert final.details is not None and final.details.input_length == 3


def test_chat_completion_with_tool_call() -> None:
    answer = ChatCompletion.model_validate(
        {
            "id": "",
            "object": "chat.completion",
            "created": 1,
            "model": "m",
            "system_fingerprint": "x",
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "0",
                                "type": "function",
                                "function": {"name": "f", "arguments": {}},
                            }
                        ],
                    },
                    "logprobs": {
                        "content": [
                            {
                                "token": "a",
                                "logprob": -1,
                                "top_logprobs": [{"token": "a", "logprob": -1}],
                            }
                        ]
                    },
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
        }
    )
    message = answer.choices[0].message
    assert message.tool_calls is not None and message.tool_calls[0].function.name == "f"


def test_chunk_accepts_tgi_single_tool_call_delta() -> None:
    chunk = ChatCompletionChunk.model_validate(
        {
            "id": "",
            "created": 1,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "role": "assistant",
                        "tool_calls": {
                            "index": 0,
                            "id": "",
                            "type": "function",
                            "function": {"name": None, "arguments": "{"},
                        },
                    },
                }
            ],
        }
    )
    calls = chunk.choices[0].delta.tool_calls
    assert calls is not None and calls[0].function is not None
    assert calls[0].function.arguments == "{"


def test_completion_keeps_tgi_float_logprobs() -> None:
    completion = Completion.model_validate(
        {
            "id": "",
            "created": 1,
            "model": "m",
            "system_fingerprint": "x",
            "choices": [{"index": 0, "text": "hi", "logprobs": [-0.5], "finish_reason": "length"}],
        }
    )
    assert completion.choices[0].logprobs == [-0.5]
    assert completion.usage is None
