"""Reading a reasoning model's thinking apart from its answer: both parsers, every cut of
the text streaming to the same fields, held-back tags, the OpenAI chat shapes, and
grammars that wait for the thinking on chat turns."""

from __future__ import annotations

import httpx
import pytest

from textgate.router.engine.channel import Finished, StepEvent, TokenInfo
from textgate.router.generation.reasoning import (
    Reasoned,
    ReasoningDiff,
    UnknownReasoningParserError,
    read_reasoning,
    reasoning_parser,
    thinking_markers,
)
from textgate.router.generation.stop_text import TextOptions
from textgate.router.openai.answer import answer_message
from textgate.router.openai.output import ResponseMeta
from textgate.router.openai.stream import ChatChunks
from textgate.tests.router.fake_shard import FakeShard, FakeTokenizer
from textgate.tests.router.openai.routes_helpers import StartRouter, chat, sse

R1 = reasoning_parser("deepseek_r1")
QWEN3 = reasoning_parser("qwen3")

TEXTS = [
    "<think>\nThe user wants a city.</think>\n\nParis.",
    "The prompt opened it. Paris</think>Paris.",
    "  <think>only thinking, cut by max_tokens",
    "No thinking at all: Paris.",
    "<think></think>Straight to it.",
    "a </th b </think> c <think> d",
    "",
]


def test_deepseek_r1_starts_inside_the_thinking() -> None:
    assert read_reasoning(TEXTS[1], True, R1) == Reasoned("The prompt opened it. Paris", "Paris.")
    assert read_reasoning(TEXTS[0], True, R1) == Reasoned("\nThe user wants a city.", "Paris.")
    # Never closed: all of it is thinking (cut by max_tokens).
    assert read_reasoning("still thinking", True, R1) == Reasoned("still thinking", "")


def test_qwen3_thinks_only_when_the_answer_opens_the_tag() -> None:
    assert read_reasoning(TEXTS[0], True, QWEN3) == Reasoned("\nThe user wants a city.", "Paris.")
    assert read_reasoning(TEXTS[3], True, QWEN3) == Reasoned(None, TEXTS[3])
    assert read_reasoning(TEXTS[2], True, QWEN3) == Reasoned("only thinking, cut by max_tokens", "")
    assert read_reasoning(TEXTS[4], True, QWEN3) == Reasoned("", "Straight to it.")


def test_no_parser_reads_everything_as_the_answer() -> None:
    assert read_reasoning(TEXTS[0], True, None) == Reasoned(None, TEXTS[0])


def test_a_tag_cut_by_the_end_of_the_text_so_far_is_held_back() -> None:
    assert read_reasoning("<thi", False, QWEN3) == Reasoned(None, "")
    assert read_reasoning("<thi", True, QWEN3) == Reasoned(None, "<thi")
    assert read_reasoning("<think>abc</th", False, QWEN3) == Reasoned("abc", "")
    assert read_reasoning("<think>abc</thx", False, QWEN3) == Reasoned("abc</thx", "")


@pytest.mark.parametrize("parser", [R1, QWEN3, None], ids=["deepseek_r1", "qwen3", "none"])
@pytest.mark.parametrize("text", TEXTS)
def test_any_split_streams_to_the_final_reading(parser, text) -> None:
    final = read_reasoning(text, True, parser)
    for cut in range(len(text) + 1):
        for second in range(cut, len(text) + 1):
            pieces = [text[:cut], text[cut:second], text[second:]]
            diff = ReasoningDiff(parser)
            thinking, rest = "", ""
            for i, piece in enumerate(pieces):
                more_thinking, more_rest = diff.push(piece, i == len(pieces) - 1)
                thinking += more_thinking
                rest += more_rest
            assert (thinking, rest) == (final.reasoning or "", final.rest), pieces


def test_an_unknown_parser_is_named() -> None:
    with pytest.raises(UnknownReasoningParserError, match="known: deepseek_r1, qwen3"):
        reasoning_parser("r2")


def test_the_message_has_reasoning_content_only_with_thinking() -> None:
    message = answer_message(TEXTS[0], tools=False, reasoning=QWEN3).model_dump(mode="json")
    assert message == {
        "role": "assistant",
        "content": "Paris.",
        "reasoning_content": "\nThe user wants a city.",
    }
    plain = answer_message(TEXTS[3], tools=False, reasoning=QWEN3).model_dump(mode="json")
    assert plain == {"role": "assistant", "content": TEXTS[3]}


def test_tool_calls_are_read_after_the_thinking() -> None:
    text = '<think>call it</think>{"name": "get_weather", "arguments": {"city": "Rome"}}'
    message = answer_message(text, tools=True, reasoning=QWEN3)
    assert message.reasoning_content == "call it" and message.content is None
    assert message.tool_calls is not None
    assert message.tool_calls[0].function.arguments == '{"city": "Rome"}'


def test_chunks_carry_reasoning_content_then_content() -> None:
    writer = ChatChunks(
        ResponseMeta(id="c", created=1, model="m"),
        1,
        TextOptions(),
        logprobs=False,
        reasoning=QWEN3,
    )
    pieces = ["<think>", "Hmm", ", Paris", "</think>", "\n\n", "Paris."]
    deltas = []
    for i, piece in enumerate(pieces):
        done = Finished("".join(pieces), 6, "eos_token", None) if i == 5 else None
        event = StepEvent([TokenInfo(id=i, text=piece, logprob=-0.1)], finished=done)
        chunk = writer.step(0, event)
        if chunk is not None:
            deltas.append(chunk.model_dump(mode="json")["choices"][0]["delta"])
    thinking = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert (thinking, content) == ("Hmm, Paris", "Paris.")
    assert all(not (d.get("reasoning_content") and d.get("content")) for d in deltas)


async def test_the_route_reads_with_the_configured_parser(start_openai: StartRouter) -> None:
    # The fake model's text never closes a thinking block: deepseek_r1 reads it all as
    # thinking (cut by max_tokens), qwen3 as the answer (it never opened one).
    async with httpx.AsyncClient(base_url=await start_openai(reasoning_parser="deepseek_r1")) as c:
        body = (await c.post("/v1/chat/completions", json=chat(max_tokens=3))).json()
        message = body["choices"][0]["message"]
        assert message == {"role": "assistant", "content": "", "reasoning_content": " t10 t11 t12"}
        events = await sse(c, "/v1/chat/completions", chat(max_tokens=3, stream=True))
        deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == " t10 t11 t12"
    async with httpx.AsyncClient(base_url=await start_openai(reasoning_parser="qwen3")) as c:
        body = (await c.post("/v1/chat/completions", json=chat(max_tokens=3))).json()
        assert body["choices"][0]["message"] == {"role": "assistant", "content": " t10 t11 t12"}


def test_markers_are_the_tags_single_tokens() -> None:
    # The fake tokenizer makes each word one token: "<think>" is 3 + 7, "</think>" 3 + 8.
    tokenizer = FakeTokenizer()
    qwen3 = thinking_markers(QWEN3, tokenizer)
    assert qwen3 is not None
    assert (qwen3.start_token_id, qwen3.end_token_id, qwen3.starts_inside) == (10, 11, False)
    r1 = thinking_markers(R1, tokenizer)
    assert r1 is not None and (r1.start_token_id, r1.end_token_id, r1.starts_inside) == (
        None,
        11,
        True,
    )
    assert thinking_markers(None, tokenizer) is None

    class Split(FakeTokenizer):
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [1, 2] if "think" in text else super().encode(text, add_special_tokens)

    assert thinking_markers(QWEN3, Split()) is None  # a tag of two tokens: no waiting


async def test_a_chat_turns_grammar_waits_for_the_thinking(
    start_openai: StartRouter, fake: FakeShard
) -> None:
    base_url = await start_openai(reasoning_parser="qwen3")
    async with httpx.AsyncClient(base_url=base_url) as client:
        body = chat(max_tokens=2, response_format={"type": "json_object"})
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        grammar = {"type": "json", "value": {"type": "object"}}
        tgi = {"inputs": "w5", "parameters": {"max_new_tokens": 2, "grammar": grammar}}
        assert (await client.post("/generate", json=tgi)).status_code == 200
    chat_request, tgi_request = fake.received_requests()
    thinking = chat_request.grammar.thinking
    assert (thinking.start_token_id, thinking.end_token_id, thinking.starts_inside) == (
        10,
        11,
        False,
    )
    # TGI's route reads no thinking out of the text, so its grammar holds from the start.
    assert tgi_request.HasField("grammar") and not tgi_request.grammar.HasField("thinking")
