"""Every validation rule: TGI's message, 422 with error_type validation, and the server lives on."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from textgate.router.config import RouterConfig
from textgate.router.generation.schemas import GenerateRequest
from textgate.router.generation.validation import ValidationError, Validator, token_spans
from textgate.tests.router.fake_shard import FakeTokenizer

LONG_PROMPT = " ".join(["w5"] * 65)  # max_input_tokens is 64 in the test config

# (parameters, inputs, stream, message) — messages are TGI's.
RULES: list[tuple[dict[str, Any], str, bool, str]] = [
    ({}, "", False, "`inputs` cannot be empty"),
    ({"temperature": 0}, "w5", False, "`temperature` must be strictly positive"),
    ({"temperature": -1.0}, "w5", False, "`temperature` must be strictly positive"),
    ({"repetition_penalty": 0}, "w5", False, "`repetition_penalty` must be strictly positive"),
    ({"frequency_penalty": 2.5}, "w5", False, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"frequency_penalty": -3}, "w5", False, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"presence_penalty": 2.5}, "w5", False, "`presence_penalty` must be >= -2.0 and <= 2.0"),
    ({"logit_bias": {"7": 101}}, "w5", False, "`logit_bias` values must be >= -100 and <= 100"),
    (
        {"logit_bias": {"1000": 1}},
        "w5",
        False,
        "`logit_bias` token id 1000 is not in the vocabulary",
    ),
    ({"logit_bias": {"-1": 1}}, "w5", False, "`logit_bias` token id -1 is not in the vocabulary"),
    ({"top_p": 0}, "w5", False, "`top_p` must be > 0.0 and < 1.0"),
    ({"top_p": 1.0}, "w5", False, "`top_p` must be > 0.0 and < 1.0"),
    ({"typical_p": 0}, "w5", False, "`typical_p` must be > 0.0 and < 1.0"),
    ({"typical_p": 1.5}, "w5", False, "`typical_p` must be > 0.0 and < 1.0"),
    ({"top_k": 0}, "w5", False, "`top_k` must be strictly positive"),
    ({"top_k": -5}, "w5", False, "`top_k` must be strictly positive"),
    ({"max_new_tokens": 0}, "w5", False, "`max_new_tokens` must be strictly positive"),
    ({"max_new_tokens": -3}, "w5", False, "`max_new_tokens` must be strictly positive"),
    (
        {"max_new_tokens": 10},
        LONG_PROMPT,
        False,
        "`inputs` must have less than 64 tokens. Given: 65. Shorten it, or set `truncate` "
        "to keep only its last 64 tokens; the server's limit is `--max-input-tokens`.",
    ),
    (
        {"max_new_tokens": 1000},
        LONG_PROMPT,
        False,
        "`inputs` must have less than 64 tokens. Given: 65.",
    ),
    (
        {"max_new_tokens": 100},
        "w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21 w22 w23 w24 w25 w26 w27 w28 w29 w30 w31 w32 w33",
        False,
        "`inputs` tokens + `max_new_tokens` must be <= 128. Given: 29 `inputs` tokens and 100 "
        "`max_new_tokens`; at most 99 new tokens fit after this prompt",
    ),
    (
        {"stop": ["a", "b", "c", "d", "e"]},
        "w5",
        False,
        "`stop` supports up to 4 stop sequences. Given: 5",
    ),
    ({"top_n_tokens": 6}, "w5", False, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ({"best_of": 3, "do_sample": True}, "w5", False, "`best_of` must be > 0 and <= 2. Given: 3"),
    ({"best_of": 0}, "w5", False, "`best_of` must be > 0 and <= 2. Given: 0"),
    ({"best_of": 2}, "w5", False, "you must use sampling when `best_of` is > 1"),
    (
        {"best_of": 2, "do_sample": True, "seed": 3},
        "w5",
        False,
        "`seed` must not be set when `best_of` > 1",
    ),
    (
        {"best_of": 2, "do_sample": True},
        "w5",
        True,
        "`best_of` != 1 is not supported when streaming tokens",
    ),
    (
        {"decoder_input_details": True},
        "w5",
        True,
        "`decoder_input_details` == true is not supported when streaming tokens",
    ),
    (
        {"truncate": 0},
        "w5",
        False,
        "`truncate` must be strictly positive and less than 64. Given: 0",
    ),
    (
        {"truncate": 65},
        "w5",
        False,
        "`truncate` must be strictly positive and less than 64. Given: 65",
    ),
    ({"watermark": True}, "w5", False, "`watermark` is not supported"),
    (
        {"adapter_id": "my-lora"},
        "w5",
        False,
        "`adapter_id` 'my-lora' is not a loaded adapter; loaded: none",
    ),
    ({"grammar": {"type": "regex", "value": "(a"}}, "w5", False, "Grammar is not valid: not a"),
    ({"seed": -1}, "w5", False, "`seed` must be >= 0 and < 2^64"),
    ({"seed": 2**64}, "w5", False, "`seed` must be >= 0 and < 2^64"),
    (
        {"max_new_tokens": 3, "min_new_tokens": 4},
        "w5",
        False,
        "`min_new_tokens` must be >= 0 and <= `max_new_tokens`",
    ),
]


@pytest.fixture
def validator(make_config: Callable[..., RouterConfig]) -> Iterator[Validator]:
    validator = Validator(make_config(), FakeTokenizer())
    yield validator
    validator.close()


def generate_request(inputs: str, **parameters: Any) -> GenerateRequest:
    return GenerateRequest.model_validate({"inputs": inputs, "parameters": parameters})


@pytest.mark.parametrize(("parameters", "inputs", "stream", "message"), RULES)
async def test_rule_rejects_with_tgi_message(
    validator: Validator, parameters: dict[str, Any], inputs: str, stream: bool, message: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        await validator.validate(generate_request(inputs, **parameters), stream=stream)
    assert str(caught.value).startswith(message)
    assert caught.value.error_type == "validation"


async def test_every_rule_is_422_over_http_and_the_server_keeps_serving(
    router: httpx.AsyncClient,
) -> None:
    for parameters, inputs, stream, message in RULES:
        route = "/generate_stream" if stream else "/generate"
        response = await router.post(route, json={"inputs": inputs, "parameters": parameters})
        assert response.status_code == 422, message
        body = response.json()
        assert body["error_type"] == "validation"
        assert body["error"].startswith(message)
        ok = await router.post(route, json={"inputs": "w5", "parameters": {"max_new_tokens": 1}})
        assert ok.status_code == 200


async def test_defaults_are_tgis(validator: Validator) -> None:
    valid = await validator.validate(generate_request("w5 w6"))
    assert valid.input_ids == (5, 6)
    assert valid.max_new_tokens == 128 - 2, "the default is bounded by what max_total leaves"
    sampling = valid.sampling
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.typical_p) == (
        1.0,
        0,
        1.0,
        1.0,
    )
    assert (sampling.repetition_penalty, sampling.frequency_penalty) == (1.0, 0.0)
    assert sampling.presence_penalty == 0.0
    assert sampling.do_sample is False
    assert 0 <= sampling.seed < 2**64
    assert valid.top_n_tokens == 0 and valid.best_of == 1
    assert valid.stopping.stop_sequences == () and not valid.stopping.ignore_eos_token


@pytest.mark.parametrize(("default", "expected"), [(20, 20), (256, 126)])
async def test_an_unset_length_is_the_default_max_new_tokens(
    make_config: Callable[..., RouterConfig], default: int, expected: int
) -> None:
    validator = Validator(make_config(default_max_new_tokens=default), FakeTokenizer())
    try:
        valid = await validator.validate(generate_request("w5 w6"))
        assert valid.max_new_tokens == expected
        long_prompt = await validator.validate(generate_request(" ".join(["w5"] * 64)))
        assert long_prompt.max_new_tokens == min(default, 128 - 64)
    finally:
        validator.close()


async def test_seeds_are_random_unless_given(validator: Validator) -> None:
    seeds = {(await validator.validate(generate_request("w5"))).sampling.seed for _ in range(5)}
    assert len(seeds) == 5
    given = await validator.validate(generate_request("w5", seed=42))
    assert given.sampling.seed == 42


async def test_a_sampling_parameter_turns_sampling_on(validator: Validator) -> None:
    valid = await validator.validate(generate_request("w5", temperature=0.7))
    assert valid.sampling.do_sample and valid.sampling.temperature == pytest.approx(0.7)


async def test_truncate_keeps_the_last_tokens(validator: Validator) -> None:
    valid = await validator.validate(generate_request("w5 w6 w7 w8", truncate=2))
    assert valid.input_ids == (7, 8)
    assert valid.inputs == "w5 w6 w7 w8"


async def test_benchmark_knobs_reach_the_stopping_parameters(validator: Validator) -> None:
    valid = await validator.validate(
        generate_request("w5", max_new_tokens=8, ignore_eos=True, min_new_tokens=4, stop=["x"])
    )
    stopping = valid.to_pb(0).stopping_parameters
    assert stopping.ignore_eos_token and stopping.min_new_tokens == 4
    assert list(stopping.stop_sequences) == ["x"] and stopping.max_new_tokens == 8


async def test_tokenization_runs_off_the_event_loop(
    make_config: Callable[..., RouterConfig],
) -> None:
    threads = []

    class RecordingTokenizer(FakeTokenizer):
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            threads.append(threading.current_thread())
            return super().encode(text, add_special_tokens)

    validator = Validator(make_config(), RecordingTokenizer())
    try:
        await validator.validate(generate_request("w5"))
    finally:
        validator.close()
    assert threads and threads[0] is not threading.main_thread()


async def test_tokenizer_errors_are_validation_errors(
    make_config: Callable[..., RouterConfig],
) -> None:
    class BrokenTokenizer:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            raise RuntimeError("boom")

    validator = Validator(make_config(), BrokenTokenizer())
    with pytest.raises(ValidationError, match="tokenizer error boom"):
        await validator.validate(generate_request("w5"))
    validator.close()


def test_token_spans_come_from_a_fast_tokenizers_offsets(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    spans = token_spans(tokenizer, "w5 w17  w6", add_special_tokens=True)
    assert [(s.id, s.text, s.start, s.stop) for s in spans] == [
        (5, "w5", 0, 2),
        (17, "w17", 3, 6),
        (6, "w6", 8, 10),
    ]


def test_token_spans_without_offsets_are_empty_like_tgis() -> None:
    class EncodeOnly:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [1, 2]

    spans = token_spans(EncodeOnly(), "anything", add_special_tokens=True)
    assert [(s.id, s.text, s.start, s.stop) for s in spans] == [(1, "", 0, 0), (2, "", 0, 0)]


async def test_tokenize_truncates_and_checks_truncate(validator: Validator) -> None:
    tokens = await validator.tokenize(generate_request("w5 w6 w7", truncate=1))
    assert [(t.id, t.text) for t in tokens] == [(7, "w7")]
    with pytest.raises(ValidationError, match="`truncate` must be strictly positive"):
        await validator.tokenize(generate_request("w5", truncate=0))


async def test_token_ids_of_a_tokenizer_without_a_size_need_only_be_non_negative(
    make_config: Callable[..., RouterConfig],
) -> None:
    class SizelessTokenizer:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [5]

    validator = Validator(make_config(), SizelessTokenizer())
    try:
        bias = GenerateRequest(inputs="w5", parameters={"logit_bias": {"123456": 1.0}})
        assert (await validator.validate(bias)).sampling.logit_bias == ((123456, 1.0),)
        with pytest.raises(ValidationError, match="`prompt` token id -3 is negative"):
            await validator.validate(GenerateRequest(inputs="x"), input_ids=[5, -3])
    finally:
        validator.close()


async def test_a_grammar_is_the_requests_constraint(
    make_config: Callable[..., RouterConfig],
) -> None:
    grammar = {"type": "regex", "value": "[ab]+"}
    validator = Validator(make_config(), FakeTokenizer())
    try:
        constrained = await validator.validate(generate_request("w5 w6", grammar=grammar))
        assert constrained.grammar is not None and constrained.grammar.value == "[ab]+"
        assert (await validator.validate(generate_request("w5 w6"))).grammar is None
    finally:
        validator.close()
