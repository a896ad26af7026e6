"""What generated sequences look like in OpenAI bodies: text, finish reasons, logprobs, usage.

OpenAI returns text that ends before the stop sequence that matched (TGI's text keeps
it); `include_stop_str_in_output` keeps it, as in vLLM (router/generation/stop_text.py).
Special tokens (end of sequence, template markers) are never part of the text.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

import textgate
from textgate.router.engine.channel import FinishReason, TokenInfo
from textgate.router.generation.reasoning import ReasoningParser
from textgate.router.generation.result import Generated
from textgate.router.generation.stop_text import TextOptions, answer_text
from textgate.router.openai.answer import answer_message

# Re-exported: the floor of every logprob these bodies carry.
from textgate.router.openai.prompt_logprobs import MIN_LOGPROB as MIN_LOGPROB
from textgate.router.openai.prompt_logprobs import json_logprob, prompt_logprobs
from textgate.router.openai.schemas import (
    ChatChoice,
    ChatCompletion,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
    Usage,
)

# TGI's format: "{version}-{docker label}"; clients such as huggingface_hub require it.
SYSTEM_FINGERPRINT = f"{textgate.__version__}-native"

_FINISH_REASONS: dict[FinishReason, str] = {
    "length": "length",
    "eos_token": "stop",
    "stop_sequence": "stop",
}


class MetaFields(TypedDict):
    """`ResponseMeta` as keyword arguments."""

    id: str
    created: int
    model: str
    system_fingerprint: str


@dataclass(frozen=True)
class ResponseMeta:
    """The fields every body and chunk of one response repeats."""

    id: str
    created: int
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT

    @classmethod
    def new(cls, prefix: str, model: str) -> ResponseMeta:
        """A fresh id ("chatcmpl-…", "cmpl-…") created now."""
        return cls(id=f"{prefix}-{uuid.uuid4().hex}", created=int(time.time()), model=model)

    def fields(self) -> MetaFields:
        """The shared fields as keyword arguments of a response or chunk model."""
        return MetaFields(
            id=self.id,
            created=self.created,
            model=self.model,
            system_fingerprint=self.system_fingerprint,
        )


def finish_reason(reason: FinishReason) -> str:
    """OpenAI's name: "stop" (end of sequence or a stop sequence) or "length"."""
    return _FINISH_REASONS[reason]


def likeliest(candidates: Sequence[Generated], n: int) -> list[Generated]:
    """The `n` candidates with the highest logprob sums (TGI's best_of rule), in order."""
    if len(candidates) <= n:
        return list(candidates)
    return sorted(candidates, key=lambda g: g.logprob_sum, reverse=True)[:n]


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    """Token counts of a request."""
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def chat_logprobs(
    tokens: Sequence[TokenInfo], top_tokens: Sequence[Sequence[TokenInfo]]
) -> ChatLogprobs:
    """Chat `logprobs`: each non-special token with its alternatives."""
    content = []
    for i, token in enumerate(tokens):
        if token.special:
            continue
        top = top_tokens[i] if i < len(top_tokens) else []
        content.append(
            TokenLogprob(
                **_top_logprob(token).model_dump(),
                top_logprobs=[_top_logprob(t) for t in top],
            )
        )
    return ChatLogprobs(content=content)


def completion_logprobs(
    prompt: Sequence[TokenInfo],
    tokens: Sequence[TokenInfo],
    top_tokens: Sequence[Sequence[TokenInfo]],
    text_offset: int = 0,
    prompt_top: Sequence[Sequence[TokenInfo]] = (),
) -> CompletionLogprobs:
    """Legacy completions `logprobs` of (echoed) `prompt` tokens then the generated ones.

    `text_offset` is where the first token's text starts in the choice's text. The first
    prompt token has no logprob and no alternatives (null); every other one has its
    `prompt_top` alternatives with itself among them, as OpenAI and vLLM give them. A
    generated special token (end of sequence) is listed too, as OpenAI lists
    `<|endoftext|>`, though not part of the text (its offset is where the text ends):
    harnesses read the last entry as the one generated token and score the ones before.
    """
    result = CompletionLogprobs()
    entries: list[tuple[TokenInfo, dict[str, float] | None]] = [
        (t, None if i == 0 else _with_itself(t, prompt_top[i] if i < len(prompt_top) else ()))
        for i, t in enumerate(prompt)
    ]
    entries += [
        (t, _alternatives(top_tokens[i]) if i < len(top_tokens) and top_tokens[i] else None)
        for i, t in enumerate(tokens)
    ]
    for i, (token, top) in enumerate(entries):
        result.tokens.append(token.text)
        result.token_logprobs.append(None if token.logprob is None else json_logprob(token.logprob))
        result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        generated_special = i >= len(prompt) and token.special
        text_offset += 0 if generated_special else len(token.text)
    return result


def _alternatives(top: Sequence[TokenInfo]) -> dict[str, float]:
    return {t.text: json_logprob(t.logprob) for t in top}


def _with_itself(token: TokenInfo, top: Sequence[TokenInfo]) -> dict[str, float] | None:
    """A prompt token's alternatives, the token itself included (null without a logprob)."""
    if token.logprob is None:
        return None
    alternatives = _alternatives(top)
    alternatives.setdefault(token.text, json_logprob(token.logprob))
    return alternatives


@dataclass(frozen=True)
class Scores:
    """What a completion choice reports beside its text."""

    logprobs: int | None = None
    """Alternatives per token in `logprobs` (None: no `logprobs`)."""
    prompt_logprobs: int | None = None
    """Alternatives per prompt token in vLLM's `prompt_logprobs` (None: none)."""
    generated: bool = True
    """False for prompt scoring only (`max_tokens: 0`): the one token generated is left out
    of the text, the logprobs and the usage."""


def chat_completion(
    meta: ResponseMeta,
    results: Sequence[Generated],
    prompt_tokens: int,
    options: TextOptions,
    *,
    logprobs: bool,
    tools: bool = False,
    top_logprobs: int | None = None,
    prompt_top: int | None = None,
    reasoning: ReasoningParser | None = None,
) -> ChatCompletion:
    """A non-streamed chat answer, one choice per result; with `tools`, each result's
    text is a tool call object read back into `tool_calls` (router/openai/answer.py).

    `top_logprobs` bounds each token's alternatives (the shard may have computed more
    for `prompt_top`, vLLM's `prompt_logprobs` of the templated prompt)."""
    choices = [
        ChatChoice(
            index=i,
            message=answer_message(answer_text(g.finished, options), tools, reasoning),
            logprobs=chat_logprobs(g.tokens, _first(g.top_tokens, top_logprobs))
            if logprobs
            else None,
            finish_reason=finish_reason(g.finished.finish_reason),
        )
        for i, g in enumerate(results)
    ]
    for choice in choices:
        if choice.message.tool_calls and choice.finish_reason == "stop":
            choice.finish_reason = "tool_calls"
    return ChatCompletion(
        **meta.fields(),
        choices=choices,
        usage=usage(prompt_tokens, sum(g.finished.generated_tokens for g in results)),
        prompt_logprobs=_prompt_logprobs(results[0], prompt_top) if results else None,
    )


def completion(
    meta: ResponseMeta,
    prompts: Sequence[str],
    results: Sequence[Sequence[Generated]],
    prompt_tokens: int,
    options: TextOptions,
    *,
    echo: bool,
    scores: Scores = Scores(),
) -> Completion:
    """A non-streamed text completion: `results[p]` are prompt p's choices."""
    choices: list[CompletionChoice] = []
    for prompt, chosen in zip(prompts, results, strict=True):
        for generated in chosen:
            choices.append(
                _completion_choice(len(choices), prompt, generated, options, echo, scores)
            )
    completion_tokens = 0
    if scores.generated:
        completion_tokens = sum(g.finished.generated_tokens for chosen in results for g in chosen)
    return Completion(
        **meta.fields(),
        choices=choices,
        usage=usage(prompt_tokens, completion_tokens),
    )


def _completion_choice(
    index: int, prompt: str, generated: Generated, options: TextOptions, echo: bool, scores: Scores
) -> CompletionChoice:
    prefix = prompt if echo else ""
    tokens = generated.tokens if scores.generated else []
    result = None
    if scores.logprobs is not None:
        result = completion_logprobs(
            generated.prefill if echo else [],
            tokens,
            _first(generated.top_tokens, scores.logprobs),
            prompt_top=_first(generated.prefill_top, scores.logprobs) if echo else (),
        )
    text = answer_text(generated.finished, options) if scores.generated else ""
    return CompletionChoice(
        index=index,
        text=prefix + text,
        logprobs=result,
        # Prompt scoring only (`max_tokens: 0`) ends at its length, as in vLLM.
        finish_reason=finish_reason(generated.finished.finish_reason)
        if scores.generated
        else "length",
        prompt_logprobs=_prompt_logprobs(generated, scores.prompt_logprobs),
    )


def _prompt_logprobs(generated: Generated, num_top: int | None) -> PromptLogprobs | None:
    if num_top is None:
        return None
    return prompt_logprobs(generated.prefill, generated.prefill_top, num_top)


def _first(
    top_tokens: Sequence[Sequence[TokenInfo]], num_top: int | None
) -> list[Sequence[TokenInfo]]:
    """Each position's alternatives cut to `num_top` (None: all the shard sent)."""
    return [top[:num_top] for top in top_tokens]


def _top_logprob(token: TokenInfo) -> TopLogprob:
    return TopLogprob(
        token=token.text, logprob=json_logprob(token.logprob), bytes=list(token.text.encode())
    )
