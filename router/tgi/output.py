"""From a request's channel events to TGI's /generate and /generate_stream bodies.

The events are read as every API reads them (`generation.result`: `collect`, `TextLedger`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

from textgate.router.engine.channel import Channel, ErrorEvent, Finished, StepEvent, TokenInfo
from textgate.router.generation.result import INCOMPLETE, Generated, StreamEnd, TextLedger
from textgate.router.generation.schemas import GenerateParameters
from textgate.router.http.delivery import StreamPacing, deliveries
from textgate.router.http.sse import error_frame, sse_frame
from textgate.router.tgi.schemas import (
    BestOfSequence,
    Details,
    GenerateResponse,
    PrefillToken,
    SpeculationDetails,
    StreamDetails,
    StreamResponse,
    Token,
)

UNPACED = StreamPacing()


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
            speculation=SpeculationDetails.of(best.num_draft_tokens, best.num_accepted_tokens),
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
        speculation=SpeculationDetails.of(channel.num_draft_tokens, channel.num_accepted_tokens),
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
