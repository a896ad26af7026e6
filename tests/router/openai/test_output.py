"""Text, finish reasons, logprobs and usage of OpenAI bodies, from generated sequences."""

from __future__ import annotations

import math

from textgate.router.engine.channel import Finished, TokenInfo
from textgate.router.generation.result import Generated
from textgate.router.generation.stop_text import TextOptions
from textgate.router.openai.output import (
    MIN_LOGPROB,
    ResponseMeta,
    chat_completion,
    chat_logprobs,
    completion,
    completion_logprobs,
    finish_reason,
    likeliest,
)

META = ResponseMeta(id="x-1", created=1, model="m")


def tok(text: str, logprob: float | None = -0.5, special: bool = False, id: int = 7) -> TokenInfo:
    return TokenInfo(id=id, text=text, logprob=logprob, special=special)


def generated(text: str, reason: str = "length", logprob: float = -0.5) -> Generated:
    tokens = [tok(t, logprob) for t in text.split("|")]
    return Generated(
        finished=Finished("".join(t.text for t in tokens), len(tokens), reason, None),  # type: ignore[arg-type]
        input_length=2,
        queued_at=0.0,
        started_at=0.0,
        tokens=tokens,
    )


def test_finish_reasons() -> None:
    assert finish_reason("length") == "length"
    assert finish_reason("eos_token") == "stop"
    assert finish_reason("stop_sequence") == "stop"


def test_chat_logprobs_shape_and_floor() -> None:
    logprobs = chat_logprobs(
        [tok("a", -1.0), tok("</s>", -0.1, special=True)],
        [[tok("a", -1.0), tok("b", -math.inf)], []],
    )
    (entry,) = logprobs.model_dump()["content"]
    assert entry == {
        "token": "a",
        "logprob": -1.0,
        "bytes": [97],
        "top_logprobs": [
            {"token": "a", "logprob": -1.0, "bytes": [97]},
            {"token": "b", "logprob": MIN_LOGPROB, "bytes": [98]},
        ],
    }


def test_completion_logprobs_with_echoed_prompt() -> None:
    prompt = [tok("Hi", None), tok(" there", -2.0), tok(" you", None)]
    result = completion_logprobs(prompt, [tok("!", -0.5)], [[tok("!", -0.5), tok("?", -1.5)]])
    assert result.model_dump() == {
        "tokens": ["Hi", " there", " you", "!"],
        "token_logprobs": [None, -2.0, None, -0.5],
        # Without alternatives from the shard a prompt token still lists itself (OpenAI's
        # shape: harnesses read it); one with no logprob (a cached prefix) has none.
        "top_logprobs": [None, {" there": -2.0}, None, {"!": -0.5, "?": -1.5}],
        "text_offset": [0, 2, 8, 12],
    }


def test_a_generated_end_of_sequence_is_listed_past_the_text() -> None:
    # lm-evaluation-harness scores entries [context:-1]: the last one must be the generated
    # token, even when it is the end of sequence the text leaves out.
    prompt = [tok("Hi", None), tok(" there", -2.0)]
    result = completion_logprobs(prompt, [tok("</s>", -0.3, special=True)], [[]])
    assert result.tokens == ["Hi", " there", "</s>"]
    assert result.token_logprobs == [None, -2.0, -0.3]
    assert result.text_offset == [0, 2, 8]


def test_echoed_prompt_tokens_carry_their_alternatives_and_themselves() -> None:
    prompt = [tok("Hi", None), tok(" there", -2.0), tok(" you", -0.1)]
    prompt_top = [[], [tok(" all", -0.2)], [tok(" you", -0.1), tok(" me", -3.0)]]
    result = completion_logprobs(prompt, [], [], prompt_top=prompt_top)
    assert result.top_logprobs == [
        None,
        {" all": -0.2, " there": -2.0},  # the token itself joins its top-1
        {" you": -0.1, " me": -3.0},
    ]


def test_likeliest_keeps_the_highest_logprob_sums() -> None:
    low, high, mid = (
        generated("a", logprob=-3),
        generated("b", logprob=-1),
        generated("c", logprob=-2),
    )
    assert likeliest([low, high, mid], 2) == [high, mid]
    assert likeliest([low, high], 2) == [low, high]


def test_chat_completion_counts_every_choice() -> None:
    answer = chat_completion(
        META, [generated("a|b"), generated("c")], 4, TextOptions(), logprobs=False
    ).model_dump()
    assert [c["message"]["content"] for c in answer["choices"]] == ["ab", "c"]
    assert answer["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    assert answer["system_fingerprint"]


def test_completion_orders_choices_by_prompt() -> None:
    answer = completion(
        META,
        ["p0", "p1"],
        [[generated("a")], [generated("b", "stop_sequence")]],
        3,
        TextOptions(stop=("b",)),
        echo=True,
    ).model_dump()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in answer["choices"]] == [
        (0, "p0a", "length"),
        (1, "p1", "stop"),
    ]
    assert answer["usage"]["completion_tokens"] == 2
