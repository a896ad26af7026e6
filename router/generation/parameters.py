"""TGI's rules for a request's `parameters`: each check raises `ValidationError` with
TGI's message, and the valid values become the engine's `SamplingParams`,
`StoppingParams` and `GrammarSpec`. No tokenizer: `validation.Validator` calls these in
TGI's order, between its own checks of the prompt's tokens.
"""

from __future__ import annotations

import secrets

from textgate.router.config import RouterConfig
from textgate.router.engine.request import GrammarSpec, SamplingParams, StoppingParams
from textgate.router.generation.grammar import GrammarSpecError, parse_grammar
from textgate.router.generation.schemas import GenerateParameters

MAX_SEED = 2**64
MAX_CHARS_PER_TOKEN = 100
"""More characters than any tokenizer packs into one token on real text: a prompt over
`max_input_tokens` times this is too long before it is tokenized (a cheap bound, so a
huge string costs no tokenizer time), and a stop sequence over `max_total_tokens` times
this could never match."""


class ValidationError(Exception):
    """A request the router rejects with 422; the message is TGI's."""

    error_type = "validation"


def check_unsupported(p: GenerateParameters) -> None:
    """Refuse the TGI parameters this server cannot honour."""
    # Silently ignoring these would return output the client did not ask for.
    if p.watermark:
        raise ValidationError("`watermark` is not supported: this server does not watermark")


def grammar_spec(p: GenerateParameters) -> GrammarSpec | None:
    """The request's grammar, parsed (None without one)."""
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


def check_stream(p: GenerateParameters, stream: bool) -> None:
    """Refuse what a token stream cannot carry."""
    if not stream:
        return
    if p.best_of is not None and p.best_of != 1:
        raise ValidationError("`best_of` != 1 is not supported when streaming tokens")
    if p.decoder_input_details:
        raise ValidationError(
            "`decoder_input_details` == true is not supported when streaming tokens"
        )


def check_best_of(p: GenerateParameters, max_best_of: int) -> int:
    """The request's best_of (1 when unset), within the server's --max-best-of."""
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


def sampling_params(
    p: GenerateParameters, best_of: int, max_logit_bias: float = 100.0
) -> SamplingParams:
    """The sampler's settings, each range checked; unset values take TGI's defaults."""
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
    if p.min_p is not None and not 0.0 <= p.min_p <= 1.0:
        raise ValidationError("`min_p` must be >= 0.0 and <= 1.0")
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
        logit_bias=_logit_bias(p.logit_bias, max_logit_bias),
        min_p=p.min_p or 0.0,
    )


def _logit_bias(bias: dict[int, float] | None, bound: float) -> tuple[tuple[int, float], ...]:
    """The bias as sorted (token id, value) pairs, each value within [-bound, bound]
    (OpenAI's 100, or --max-logit-bias)."""
    for token_id, value in (bias or {}).items():
        if not -bound <= value <= bound:
            raise ValidationError(
                f"`logit_bias` values must be >= {-bound:g} and <= {bound:g} "
                f"(token {token_id}: {value})"
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


def check_counts(p: GenerateParameters, config: RouterConfig) -> None:
    """Bound max/min_new_tokens, the stop sequences and top_n_tokens by the server's limits."""
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


def check_truncate(truncate: int | None, max_input_tokens: int) -> int | None:
    """`truncate` as given, once it lies in (0, max_input_tokens]."""
    if truncate is not None and not 0 < truncate <= max_input_tokens:
        raise ValidationError(
            f"`truncate` must be strictly positive and less than {max_input_tokens}. "
            f"Given: {truncate}"
        )
    return truncate


def stopping_params(p: GenerateParameters, max_new_tokens: int) -> StoppingParams:
    """When the request stops: its length (already checked), stop sequences, eos."""
    return StoppingParams(
        max_new_tokens=max_new_tokens,
        stop_sequences=tuple(p.stop),
        ignore_eos_token=p.ignore_eos,
        min_new_tokens=min(p.min_new_tokens or 0, max_new_tokens),
        stop_token_ids=tuple(sorted(set(p.stop_token_ids or ()))),
    )
