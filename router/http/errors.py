"""Error bodies: TGI's on TGI's routes, OpenAI's on the OpenAI routes (`/v1/...`),
Anthropic's on the Messages routes (`/v1/messages...`); `error_api` picks by path.

TGI's clients read `{"error": "<message>", "error_type": "<type>"}`. The `openai` SDK
reads `error.message` from `{"error": {"message", "type", "param", "code"}}` and shows
only "Error code: 422" for anything else. The OpenAI body keeps TGI's `error_type`
beside it, so TGI's `text-generation` client still maps the status to its exception
class, and `huggingface_hub` still shows the message. The `anthropic` SDK reads
`{"type": "error", "error": {"type", "message"}}` and picks its exception class by the
status, so Anthropic's errors also take Anthropic's statuses (400 for a bad request,
529 when overloaded).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict
from starlette.responses import JSONResponse

ErrorApi = Literal["tgi", "openai", "anthropic"]
"""Whose error shape (and statuses) a route answers with."""

STATUS_BY_ERROR_TYPE = {
    "validation": 422,
    "generation": 424,
    "overloaded": 429,
    "rate_limited": 429,
    "incomplete_generation": 500,
    "healthcheck": 503,
    "payload_too_large": 413,
    "unauthorized": 401,
    "model_not_found": 404,
    # A request's own deadline (`timeout`) ran out while it was queued; 408 as for a body
    # that did not arrive in time (request_io.read_body).
    "timeout": 408,
}

# OpenAI's `type` for TGI's error types it has a name for; the others keep TGI's.
OPENAI_TYPE_BY_ERROR_TYPE = {
    "validation": "invalid_request_error",
    "payload_too_large": "invalid_request_error",
    "model_not_found": "invalid_request_error",
    "unauthorized": "authentication_error",
    "overloaded": "rate_limit_error",
    "rate_limited": "rate_limit_error",
    "generation": "server_error",
    "incomplete_generation": "server_error",
    "internal": "server_error",
    "timeout": "timeout_error",
}

# OpenAI's `code` for the error types it has one for.
OPENAI_CODE_BY_ERROR_TYPE = {
    "model_not_found": "model_not_found",
    "unauthorized": "invalid_api_key",
    "rate_limited": "rate_limit_exceeded",
    "timeout": "request_timeout",
}

# Anthropic's status for TGI's error types (the others: TGI's own).
ANTHROPIC_STATUS_BY_ERROR_TYPE = {
    "validation": 400,
    "model_not_found": 404,
    "overloaded": 529,
    "generation": 500,
    "incomplete_generation": 500,
}
# Anthropic's `type` for a status; other 4xx are invalid_request_error, 5xx api_error.
ANTHROPIC_TYPE_BY_STATUS = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

OPENAI_PATH_PREFIX = "/v1/"
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})


class ErrorResponse(BaseModel):
    """TGI's error body, and the last event of a TGI stream that failed."""

    model_config = ConfigDict(frozen=True)

    error: str
    error_type: str


class OpenAIError(BaseModel):
    """The `error` object of OpenAI's error body; the SDK shows `message`."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorResponse(BaseModel):
    """Every error of the OpenAI routes, and the last event of a stream that failed.

    `error_type` is TGI's, kept so TGI's client still picks its exception class.
    """

    error: OpenAIError
    error_type: str


class PayloadTooLargeError(Exception):
    """The request body is over `payload_limit`."""

    error_type = "payload_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(f"Payload too large: the body exceeds {limit} bytes")


class ModelNotFoundError(Exception):
    """An OpenAI request named a model this server does not serve (OpenAI's 404)."""

    error_type = "model_not_found"


class AnthropicError(BaseModel):
    """The `error` object of Anthropic's error body."""

    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every error of the Anthropic routes, and the `error` event of a stream that failed."""

    type: Literal["error"] = "error"
    error: AnthropicError


def error_api(path: str) -> ErrorApi:
    """Whose shape errors on `path` are answered in."""
    if path in ANTHROPIC_PATHS:
        return "anthropic"
    return "openai" if path.startswith(OPENAI_PATH_PREFIX) else "tgi"


def error_response(
    message: str, error_type: str, status_code: int | None = None, *, api: ErrorApi = "tgi"
) -> JSONResponse:
    """The error body of `api` for `error_type`, with TGI's status (Anthropic's for
    `api` "anthropic") unless `status_code` is given."""
    status = status_code or STATUS_BY_ERROR_TYPE.get(error_type, 500)
    body: BaseModel
    if api == "anthropic":
        status = status_code or anthropic_status(error_type)
        body = anthropic_error(message, status)
    elif api == "openai":
        body = openai_error(message, error_type)
    else:
        body = ErrorResponse(error=message, error_type=error_type)
    return JSONResponse(body.model_dump(mode="json"), status_code=status)


def anthropic_error(message: str, status: int) -> AnthropicErrorResponse:
    """Anthropic's error body for an answer of HTTP `status`."""
    kind = ANTHROPIC_TYPE_BY_STATUS.get(status)
    if kind is None:
        kind = "api_error" if status >= 500 else "invalid_request_error"
    return AnthropicErrorResponse(error=AnthropicError(type=kind, message=message))


def anthropic_status(error_type: str) -> int:
    """Anthropic's status for one of TGI's error types."""
    return ANTHROPIC_STATUS_BY_ERROR_TYPE.get(error_type, STATUS_BY_ERROR_TYPE.get(error_type, 500))


def openai_error(message: str, error_type: str) -> OpenAIErrorResponse:
    """OpenAI's error body; `code` names what failed where OpenAI has a code for it."""
    code = OPENAI_CODE_BY_ERROR_TYPE.get(error_type)
    detail = OpenAIError(
        message=message,
        type=OPENAI_TYPE_BY_ERROR_TYPE.get(error_type, error_type),
        param=None,
        code=code,
    )
    return OpenAIErrorResponse(error=detail, error_type=error_type)
