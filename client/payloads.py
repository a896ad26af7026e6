"""Request bodies for each route, validated before anything is sent.

Checks mirror the `text_generation` client and TGI's router, so an obviously bad request
raises `ValidationError` locally with the message the server would have answered.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import pydantic

from textgate.client.errors import ValidationError
from textgate.client.openai_types import Message, Tool
from textgate.client.types import Parameters

M = TypeVar("M", bound=pydantic.BaseModel)

# (field, is_invalid, message); a None value is never checked.
Rule = tuple[str, Callable[[Any], bool], str]


def _not_probability(value: float) -> bool:
    return not 0.0 < value < 1.0


def _not_penalty(value: float) -> bool:
    return not -2.0 <= value <= 2.0


_GENERATE_RULES: list[Rule] = [
    ("max_new_tokens", lambda v: v <= 0, "`max_new_tokens` must be strictly positive"),
    ("min_new_tokens", lambda v: v < 0, "`min_new_tokens` must be positive"),
    ("best_of", lambda v: v <= 0, "`best_of` must be strictly positive"),
    ("repetition_penalty", lambda v: v <= 0, "`repetition_penalty` must be strictly positive"),
    ("frequency_penalty", _not_penalty, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ("seed", lambda v: v < 0, "`seed` must be positive"),
    ("temperature", lambda v: v <= 0, "`temperature` must be strictly positive"),
    ("top_k", lambda v: v <= 0, "`top_k` must be strictly positive"),
    ("top_p", _not_probability, "`top_p` must be > 0.0 and < 1.0"),
    ("truncate", lambda v: v <= 0, "`truncate` must be strictly positive"),
    ("typical_p", _not_probability, "`typical_p` must be > 0.0 and < 1.0"),
    ("top_n_tokens", lambda v: v <= 0, "`top_n_tokens` must be strictly positive"),
]

# OpenAI semantics: temperature 0 means greedy, top_p 1.0 means no filtering.
_OPENAI_RULES: list[Rule] = [
    ("max_tokens", lambda v: v <= 0, "`max_tokens` must be strictly positive"),
    ("n", lambda v: v <= 0, "`n` must be strictly positive"),
    ("temperature", lambda v: v < 0, "`temperature` must be >= 0.0"),
    ("top_p", lambda v: not 0.0 < v <= 1.0, "`top_p` must be > 0.0 and <= 1.0"),
    ("seed", lambda v: v < 0, "`seed` must be positive"),
    ("top_logprobs", lambda v: v < 0, "`top_logprobs` must be positive"),
    ("repetition_penalty", lambda v: v <= 0, "`repetition_penalty` must be strictly positive"),
    ("frequency_penalty", _not_penalty, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ("presence_penalty", _not_penalty, "`presence_penalty` must be >= -2.0 and <= 2.0"),
]


def generate_payload(prompt: str, params: Mapping[str, Any], *, stream: bool) -> dict[str, Any]:
    """Body of `/generate` or `/generate_stream`: `{"inputs", "parameters"}`.

    `params` are the client method's keyword arguments; `stop_sequences` is sent as `stop`.
    """
    values = dict(params)
    values["stop"] = list(values.pop("stop_sequences", None) or [])
    parameters = _build(Parameters, values)
    if not prompt:
        raise ValidationError("`inputs` cannot be empty")
    check_parameters(parameters, stream=stream)
    return {"inputs": prompt, "parameters": parameters.model_dump(mode="json", exclude_none=True)}


def check_parameters(parameters: Parameters, *, stream: bool) -> None:
    """Raise `ValidationError` for parameter values the server would reject."""
    _apply(_GENERATE_RULES, parameters.model_dump())
    if (parameters.best_of or 1) > 1:
        _check_best_of(parameters, stream=stream)
    min_new, max_new = parameters.min_new_tokens, parameters.max_new_tokens
    if min_new is not None and max_new is not None and min_new > max_new:
        raise ValidationError("`min_new_tokens` must be <= `max_new_tokens`")
    if parameters.grammar is not None and not parameters.grammar.value:
        raise ValidationError(
            f"`value` cannot be empty for `{parameters.grammar.type.value}` grammar"
        )


def _check_best_of(parameters: Parameters, *, stream: bool) -> None:
    if parameters.seed is not None:
        raise ValidationError("`seed` must not be set when `best_of` is > 1")
    sampling = parameters.do_sample or any(
        value is not None
        for value in (
            parameters.temperature,
            parameters.top_k,
            parameters.top_p,
            parameters.typical_p,
        )
    )
    if not sampling:
        raise ValidationError("you must use sampling when `best_of` is > 1")
    if stream:
        raise ValidationError("`best_of` != 1 is not supported when `stream` == True")


def chat_payload(
    messages: Sequence[Message | Mapping[str, Any]], params: Mapping[str, Any], *, stream: bool
) -> dict[str, Any]:
    """Body of `/v1/chat/completions`; `None` parameters are left out."""
    if not messages:
        raise ValidationError("`messages` cannot be empty")
    values = _without_none(params)
    _apply(_OPENAI_RULES, values)
    body: dict[str, Any] = {**values}
    body["messages"] = [_dump(Message, m, f"messages[{i}]") for i, m in enumerate(messages)]
    if "tools" in body:
        body["tools"] = [_dump(Tool, t, f"tools[{i}]") for i, t in enumerate(body["tools"])]
    body["stream"] = stream
    return body


def completion_payload(
    prompt: str | Sequence[str], params: Mapping[str, Any], *, stream: bool
) -> dict[str, Any]:
    """Body of `/v1/completions`; `None` parameters are left out."""
    if not prompt or any(not part for part in ([prompt] if isinstance(prompt, str) else prompt)):
        raise ValidationError("`prompt` cannot be empty")
    values = _without_none(params)
    _apply(_OPENAI_RULES, values)
    return {
        **values,
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "stream": stream,
    }


def _apply(rules: list[Rule], values: Mapping[str, Any]) -> None:
    for field, is_invalid, message in rules:
        value = values.get(field)
        if value is not None and is_invalid(value):
            raise ValidationError(message)


def _build(model: type[M], values: Any, where: str = "") -> M:
    try:
        # from_attributes: messages may be objects of another client's `Message` class.
        return model.model_validate(values, from_attributes=True)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        parts = [where] if where else []
        field = ".".join(parts + [str(part) for part in first["loc"]])
        raise ValidationError(f"`{field}`: {first['msg']}") from err


def _dump(model: type[pydantic.BaseModel], value: Any, where: str) -> dict[str, Any]:
    return _build(model, value, where).model_dump(mode="json", exclude_none=True)


def _without_none(params: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in params.items() if value is not None}


def method_arguments(scope: Mapping[str, Any], *skip: str) -> dict[str, Any]:
    """A client method's keyword arguments, taken from its `locals()` before any assignment.

    The methods spell out every parameter (for signatures and docs that match the
    `text_generation` client); this forwards them without listing them a second time.
    """
    return {key: value for key, value in scope.items() if key != "self" and key not in skip}
