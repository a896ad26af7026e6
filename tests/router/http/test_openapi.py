"""The OpenAPI spec and the /docs page."""

from __future__ import annotations

import httpx
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from textgate.router.http.openapi import docs_page, openapi_spec


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


async def test_docs_page_links_the_spec_without_external_assets(
    router: httpx.AsyncClient,
) -> None:
    response = await router.get("/docs")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    page = response.text
    assert "/api-doc/openapi.json" in page
    assert "/generate_stream" in page
    assert "http://" not in page and "https://" not in page and "<script" not in page


def test_routes_mounted_by_other_modules_are_listed() -> None:
    async def completions(request: Request) -> Response:
        """OpenAI completions.

        More text that stays out of the summary.
        """
        return Response()

    spec = openapi_spec([Route("/v1/completions", completions, methods=["POST"])], "1.0")
    assert spec["paths"]["/v1/completions"] == {
        "post": {"summary": "OpenAI completions.", "responses": {"200": {"description": "OK"}}}
    }
    assert "<code>/v1/completions</code>" in docs_page(spec)
