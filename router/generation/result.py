"""What a request's channel events add up to, for every API alike.

`collect` waits for one request and gives its `Generated` (tokens, prompt logprobs, the
final event, timings); a stream reads the same events through a `TextLedger`, so what its
tokens spell and its final text (`generated_text`, an OpenAI message) are one text.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TypeAlias

from textgate.router.engine.channel import Channel, ErrorEvent, Finished, StepEvent, TokenInfo

INCOMPLETE = ErrorEvent("Incomplete generation", "incomplete_generation")

StreamEnd: TypeAlias = Finished | ErrorEvent
"""How a stream ended: its request finished, or failed (a client that left is neither)."""


class GenerationError(Exception):
    """A request ended with an error event; `error_type` picks the HTTP status."""

    def __init__(self, event: ErrorEvent) -> None:
        super().__init__(event.message)
        self.error_type = event.error_type


@dataclass
class Generated:
    """Everything one request produced, with its timings."""

    finished: Finished
    input_length: int
    queued_at: float
    started_at: float
    tokens: list[TokenInfo] = field(default_factory=list)
    top_tokens: list[list[TokenInfo]] = field(default_factory=list)
    prefill: list[TokenInfo] = field(default_factory=list)
    prefill_top: list[list[TokenInfo]] = field(default_factory=list)
    ended_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    """When its first generated token arrived; None: it generated none."""
    num_draft_tokens: int = 0
    """Speculation's drafts verified for it (`Channel.num_draft_tokens`)."""
    num_accepted_tokens: int = 0
    """Of those, the ones accepted."""

    @property
    def logprob_sum(self) -> float:
        return sum(t.logprob or 0.0 for t in self.tokens)


def visible_text(tokens: Sequence[TokenInfo]) -> str:
    """The text of `tokens` without the special ones."""
    return "".join(t.text for t in tokens if not t.special)


class TextLedger:
    """One request's text as its tokens spell it, made one with the shard's final text.

    The shard sends each token's text, decoded incrementally (empty while a character is
    incomplete), and at the end the whole text decoded at once (`Finished.text`). The two
    can differ: a text that ends inside a character shows U+FFFD only in the whole
    decode; a token the tokenizer skips as special but does not flag shows only in the
    tokens. `settle` makes the final event say one thing: where the whole text extends
    what the tokens spelled, the last token's text takes the rest; `Finished.text` is
    then what the (non-special) tokens spell, whatever they spell.
    """

    def __init__(self) -> None:
        self._spelled = ""

    def settle(self, event: StepEvent) -> StepEvent:
        """`event` with its final text and last token agreeing with the tokens before."""
        spelled = self._spelled + visible_text(event.tokens)
        self._spelled = spelled
        done = event.finished
        if done is None or done.text == spelled:
            return event
        tokens = event.tokens
        last = tokens[-1] if tokens else None
        if done.text.startswith(spelled) and last is not None and not last.special:
            tokens = [*tokens[:-1], replace(last, text=last.text + done.text[len(spelled) :])]
            spelled = done.text
        self._spelled = spelled
        return replace(event, tokens=tokens, finished=replace(done, text=spelled))


async def collect(channel: Channel) -> Generated:
    """Wait for the request to finish; GenerationError if it fails."""
    tokens: list[TokenInfo] = []
    top_tokens: list[list[TokenInfo]] = []
    prefill: list[TokenInfo] = []
    prefill_top: list[list[TokenInfo]] = []
    ledger = TextLedger()
    async for event in channel:
        if isinstance(event, ErrorEvent):
            raise GenerationError(event)
        event = ledger.settle(event)
        tokens += event.tokens
        top_tokens += event.top_tokens
        prefill += event.prefill
        prefill_top += event.prefill_top
        if event.finished is not None:
            return Generated(
                finished=event.finished,
                input_length=channel.input_length,
                queued_at=channel.queued_at,
                started_at=channel.started_at or channel.queued_at,
                tokens=tokens,
                top_tokens=top_tokens,
                prefill=prefill,
                prefill_top=prefill_top,
                first_token_at=channel.first_token_at,
                num_draft_tokens=channel.num_draft_tokens,
                num_accepted_tokens=channel.num_accepted_tokens,
            )
    raise GenerationError(INCOMPLETE)


def best_of(candidates: Sequence[Generated]) -> tuple[Generated, list[Generated]]:
    """The candidate with the highest logprob sum (TGI's rule), and the others."""
    best = max(range(len(candidates)), key=lambda i: candidates[i].logprob_sum)
    return candidates[best], [c for i, c in enumerate(candidates) if i != best]
