"""OpenAI request fields to TGI parameters, and the checks only the OpenAI dialect needs."""

from __future__ import annotations

from typing import Any

import pytest

from textgate.router.config import RouterConfig
from textgate.router.engine.request import SamplingParams, StoppingParams, ValidRequest
from textgate.router.generation.validation import MAX_SEED, ValidationError
from textgate.router.openai.params import (
    Fanout,
    candidates,
    chat_fanout,
    chat_parameters,
    completion_fanout,
    completion_parameters,
    prompt_list,
    scores_prompt_only,
    template_messages,
)
from textgate.router.openai.schemas import ChatCompletionRequest, CompletionRequest

CONFIG = RouterConfig(model_id="m", tokenizer_path="unused", max_best_of=4)


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields}
    )


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **fields})


def test_unset_temperature_samples_at_one() -> None:
    params = chat_parameters(chat(), CONFIG)
    assert params.do_sample
    assert params.temperature is None
    assert params.max_new_tokens is None


def test_temperature_zero_is_greedy_without_warpers() -> None:
    params = chat_parameters(chat(temperature=0, top_p=0.5, top_k=5), CONFIG)
    assert not params.do_sample
    assert (params.temperature, params.top_p, params.top_k) == (None, None, None)


def test_sampling_fields_pass_through() -> None:
    body = chat(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=3,
        stop="END",
        frequency_penalty=0.2,
        presence_penalty=0.3,
        logit_bias={"11": -2.5},
        repetition_penalty=1.1,
        ignore_eos=True,
        min_tokens=2,
        max_tokens=9,
    )
    params = chat_parameters(body, CONFIG)
    assert params.do_sample
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.7, 0.9, 40, 3)
    assert params.stop == ["END"]
    assert (params.frequency_penalty, params.repetition_penalty) == (0.2, 1.1)
    assert params.presence_penalty == 0.3
    assert params.logit_bias == {11: -2.5}
    assert params.ignore_eos and params.min_new_tokens == 2
    assert params.max_new_tokens == 9


def test_openai_neutral_values_read_as_unset() -> None:
    params = chat_parameters(chat(top_p=1, top_k=-1, presence_penalty=0, logit_bias={}), CONFIG)
    assert params.top_p is None and params.top_k is None


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert chat_parameters(chat(max_tokens=5, max_completion_tokens=7), CONFIG).max_new_tokens == 7


def test_logprobs_map_to_top_n_tokens() -> None:
    assert chat_parameters(chat(), CONFIG).top_n_tokens is None
    assert chat_parameters(chat(logprobs=True), CONFIG).top_n_tokens == 0
    assert chat_parameters(chat(logprobs=True, top_logprobs=3), CONFIG).top_n_tokens == 3
    assert completion_parameters(completion(logprobs=2), CONFIG).top_n_tokens == 2


def test_completion_defaults_and_echo_logprobs() -> None:
    params = completion_parameters(completion(), CONFIG)
    assert params.max_new_tokens == 16
    assert not params.decoder_input_details
    echoed = completion_parameters(completion(echo=True, logprobs=0), CONFIG)
    assert echoed.decoder_input_details


def test_prompt_logprobs_ask_for_the_prompt_and_the_most_alternatives() -> None:
    params = completion_parameters(completion(logprobs=1, prompt_logprobs=3), CONFIG)
    assert params.decoder_input_details and params.top_n_tokens == 3
    chat_params = chat_parameters(chat(prompt_logprobs=2), CONFIG)
    assert chat_params.decoder_input_details and chat_params.top_n_tokens == 2


def test_max_tokens_0_with_echo_generates_one_token_to_drop() -> None:
    body = completion(echo=True, max_tokens=0)
    assert completion_parameters(body, CONFIG).max_new_tokens == 1
    assert scores_prompt_only(body)
    assert not scores_prompt_only(completion(echo=True, max_tokens=1))


def test_unknown_fields_are_ignored() -> None:
    assert chat(store=True, metadata={"a": "b"}, parallel_tool_calls=False).messages


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"response_format": {"type": "json_schema"}}, "needs `json_schema`"),
        ({"response_format": {"type": "xml"}}, "`response_format` type must be"),
        ({"top_logprobs": 1}, "needs `logprobs`"),
        ({"logprobs": True, "top_logprobs": 6}, "<= 5"),
        ({"temperature": -0.1}, "`temperature` must be >= 0"),
        ({"top_p": 0}, "`top_p` must be > 0"),
        ({"max_tokens": 0}, "`max_tokens` must be >= 1"),
    ],
)
def test_chat_rejections(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(")):
        chat_parameters(chat(**fields), CONFIG)


def test_text_response_format_and_no_tool_choice_are_accepted() -> None:
    chat_parameters(chat(response_format={"type": "text"}, tool_choice="none", tools=[]), CONFIG)


def test_fanout_limits() -> None:
    assert chat_fanout(chat(n=3), CONFIG) == Fanout(num_choices=3, num_candidates=3)
    assert completion_fanout(completion(n=2, best_of=4), CONFIG) == Fanout(2, 4)
    for body, message in [
        (completion(n=0), "`n` must be >= 1 and <= 4"),
        (completion(n=5), "`n` must be >= 1 and <= 4"),
        (completion(n=2, best_of=1), "`best_of` must be >= `n`"),
        (completion(best_of=5), "`best_of` must be <= 4"),
        (completion(best_of=2, stream=True), "not supported when streaming"),
        (completion(prompt=["a"] * 5), "at most 4 prompts"),
    ]:
        with pytest.raises(ValidationError, match=message):
            completion_fanout(body, CONFIG)


def test_prompt_list() -> None:
    assert prompt_list(completion(prompt="a")) == ["a"]
    assert prompt_list(completion(prompt=["a", "b"])) == ["a", "b"]
    assert prompt_list(completion(prompt=[5, 6])) == [[5, 6]]
    assert prompt_list(completion(prompt=[[5], [6, 7]])) == [[5], [6, 7]]
    for empty in ("", [], ["a", ""], [[5], []]):
        with pytest.raises(ValidationError, match="cannot be empty"):
            prompt_list(completion(prompt=empty))


def test_template_messages_flatten_text_parts() -> None:
    body = chat(
        messages=[
            {"role": "system", "content": "s"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None, "name": "bot"},
        ]
    )
    assert template_messages(body.messages) == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "name": "bot"},
    ]


def test_template_messages_reject_non_text_parts() -> None:
    body = chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(ValidationError, match="'image_url' are not supported"):
        template_messages(body.messages)


def test_candidates_get_consecutive_or_random_seeds() -> None:
    valid = ValidRequest(
        inputs="hi",
        input_ids=(1,),
        sampling=SamplingParams(do_sample=True, seed=MAX_SEED - 1),
        stopping=StoppingParams(max_new_tokens=1),
    )
    assert [c.sampling.seed for c in candidates(valid, MAX_SEED - 1, 3)] == [MAX_SEED - 1, 0, 1]
    random = candidates(valid, None, 3)
    assert random[0] is valid
    assert len({c.sampling.seed for c in random}) == 3


def test_min_p_and_stop_token_ids_pass_through_and_min_p_drops_when_greedy() -> None:
    params = chat_parameters(chat(min_p=0.1, stop_token_ids=[7, 3]), CONFIG)
    assert (params.min_p, params.stop_token_ids) == (0.1, [7, 3])
    greedy = completion_parameters(completion(min_p=0.1, temperature=0, stop_token_ids=[7]), CONFIG)
    assert greedy.min_p is None and greedy.stop_token_ids == [7]


def test_min_p_and_stop_token_ids_reach_the_engine_request() -> None:
    from textgate.router.generation.parameters import sampling_params, stopping_params
    from textgate.router.generation.schemas import GenerateParameters

    p = GenerateParameters(min_p=0.25, stop_token_ids=[9, 4, 9], do_sample=True)
    assert sampling_params(p, 1).to_pb().min_p == 0.25
    assert list(stopping_params(p, 5).to_pb().stop_token_ids) == [4, 9]
    with pytest.raises(ValidationError, match=r"`min_p` must be >= 0\.0 and <= 1\.0"):
        sampling_params(GenerateParameters(min_p=1.5), 1)


def test_max_logit_bias_bounds_every_value() -> None:
    from textgate.router.generation.parameters import sampling_params
    from textgate.router.generation.schemas import GenerateParameters

    p = GenerateParameters(logit_bias={5: 20.0})
    assert sampling_params(p, 1).logit_bias == ((5, 20.0),)
    with pytest.raises(ValidationError, match=r"must be >= -10 and <= 10 \(token 5: 20.0\)"):
        sampling_params(p, 1, max_logit_bias=10)
    with pytest.raises(ValueError, match="max_logit_bias must be > 0"):
        RouterConfig(model_id="m", tokenizer_path="t", max_logit_bias=0)
