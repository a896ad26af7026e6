"""Request validation: TGI's rules and messages, tokenization off the event loop.

Every rejected request raises `ValidationError`, answered 422 with
`{"error": str(err), "error_type": "validation"}`. The order of the checks is TGI's,
so a request breaking several rules gets the same message it would get from TGI.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence, Sized
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, cast

from textgate.router.config import RouterConfig
from textgate.router.engine.request import (
    GrammarSpec,
    SamplingParams,
    StoppingParams,
    ValidRequest,
)
from textgate.router.tgi.grammar import GrammarSpecError, parse_grammar
from textgate.router.tgi.schemas import GenerateParameters, GenerateRequest, SimpleToken

MAX_SEED = 2**64
MAX_CHARS_PER_TOKEN = 100
"""More characters than any tokenizer packs into one token on real text: a prompt over
`max_input_tokens` times this is too long before it is tokenized (a cheap bound, so a
huge string costs no tokenizer time), and a stop sequence over `max_total_tokens` times
this could never match."""


@dataclass(frozen=True)
class Wording:
    """How a route names the prompt and the length limit in its error messages."""

    prompt: str = "inputs"
    max_new_tokens: str = "max_new_tokens"
    truncate: str = "truncate"
    templated: bool = False
    """The prompt went through the chat template, whose tokens count too."""


TGI_WORDING = Wording()


class ValidationError(Exception):
    """A request the router rejects with 422; the message is TGI's."""

    error_type = "validation"


class Tokenizer(Protocol):
    """What validation needs from a tokenizer (transformers' tokenizers fit)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


class Validator:
    """Checks requests against the router's limits and tokenizes them in a thread pool."""

    def __init__(
        self, config: RouterConfig, tokenizer: Tokenizer, *, grammars: bool = True
    ) -> None:
        self._config = config
        # Grammars are enforced by the paged shards' sampler; the transformers fallback
        # (padded shards) has none, so a grammar there is refused here rather than failing
        # the batch it would join.
        self._grammars = grammars
        self._tokenizer = tokenizer
        # transformers' tokenizers know their size; logit_bias ids are checked against it.
        self._vocab_size: int | None = len(tokenizer) if isinstance(tokenizer, Sized) else None
        self._executor = ThreadPoolExecutor(
            max_workers=config.validation_workers, thread_name_prefix="tokenizer"
        )

    async def validate(
        self,
        request: GenerateRequest,
        *,
        stream: bool = False,
        input_ids: Sequence[int] | None = None,
        wording: Wording = TGI_WORDING,
    ) -> ValidRequest:
        """The validated request, or ValidationError with TGI's message.

        `input_ids`: the prompt as token ids (OpenAI completions), used instead of
        tokenizing `request.inputs` (then only its text for echoing). `wording` names
        the route's own fields in the length errors."""
        params = request.parameters
        _check_unsupported(params)
        _check_stream(params, stream)
        best_of = _check_best_of(params, self._config.max_best_of)
        sampling = _sampling(params, best_of)
        self._check_token_ids(sampling.logit_bias)
        _check_counts(params, self._config)
        truncate = _check_truncate(params.truncate, self._config.max_input_tokens)
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
        return ValidRequest(
            inputs=request.inputs,
            input_ids=tuple(ids),
            sampling=sampling,
            stopping=_stopping(params, max_new_tokens),
            top_n_tokens=params.top_n_tokens or 0,
            decoder_input_details=params.decoder_input_details,
            best_of=best_of,
            grammar=self._grammar(params),
        )

    def _grammar(self, params: GenerateParameters) -> GrammarSpec | None:
        grammar = _grammar(params)
        if grammar is not None and not self._grammars:
            raise ValidationError(
                "`grammar` needs a natively supported model: this one is served by the "
                "transformers fallback, which cannot constrain its output"
            )
        return grammar

    async def tokenize(self, request: GenerateRequest) -> list[SimpleToken]:
        """The prompt's tokens with their character spans (TGI's /tokenize).

        `parameters.truncate` keeps the last tokens, as generation would.
        """
        truncate = _check_truncate(request.parameters.truncate, self._config.max_input_tokens)
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


def _check_unsupported(p: GenerateParameters) -> None:
    # Silently ignoring these would return output the client did not ask for.
    if p.watermark:
        raise ValidationError("`watermark` is not supported: this server does not watermark")
    if p.adapter_id is not None:
        raise ValidationError("`adapter_id` is not supported: this server loads no adapters")


def _grammar(p: GenerateParameters) -> GrammarSpec | None:
    if p.grammar is None:
        return None
    if p.min_new_tokens:
        raise ValidationError(
            "`min_new_tokens` cannot be combined with `grammar`: the grammar decides where "
            "the text ends"
        )
    if isinstance(p.grammar, GrammarSpec):  # built by the router (OpenAI routes)
        return p.grammar
    try:
        return parse_grammar(p.grammar)
    except GrammarSpecError as exc:
        raise ValidationError(f"Grammar is not valid: {exc}") from None


def _check_stream(p: GenerateParameters, stream: bool) -> None:
    if not stream:
        return
    if p.best_of is not None and p.best_of != 1:
        raise ValidationError("`best_of` != 1 is not supported when streaming tokens")
    if p.decoder_input_details:
        raise ValidationError(
            "`decoder_input_details` == true is not supported when streaming tokens"
        )


def _check_best_of(p: GenerateParameters, max_best_of: int) -> int:
    best_of = 1 if p.best_of is None else p.best_of
    if max_best_of == 1 and best_of != 1:
        raise ValidationError("`best_of` != 1 is not allowed for this endpoint")
    if not 0 < best_of <= max_best_of:
        raise ValidationError(f"`best_of` must be > 0 and <= {max_best_of}. Given: {best_of}")
    if best_of > 1 and not _wants_sampling(p):
        raise ValidationError("you must use sampling when `best_of` is > 1")
    return best_of


def _wants_sampling(p: GenerateParameters) -> bool:
    """TGI samples when asked to, or when any sampling parameter is set."""
    warpers = (p.temperature, p.top_k, p.top_p, p.typical_p)
    return p.do_sample or any(value is not None for value in warpers)


def _sampling(p: GenerateParameters, best_of: int) -> SamplingParams:
    temperature = 1.0 if p.temperature is None else p.temperature
    if temperature <= 0:
        raise ValidationError("`temperature` must be strictly positive")
    repetition_penalty = 1.0 if p.repetition_penalty is None else p.repetition_penalty
    if repetition_penalty <= 0:
        raise ValidationError("`repetition_penalty` must be strictly positive")
    frequency_penalty = _penalty("frequency_penalty", p.frequency_penalty)
    presence_penalty = _penalty("presence_penalty", p.presence_penalty)
    if p.top_p is not None and not 0.0 < p.top_p < 1.0:
        raise ValidationError("`top_p` must be > 0.0 and < 1.0")
    if p.typical_p is not None and not 0.0 < p.typical_p < 1.0:
        raise ValidationError("`typical_p` must be > 0.0 and < 1.0")
    if p.top_k is not None and p.top_k <= 0:
        raise ValidationError("`top_k` must be strictly positive")
    return SamplingParams(
        temperature=temperature,
        top_k=p.top_k or 0,
        top_p=1.0 if p.top_p is None else p.top_p,
        typical_p=1.0 if p.typical_p is None else p.typical_p,
        # The shard gets an explicit choice: TGI samples whenever a warper is set.
        do_sample=_wants_sampling(p),
        seed=_seed(p.seed, best_of),
        repetition_penalty=repetition_penalty,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        logit_bias=_logit_bias(p.logit_bias),
    )


def _logit_bias(bias: dict[int, float] | None) -> tuple[tuple[int, float], ...]:
    """The bias as sorted (token id, value) pairs, each value within [-100, 100]."""
    for token_id, value in (bias or {}).items():
        if not -100.0 <= value <= 100.0:
            raise ValidationError(
                f"`logit_bias` values must be >= -100 and <= 100 (token {token_id}: {value})"
            )
    return tuple(sorted((bias or {}).items()))


def _penalty(name: str, value: float | None) -> float:
    """An OpenAI-style additive penalty: 0.0 when unset, else within [-2, 2]."""
    if value is None:
        return 0.0
    if not -2.0 <= value <= 2.0:
        raise ValidationError(f"`{name}` must be >= -2.0 and <= 2.0")
    return value


def _seed(seed: int | None, best_of: int) -> int:
    if seed is None:
        return secrets.randbits(64)
    if best_of > 1:
        raise ValidationError("`seed` must not be set when `best_of` > 1")
    if not 0 <= seed < MAX_SEED:
        raise ValidationError(f"`seed` must be >= 0 and < 2^64. Given: {seed}")
    return seed


def _check_counts(p: GenerateParameters, config: RouterConfig) -> None:
    if p.max_new_tokens is not None and p.max_new_tokens <= 0:
        raise ValidationError("`max_new_tokens` must be strictly positive")
    if len(p.stop) > config.max_stop_sequences:
        raise ValidationError(
            f"`stop` supports up to {config.max_stop_sequences} stop sequences. "
            f"Given: {len(p.stop)}"
        )
    longest_stop = max(map(len, p.stop), default=0)
    if longest_stop > config.max_total_tokens * MAX_CHARS_PER_TOKEN:
        raise ValidationError(
            f"`stop` sequences must have at most {config.max_total_tokens * MAX_CHARS_PER_TOKEN}"
            f" characters (longer ones could never match). Given: {longest_stop}"
        )
    top_n = p.top_n_tokens
    if top_n is not None and not 0 <= top_n <= config.max_top_n_tokens:
        raise ValidationError(
            f"`top_n_tokens` must be >= 0 and <= {config.max_top_n_tokens}. Given: {top_n}"
        )
    min_new = p.min_new_tokens
    if min_new is not None and (
        min_new < 0 or (p.max_new_tokens is not None and min_new > p.max_new_tokens)
    ):
        raise ValidationError(
            f"`min_new_tokens` must be >= 0 and <= `max_new_tokens`. Given: {min_new}"
        )


def _check_truncate(truncate: int | None, max_input_tokens: int) -> int | None:
    if truncate is not None and not 0 < truncate <= max_input_tokens:
        raise ValidationError(
            f"`truncate` must be strictly positive and less than {max_input_tokens}. "
            f"Given: {truncate}"
        )
    return truncate


def _stopping(p: GenerateParameters, max_new_tokens: int) -> StoppingParams:
    return StoppingParams(
        max_new_tokens=max_new_tokens,
        stop_sequences=tuple(p.stop),
        ignore_eos_token=p.ignore_eos,
        min_new_tokens=min(p.min_new_tokens or 0, max_new_tokens),
    )
