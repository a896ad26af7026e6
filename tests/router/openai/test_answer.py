"""Reading a choice's text: content, tool calls, the no_tool answer; stream deltas as its differences."""

from __future__ import annotations

import json
from typing import Any

from textgate.router.generation.answer import Answer, CallText, read_answer
from textgate.router.generation.tools import NO_TOOL
from textgate.router.openai.answer import AnswerStream, answer_message

CALL = '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}'


def stream(pieces: list[str], tools: bool = True) -> tuple[str, list[dict[str, Any]], bool]:
    """The content and tool-call deltas of `pieces` streamed one by one, and `called`."""
    answers = AnswerStream(tools)
    content, deltas = "", []
    for i, piece in enumerate(pieces):
        added, calls = answers.push(piece, i == len(pieces) - 1)
        content += added
        deltas += calls
    return content, deltas, answers.called


def test_a_complete_call_is_its_name_and_arguments_text() -> None:
    answer = read_answer(CALL, ended=True, tools=True)
    assert answer == Answer(None, (CallText("get_weather", '{"city": "Rome", "unit": "c"}'),))
    message = answer_message(CALL, tools=True)
    assert message.content is None and message.tool_calls is not None
    (call,) = message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert call.function.arguments == '{"city": "Rome", "unit": "c"}'


def test_arguments_are_kept_as_generated_unicode_and_escapes_included() -> None:
    arguments = '{"city": "東京 \\"à\\" \\u00e9 🙂", "n": 1.50}'
    text = f'{{"name": "f", "arguments": {arguments}}}'
    assert read_answer(text, ended=True, tools=True).calls == (CallText("f", arguments),)


def test_the_closing_brace_is_held_until_the_text_ends() -> None:
    partial = read_answer('{"name": "f", "arguments": {"a": {"b": 1}', ended=False, tools=True)
    assert partial.calls == (CallText("f", '{"a": {"b": 1'),)
    # Cut short by max_tokens right after a nested close: nothing is the call's brace.
    cut = read_answer('{"name": "f", "arguments": {"a": {"b": 1}', ended=True, tools=True)
    assert cut.calls == (CallText("f", '{"a": {"b": 1}'),)


def test_text_that_never_named_a_call_is_content_once_it_ends() -> None:
    assert read_answer('{"name": "get_wea', ended=False, tools=True) == Answer("")
    assert read_answer('{"name": "get_wea', ended=True, tools=True) == Answer('{"name": "get_wea')


def test_a_no_tool_answer_is_its_content_decoded_as_far_as_complete() -> None:
    def content(text: str, ended: bool = False) -> str | None:
        return read_answer(f'{{"name": "{NO_TOOL}", "arguments": {text}', ended, True).content

    assert content('{"content": "Hi \\"you\\"') == 'Hi "you"'
    assert content('{"content": "a\\') == "a"  # the escape is not complete yet
    assert content('{"content": "a\\u00') == "a"
    assert content('{"content": "a\\ud83d') == "a"  # half of a surrogate pair
    assert content('{"content": "a\\ud83d\\ude42') == "a🙂"
    assert content('{"content": "a\\n東"}}', ended=True) == "a\n東"
    assert content('{"cont') == ""
    assert content('{"cont', ended=True) == f'{{"name": "{NO_TOOL}", "arguments": {{"cont'


def test_a_call_streams_one_delta_per_chunk_with_the_name_first() -> None:
    # The token that completes the name carries the arguments' opening brace too.
    pieces = ['{"name": "get_weather", "arguments', '": {"', 'city": "Rome", "unit": "c"}', "}"]
    answers = AnswerStream(tools=True)
    content, first = answers.push(pieces[0], False)
    assert (content, first) == ("", [])
    _, opened = answers.push(pieces[1], False)
    (delta,) = opened  # one entry: a client reading only the first loses nothing
    assert delta["index"] == 0 and delta["id"].startswith("call_") and delta["type"] == "function"
    assert delta["function"] == {"name": "get_weather", "arguments": '{"'}
    content, deltas, called = stream(pieces)
    arguments = "".join(d["function"]["arguments"] for d in deltas)
    assert called and content == "" and arguments == '{"city": "Rome", "unit": "c"}'


def test_a_no_tool_answer_streams_as_content() -> None:
    text = json.dumps({"name": NO_TOOL, "arguments": {"content": "Hello \u00e9\n"}})
    content, deltas, called = stream([text[i : i + 3] for i in range(0, len(text), 3)])
    assert (content, deltas, called) == ("Hello \u00e9\n", [], False)


def test_plain_text_streams_as_it_comes() -> None:
    assert stream(["a{", '"b', "}"], tools=False) == ('a{"b}', [], False)
