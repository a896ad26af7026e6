"""What a chat answer says, read from its text the same way while it streams and once it ends.

`read_answer` is the one reading of an answer's text, for every API: its content, and
with tools its calls (name and arguments text). The non-streamed message is the reading
of the final text; a stream's deltas are the differences between successive readings of
the text so far (`AnswerDiff`; each API spells them its own way). What must hold, and
the property tests check: the reading of any prefix of a text is, field by field, a
prefix of the reading of the whole (the same call names, content and each call's
arguments only growing), so the deltas joined are exactly the non-streamed answer,
wherever the token boundaries fall.

With tools the text is one call object, `{"name": "<function>", "arguments": {...}}`
(the compact JSON the tools grammar generates, router/generation/tools.py):

- until `{"name": "...", "arguments": ` is complete it says nothing; a text that ends
  before (cut by max_tokens) is answered as content, as it is;
- a call's arguments are the text after `"arguments": ` less the call object's closing
  brace: a text that ends in `}` holds that brace back until it is known to be the
  last (the whole text parses) or not (more text came, or the text ended unparsable);
- a `no_tool` call's content is its `content` string, decoded as far as its escapes
  are complete (a text that ends before that string starts is content as it is).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from textgate.router.generation.tools import NO_TOOL

# The compact form the JSON grammar generates (properties in schema order).
_CALL_PREFIX = re.compile(r'\{"name": "((?:[^"\\]|\\.)*)", "arguments": ')
_CONTENT_PREFIX = re.compile(r'\{"content": "')
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")


@dataclass(frozen=True)
class CallText:
    """A tool call as its text says it so far."""

    name: str
    arguments: str
    """The arguments object's JSON text (a prefix of it while it streams)."""


@dataclass(frozen=True)
class Answer:
    """One reading of a choice's text."""

    content: str | None
    """The text answer; None when the text is a tool call."""
    calls: tuple[CallText, ...] = ()


def read_answer(text: str, ended: bool, tools: bool) -> Answer:
    """What `text` says; `ended`: no more text will come; `tools`: it is a call object."""
    if not tools:
        return Answer(text)
    match = _CALL_PREFIX.match(text)
    if match is None:
        return Answer(text if ended else "")
    name = json.loads(f'"{match.group(1)}"')
    rest = text[match.end() :]
    if name == NO_TOOL:
        return Answer(_no_tool_content(rest, text, ended))
    return Answer(None, (CallText(name, _arguments(rest, text, ended)),))


@dataclass(frozen=True)
class CallDelta:
    """What one call adds to a stream: a new call's name and arguments so far, or the
    arguments text an open call adds."""

    index: int
    arguments: str
    name: str | None = None
    """Set on the call's first delta only."""


class AnswerDiff:
    """A streamed answer: the content and call deltas each new piece of text adds.

    A call's first delta has its name and the arguments known so far (maybe none); the
    next ones carry what the arguments add (one per call and piece, none when empty).
    """

    def __init__(self, tools: bool) -> None:
        self._tools = tools
        self._text = ""
        self._answer = Answer("")

    @property
    def called(self) -> bool:
        """The answer is a tool call."""
        return bool(self._answer.calls)

    def push(self, text: str, ended: bool) -> tuple[str, list[CallDelta]]:
        """Add `text`; the content and the call deltas to send now."""
        self._text += text
        before, after = self._answer, read_answer(self._text, ended, self._tools)
        self._answer = after
        content = _added(before.content or "", after.content or "")
        deltas: list[CallDelta] = []
        for index, call in enumerate(after.calls):
            if index >= len(before.calls):
                deltas.append(CallDelta(index, call.arguments, call.name))
                continue
            arguments = _added(before.calls[index].arguments, call.arguments)
            if arguments:
                deltas.append(CallDelta(index, arguments))
        return content, deltas


def _added(before: str, after: str) -> str:
    """What `after` adds to `before`, which it must extend (what a reading guarantees)."""
    if not after.startswith(before):
        raise ValueError(f"an answer's reading went back: {before!r} then {after!r}")
    return after[len(before) :]


def _arguments(rest: str, text: str, ended: bool) -> str:
    if ended and not _is_complete(text):
        return rest  # cut short: all of it is (unfinished) arguments
    # The text's last `}` (and any space after it) may close the call object: held back
    # until the text ends, then left out when the text is complete.
    held = rest.rstrip()
    return held[:-1] if held.endswith("}") else held


def _is_complete(text: str) -> bool:
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(call, dict) and "arguments" in call


def _no_tool_content(rest: str, text: str, ended: bool) -> str:
    match = _CONTENT_PREFIX.match(rest)
    if match is None:
        return text if ended else ""
    return _string_prefix(rest[match.end() :])


def _string_prefix(body: str) -> str:
    """The decoded JSON string whose text (after its opening quote) starts `body`, up to
    its closing quote or the last escape that is complete."""
    end = 0
    while end < len(body) and body[end] != '"':
        step = _escape_length(body, end) if body[end] == "\\" else 1
        if step == 0:
            break
        end += step
    decoded: str = json.loads(f'"{body[:end]}"')
    return decoded


def _escape_length(body: str, start: int) -> int:
    """Characters of the escape at `start`; 0 while it is incomplete (or not JSON: the
    reading stops there for good). A high surrogate `\\uD8xx` waits for the escape after
    it (the pair is one character)."""
    if start + 1 >= len(body) or body[start + 1] not in _ESCAPES:
        return 0
    if body[start + 1] != "u":
        return 2
    code = body[start + 2 : start + 6]
    if len(code) < 4 or not all(c in _HEX for c in code):
        return 0
    if not 0xD800 <= int(code, 16) <= 0xDBFF:
        return 6
    if start + 8 > len(body):
        return 0
    if body[start + 6 : start + 8] != "\\u":
        return 6
    return 12 if start + 12 <= len(body) else 0
