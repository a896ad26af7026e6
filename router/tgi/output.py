"""From a request's channel events to TGI's /generate and /generate_stream bodies.

Every API reads a request's events through a `TextLedger`, so what its tokens spell and
its final text (`generated_text`, an OpenAI message) are one text.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeAlias

from textgate.router.engine.channel import Channel, ErrorEvent, Finished, StepEvent, TokenInfo
from textgate.router.http.delivery import StreamPacing, deliveries
from textgate.router.http.sse import error_frame, sse_frame
from textgate.router.tgi.schemas import (
    BestOfSequence,
    Details,
    GenerateParameters,
    GenerateResponse,
    PrefillToken,
    StreamDetails,
    StreamResponse,
    Token,
)

INCOMPLETE = ErrorEvent("Incomplete generation", "incomplete_generation")
UNPACED = StreamPacing()

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
    ended_at: float = field(default_factory=time.monotonic)

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
    ledger = TextLedger()
    async for event in channel:
        if isinstance(event, ErrorEvent):
            raise GenerationError(event)
        event = ledger.settle(event)
        tokens += event.tokens
        top_tokens += event.top_tokens
        prefill += event.prefill
        if event.finished is not None:
            return Generated(
                finished=event.finished,
                input_length=channel.input_length,
                queued_at=channel.queued_at,
                started_at=channel.started_at or channel.queued_at,
                tokens=tokens,
                top_tokens=top_tokens,
                prefill=prefill,
            )
    raise GenerationError(INCOMPLETE)


def best_of(candidates: Sequence[Generated]) -> tuple[Generated, list[Generated]]:
    """The candidate with the highest logprob sum (TGI's rule), and the others."""
    best = max(range(len(candidates)), key=lambda i: candidates[i].logprob_sum)
    return candidates[best], [c for i, c in enumerate(candidates) if i != best]


def generate_response(
    best: Generated,
    others: Sequence[Generated],
    params: GenerateParameters,
    prompt: str,
    *,
    sampled: bool = True,
) -> GenerateResponse:
    """The /generate body; `others` are the best_of candidates not chosen.

    `sampled`: whether the request sampled; greedy ones report no seed, as TGI's do.
    """
    prefix = prompt if params.return_full_text else ""
    details = None
    if params.details or params.decoder_input_details:
        details = Details(
            finish_reason=best.finished.finish_reason,
            generated_tokens=best.finished.generated_tokens,
            seed=best.finished.seed if sampled else None,
            prefill=[_prefill_token(t) for t in best.prefill],
            tokens=[_token(t) for t in best.tokens],
            top_tokens=[[_token(t) for t in top] for top in best.top_tokens],
            best_of_sequences=[_best_of_sequence(o, prefix) for o in others] if others else None,
        )
    return GenerateResponse(generated_text=prefix + best.finished.text, details=details)


async def stream_frames(
    channel: Channel,
    params: GenerateParameters,
    prompt: str,
    *,
    sampled: bool = True,
    on_end: Callable[[StreamEnd], None] | None = None,
    pacing: StreamPacing = UNPACED,
) -> AsyncIterator[bytes]:
    """SSE writes for /generate_stream: one event per token, the tokens due together in one
    write (`deliveries`), and an error event on failure.

    `sampled` as for `generate_response`; `on_end` hears how the stream ended, before
    its last write is sent.
    """
    prefix = prompt if params.return_full_text else ""
    index = 0
    ledger = TextLedger()
    try:
        async for write in deliveries([channel], pacing):
            frames: list[bytes] = []
            for _, event in write:
                if isinstance(event, StepEvent):
                    event = ledger.settle(event)
                if isinstance(event, ErrorEvent) or (event.finished and not event.tokens):
                    end = event if isinstance(event, ErrorEvent) else INCOMPLETE
                    if on_end is not None:
                        on_end(end)
                    frames.append(error_frame(end.message, end.error_type))
                    break
                if event.finished is not None and on_end is not None:
                    on_end(event.finished)
                for i, token in enumerate(event.tokens):
                    index += 1
                    finished = event.finished if i == len(event.tokens) - 1 else None
                    top = event.top_tokens[i] if i < len(event.top_tokens) else []
                    frames.append(
                        sse_frame(
                            StreamResponse(
                                index=index,
                                token=_token(token),
                                top_tokens=[_token(t) for t in top],
                                generated_text=None if finished is None else prefix + finished.text,
                                details=_stream_details(finished, channel, params, sampled),
                            )
                        )
                    )
            yield b"".join(frames)
    finally:
        # No-op once finished; otherwise the client left (or the server is closing).
        channel.cancel()


def _stream_details(
    finished: Finished | None, channel: Channel, params: GenerateParameters, sampled: bool
) -> StreamDetails | None:
    if finished is None or not params.details:
        return None
    return StreamDetails(
        finish_reason=finished.finish_reason,
        generated_tokens=finished.generated_tokens,
        seed=finished.seed if sampled else None,
        input_length=channel.input_length,
    )


def _best_of_sequence(candidate: Generated, prefix: str) -> BestOfSequence:
    return BestOfSequence(
        generated_text=prefix + candidate.finished.text,
        finish_reason=candidate.finished.finish_reason,
        generated_tokens=candidate.finished.generated_tokens,
        seed=candidate.finished.seed,
        prefill=[_prefill_token(t) for t in candidate.prefill],
        tokens=[_token(t) for t in candidate.tokens],
        top_tokens=[[_token(t) for t in top] for top in candidate.top_tokens],
    )


def _token(token: TokenInfo) -> Token:
    return Token(id=token.id, text=token.text, logprob=token.logprob, special=token.special)


def _prefill_token(token: TokenInfo) -> PrefillToken:
    return PrefillToken(id=token.id, text=token.text, logprob=token.logprob)
