"""TGI's error bodies and the HTTP status of each `error_type`."""

from __future__ import annotations

from starlette.responses import JSONResponse

from textgate.router.tgi.schemas import ErrorResponse

STATUS_BY_ERROR_TYPE = {
    "validation": 422,
    "generation": 424,
    "overloaded": 429,
    "incomplete_generation": 500,
    "healthcheck": 503,
    "payload_too_large": 413,
    "unauthorized": 401,
}


class PayloadTooLargeError(Exception):
    """The request body is over `payload_limit`."""

    error_type = "payload_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(f"Payload too large: the body exceeds {limit} bytes")


def error_response(message: str, error_type: str, status_code: int | None = None) -> JSONResponse:
    """`{"error": message, "error_type": error_type}` with the status TGI uses for the type."""
    status = status_code or STATUS_BY_ERROR_TYPE.get(error_type, 500)
    body = ErrorResponse(error=message, error_type=error_type)
    return JSONResponse(body.model_dump(mode="json"), status_code=status)
