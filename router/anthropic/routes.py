"""Anthropic's Messages routes, mapped onto the canonical request.

A request's system prompt and turns go through the model's chat template
(router/anthropic/prompt.py), its sampling fields become `GenerateParameters`
(router/anthropic/params.py), its tools a tool plan whose grammar constrains the answer
to one call object. Errors have Anthropic's body (`{"type": "error", "error": {"type",
"message"}}`) and statuses (400 for a bad request, 404 for an unknown model, 529 when
overloaded).

    POST /v1/messages               a message answer, or its stream of events
    POST /v1/messages/count_tokens  the templated prompt's token count
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from textgate.router.anthropic.output import message_response, new_id
from textgate.router.anthropic.params import WORDING, generate_parameters
from textgate.router.anthropic.prompt import continues_last_turn, template_messages, tool_plan
from textgate.router.anthropic.schemas import CountTokensRequest, MessagesRequest, TokenCount
from textgate.router.anthropic.stream import MessageEvents
from textgate.router.generation.reasoning import reasoning_parser
from textgate.router.generation.schemas import GenerateRequest
from textgate.router.generation.stop_text import TextOptions
from textgate.router.generation.tools import ToolPlan
from textgate.router.http.request_io import read_json, with_request_timeout
from textgate.router.http.served_model import served_model, with_adapter
from textgate.router.http.serving import CLIENT_CLOSED_REQUEST, Serving
from textgate.router.http.state import RouterState
from textgate.router.http.typed_errors import answers_typed_errors

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"


def anthropic_routes(state: RouterState) -> list[BaseRoute]:
    """The Messages routes over `state`; they answer their own errors."""
    handlers = _MessagesHandlers(state)
    return [
        Route(MESSAGES_PATH, answers_typed_errors(handlers.messages), methods=["POST"]),
        Route(COUNT_TOKENS_PATH, answers_typed_errors(handlers.count_tokens), methods=["POST"]),
    ]


class _MessagesHandlers:
    def __init__(self, state: RouterState) -> None:
        self._state = state
        self._config = state.config
        self._metrics = state.metrics
        self._serving = Serving(state)
        self._reasoning = reasoning_parser(state.config.reasoning_parser)

    async def messages(self, request: Request) -> Response:
        """POST /v1/messages: Anthropic's Messages API (the turns through the chat template)."""
        received = time.monotonic()
        self._metrics.request_received()
        with self._metrics.count_failures():
            return await self._message(request, received)

    async def count_tokens(self, request: Request) -> Response:
        """POST /v1/messages/count_tokens: the tokens of the templated system, turns and tools."""
        body = await read_json(request, CountTokensRequest, self._config.payload_limit)
        served_model(body.model, self._config.model_id, self._state.validator.adapters)
        prompt = await self._render(body, tool_plan(body))
        inputs = GenerateRequest(inputs=prompt, add_special_tokens=False)
        tokens = await self._state.validator.tokenize(inputs)
        return JSONResponse(TokenCount(input_tokens=len(tokens)).model_dump(mode="json"))

    async def _message(self, request: Request, received: float) -> Response:
        body = await read_json(request, MessagesRequest, self._config.payload_limit)
        adapters = self._state.validator.adapters
        model = served_model(body.model, self._config.model_id, adapters)
        tools = tool_plan(body)
        params = with_adapter(model, adapters, generate_parameters(body, tools))
        params = with_request_timeout(params, request)
        prompt = await self._render(body, tools)
        # The template already holds the special tokens the model expects (BOS, markers).
        inputs = GenerateRequest(inputs=prompt, parameters=params, add_special_tokens=False)
        valid = await self._serving.validate(
            inputs, body.stream, wording=WORDING, received=received
        )
        channels = self._state.engine.submit([valid])
        message_id = new_id("msg")
        options = TextOptions(stop=tuple(params.stop))
        if body.stream:
            events = MessageEvents(
                message_id,
                model,
                valid.input_length,
                options,
                tools=tools is not None,
                reasoning=self._reasoning,
            )
            return self._serving.stream(channels, events, received)
        results = await self._serving.collect(request, channels, received)
        if results is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        answer = message_response(
            message_id,
            model,
            results[0],
            options,
            tools=tools is not None,
            reasoning=self._reasoning,
        )
        return JSONResponse(answer.model_dump(mode="json"))

    async def _render(self, body: CountTokensRequest, tools: ToolPlan | None) -> str:
        prefill = continues_last_turn(body)
        return await self._serving.render(
            template_messages(body),
            tools,
            add_generation_prompt=not prefill,
            continue_final_message=prefill,
        )
