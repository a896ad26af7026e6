"""OpenAI request fields to TGI's `GenerateParameters`, with the checks TGI's validator cannot make.

The validator then applies TGI's own rules (token limits, stop count, seed, ranges);
what is checked here is what only exists in the OpenAI dialect: `n`/`best_of`,
OpenAI's ranges (temperature 0 is greedy, top_p may be 1), and the features this
server does not implement, which get a clear 422 instead of being ignored.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, cast

from textgate.router.config import RouterConfig
from textgate.router.engine.request import ValidRequest
from textgate.router.generation.schemas import GenerateParameters
from textgate.router.generation.tools import ToolPlan
from textgate.router.generation.validation import MAX_SEED, ValidationError
from textgate.router.openai.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingRequest,
)
from textgate.router.openai.tools import response_format_grammar


@dataclass(frozen=True)
class Fanout:
    """How many sequences to generate per prompt, and how many of them to return."""

    num_choices: int
    """`n`: choices returned per prompt."""
    num_candidates: int
    """Sequences generated per prompt (`best_of`, >= num_choices); the likeliest are kept."""


def chat_parameters(
    body: ChatCompletionRequest, config: RouterConfig, tools: ToolPlan | None = None
) -> GenerateParameters:
    """The TGI parameters of a chat request; ValidationError for what cannot be served.

    The grammar is the tool plan's (a call object) or `response_format`'s, if any.
    """
    grammar = tools.grammar if tools is not None else response_format_grammar(body.response_format)
    top_n = _chat_top_logprobs(body, config)
    prompt_top = _prompt_top(body, config)
    _check_max_tokens(body.max_completion_tokens, "max_completion_tokens")
    max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = body.max_tokens
    params = _parameters(
        body,
        max_tokens,
        top_n_tokens=_most(top_n, prompt_top),
        prompt_logprobs=prompt_top is not None,
    )
    return params.model_copy(update={"grammar": grammar}) if grammar is not None else params


def completion_parameters(body: CompletionRequest, config: RouterConfig) -> GenerateParameters:
    """The TGI parameters of a text completion request."""
    if body.suffix:
        raise ValidationError("`suffix` is not supported")
    top_n = body.logprobs
    if top_n is not None and not 0 <= top_n <= config.max_top_n_tokens:
        raise ValidationError(
            f"`logprobs` must be >= 0 and <= {config.max_top_n_tokens}. Given: {top_n}"
        )
    if body.echo and top_n is not None and body.stream:
        raise ValidationError("`echo` with `logprobs` is not supported when streaming")
    prompt_top = _prompt_top(body, config)
    prompt_logprobs = (body.echo and top_n is not None) or prompt_top is not None
    return _parameters(
        body,
        _completion_max_tokens(body),
        top_n_tokens=_most(top_n, prompt_top),
        prompt_logprobs=prompt_logprobs,
    )


def scores_prompt_only(body: CompletionRequest) -> bool:
    """`max_tokens: 0` with `echo` (vLLM): the prompt and its scores, nothing generated.

    One token is generated (the engine always samples one) and left out of the answer."""
    return body.echo and body.max_tokens == 0


def _completion_max_tokens(body: CompletionRequest) -> int | None:
    if body.max_tokens != 0:
        return body.max_tokens
    if not body.echo:
        raise ValidationError("`max_tokens` must be >= 1 (0 only with `echo`). Given: 0")
    if body.stream:
        raise ValidationError("`max_tokens` 0 is not supported when streaming")
    return 1


def _prompt_top(body: SamplingRequest, config: RouterConfig) -> int | None:
    """vLLM's `prompt_logprobs`: alternatives per prompt token (None: not asked)."""
    top = body.prompt_logprobs
    if top is None:
        return None
    if not 0 <= top <= config.max_top_n_tokens:
        raise ValidationError(
            f"`prompt_logprobs` must be >= 0 and <= {config.max_top_n_tokens}. Given: {top}"
        )
    if body.stream:
        raise ValidationError("`prompt_logprobs` is not supported when streaming")
    return top


def _most(*counts: int | None) -> int | None:
    """The alternatives to compute for several asks of them (None: none asked)."""
    given = [c for c in counts if c is not None]
    return max(given) if given else None


def chat_fanout(body: ChatCompletionRequest, config: RouterConfig) -> Fanout:
    """`n` independent choices."""
    return _fanout(body.n, None, body.stream, config)


def completion_fanout(body: CompletionRequest, config: RouterConfig) -> Fanout:
    """`n` choices per prompt, the likeliest of `best_of` candidates."""
    prompts = prompt_list(body)
    if len(prompts) > config.max_client_batch_size:
        raise ValidationError(
            f"`prompt` holds at most {config.max_client_batch_size} prompts. Given: {len(prompts)}"
        )
    return _fanout(body.n, body.best_of, body.stream, config)


def prompt_list(body: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request, each non-empty: text, or token ids."""
    prompt = body.prompt
    prompts: list[str | list[int]]
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [cast("str | list[int]", prompt)]
    else:
        prompts = list(cast("list[str] | list[list[int]]", prompt))
    if not prompts or not all(prompts):
        raise ValidationError("`prompt` cannot be empty")
    return prompts


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates read them: content as one string."""
    return [{**m.model_dump(exclude_none=True), "content": _text_content(m)} for m in messages]


def candidates(valid: ValidRequest, seed: int | None, num_candidates: int) -> list[ValidRequest]:
    """`num_candidates` copies of `valid`, each its own sampling seed (seed + i when set)."""
    copies = [valid]
    for i in range(1, num_candidates):
        next_seed = secrets.randbits(64) if seed is None else (seed + i) % MAX_SEED
        copies.append(valid.with_seed(next_seed))
    return copies


def stop_sequences(body: SamplingRequest) -> list[str]:
    """`stop` as a list."""
    if body.stop is None:
        return []
    return [body.stop] if isinstance(body.stop, str) else list(body.stop)


def _parameters(
    body: SamplingRequest,
    max_tokens: int | None,
    *,
    top_n_tokens: int | None,
    prompt_logprobs: bool = False,
) -> GenerateParameters:
    _check_sampling(body)
    _check_max_tokens(max_tokens, "max_tokens")
    greedy = body.temperature == 0
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else None
    return GenerateParameters(
        # OpenAI samples unless temperature is 0; TGI reads "no warper set" as greedy,
        # so greedy must drop the warpers and sampling must say so explicitly.
        do_sample=not greedy,
        temperature=None if greedy else body.temperature,
        top_p=None if greedy or body.top_p == 1 else body.top_p,
        top_k=None if greedy else top_k,
        min_p=None if greedy else body.min_p,
        max_new_tokens=max_tokens,
        stop=stop_sequences(body),
        seed=body.seed,
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        logit_bias=_token_bias(body.logit_bias),
        repetition_penalty=body.repetition_penalty,
        top_n_tokens=top_n_tokens,
        decoder_input_details=prompt_logprobs,
        ignore_eos=body.ignore_eos,
        min_new_tokens=body.min_tokens,
        stop_token_ids=body.stop_token_ids,
        truncate=body.truncate_prompt_tokens,
        skip_special_tokens=body.skip_special_tokens,
        priority=body.priority,
        timeout=body.timeout,
    )


def _check_sampling(body: SamplingRequest) -> None:
    if body.temperature is not None and body.temperature < 0:
        raise ValidationError(f"`temperature` must be >= 0. Given: {body.temperature}")
    if body.top_p is not None and not 0 < body.top_p <= 1:
        raise ValidationError(f"`top_p` must be > 0 and <= 1. Given: {body.top_p}")


def _token_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias, keyed by token ids written as strings."""
    if not bias:
        return None
    try:
        return {int(token_id): value for token_id, value in bias.items()}
    except ValueError:
        raise ValidationError("`logit_bias` keys must be token ids (integers)") from None


def _check_max_tokens(value: int | None, name: str) -> None:
    if value is not None and value < 1:
        raise ValidationError(f"`{name}` must be >= 1. Given: {value}")


def _chat_top_logprobs(body: ChatCompletionRequest, config: RouterConfig) -> int | None:
    top = body.top_logprobs
    if top is None:
        return 0 if body.logprobs else None
    if not body.logprobs:
        raise ValidationError("`top_logprobs` needs `logprobs` to be true")
    if not 0 <= top <= config.max_top_n_tokens:
        raise ValidationError(
            f"`top_logprobs` must be >= 0 and <= {config.max_top_n_tokens}. Given: {top}"
        )
    return top


def _fanout(n: int, best_of: int | None, stream: bool, config: RouterConfig) -> Fanout:
    limit = config.max_best_of
    if not 1 <= n <= limit:
        raise ValidationError(f"`n` must be >= 1 and <= {limit} (--max-best-of). Given: {n}")
    num_candidates = n if best_of is None else best_of
    if num_candidates < n:
        raise ValidationError(f"`best_of` must be >= `n`. Given: {best_of} < {n}")
    if num_candidates > limit:
        raise ValidationError(
            f"`best_of` must be <= {limit} (--max-best-of). Given: {num_candidates}"
        )
    if stream and num_candidates != n:
        raise ValidationError("`best_of` != `n` is not supported when streaming")
    return Fanout(num_choices=n, num_candidates=num_candidates)


def _text_content(message: ChatMessage) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise ValidationError(
                f"content parts of type {part.type!r} are not supported: only text is"
            )
        texts.append(part.text)
    return "\n".join(texts)
