"""POST /v1/responses: OpenAI's Responses API over the chat pipeline, stateless.

    body -> messages (instructions, input items) -> chat template -> one generation
         -> a response object, or its typed events (router/openai/responses_stream.py)

Nothing is stored: `store` is accepted and the response says `"store": false`; what
needs a stored response (`previous_response_id`, `conversation`) is refused with a 422 in
OpenAI's error shape. A client continues a conversation by sending it whole: earlier
`output` items (messages, `function_call`s) and `function_call_output`s go back in `input`.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from textgate.router.generation.reasoning import reasoning_parser
from textgate.router.generation.schemas import GenerateRequest
from textgate.router.generation.validation import Wording
from textgate.router.http.request_io import read_json, with_request_timeout
from textgate.router.http.served_model import served_model, with_adapter
from textgate.router.http.serving import CLIENT_CLOSED_REQUEST, Serving
from textgate.router.http.state import RouterState
from textgate.router.openai.responses_input import (
    check_stateless,
    format_grammar,
    generate_parameters,
    input_messages,
    tool_plan,
)
from textgate.router.openai.responses_output import ResponseHead, completed_response
from textgate.router.openai.responses_schemas import ResponsesRequest
from textgate.router.openai.responses_stream import ResponseEvents

RESPONSES_WORDING = Wording("input", "max_output_tokens", "truncation", templated=True)


class ResponsesHandler:
    """The /v1/responses route over one `RouterState`."""

    def __init__(self, state: RouterState, serving: Serving) -> None:
        self._state = state
        self._serving = serving
        self._reasoning = reasoning_parser(state.config.reasoning_parser)

    async def create(self, request: Request) -> Response:
        """POST /v1/responses: OpenAI Responses (stateless): input items through the chat
        template; stream: true gives typed SSE events ending in response.completed."""
        received = time.monotonic()
        metrics = self._state.metrics
        metrics.request_received()
        with metrics.count_failures():
            return await self._create(request, received)

    async def _create(self, request: Request, received: float) -> Response:
        config = self._state.config
        body = await read_json(request, ResponsesRequest, config.payload_limit)
        adapters = self._state.validator.adapters
        model = served_model(body.model, config.model_id, adapters)
        check_stateless(body)
        tools = tool_plan(body)
        grammar = tools.grammar if tools is not None else format_grammar(body)
        params = with_adapter(model, adapters, generate_parameters(body, config, grammar))
        params = with_request_timeout(params, request)
        prompt = await self._serving.render(input_messages(body), tools)
        # The template already holds the special tokens the model expects (BOS, markers).
        inputs = GenerateRequest(inputs=prompt, parameters=params, add_special_tokens=False)
        valid = await self._serving.validate(
            inputs, body.stream, wording=RESPONSES_WORDING, received=received
        )
        channels = self._state.engine.submit([valid])
        head = ResponseHead.new(model, body)
        if body.stream:
            events = ResponseEvents(
                head, valid.input_length, tools=tools is not None, reasoning=self._reasoning
            )
            return self._serving.stream(channels, events, received)
        results = await self._serving.collect(request, channels, received)
        if results is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        answer = completed_response(
            head, results[0], valid.input_length, tools is not None, self._reasoning
        )
        return JSONResponse(answer.model_dump(mode="json"))
