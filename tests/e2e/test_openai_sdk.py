"""End to end: the `openai` SDK against the launcher serving the embedded default model."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from openai import NotFoundError, OpenAI, UnprocessableEntityError
from openai.types.chat import ChatCompletionMessageParam

pytestmark = pytest.mark.e2e

# TGI's README spells the model "tgi"; answers name the served model.
MODEL = "tgi"
SERVED = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Name the capital of France."}
]


@pytest.fixture(scope="module")
def client(live_server: str) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{live_server}/v1", api_key="-", timeout=120, max_retries=0) as openai:
        yield openai


def test_models_list_names_the_served_model(client: OpenAI) -> None:
    (model,) = client.models.list().data
    assert model.id == SERVED
    assert model.object == "model"


def test_chat_completion_answers_paris(client: OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=20,
    )
    choice = answer.choices[0]
    assert "Paris" in (choice.message.content or "")
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert answer.usage is not None
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    assert answer.model == SERVED


def test_chat_completion_stream_answers_paris_with_usage(client: OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_completion_continues_a_prompt(client: OpenAI) -> None:
    answer = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5
    )
    assert answer.choices[0].text
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage is not None and 0 < answer.usage.completion_tokens <= 5


def test_presence_penalty_steers_away_from_tokens_already_used(client: OpenAI) -> None:
    def complete(presence_penalty: float) -> str:
        answer = client.completions.create(
            model=MODEL,
            prompt="red red red red red red red red",
            temperature=0,
            max_tokens=12,
            presence_penalty=presence_penalty,
        )
        return answer.choices[0].text

    plain, penalized = complete(0.0), complete(2.0)
    assert plain.split().count("red") > penalized.split().count("red")


def test_logit_bias_bans_and_forces_tokens(client: OpenAI, live_server: str) -> None:
    prompt = "The capital of France is"
    details = httpx.post(
        f"{live_server}/generate",
        json={"inputs": prompt, "parameters": {"max_new_tokens": 1, "details": True}},
        timeout=120,
    ).json()["details"]
    greedy = details["tokens"][0]  # " Paris"
    (forced,) = httpx.post(f"{live_server}/tokenize", json={"inputs": " Berlin"}).json()[:1]

    def first_text(bias: dict[str, int]) -> str:
        answer = client.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=2, logit_bias=bias
        )
        return answer.choices[0].text

    assert first_text({}).startswith(greedy["text"])
    assert not first_text({str(greedy["id"]): -100}).startswith(greedy["text"])
    assert first_text({str(forced["id"]): 100}).startswith(forced["text"])


def test_a_token_id_prompt_completes_like_its_text(client: OpenAI, live_server: str) -> None:
    text = "The capital of France is"
    ids = [t["id"] for t in httpx.post(f"{live_server}/tokenize", json={"inputs": text}).json()]

    def complete(prompt: str | list[int]) -> str:
        answer = client.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=6, echo=True
        )
        return answer.choices[0].text

    assert complete(ids) == complete(text)


@pytest.mark.parametrize("name", [SERVED, "SmolLM2-135M-Instruct", "tgi"])
def test_the_served_name_and_tgi_are_accepted(client: OpenAI, name: str) -> None:
    answer = client.completions.create(model=name, prompt="Hi", temperature=0, max_tokens=1)
    assert answer.model == SERVED


def test_another_model_name_is_openais_404(client: OpenAI) -> None:
    with pytest.raises(NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=1)
    assert "`gpt-4o` does not exist" in str(caught.value)
    assert SERVED in str(caught.value)
    assert caught.value.code == "model_not_found"


def test_the_sdk_error_carries_the_servers_reason(client: OpenAI) -> None:
    with pytest.raises(UnprocessableEntityError) as caught:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10**6)
    assert "max_tokens" in str(caught.value) or "max_new_tokens" in str(caught.value)
    assert caught.value.type == "invalid_request_error"
