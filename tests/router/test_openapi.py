"""The OpenAPI spec and the /docs page."""

from __future__ import annotations

import re
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from textgate.router.openapi import docs_page, openapi_spec


async def test_spec_describes_tgis_routes_from_the_pydantic_models(
    router: httpx.AsyncClient,
) -> None:
    response = await router.get("/api-doc/openapi.json")
    assert response.status_code == 200
    spec = response.json()
    assert spec["openapi"].startswith("3.")
    paths = spec["paths"]
    for path, method in [
        ("/", "post"),
        ("/", "get"),
        ("/generate", "post"),
        ("/generate_stream", "post"),
        ("/invocations", "post"),
        ("/tokenize", "post"),
        ("/health", "get"),
        ("/ping", "get"),
        ("/info", "get"),
        ("/metrics", "get"),
        ("/v1/chat/completions", "post"),
        ("/v1/completions", "post"),
        ("/v1/responses", "post"),
        ("/v1/models", "get"),
    ]:
        assert method in paths[path], (method, path)
    generate = paths["/generate"]["post"]
    assert generate["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/GenerateRequest"
    }
    assert set(generate["responses"]) == {"200", "422", "424", "429", "500"}
    schemas = spec["components"]["schemas"]
    for name in ("GenerateRequest", "GenerateParameters", "GenerateResponse", "Details", "Token"):
        assert name in schemas, name
    parameters = schemas["GenerateParameters"]["properties"]
    for name in ("best_of", "top_n_tokens", "decoder_input_details", "watermark", "ignore_eos"):
        assert name in parameters, name


async def test_docs_is_swagger_ui_served_from_this_server(router: httpx.AsyncClient) -> None:
    response = await router.get("/docs")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    page = response.text
    assert "http://" not in page and "https://" not in page, "no CDN: the page works offline"
    assert 'url: "/api-doc/openapi.json"' in page and "SwaggerUIBundle(" in page
    assets = re.findall(r'(?:src|href)="(/docs/assets/[^"]+)"', page)
    assert {"/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css"} <= set(assets)
    for asset in assets:
        served = await router.get(asset)
        assert served.status_code == 200, asset
        assert served.content, asset
    assert "/generate_stream" in page, "the route table stays for clients without JavaScript"


async def test_the_docs_assets_need_no_api_key(start_router: Any) -> None:
    async with httpx.AsyncClient(base_url=await start_router(api_key="k")) as http:
        assert (await http.get("/docs")).status_code == 200
        assert (await http.get("/docs/assets/swagger-ui-bundle.js")).status_code == 200
        assert (await http.post("/generate", json={"inputs": "w5"})).status_code == 401


def test_openai_routes_have_request_schemas_and_openai_error_bodies() -> None:
    spec = openapi_spec([], "1.0")
    chat = spec["paths"]["/v1/chat/completions"]["post"]
    body = chat["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    error = chat["responses"]["422"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/OpenAIErrorResponse"}
    assert "messages" in spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert "`" not in chat["summary"] and "bearer" in spec["components"]["securitySchemes"]


def test_the_responses_route_has_its_request_and_response_schemas() -> None:
    spec = openapi_spec([], "1.0")
    responses = spec["paths"]["/v1/responses"]["post"]
    body = responses["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ResponsesRequest"}
    answer = responses["responses"]["200"]["content"]["application/json"]["schema"]
    assert answer == {"$ref": "#/components/schemas/ResponseObject"}
    error = responses["responses"]["422"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/OpenAIErrorResponse"}
    schemas = spec["components"]["schemas"]
    assert {"input", "instructions", "text", "tools", "store"} <= set(
        schemas["ResponsesRequest"]["properties"]
    )
    assert "output" in schemas["ResponseObject"]["properties"]


def test_routes_mounted_by_other_modules_are_listed() -> None:
    async def completions(request: Request) -> Response:
        """OpenAI completions.

        More text that stays out of the summary.
        """
        return Response()

    spec = openapi_spec([Route("/v1/other", completions, methods=["POST"])], "1.0")
    assert spec["paths"]["/v1/other"] == {
        "post": {"summary": "OpenAI completions.", "responses": {"200": {"description": "OK"}}}
    }
    assert "<code>/v1/other</code>" in docs_page(spec)
