"""Exceptions raised by the textgate client, mapped from the server's error answers.

The class names are those of the `text_generation` client, so `except ValidationError:`
keeps working after switching imports. Every class derives from `TextGateError`, which
carries the server's message, the HTTP status and the `error_type` it sent.
"""

from __future__ import annotations

from typing import Any


class TextGateError(Exception):
    """Base of every error raised by the textgate client."""

    def __init__(
        self, message: str, *, status_code: int | None = None, error_type: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.error_type = error_type


class ValidationError(TextGateError):
    """The request was rejected: by the client before sending, or by the server (422)."""


class GenerationError(TextGateError):
    """The model failed while generating (424, `generation`)."""


class OverloadedError(TextGateError):
    """The server has too many requests in flight (429, `overloaded`)."""


class IncompleteGenerationError(TextGateError):
    """The generation ended without its final answer (`incomplete_generation`, or a cut stream)."""


class BadRequestError(TextGateError):
    """The server could not read the request (400)."""


class UnauthorizedError(TextGateError):
    """Missing or wrong API key (401, 403)."""


class NotFoundError(TextGateError):
    """The route or model does not exist (404)."""


class RateLimitExceededError(TextGateError):
    """Too many requests without a TGI `error_type` (429), e.g. from a gateway in front."""


class ShardNotReadyError(TextGateError):
    """The model shards are not serving yet (503, `unhealthy`; 424 without `error_type`)."""


class ShardTimeoutError(TextGateError):
    """A gateway timed out waiting for the model (504)."""


class UnknownError(TextGateError):
    """Any other error answer, or an answer the client cannot read."""


class ClientTimeoutError(TextGateError, TimeoutError):
    """No answer within the client's `timeout` (connect, read, write or pool)."""


class ConnectionFailedError(TextGateError, ConnectionError):
    """The server could not be reached at all."""


# TGI's `error_type` values decide first: they are what the server meant.
_BY_ERROR_TYPE: dict[str, type[TextGateError]] = {
    "validation": ValidationError,
    "generation": GenerationError,
    "overloaded": OverloadedError,
    "incomplete_generation": IncompleteGenerationError,
    "unhealthy": ShardNotReadyError,
    "healthcheck": ShardNotReadyError,
    "unauthorized": UnauthorizedError,
    "model_not_found": NotFoundError,
    "payload_too_large": BadRequestError,
    # The server cancelled a stream its reader left unread past --max-stream-buffer.
    "stream_buffer_overflow": IncompleteGenerationError,
}

# Without a known `error_type` (another gateway, a proxy, an OpenAI-style body) the
# status decides, as the `text_generation` client does.
_BY_STATUS: dict[int, type[TextGateError]] = {
    400: BadRequestError,
    401: UnauthorizedError,
    403: UnauthorizedError,
    404: NotFoundError,
    422: ValidationError,
    424: ShardNotReadyError,
    429: RateLimitExceededError,
    503: ShardNotReadyError,
    504: ShardTimeoutError,
}


def parse_error(status_code: int, payload: Any) -> TextGateError:
    """Build the exception for an error answer.

    `payload` is the decoded JSON body (or stream event): TGI's `{"error": str, "error_type": str}`,
    OpenAI's `{"error": {"message": str, "type": str}}` (textgate's OpenAI routes add TGI's
    `error_type` beside it, which decides then), or anything else (then its text is the
    message).
    """
    message, error_type = _message_and_type(payload)
    error_class = _BY_ERROR_TYPE.get(error_type or "") or _BY_STATUS.get(status_code, UnknownError)
    return error_class(message, status_code=status_code, error_type=error_type)


def _message_and_type(payload: Any) -> tuple[str, str | None]:
    if not isinstance(payload, dict) or "error" not in payload:
        return str(payload), None
    error = payload["error"]
    if isinstance(error, dict):
        error_type = payload.get("error_type", error.get("type"))
        return str(error.get("message", error)), _str_or_none(error_type)
    return str(error), _str_or_none(payload.get("error_type"))


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)
