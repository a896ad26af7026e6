"""Request plumbing every route module shares: bounded JSON bodies, the deadline header,
client disconnects."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable
from typing import Any, TypeVar

import pydantic
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive

from textgate.router.generation.schemas import GenerateParameters
from textgate.router.generation.validation import ValidationError
from textgate.router.http.errors import PayloadTooLargeError

T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499
"""nginx's status for a client that left before its answer (never actually received)."""
BODY_TIMEOUT_S = 60.0
"""Seconds a request's whole body may take to arrive by default (`--body-timeout`;
2 MB in 60 s is 33 KB/s)."""
BODY_TIMEOUT_STATE_KEY = "textgate.body_timeout_s"
"""Where the HTTP server puts its body deadline in each request's ASGI `state`
(`guarded_h11.GuardedH11Protocol`); a request without it gets BODY_TIMEOUT_S."""
M = TypeVar("M", bound=pydantic.BaseModel)
REQUEST_TIMEOUT_HEADER = "x-request-timeout"
"""Seconds a request may take from its arrival, on every generating route; a `timeout` in
the body wins over it."""


class ClientDisconnectedError(Exception):
    """The client closed the connection before its answer was ready."""


async def read_json(request: Request, model: type[M], limit: int) -> M:
    """The body parsed as `model`: PayloadTooLargeError over `limit` bytes, else
    ValidationError (422) with TGI's "Failed to deserialize..." message when it does not fit."""
    return parse_json(await read_body(request, limit), model)


def parse_json(body: bytes, model: type[M]) -> M:
    """`body` parsed as `model` as `read_json` parses it (ValidationError when it does not
    fit), for a route that reads its body once and picks the model by its shape."""
    try:
        # Only standard JSON, and no coercion ("5" is not an int, 1 is not a bool): serde's
        # strictness, as TGI. pydantic reads duplicate keys silently (the last one wins),
        # so the standard-JSON check runs first.
        check_standard_json(body)
        return model.model_validate_json(body, strict=True)
    except ValueError as exc:  # pydantic.ValidationError is a ValueError too
        raise ValidationError(describe(exc)) from exc


def check_standard_json(body: bytes) -> None:
    """ValueError unless `body` is one standard JSON text (RFC 8259) read one way only:
    UTF-8, no NaN/Infinity, no number that overflows a double (1e999), nothing after the
    value, and no object naming a key twice (which of two values was meant is a guess).
    Lone surrogates (valid JSON, not valid text) are left to pydantic, which refuses them."""
    try:
        _STANDARD_JSON.decode(body.decode("utf-8"))
    except RecursionError:
        raise ValueError("recursion limit exceeded") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate field `{key}`")
            seen.add(key)
    return obj


def _no_constant(name: str) -> None:
    raise ValueError(f"expected value, found {name} (not a JSON number)")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number out of range: {text}")
    return value


_STANDARD_JSON = json.JSONDecoder(
    object_pairs_hook=_unique_keys, parse_constant=_no_constant, parse_float=_finite_float
)


def with_request_timeout(params: GenerateParameters, request: Request) -> GenerateParameters:
    """`params` with the `X-Request-Timeout` header's seconds as its `timeout`, unless the
    body gave one (ValidationError when the header is not a finite number)."""
    header = request.headers.get(REQUEST_TIMEOUT_HEADER)
    if header is None or params.timeout is not None:
        return params
    try:
        timeout = float(header)
    except ValueError:
        timeout = math.nan
    if not math.isfinite(timeout):
        raise ValidationError(f"`X-Request-Timeout` must be a number of seconds. Given: {header}")
    return params.model_copy(update={"timeout": timeout})


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body; PayloadTooLargeError as soon as it is known to exceed `limit` bytes,
    408 when it has not all arrived within the server's body deadline (a client trickling
    it: `--body-timeout`, BODY_TIMEOUT_S unless the server says otherwise)."""
    timeout_s = request.scope.get("state", {}).get(BODY_TIMEOUT_STATE_KEY, BODY_TIMEOUT_S)
    try:
        return await asyncio.wait_for(_read_body(request, limit), timeout_s)
    except asyncio.TimeoutError:
        raise HTTPException(408, "Request Timeout") from None
    except ClientDisconnect:
        # Gone before its body was read (uvicorn drops a buffered body once the connection
        # closes): nobody to answer, and no server error to log.
        raise HTTPException(CLIENT_CLOSED_REQUEST, "Client Closed Request") from None


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLargeError(limit)
    return bytes(body)


def describe(exc: ValueError) -> str:
    """The first problem of a body that does not deserialize, worded like TGI's."""
    if isinstance(exc, pydantic.ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        detail = f"{where}: {first['msg']}" if where else first["msg"]
    else:
        detail = f"Invalid JSON: {exc}"
    return f"Failed to deserialize the JSON body into the target type: {detail}"


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`await work`, unless the client disconnects first (then ClientDisconnectedError,
    and `work` is cancelled)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnectedError()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
