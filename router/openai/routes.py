"""The OpenAI-compatible routes, mapped onto TGI's pipeline.

Every request becomes TGI `GenerateRequest`s (one per prompt) that the validator
checks and tokenizes; `n`/`best_of` copies get their own seeds and go to the engine
together (all admitted or 429). Errors on `/v1/...` have OpenAI's body
(`{"error": {"message", "type", "param", "code"}}`, TGI's `error_type` beside it) and
TGI's statuses; `/chat_tokenize` is TGI's route and answers in TGI's shape.

    POST /v1/chat/completions   messages -> chat template -> generation
    POST /v1/completions        prompt(s) -> generation
    GET  /v1/models             the served model
    POST /chat_tokenize         TGI's: the templated prompt and its tokens
    POST /tokenize, /detokenize vLLM's tokenizer routes (router/openai/tokenize.py)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from textgate.router.engine.channel import Channel
from textgate.router.engine.quota import base_model_names
from textgate.router.generation.reasoning import reasoning_parser
from textgate.router.generation.schemas import GenerateRequest
from textgate.router.generation.stop_text import TextOptions
from textgate.router.generation.tools import ToolPlan
from textgate.router.generation.validation import Wording
from textgate.router.http.auth import tenant_of
from textgate.router.http.request_io import read_json, with_request_timeout
from textgate.router.http.served_model import served_model, with_adapter
from textgate.router.http.serving import CLIENT_CLOSED_REQUEST, Serving
from textgate.router.http.state import RouterState
from textgate.router.http.typed_errors import answers_typed_errors
from textgate.router.openai.output import (
    ResponseMeta,
    Scores,
    chat_completion,
    completion,
    likeliest,
)
from textgate.router.openai.params import (
    candidates,
    chat_fanout,
    chat_parameters,
    completion_fanout,
    completion_parameters,
    prompt_list,
    scores_prompt_only,
    stop_sequences,
    template_messages,
)
from textgate.router.openai.responses import ResponsesHandler
from textgate.router.openai.schemas import (
    ChatCompletionRequest,
    ChatTokenizeResponse,
    CompletionRequest,
    ModelCard,
    ModelList,
    SamplingRequest,
)
from textgate.router.openai.stream import (
    ChatChunks,
    ChunkFrames,
    ChunkWriter,
    CompletionChunks,
)
from textgate.router.openai.tokenize import VLLM_TOKENIZE, VllmTokenizer
from textgate.router.openai.tools import tool_plan

OPENAI_TRUNCATE = "truncate_prompt_tokens"
COMPLETION_WORDING = Wording("prompt", "max_tokens", OPENAI_TRUNCATE)


def openai_routes(state: RouterState) -> list[BaseRoute]:
    """The OpenAI-compatible routes over `state`; they answer their own errors."""
    serving = Serving(state)
    handlers = _OpenAIHandlers(state, serving)
    responses = ResponsesHandler(state, serving)
    tokenizer = VllmTokenizer(state, handlers.templated)
    return [
        Route(
            "/v1/chat/completions",
            answers_typed_errors(handlers.chat_completions),
            methods=["POST"],
        ),
        Route("/v1/completions", answers_typed_errors(handlers.completions), methods=["POST"]),
        Route("/v1/responses", answers_typed_errors(responses.create), methods=["POST"]),
        Route("/v1/models", handlers.models, methods=["GET"]),
        Route("/chat_tokenize", answers_typed_errors(handlers.chat_tokenize), methods=["POST"]),
        # Beside TGI's on the same path; the app picks by body (openai/tokenize.py).
        Route(
            "/tokenize",
            answers_typed_errors(tokenizer.tokenize),
            methods=["POST"],
            name=VLLM_TOKENIZE,
        ),
        Route("/detokenize", answers_typed_errors(tokenizer.detokenize), methods=["POST"]),
    ]


class _OpenAIHandlers:
    def __init__(self, state: RouterState, serving: Serving) -> None:
        self._state = state
        self._serving = serving
        self._config = state.config
        self._metrics = state.metrics
        self._created = int(time.time())
        self._reasoning = reasoning_parser(self._config.reasoning_parser)

    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions: OpenAI chat completion (messages through the chat template)."""
        received = time.monotonic()
        self._metrics.request_received()
        with self._metrics.count_failures():
            return await self._chat(request, received)

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions: OpenAI (legacy) text completion of one or more prompts."""
        received = time.monotonic()
        self._metrics.request_received()
        with self._metrics.count_failures():
            return await self._complete(request, received)

    async def models(self, request: Request) -> Response:
        """GET /v1/models: the served model and its adapters, OpenAI's model list. The route
        is open (probes carry no key), but a request with a key whose tenant may use only
        some models (`models:` in the key file) sees those."""
        base = self._config.model_id
        cards = [ModelCard(id=base, created=self._created)] + [
            ModelCard(id=name, created=self._created, parent=base)
            for name in self._state.validator.adapters
        ]
        tenants = getattr(request.app.state, "tenants", None)
        quota = None if tenants is None else tenant_of(request.scope, tenants)
        if quota is not None:
            names = base_model_names(base)
            cards = [card for card in cards if quota.limits.allows(card.id, names)]
        return JSONResponse(ModelList(data=cards).model_dump(mode="json"))

    async def chat_tokenize(self, request: Request) -> Response:
        """POST /chat_tokenize: the chat-templated prompt and its tokens with their spans."""
        body = await read_json(request, ChatCompletionRequest, self._config.payload_limit)
        prompt = await self.templated(body)
        inputs = GenerateRequest(inputs=prompt, add_special_tokens=False)
        tokens = await self._state.validator.tokenize(inputs)
        answer = ChatTokenizeResponse(tokenize_response=tokens, templated_text=prompt)
        return JSONResponse(answer.model_dump(mode="json"))

    async def templated(self, body: ChatCompletionRequest) -> str:
        """The prompt of `body` as a chat completion renders it, its tools included."""
        return await self._render(body, tool_plan(body))

    async def _chat(self, request: Request, received: float) -> Response:
        body = await read_json(request, ChatCompletionRequest, self._config.payload_limit)
        adapters = self._state.validator.adapters
        model = served_model(body.model, self._config.model_id, adapters)
        tools = tool_plan(body)
        params = with_adapter(model, adapters, chat_parameters(body, self._config, tools))
        params = with_request_timeout(params, request)
        fanout = chat_fanout(body, self._config)
        prompt = await self._render(body, tools)
        # The template already holds the special tokens the model expects (BOS, markers).
        inputs = GenerateRequest(inputs=prompt, parameters=params, add_special_tokens=False)
        length_field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        wording = Wording("messages", length_field, OPENAI_TRUNCATE, templated=True)
        valid = await self._serving.validate(
            inputs, body.stream, wording=wording, received=received
        )
        channels = self._state.engine.submit(candidates(valid, body.seed, fanout.num_candidates))
        meta = ResponseMeta.new("chatcmpl", model)
        options = _text_options(body)
        if body.stream:
            writer = ChatChunks(
                meta,
                len(channels),
                options,
                logprobs=body.logprobs,
                tools=tools is not None,
                reasoning=self._reasoning,
            )
            return self._stream(channels, writer, valid.input_length, body, received)
        results = await self._serving.collect(request, channels, received)
        if results is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        answer = chat_completion(
            meta,
            results,
            valid.input_length,
            options,
            logprobs=body.logprobs,
            tools=tools is not None,
            top_logprobs=body.top_logprobs or 0,
            prompt_top=body.prompt_logprobs,
            reasoning=self._reasoning,
        )
        return JSONResponse(answer.model_dump(mode="json"))

    async def _complete(self, request: Request, received: float) -> Response:
        body = await read_json(request, CompletionRequest, self._config.payload_limit)
        adapters = self._state.validator.adapters
        model = served_model(body.model, self._config.model_id, adapters)
        given = prompt_list(body)
        params = with_adapter(model, adapters, completion_parameters(body, self._config))
        params = with_request_timeout(params, request)
        fanout = completion_fanout(body, self._config)
        validator = self._state.validator
        # Token-id prompts keep their ids; their text is what `echo` returns.
        prompts = [p if isinstance(p, str) else validator.decode(p) for p in given]
        valids = await asyncio.gather(
            *(
                self._serving.validate(
                    GenerateRequest(inputs=text, parameters=params),
                    body.stream,
                    input_ids=None if isinstance(p, str) else p,
                    wording=COMPLETION_WORDING,
                    received=received,
                )
                for text, p in zip(prompts, given, strict=True)
            )
        )
        requests = [r for v in valids for r in candidates(v, body.seed, fanout.num_candidates)]
        channels = self._state.engine.submit(requests)
        prompt_tokens = sum(v.input_length for v in valids)
        meta = ResponseMeta.new("cmpl", model)
        options = _text_options(body)
        logprobs = body.logprobs is not None
        if body.stream:
            # Streams have no best_of: channel i is choice i, of prompt i // n.
            choice_prompts = [p for p in prompts for _ in range(fanout.num_choices)]
            writer = CompletionChunks(
                meta, choice_prompts, options, echo=body.echo, logprobs=logprobs
            )
            return self._stream(channels, writer, prompt_tokens, body, received)
        results = await self._serving.collect(request, channels, received)
        if results is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        size = fanout.num_candidates
        chosen = [
            likeliest(results[p * size : (p + 1) * size], fanout.num_choices)
            for p in range(len(prompts))
        ]
        scores = Scores(body.logprobs, body.prompt_logprobs, not scores_prompt_only(body))
        answer = completion(
            meta, prompts, chosen, prompt_tokens, options, echo=body.echo, scores=scores
        )
        return JSONResponse(answer.model_dump(mode="json"))

    async def _render(self, body: ChatCompletionRequest, tools: ToolPlan | None) -> str:
        # Asking to continue the last message implies no new assistant header,
        # unless the client explicitly asked for both (then it is told it cannot).
        implied = (
            body.continue_final_message and "add_generation_prompt" not in body.model_fields_set
        )
        return await self._serving.render(
            template_messages(body.messages),
            tools,
            add_generation_prompt=body.add_generation_prompt and not implied,
            continue_final_message=body.continue_final_message,
        )

    def _stream(
        self,
        channels: Sequence[Channel],
        writer: ChunkWriter,
        prompt_tokens: int,
        body: SamplingRequest,
        received: float,
    ) -> Response:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        frames = ChunkFrames(writer, len(channels), prompt_tokens, include_usage)
        return self._serving.stream(channels, frames, received)


def _text_options(body: SamplingRequest) -> TextOptions:
    return TextOptions(stop=tuple(stop_sequences(body)), keep_stop=body.include_stop_str_in_output)
