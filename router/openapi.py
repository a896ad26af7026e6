"""The OpenAPI spec at /api-doc/openapi.json (TGI's path) and an interactive /docs page.

Schemas come from the pydantic models of the TGI, OpenAI and Anthropic bodies, so the spec cannot
drift from what the handlers parse and send. Routes mounted by other modules are listed
too, with their methods and a summary from their endpoint's docstring.
/docs is Swagger UI, as TGI serves: its assets come from the `swagger-ui-bundle` package
and are served by this server under /docs/assets, so the page works offline (no CDN).
Without JavaScript the page still lists every route.
"""

from __future__ import annotations

import html
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path

from textgate.router.anthropic.schemas import (
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    TokenCount,
)
from textgate.router.generation.schemas import GenerateRequest, SimpleToken
from textgate.router.http.errors import AnthropicErrorResponse, ErrorResponse, OpenAIErrorResponse
from textgate.router.openai.responses_schemas import ResponseObject, ResponsesRequest
from textgate.router.openai.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelList,
)
from textgate.router.tgi.schemas import GenerateResponse, Info, StreamResponse

SPEC_PATH = "/api-doc/openapi.json"
DOCS_PATH = "/docs"
DOCS_ASSETS_PATH = "/docs/assets"
SCHEMA_MODELS: tuple[type[BaseModel], ...] = (
    GenerateRequest,
    GenerateResponse,
    StreamResponse,
    SimpleToken,
    Info,
    ErrorResponse,
    ChatCompletionRequest,
    ChatCompletion,
    CompletionRequest,
    Completion,
    ModelList,
    ResponsesRequest,
    ResponseObject,
    OpenAIErrorResponse,
    MessagesRequest,
    MessageResponse,
    CountTokensRequest,
    TokenCount,
    AnthropicErrorResponse,
)
_GENERATE_ERRORS = {
    "422": "Input validation error",
    "424": "Generation error",
    "429": "Model is overloaded",
    "500": "Incomplete generation",
}

# Anthropic's statuses (router/http/errors.py).
_ANTHROPIC_ERRORS = {
    "400": "Invalid request",
    "404": "Unknown model",
    "500": "Generation error",
    "529": "Overloaded",
}


@dataclass(frozen=True)
class _Operation:
    method: str
    path: str
    summary: str
    request: str | None = None
    """Schema of the JSON body, if any."""
    content: dict[str, Any] = field(default_factory=dict)
    """Media type -> schema of the 200 answer."""
    errors: dict[str, str] = field(default_factory=dict)
    """Status -> description of the error answers."""
    error_schema: str = "ErrorResponse"
    """Schema of the error bodies (TGI's, OpenAI's on /v1/..., Anthropic's on /v1/messages)."""


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _list_of(name: str) -> dict[str, Any]:
    return {"type": "array", "items": _ref(name)}


_JSON = "application/json"
_SSE = "text/event-stream"
_OPERATIONS: tuple[_Operation, ...] = (
    _Operation(
        "post",
        "/",
        "Generate tokens (TGI compat): `stream` false gives a one-element list, true gives SSE",
        "GenerateRequest",
        {_JSON: _list_of("GenerateResponse"), _SSE: _ref("StreamResponse")},
        _GENERATE_ERRORS,
    ),
    _Operation(
        "post",
        "/generate",
        "Generate tokens",
        "GenerateRequest",
        {_JSON: _ref("GenerateResponse")},
        _GENERATE_ERRORS,
    ),
    _Operation(
        "post",
        "/generate_stream",
        "Generate a stream of tokens as server-sent events",
        "GenerateRequest",
        {_SSE: _ref("StreamResponse")},
        _GENERATE_ERRORS,
    ),
    _Operation(
        "post",
        "/invocations",
        "Generate (SageMaker): a TGI body as for POST /; a `messages` or `prompt` body"
        " is served as /v1/chat/completions or /v1/completions",
        "GenerateRequest",
        {_JSON: _list_of("GenerateResponse"), _SSE: _ref("StreamResponse")},
        _GENERATE_ERRORS,
    ),
    _Operation(
        "post",
        "/tokenize",
        "Tokenize the inputs",
        "GenerateRequest",
        {_JSON: _list_of("SimpleToken")},
        {"422": "Input validation error"},
    ),
    _Operation("get", "/", "Health check", errors={"503": "Text generation is down"}),
    _Operation("get", "/health", "Health check", errors={"503": "Text generation is down"}),
    _Operation(
        "get", "/ping", "Health check (SageMaker)", errors={"503": "Text generation is down"}
    ),
    _Operation("get", "/info", "Served model info", content={_JSON: _ref("Info")}),
    _Operation("get", "/metrics", "Prometheus metrics", content={"text/plain": {"type": "string"}}),
    _Operation("get", SPEC_PATH, "This OpenAPI spec", content={_JSON: {"type": "object"}}),
    _Operation("get", DOCS_PATH, "The API documentation page", content={"text/html": {}}),
    _Operation(
        "post",
        "/v1/chat/completions",
        "OpenAI chat completion (messages through the model's chat template);"
        " stream: true gives SSE chunks ending in data: [DONE]",
        "ChatCompletionRequest",
        {_JSON: _ref("ChatCompletion"), _SSE: {"type": "string"}},
        _GENERATE_ERRORS,
        error_schema="OpenAIErrorResponse",
    ),
    _Operation(
        "post",
        "/v1/completions",
        "OpenAI text completion of one or more prompts",
        "CompletionRequest",
        {_JSON: _ref("Completion"), _SSE: {"type": "string"}},
        _GENERATE_ERRORS,
        error_schema="OpenAIErrorResponse",
    ),
    _Operation(
        "post",
        "/v1/responses",
        "OpenAI Responses (stateless: nothing is stored); stream: true gives typed SSE events"
        " (response.created ... response.completed)",
        "ResponsesRequest",
        {_JSON: _ref("ResponseObject"), _SSE: {"type": "string"}},
        _GENERATE_ERRORS,
        error_schema="OpenAIErrorResponse",
    ),
    _Operation("get", "/v1/models", "The served model", content={_JSON: _ref("ModelList")}),
    _Operation(
        "post",
        "/v1/messages",
        "Anthropic Messages (the turns through the model's chat template);"
        " stream: true gives Anthropic's typed SSE events",
        "MessagesRequest",
        {_JSON: _ref("MessageResponse"), _SSE: {"type": "string"}},
        _ANTHROPIC_ERRORS,
        error_schema="AnthropicErrorResponse",
    ),
    _Operation(
        "post",
        "/v1/messages/count_tokens",
        "Anthropic token count of the templated system prompt, turns and tools",
        "CountTokensRequest",
        {_JSON: _ref("TokenCount")},
        {"400": "Invalid request", "404": "Unknown model"},
        error_schema="AnthropicErrorResponse",
    ),
)


def openapi_spec(routes: Sequence[BaseRoute], version: str) -> dict[str, Any]:
    """OpenAPI 3.1 for the mounted `routes`: TGI's in full, any others by method and summary."""
    _, schemas = models_json_schema(
        [(model, "validation") for model in SCHEMA_MODELS],
        ref_template="#/components/schemas/{model}",
    )
    paths: dict[str, dict[str, Any]] = {}
    for operation in _OPERATIONS:
        paths.setdefault(operation.path, {})[operation.method] = _operation_spec(operation)
    for route in routes:
        if isinstance(route, Route):
            _add_route(paths, route)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "textgate",
            "description": "Text generation server, compatible with TGI, OpenAI and Anthropic clients",
            "version": version,
            "license": {"name": "Apache 2.0"},
        },
        "paths": paths,
        "components": {
            "schemas": schemas.get("$defs", {}),
            # --api-key: Swagger UI's "Authorize" sends it on the routes that generate.
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{}, {"bearer": []}],
    }


def docs_routes(routes: Sequence[BaseRoute], version: str) -> list[BaseRoute]:
    """GET /api-doc/openapi.json, GET /docs and its assets, describing `routes`."""
    spec = openapi_spec(routes, version)
    page = docs_page(spec)

    async def openapi_json(request: Request) -> Response:
        return JSONResponse(spec)

    async def docs(request: Request) -> Response:
        return HTMLResponse(page)

    return [
        Route(SPEC_PATH, openapi_json, methods=["GET"]),
        Route(DOCS_PATH, docs, methods=["GET"]),
        Mount(DOCS_ASSETS_PATH, StaticFiles(directory=str(swagger_ui_path)), name="docs-assets"),
    ]


def docs_page(spec: dict[str, Any]) -> str:
    """Swagger UI over the spec, from this server's own assets; a route table without JS."""
    rows = []
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            rows.append(
                f"<tr><td><code>{method.upper()}</code></td><td><code>{html.escape(path)}</code>"
                f"</td><td>{html.escape(operation.get('summary', ''))}</td></tr>"
            )
    title = html.escape(f"{spec['info']['title']} {spec['info']['version']}")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title} API</title>
<link rel="stylesheet" href="{DOCS_ASSETS_PATH}/swagger-ui.css">
<link rel="icon" type="image/png" href="{DOCS_ASSETS_PATH}/favicon-32x32.png">
</head><body>
<div id="swagger-ui"></div>
<noscript><h1>{title} API</h1>
<p>The full OpenAPI spec, with every request and response schema:
<a href="{SPEC_PATH}">{SPEC_PATH}</a>.</p>
<table><thead><tr><th>Method</th><th>Path</th><th>What it does</th></tr></thead>
<tbody>{"".join(rows)}</tbody></table></noscript>
<script src="{DOCS_ASSETS_PATH}/swagger-ui-bundle.js"></script>
<script>
window.ui = SwaggerUIBundle({{
  url: "{SPEC_PATH}",
  dom_id: "#swagger-ui",
  deepLinking: true,
  presets: [SwaggerUIBundle.presets.apis],
}});
</script>
</body></html>
"""


def _operation_spec(operation: _Operation) -> dict[str, Any]:
    responses: dict[str, Any] = {
        "200": {
            "description": "OK",
            "content": {media: {"schema": schema} for media, schema in operation.content.items()},
        }
    }
    for status, description in operation.errors.items():
        responses[status] = {
            "description": description,
            "content": {_JSON: {"schema": _ref(operation.error_schema)}},
        }
    # Summaries are plain text in Swagger UI; descriptions are markdown.
    spec: dict[str, Any] = {
        "summary": operation.summary.replace("`", ""),
        "description": operation.summary,
        "responses": responses,
    }
    if operation.request is not None:
        spec["requestBody"] = {
            "required": True,
            "content": {_JSON: {"schema": _ref(operation.request)}},
        }
    return spec


def _add_route(paths: dict[str, dict[str, Any]], route: Route) -> None:
    """A route not described above: its methods, summarized by its endpoint's docstring."""
    doc = inspect.getdoc(route.endpoint) or route.name
    summary = doc.splitlines()[0] if doc else route.path
    for method in sorted(route.methods or ()):
        if method == "HEAD":
            continue
        paths.setdefault(route.path, {}).setdefault(
            method.lower(), {"summary": summary, "responses": {"200": {"description": "OK"}}}
        )
