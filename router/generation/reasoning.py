"""A reasoning model's thinking, read apart from its answer (`--reasoning-parser`).

Reasoning models write their thinking between `<think>` and `</think>`, then answer.
`read_reasoning` is the one reading of a text: the thinking, and the rest (what
router/generation/answer.py then reads as content or tool calls). Like that reading,
the reading of any prefix of a text is, field by field, a prefix of the reading of the
whole, so streamed deltas joined are exactly the non-streamed fields. A tag cut by the
end of the text so far is held back until the next piece shows whether it completes.

The parsers, named as vLLM names them:

- `deepseek_r1`: the chat template opens the thinking in the prompt, so the text starts
  inside it (an opening tag there is dropped); everything before `</think>` is
  thinking, and a text that never closes it is all thinking (cut by max_tokens).
- `qwen3`: the text thinks only when it opens with `<think>` (whitespace before it
  allowed); otherwise (`enable_thinking: false`) all of it is the answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from textgate.registry import Registry
from textgate.router.engine.request import ThinkingMarkers


@dataclass(frozen=True)
class ReasoningParser:
    """How one family marks its thinking."""

    name: str
    starts_inside: bool
    """The text begins inside the thinking (the prompt opened it)."""
    start: str = "<think>"
    end: str = "</think>"


class UnknownReasoningParserError(ValueError):
    """--reasoning-parser names no parser."""


PARSERS: Registry[ReasoningParser] = Registry(
    "reasoning parser", "unknown {noun} {name!r}; known: {known}", UnknownReasoningParserError
)
for _parser in (ReasoningParser("deepseek_r1", True), ReasoningParser("qwen3", False)):
    PARSERS.register(_parser.name)(_parser)


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser `--reasoning-parser name` means (None: none)."""
    return None if name is None else PARSERS.lookup(name)


def thinking_markers(parser: ReasoningParser | None, tokenizer: Any) -> ThinkingMarkers | None:
    """The parser's tags as the tokenizer's single tokens (as Qwen3's and DeepSeek-R1's
    vocabularies have them), so a grammar can wait for the thinking to end; None without
    a parser, or where a tag the parser needs takes several tokens."""
    if parser is None:
        return None
    end = _single_token(tokenizer, parser.end)
    start = _single_token(tokenizer, parser.start)
    if end is None or (start is None and not parser.starts_inside):
        return None
    return ThinkingMarkers(end, parser.starts_inside, None if parser.starts_inside else start)


def _single_token(tokenizer: Any, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


@dataclass(frozen=True)
class Reasoned:
    """One reading of a text: its thinking (None where it has none) and the rest."""

    reasoning: str | None
    rest: str


def read_reasoning(text: str, ended: bool, parser: ReasoningParser | None) -> Reasoned:
    """What of `text` is thinking; `ended`: no more text will come."""
    if parser is None:
        return Reasoned(None, text)
    opened = text.lstrip()
    if opened.startswith(parser.start):
        thinking = opened[len(parser.start) :]
    elif not ended and parser.start.startswith(opened):
        return Reasoned(None, "")  # maybe the opening tag, not all here yet
    elif parser.starts_inside:
        thinking = text
    else:
        return Reasoned(None, text)
    close = thinking.find(parser.end)
    if close < 0:
        return Reasoned(thinking if ended else _without_partial_tag(thinking, parser.end), "")
    return Reasoned(thinking[:close], thinking[close + len(parser.end) :].lstrip())


def thinking_tokens(pieces: Sequence[str], parser: ReasoningParser | None) -> int:
    """How many of a text's tokens (`pieces`: each token's text, in order) are thinking:
    those up to the one that completes the closing tag, all of them where it never
    closes, none where the text does not think."""
    text = "".join(pieces)
    if parser is None or read_reasoning(text, True, parser).reasoning is None:
        return 0
    opened = text.find(parser.start)
    inside = opened + len(parser.start) if text.lstrip().startswith(parser.start) else 0
    close = text.find(parser.end, inside)
    if close < 0:
        return len(pieces)
    stop, spelled = close + len(parser.end), 0
    for count, piece in enumerate(pieces, 1):
        spelled += len(piece)
        if spelled >= stop:
            return count
    return len(pieces)


def _without_partial_tag(text: str, tag: str) -> str:
    """`text` less a suffix that is the start of `tag` (it may be completed next)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return text[:-size]
    return text


class ReasoningDiff:
    """A streamed text: the thinking and the rest each new piece adds."""

    def __init__(self, parser: ReasoningParser | None) -> None:
        self._parser = parser
        self._text = ""
        self._reading = Reasoned(None, "")

    def push(self, text: str, ended: bool) -> tuple[str, str]:
        """Add `text`; (thinking, rest) to send now (each maybe empty)."""
        self._text += text
        before, after = self._reading, read_reasoning(self._text, ended, self._parser)
        self._reading = after
        return (
            _added(before.reasoning or "", after.reasoning or ""),
            _added(before.rest, after.rest),
        )


def _added(before: str, after: str) -> str:
    if not after.startswith(before):
        raise ValueError(f"a reasoning reading went back: {before!r} then {after!r}")
    return after[len(before) :]
