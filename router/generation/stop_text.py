"""A sequence's answer text: cut before the stop sequence that ended it, whole or streamed.

The chat APIs (OpenAI's, Anthropic's) return text that ends before the stop sequence
that matched (TGI's text keeps it); `keep_stop` (vLLM's `include_stop_str_in_output`)
keeps it. A stream holds back any tail that could still become a stop sequence, so the
streamed text is exactly the non-streamed one. Special tokens are never part of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from textgate.router.engine.channel import Finished, FinishReason, TokenInfo
from textgate.router.generation.result import visible_text


@dataclass(frozen=True)
class TextOptions:
    """How a choice's text is cut."""

    stop: tuple[str, ...] = ()
    keep_stop: bool = False
    """Keep the matched stop sequence at the end of the text."""

    @property
    def trimmed_stops(self) -> tuple[str, ...]:
        """The stop sequences cut from the text."""
        return () if self.keep_stop else tuple(s for s in self.stop if s)


def matched_stop(text: str, stops: Sequence[str]) -> str | None:
    """The first stop sequence in `text` (the one that ended generation; the longest of
    those starting there), if any."""
    found = [(text.find(s), -len(s), s) for s in stops if s and s in text]
    return min(found)[2] if found else None


def trim_stop(text: str, stops: Sequence[str]) -> str:
    """`text` up to the first stop sequence in it (the one that ended generation)."""
    stop = matched_stop(text, stops)
    return text if stop is None else text[: text.find(stop)]


def answer_text(finished: Finished, options: TextOptions) -> str:
    """The text a finished sequence answers with."""
    if finished.finish_reason != "stop_sequence":
        return finished.text
    return trim_stop(finished.text, options.trimmed_stops)


class StreamText:
    """One streamed choice's text: what can be sent now, holding back a possible stop sequence.

    A stop sequence can span tokens; while the tail of the text could still be the
    start of one, that tail is held back, so no part of a matched stop is ever sent.
    """

    def __init__(self, options: TextOptions) -> None:
        self._stops = options.trimmed_stops
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._text = ""
        self._sent = 0

    def push(self, tokens: Sequence[TokenInfo], finished: FinishReason | None = None) -> str:
        """Add `tokens`; return the text that can be sent now.

        Once `finished`, that is everything not sent yet, cut before the stop sequence
        that matched.
        """
        self._text += visible_text(tokens)
        if finished is None:
            return self._take(max(len(self._text) - self._hold, self._sent))
        if finished == "stop_sequence":
            self._text = trim_stop(self._text, self._stops)
        return self._take(len(self._text))

    def _take(self, end: int) -> str:
        out = self._text[self._sent : end]
        self._sent = max(end, self._sent)
        return out
