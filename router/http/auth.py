"""The API key check: which tenant a request is for, and its requests' quotas.

A request to a guarded route presents its key as `Authorization: Bearer <key>` (or, on
Anthropic's routes, `x-api-key: <key>`, as its SDKs send it); a missing or unknown key is
a 401 in the API's shape. The tenant's lease (router/engine/quota.py) is opened here, so a
request over its requests per minute or its requests in flight is a 429 before its body
is read; it is held until the response's last byte (a stream's too) and then settled.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from textgate.router.engine.quota import QuotaExceededError, TenantQuota, leased
from textgate.router.http.errors import ErrorApi, error_api, error_response
from textgate.router.http.tenants import Tenants
from textgate.router.http.typed_errors import typed_error_response
from textgate.router.metrics import Metrics

Guarded = Callable[[Scope], bool]
"""Whether a request's route needs a key (probes, /info, /metrics and the docs do not)."""


class AuthMiddleware:
    """Answers 401 unless a guarded request carries a tenant's key, 429 when the tenant is
    over its request limits; the request runs under its tenant's lease."""

    def __init__(self, app: ASGIApp, tenants: Tenants, metrics: Metrics, guarded: Guarded):
        self._app = app
        self._tenants = tenants
        self._metrics = metrics
        self._guarded = guarded

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._guarded(scope):
            await self._app(scope, receive, send)
            return
        path = scope.get("path", "")
        quota = tenant_of(scope, self._tenants)
        if quota is None:
            response = error_response("Unauthorized", "unauthorized", 401, api=error_api(path))
            await response(scope, receive, send)
            return
        self._metrics.tenant_request(quota.name)
        try:
            lease = quota.open_lease()
        except QuotaExceededError as exc:
            self._metrics.tenant_rate_limited(quota.name, exc.limit)
            await typed_error_response(exc, path)(scope, receive, send)
            return
        try:
            with leased(lease):
                await self._app(scope, receive, send)
        finally:
            self._metrics.tenant_tokens(quota.name, lease.close())
            if lease.refused is not None:
                self._metrics.tenant_rate_limited(quota.name, lease.refused)


def tenant_of(scope: Scope, tenants: Tenants) -> TenantQuota | None:
    """The quota of the tenant whose key the request carries; None without a known key."""
    keys = presented_keys(scope, error_api(scope.get("path", "")))
    return next(filter(None, map(tenants.authenticate, keys)), None)


def presented_keys(scope: Scope, api: ErrorApi) -> list[str]:
    """The keys a request carries: its bearer token, and on Anthropic's routes its
    `x-api-key`."""
    headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
    keys = []
    authorization = next((v for k, v in headers if k == b"authorization"), b"")
    scheme, _, token = authorization.decode("latin-1").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        keys.append(token.strip())
    if api == "anthropic":
        key = next((v for k, v in headers if k == b"x-api-key"), b"")
        if key:
            keys.append(key.decode("latin-1"))
    return keys
