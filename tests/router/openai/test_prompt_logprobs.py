"""vLLM's `prompt_logprobs` shape: null first, then the token itself and its alternatives."""

from __future__ import annotations

import math

from textgate.router.engine.channel import TokenInfo
from textgate.router.openai.prompt_logprobs import MIN_LOGPROB, prompt_logprobs


def tok(token_id: int, text: str, logprob: float | None) -> TokenInfo:
    return TokenInfo(id=token_id, text=text, logprob=logprob)


PROMPT = [tok(1, "Hi", None), tok(2, " there", -2.0), tok(3, " you", -0.1)]
TOP = [[], [tok(4, " all", -0.2), tok(2, " there", -2.0)], [tok(3, " you", -0.1)]]


def dumped(num_top: int) -> list[dict[str, dict[str, object]] | None]:
    return [
        None if p is None else {k: v.model_dump() for k, v in p.items()}
        for p in prompt_logprobs(PROMPT, TOP, num_top)
    ]


def test_the_token_comes_first_then_its_alternatives_with_their_ranks() -> None:
    assert dumped(2) == [
        None,
        {
            "2": {"logprob": -2.0, "rank": 2, "decoded_token": " there"},
            "4": {"logprob": -0.2, "rank": 1, "decoded_token": " all"},
        },
        {"3": {"logprob": -0.1, "rank": 1, "decoded_token": " you"}},
    ]
    assert list(dumped(2)[1] or {}) == ["2", "4"]  # vLLM's order: the prompt token first


def test_alternatives_are_cut_to_the_count_asked_and_outsiders_have_no_rank() -> None:
    first = dumped(1)[1]
    assert first == {
        "2": {"logprob": -2.0, "rank": None, "decoded_token": " there"},
        "4": {"logprob": -0.2, "rank": 1, "decoded_token": " all"},
    }
    assert dumped(0)[1] == {"2": {"logprob": -2.0, "rank": None, "decoded_token": " there"}}


def test_unknown_logprobs_are_null_and_minus_infinity_is_the_floor() -> None:
    prompt = [tok(1, "a", None), tok(2, "b", None), tok(3, "c", -math.inf)]
    result = prompt_logprobs(prompt, [], 3)
    assert result[:2] == [None, None]  # a cached prefix has no logprobs
    assert result[2] is not None and result[2]["3"].logprob == MIN_LOGPROB
