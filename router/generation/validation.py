"""Request validation: TGI's rules and messages, tokenization off the event loop.

Every rejected request raises `ValidationError`, answered 422 with
`{"error": str(err), "error_type": "validation"}`. The order of the checks is TGI's,
so a request breaking several rules gets the same message it would get from TGI.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence, Sized
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, cast

from textgate.router.config import RouterConfig
from textgate.router.engine.fairness import ANONYMOUS_TENANT
from textgate.router.engine.lora_registry import LoraRegistry
from textgate.router.engine.quota import (
    Limits,
    ModelNotAllowedError,
    base_model_names,
    current_lease,
)
from textgate.router.engine.request import GrammarSpec, ValidRequest
from textgate.router.generation.parameters import (
    MAX_CHARS_PER_TOKEN,
    check_best_of,
    check_counts,
    check_stream,
    check_truncate,
    check_unsupported,
    grammar_spec,
    sampling_params,
    stopping_params,
)

# Re-exported: the routes catch and raise ValidationError under this module's name.
from textgate.router.generation.parameters import MAX_SEED as MAX_SEED
from textgate.router.generation.parameters import ValidationError as ValidationError
from textgate.router.generation.reasoning import reasoning_parser, thinking_markers
from textgate.router.generation.schemas import GenerateParameters, GenerateRequest, SimpleToken


@dataclass(frozen=True)
class Wording:
    """How a route names the prompt and the length limit in its error messages."""

    prompt: str = "inputs"
    max_new_tokens: str = "max_new_tokens"
    truncate: str = "truncate"
    templated: bool = False
    """The prompt went through the chat template, whose tokens count too."""


TGI_WORDING = Wording()


class Tokenizer(Protocol):
    """What validation needs from a tokenizer (transformers' tokenizers fit)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


class Validator:
    """Checks requests against the router's limits and tokenizes them in a thread pool."""

    def __init__(
        self,
        config: RouterConfig,
        tokenizer: Tokenizer,
        *,
        adapters: LoraRegistry | None = None,
    ) -> None:
        self._config = config
        self._adapters = adapters if adapters is not None else LoraRegistry()
        self._tokenizer = tokenizer
        # transformers' tokenizers know their size; logit_bias ids are checked against it.
        self._vocab_size: int | None = len(tokenizer) if isinstance(tokenizer, Sized) else None
        self._executor = ThreadPoolExecutor(
            max_workers=config.validation_workers, thread_name_prefix="tokenizer"
        )
        parser = reasoning_parser(config.reasoning_parser)
        self._thinking = thinking_markers(parser, tokenizer)
        """A templated prompt's grammar waits for the thinking to end (None: it does not)."""

    async def validate(
        self,
        request: GenerateRequest,
        *,
        stream: bool = False,
        input_ids: Sequence[int] | None = None,
        wording: Wording = TGI_WORDING,
        received_at: float | None = None,
    ) -> ValidRequest:
        """The validated request, or ValidationError with TGI's message.

        `input_ids`: the prompt as token ids (OpenAI completions), used instead of
        tokenizing `request.inputs` (then only its text for echoing). `wording` names
        the route's own fields in the length errors. `received_at`: when the server
        received it (time.monotonic()), where its deadline starts; None: its admission."""
        params = request.parameters
        lease = current_lease()
        limits = lease.quota.limits if lease is not None else Limits()
        self._check_model_allowed(limits, params.adapter_id)
        check_unsupported(params)
        check_stream(params, stream)
        best_of = check_best_of(params, self._config.max_best_of)
        sampling = sampling_params(params, best_of, self._config.max_logit_bias)
        self._check_token_ids(sampling.logit_bias)
        self.check_token_ids(params.stop_token_ids or (), "stop_token_ids")
        check_counts(params, self._config)
        truncate = check_truncate(params.truncate, self._config.max_input_tokens)
        if input_ids is not None:
            self._check_prompt_ids(input_ids)
            ids = list(input_ids)
        elif not request.inputs:
            raise ValidationError("`inputs` cannot be empty")
        else:
            if truncate is None:
                self._check_prompt_chars(len(request.inputs), wording)
            ids = await self._tokenize(request.inputs, request.add_special_tokens)
        if truncate is not None:
            ids = ids[-truncate:]
        max_new_tokens = self._check_lengths(len(ids), params.max_new_tokens, wording)
        max_new_tokens = _check_key_max_new_tokens(
            max_new_tokens, params.max_new_tokens is None, limits, wording
        )
        return ValidRequest(
            inputs=request.inputs,
            input_ids=tuple(ids),
            sampling=sampling,
            stopping=stopping_params(params, max_new_tokens),
            top_n_tokens=params.top_n_tokens or 0,
            decoder_input_details=params.decoder_input_details,
            best_of=best_of,
            grammar=self._grammar(params, wording),
            adapter_id=self._check_adapter(params.adapter_id),
            skip_special_tokens=params.skip_special_tokens,
            priority=_check_key_priority(params.priority, limits),
            timeout_s=_timeout(params.timeout, limits),
            received_at=received_at,
            tenant=lease.quota.name if lease is not None else ANONYMOUS_TENANT,
            tenant_weight=limits.weight,
        )

    def _grammar(self, params: GenerateParameters, wording: Wording) -> GrammarSpec | None:
        """The request's grammar; on a chat turn (a templated prompt) of a reasoning model,
        one that applies after the thinking, so the model may think first."""
        grammar = grammar_spec(params)
        if grammar is None or self._thinking is None or not wording.templated:
            return grammar
        return dataclasses.replace(grammar, thinking=self._thinking)

    @property
    def adapters(self) -> tuple[str, ...]:
        """The LoRA adapters the shards hold now (`adapter_id` must name one)."""
        return self._adapters.names

    def _check_model_allowed(self, limits: Limits, adapter_id: str | None) -> None:
        """ModelNotAllowedError unless the request's API key may use its model (the base
        goes by `base_model_names`)."""
        model_id = self._config.model_id
        model = adapter_id or model_id
        if not limits.allows(model, base_model_names(model_id)):
            raise ModelNotAllowedError(model)

    def _check_adapter(self, adapter_id: str | None) -> str | None:
        if adapter_id is None or adapter_id in self._adapters:
            return adapter_id
        raise ValidationError(self._adapters.not_loaded(adapter_id))

    async def tokenize(self, request: GenerateRequest) -> list[SimpleToken]:
        """The prompt's tokens with their character spans (TGI's /tokenize).

        `parameters.truncate` keeps the last tokens, as generation would.
        """
        truncate = check_truncate(request.parameters.truncate, self._config.max_input_tokens)
        loop = asyncio.get_running_loop()
        try:
            tokens = await loop.run_in_executor(
                self._executor,
                token_spans,
                self._tokenizer,
                request.inputs,
                request.add_special_tokens,
            )
        except Exception as exc:
            raise ValidationError(f"tokenizer error {exc}") from exc
        return tokens[-truncate:] if truncate is not None else tokens

    def close(self) -> None:
        """Stop the tokenizer threads (pending work is dropped)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(
                self._executor, self._encode, text, add_special_tokens
            )
        except Exception as exc:
            raise ValidationError(f"tokenizer error {exc}") from exc

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids (empty when the tokenizer cannot decode)."""
        decode = getattr(self._tokenizer, "decode", None)
        return str(decode(list(ids))) if decode is not None else ""

    def check_token_ids(self, ids: Sequence[int], field: str) -> None:
        """ValidationError unless every one of `ids` is in the vocabulary (`field` names
        them in the message)."""
        for token_id in ids:
            self._check_id(token_id, f"`{field}` token id")

    def _check_token_ids(self, logit_bias: tuple[tuple[int, float], ...]) -> None:
        for token_id, _ in logit_bias:
            self._check_id(token_id, "`logit_bias` token id")

    def _check_prompt_ids(self, ids: Sequence[int]) -> None:
        if not ids:
            raise ValidationError("`prompt` cannot be empty")
        for token_id in ids:
            self._check_id(token_id, "`prompt` token id")

    def _check_id(self, token_id: int, what: str) -> None:
        if self._vocab_size is None:
            if token_id < 0:
                raise ValidationError(f"{what} {token_id} is negative")
        elif not 0 <= token_id < self._vocab_size:
            raise ValidationError(
                f"{what} {token_id} is not in the vocabulary (0 to {self._vocab_size - 1})"
            )

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _check_prompt_chars(self, num_chars: int, wording: Wording) -> None:
        limit = self._config.max_input_tokens
        if num_chars > limit * MAX_CHARS_PER_TOKEN:
            raise ValidationError(
                f"`{wording.prompt}` must have less than {limit} tokens. Given: {num_chars} "
                f"characters, more than {limit} tokens hold. Shorten it, or set "
                f"`{wording.truncate}` to keep only its last {limit} tokens; the server's "
                "limit is `--max-input-tokens`."
            )

    def _check_lengths(
        self, input_length: int, max_new_tokens: int | None, wording: Wording
    ) -> int:
        """The request's max_new_tokens: as given, else `default_max_new_tokens` (bounded by
        what max_total_tokens leaves).

        The prompt is checked first, so a prompt that is too long is reported as such
        whatever the length asked for; a defaulted length never fails.
        """
        config = self._config
        if input_length > config.max_input_tokens:
            templated = (
                " (after the chat template, whose tokens count too)" if wording.templated else ""
            )
            raise ValidationError(
                f"`{wording.prompt}` must have less than {config.max_input_tokens} tokens. "
                f"Given: {input_length}{templated}. Shorten it, or set `{wording.truncate}` to keep "
                f"only its last {config.max_input_tokens} tokens; the server's limit is "
                "`--max-input-tokens`."
            )
        room = config.max_total_tokens - input_length
        if max_new_tokens is None:
            return min(config.default_max_new_tokens, room)
        if max_new_tokens > room:
            raise ValidationError(
                f"`{wording.prompt}` tokens + `{wording.max_new_tokens}` must be <= "
                f"{config.max_total_tokens}. Given: {input_length} `{wording.prompt}` tokens "
                f"and {max_new_tokens} `{wording.max_new_tokens}`; at most {room} new tokens "
                f"fit after this prompt (the server's `--max-total-tokens`)."
            )
        return max_new_tokens


def _check_key_max_new_tokens(
    max_new_tokens: int, defaulted: bool, limits: Limits, wording: Wording
) -> int:
    """The request's length under its API key's `max_new_tokens`: a default is lowered to
    it, a length asked for beyond it is refused."""
    cap = limits.max_new_tokens
    if cap is None or max_new_tokens <= cap:
        return max_new_tokens
    if defaulted:
        return cap
    raise ValidationError(
        f"`{wording.max_new_tokens}` must be <= {cap} for this API key (its `max_new_tokens` "
        f"limit). Given: {max_new_tokens}"
    )


def _check_key_priority(priority: int | None, limits: Limits) -> int:
    """The request's priority, refused when better (lower) than its API key allows; unset,
    vLLM's 0, or the key's bound when that is worse."""
    bound = limits.priority
    if priority is None:
        return 0 if bound is None else max(0, bound)
    if bound is not None and priority < bound:
        raise ValidationError(
            f"`priority` must be >= {bound} for this API key (its `priority` limit; lower "
            f"is served first). Given: {priority}"
        )
    return priority


def _timeout(timeout: float | None, limits: Limits) -> float | None:
    """The request's deadline in seconds: its own (the body's, else its header's), else its
    API key's `timeout_s`; None: none."""
    if timeout is None:
        return limits.timeout_s
    if not timeout > 0:
        raise ValidationError(f"`timeout` must be > 0 seconds. Given: {timeout}")
    return timeout


def token_spans(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[SimpleToken]:
    """Token ids with the text each one covers.

    Fast (transformers) tokenizers give character offsets; a tokenizer that cannot gives
    ids with empty spans, as TGI does for those.
    """
    if callable(tokenizer):
        try:
            encoding = cast(Any, tokenizer)(
                text, add_special_tokens=add_special_tokens, return_offsets_mapping=True
            )
            ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
        except NotImplementedError:
            pass  # a slow tokenizer: no offsets
        else:
            return [
                SimpleToken(id=i, text=text[start:stop], start=start, stop=stop)
                for i, (start, stop) in zip(ids, offsets, strict=True)
            ]
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return [SimpleToken(id=i, text="", start=0, stop=0) for i in ids]
