"""vLLM's runtime LoRA routes: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

As vLLM: 200 with a plain-text message on success; 400 with an OpenAI error body when the
request or the adapter cannot be served (404 unloading a name that is not loaded). The
API key guards them like every generating route.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from textgate.router.engine.adapter_loader import AdapterError, AdapterLoader
from textgate.router.generation.validation import ValidationError
from textgate.router.http.errors import error_response
from textgate.router.http.request_io import read_json
from textgate.router.http.state import RouterState


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's LoadLoRAAdapterRequest."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str
    """The name requests will give as `model` (OpenAI) or `adapter_id` (TGI)."""
    lora_path: str
    """A PEFT folder (adapter_config.json, adapter_model.safetensors) on the server's disk."""


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's UnloadLoRAAdapterRequest (by name)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str
    """A loaded adapter's name."""


def lora_routes(state: RouterState) -> list[BaseRoute]:
    """The two routes over the engine's adapters and the shards."""
    handlers = LoraHandlers(state)
    return [
        Route("/v1/load_lora_adapter", handlers.load, methods=["POST"]),
        Route("/v1/unload_lora_adapter", handlers.unload, methods=["POST"]),
    ]


class LoraHandlers:
    """Each route reads its body and hands it to one `AdapterLoader`."""

    def __init__(self, state: RouterState) -> None:
        engine = state.engine
        self._loader = AdapterLoader(
            engine.adapters,
            state.shards,
            engine.num_active_on,
            state.config.model_id,
            engine.residency,
        )
        self._payload_limit = state.config.payload_limit

    async def load(self, request: Request) -> Response:
        """POST /v1/load_lora_adapter: load a PEFT folder as a LoRA adapter, between steps."""
        try:
            body = await read_json(request, LoadLoraAdapterRequest, self._payload_limit)
            if not body.lora_name or not body.lora_path:
                raise AdapterError("Both 'lora_name' and 'lora_path' must be provided.")
            await self._loader.load(body.lora_name, body.lora_path)
        except (AdapterError, ValidationError) as exc:
            return _error(exc)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        """POST /v1/unload_lora_adapter: unload a LoRA adapter no request is using."""
        try:
            body = await read_json(request, UnloadLoraAdapterRequest, self._payload_limit)
            if not body.lora_name:
                raise AdapterError("'lora_name' must be provided.")
            await self._loader.unload(body.lora_name)
        except (AdapterError, ValidationError) as exc:
            return _error(exc)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _error(exc: AdapterError | ValidationError) -> Response:
    """vLLM's statuses in the OpenAI error body (a malformed body too: 400, not 422)."""
    status = exc.status if isinstance(exc, AdapterError) else 400
    error_type = {404: "model_not_found", 500: "internal"}.get(status, "validation")
    return error_response(str(exc), error_type, status, api="openai")
