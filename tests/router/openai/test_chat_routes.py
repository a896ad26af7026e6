"""The OpenAI chat routes end to end: uvicorn -> the router app -> engine -> fake shard.

/v1/chat/completions (whole answers and streams) and /chat_tokenize; see
routes_helpers for the fake chat template.
"""

from __future__ import annotations

import httpx
import pytest

from textgate.tests.router.fake_shard import FakeShard
from textgate.tests.router.openai.routes_helpers import chat, sse


async def test_chat_completion_has_openai_shape(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/chat/completions", json=chat(max_tokens=3, temperature=0, user="u")
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert isinstance(body["created"], int)
    assert body["model"] == "fake-model"
    assert isinstance(body["system_fingerprint"], str)
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": " t10 t11 t12"},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


async def test_chat_maps_parameters_onto_the_shard_request(
    client: httpx.AsyncClient, fake: FakeShard
) -> None:
    body = chat(
        max_completion_tokens=2,
        max_tokens=50,
        temperature=0.5,
        top_p=0.9,
        seed=7,
        frequency_penalty=0.5,
        presence_penalty=-0.25,
        logit_bias={"7": 5.0, "2": -100},
        ignore_eos=True,
        min_tokens=1,
        min_p=0.05,
        stop_token_ids=[11, 3],
    )
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    (request,) = fake.received_requests()
    assert list(request.input_ids) == [5, 9]
    params, stopping = request.parameters, request.stopping_parameters
    assert params.do_sample and params.seed == 7
    assert params.temperature == pytest.approx(0.5)
    assert params.top_p == pytest.approx(0.9)
    assert params.frequency_penalty == pytest.approx(0.5)
    assert params.presence_penalty == pytest.approx(-0.25)
    assert dict(params.logit_bias) == {7: 5.0, 2: -100.0}
    assert stopping.max_new_tokens == 2
    assert stopping.ignore_eos_token and stopping.min_new_tokens == 1
    assert params.min_p == pytest.approx(0.05)
    assert list(stopping.stop_token_ids) == [3, 11]
    bad = await client.post("/v1/chat/completions", json=chat(stop_token_ids=[10**6]))
    assert bad.status_code == 422 and "`stop_token_ids` token id 1000000" in bad.text


async def test_temperature_zero_is_greedy_and_unset_samples(
    client: httpx.AsyncClient, fake: FakeShard
) -> None:
    await client.post("/v1/chat/completions", json=chat(max_tokens=1, temperature=0, top_p=0.5))
    await client.post("/v1/chat/completions", json=chat(max_tokens=1))
    greedy, default = (r.parameters for r in fake.received_requests())
    assert not greedy.do_sample and greedy.top_p == 1.0
    assert default.do_sample and default.temperature == 1.0


async def test_stop_sequence_is_cut_from_the_answer(client: httpx.AsyncClient) -> None:
    body = chat(max_tokens=10, stop=" t12")
    answer = (await client.post("/v1/chat/completions", json=body)).json()
    assert answer["choices"][0]["message"]["content"] == " t10 t11"
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == 3
    body["include_stop_str_in_output"] = True
    answer = (await client.post("/v1/chat/completions", json=body)).json()
    assert answer["choices"][0]["message"]["content"] == " t10 t11 t12"


async def test_eos_finishes_with_stop(client: httpx.AsyncClient, fake: FakeShard) -> None:
    fake.eos_after = 2
    answer = (await client.post("/v1/chat/completions", json=chat(max_tokens=10))).json()
    assert answer["choices"][0]["message"]["content"] == " t10 t11"
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == 3


async def test_skip_special_tokens_false_keeps_the_eos_text(
    client: httpx.AsyncClient, fake: FakeShard
) -> None:
    fake.eos_after = 2
    body = chat(max_tokens=10, skip_special_tokens=False)
    answer = (await client.post("/v1/chat/completions", json=body)).json()
    assert answer["choices"][0]["message"]["content"] == " t10 t11</s>"
    assert answer["choices"][0]["finish_reason"] == "stop"
    chunks = await sse(client, "/v1/chat/completions", {**body, "stream": True})
    streamed = "".join(
        c["choices"][0]["delta"].get("content") or ""
        for c in chunks
        if c != "[DONE]" and c["choices"]
    )
    assert streamed == " t10 t11</s>"
    completion = {"model": "fake-model", "prompt": "w9", "max_tokens": 10}
    kept = await client.post("/v1/completions", json={**completion, "skip_special_tokens": False})
    assert kept.json()["choices"][0]["text"] == " t10 t11</s>"
    skipped = await client.post("/v1/completions", json=completion)
    assert skipped.json()["choices"][0]["text"] == " t10 t11"


async def test_n_gives_independent_choices(client: httpx.AsyncClient, fake: FakeShard) -> None:
    answer = (
        await client.post("/v1/chat/completions", json=chat(max_tokens=2, n=2, seed=5))
    ).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert answer["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    seeds = sorted(r.parameters.seed for r in fake.received_requests())
    assert seeds == [5, 6]


async def test_n_copies_reuse_one_prefill_of_the_prompt(
    client: httpx.AsyncClient, fake: FakeShard
) -> None:
    words = " ".join(f"w{i}" for i in range(20, 59))  # with " w9", 40 tokens
    answer = (await client.post("/v1/chat/completions", json=chat(words, max_tokens=2, n=2))).json()
    assert [c["message"]["content"] for c in answer["choices"]] == [" t10 t11"] * 2
    # Blocks of 16: the copy waits one step, then computes only the last 8 prompt tokens.
    starts = [
        [(s.start_position, len(s.token_ids)) for s in call.plan.scheduled]
        for call in fake.calls_to("Step")
    ]
    assert starts[:2] == [[(0, 40)], [(40, 1), (32, 8)]]


async def test_chat_logprobs_have_openai_shape(client: httpx.AsyncClient) -> None:
    body = chat(max_tokens=2, temperature=0, logprobs=True, top_logprobs=2)
    choice = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
    first = choice["logprobs"]["content"][0]
    assert first["token"] == " t10"
    assert first["logprob"] == -0.5
    assert first["bytes"] == list(b" t10")
    assert [t["token"] for t in first["top_logprobs"]] == [" t10", " t11"]
    assert len(choice["logprobs"]["content"]) == 2


async def test_chat_prompt_logprobs_score_the_templated_prompt(client: httpx.AsyncClient) -> None:
    # vLLM's extra: beside the choices; more alternatives than `top_logprobs` asks are not
    # shown on the generated tokens.
    body = chat(max_tokens=1, temperature=0, logprobs=True, top_logprobs=1, prompt_logprobs=2)
    answer = (await client.post("/v1/chat/completions", json=body)).json()
    assert answer["prompt_logprobs"] == [  # "w5" and the template's " w9"
        None,
        {"9": {"logprob": -1.0, "rank": None, "decoded_token": " t9"}},
    ]
    (first,) = answer["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in first["top_logprobs"]] == [" t10"]
    plain = (await client.post("/v1/chat/completions", json=chat(max_tokens=1))).json()
    assert "prompt_logprobs" not in plain


async def test_chat_stream_sends_role_content_finish_usage_done(client: httpx.AsyncClient) -> None:
    body = chat(max_tokens=3, stream=True, stream_options={"include_usage": True})
    events = await sse(client, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c["choices"][0]["delta"]["content"] for c in chunks[:-1]]
    assert "".join(content) == " t10 t11 t12"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


async def test_chat_stream_holds_back_stop_sequences(client: httpx.AsyncClient) -> None:
    events = await sse(
        client, "/v1/chat/completions", chat(max_tokens=9, stream=True, stop=[" t12"])
    )
    content = "".join(e["choices"][0]["delta"]["content"] for e in events[:-1])
    assert content == " t10 t11"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert "usage" not in events[-2] or events[-2]["usage"] is None


async def test_chat_stream_with_n_and_logprobs(client: httpx.AsyncClient) -> None:
    body = chat(max_tokens=2, stream=True, n=2, logprobs=True)
    events = await sse(client, "/v1/chat/completions", body)
    for index in (0, 1):
        chunks = [e["choices"][0] for e in events[:-1] if e["choices"][0]["index"] == index]
        assert "".join(c["delta"]["content"] for c in chunks) == " t10 t11"
        assert chunks[-1]["finish_reason"] == "length"
        tokens = [t["token"] for c in chunks if c["logprobs"] for t in c["logprobs"]["content"]]
        assert tokens == [" t10", " t11"]


async def test_chat_tokenize_has_tgi_shape(client: httpx.AsyncClient) -> None:
    body = chat("w5 hello")
    answer = (await client.post("/chat_tokenize", json=body)).json()
    assert answer == {
        "templated_text": "w5 hello w9",
        "tokenize_response": [
            {"id": 5, "text": "w5", "start": 0, "stop": 2},
            {"id": 8, "text": "hello", "start": 3, "stop": 8},
            {"id": 9, "text": "w9", "start": 9, "stop": 11},
        ],
    }


async def test_continue_final_message_prefills_the_answer(
    client: httpx.AsyncClient, fake: FakeShard
) -> None:
    messages = [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w30"}]
    body = {"messages": messages, "max_tokens": 1, "continue_final_message": True}
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    (request,) = fake.received_requests()
    assert list(request.input_ids) == [5, 30]


async def test_explicit_nulls_mean_unset(client: httpx.AsyncClient) -> None:
    # TGI's text-generation client sends every unset field as null.
    body = chat(max_tokens=2, temperature=0, n=None, logprobs=None, stream=None, stop=None)
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1
