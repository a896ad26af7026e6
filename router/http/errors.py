"""Error bodies: TGI's on TGI's routes, OpenAI's on the OpenAI routes (`/v1/...`).

TGI's clients read `{"error": "<message>", "error_type": "<type>"}`. The `openai` SDK
reads `error.message` from `{"error": {"message", "type", "param", "code"}}` and shows
only "Error code: 422" for anything else. The OpenAI body keeps TGI's `error_type`
beside it, so TGI's `text-generation` client still maps the status to its exception
class, and `huggingface_hub` still shows the message.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from starlette.responses import JSONResponse

STATUS_BY_ERROR_TYPE = {
    "validation": 422,
    "generation": 424,
    "overloaded": 429,
    "incomplete_generation": 500,
    "healthcheck": 503,
    "payload_too_large": 413,
    "unauthorized": 401,
    "model_not_found": 404,
}

# OpenAI's `type` for TGI's error types it has a name for; the others keep TGI's.
OPENAI_TYPE_BY_ERROR_TYPE = {
    "validation": "invalid_request_error",
    "payload_too_large": "invalid_request_error",
    "model_not_found": "invalid_request_error",
    "unauthorized": "authentication_error",
    "overloaded": "rate_limit_error",
    "generation": "server_error",
    "incomplete_generation": "server_error",
    "internal": "server_error",
}

OPENAI_PATH_PREFIX = "/v1/"


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


def is_openai_path(path: str) -> bool:
    """Whether errors on `path` are answered in OpenAI's shape."""
    return path.startswith(OPENAI_PATH_PREFIX)


def error_response(
    message: str, error_type: str, status_code: int | None = None, *, openai: bool = False
) -> JSONResponse:
    """The error body for `error_type` (TGI's, or OpenAI's when `openai`) with TGI's status."""
    status = status_code or STATUS_BY_ERROR_TYPE.get(error_type, 500)
    body = (
        openai_error(message, error_type)
        if openai
        else ErrorResponse(error=message, error_type=error_type)
    )
    return JSONResponse(body.model_dump(mode="json"), status_code=status)


def openai_error(message: str, error_type: str) -> OpenAIErrorResponse:
    """OpenAI's error body; `code` names what failed where OpenAI has a code for it."""
    code = error_type if error_type in ("model_not_found", "unauthorized") else None
    if error_type == "unauthorized":
        code = "invalid_api_key"
    detail = OpenAIError(
        message=message,
        type=OPENAI_TYPE_BY_ERROR_TYPE.get(error_type, error_type),
        param=None,
        code=code,
    )
    return OpenAIErrorResponse(error=detail, error_type=error_type)
