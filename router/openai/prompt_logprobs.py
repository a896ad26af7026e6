"""vLLM's `prompt_logprobs`: each prompt token's logprob and its likeliest alternatives.

A completion choice (or a chat answer) lists, per prompt token, `null` for the first one
(nothing comes before it) and for each other one an object keyed by token id (a string,
as JSON keys are): the token itself first, then its `prompt_logprobs` likeliest
alternatives, each `{"logprob", "rank", "decoded_token"}`. The numbers are the TGI
route's `decoder_input_details` (the shard's prompt logprobs); a rank is the token's
place among its position's alternatives (1: likeliest), null for a token outside them.
"""

from __future__ import annotations

from collections.abc import Sequence

from textgate.router.engine.channel import TokenInfo
from textgate.router.openai.schemas import PromptLogprob, PromptLogprobs

MIN_LOGPROB = -9999.0
"""JSON has no -inf: the floor vLLM uses too."""


def prompt_logprobs(
    prompt: Sequence[TokenInfo], prompt_top: Sequence[Sequence[TokenInfo]], num_top: int
) -> PromptLogprobs:
    """vLLM's `prompt_logprobs` of `prompt`, with at most `num_top` alternatives per token
    (`prompt_top[i]`: position i's alternatives, likeliest first)."""
    result: PromptLogprobs = []
    for i, token in enumerate(prompt):
        if i == 0 or token.logprob is None:
            result.append(None)
            continue
        top = list(prompt_top[i][:num_top]) if i < len(prompt_top) else []
        result.append(_position(token, top))
    return result


def _position(token: TokenInfo, top: list[TokenInfo]) -> dict[str, PromptLogprob]:
    ranks = {t.id: rank for rank, t in enumerate(top, start=1)}
    entries = {str(token.id): _entry(token, ranks.get(token.id))}
    for rank, alternative in enumerate(top, start=1):
        entries.setdefault(str(alternative.id), _entry(alternative, rank))
    return entries


def json_logprob(logprob: float | None) -> float:
    """A JSON-safe logprob; unknown (None) and -inf read as the floor."""
    return MIN_LOGPROB if logprob is None else max(logprob, MIN_LOGPROB)


def _entry(token: TokenInfo, rank: int | None) -> PromptLogprob:
    return PromptLogprob(logprob=json_logprob(token.logprob), rank=rank, decoded_token=token.text)
