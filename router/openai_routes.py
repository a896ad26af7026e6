"""The OpenAI-compatible routes, mapped onto TGI's pipeline.

Every request becomes TGI `GenerateRequest`s (one per prompt) that the validator
checks and tokenizes; `n`/`best_of` copies get their own seeds and go to the engine
together (all admitted or 429). Errors keep TGI's `{"error", "error_type"}` bodies
and statuses, so these routes answer like the TGI ones next to them.

    POST /v1/chat/completions   messages -> chat template -> generation
    POST /v1/completions        prompt(s) -> generation
    GET  /v1/models             the served model
    POST /chat_tokenize         TGI's: the templated prompt and its tokens
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import pydantic
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive

from textgate.router.batcher import OverloadedError
from textgate.router.channel import Channel
from textgate.router.chat_template import render_chat
from textgate.router.errors import PayloadTooLargeError, error_response
from textgate.router.generate import Generated, GenerationError, collect
from textgate.router.openai_output import (
    ResponseMeta,
    TextOptions,
    chat_completion,
    completion,
    likeliest,
)
from textgate.router.openai_params import (
    candidates,
    chat_fanout,
    chat_parameters,
    completion_fanout,
    completion_parameters,
    prompt_list,
    stop_sequences,
    template_messages,
)
from textgate.router.openai_schemas import (
    ChatCompletionRequest,
    ChatTokenizeResponse,
    CompletionRequest,
    ModelCard,
    ModelList,
    SamplingRequest,
    SimpleToken,
)
from textgate.router.openai_stream import ChatChunks, ChunkWriter, CompletionChunks, openai_frames
from textgate.router.schemas import GenerateRequest
from textgate.router.sse import SseResponse
from textgate.router.state import RouterState
from textgate.router.validation import ValidationError

Body = TypeVar("Body", bound=pydantic.BaseModel)
Handler = Callable[[Request], Awaitable[Response]]
# A client that left before its (non-streamed) answer was ready (nginx's code).
CLIENT_CLOSED_REQUEST = 499


def openai_routes(state: RouterState) -> list[BaseRoute]:
    """The OpenAI-compatible routes over `state`; they answer their own errors."""
    handlers = _OpenAIHandlers(state)
    return [
        Route("/v1/chat/completions", _typed_errors(handlers.chat_completions), methods=["POST"]),
        Route("/v1/completions", _typed_errors(handlers.completions), methods=["POST"]),
        Route("/v1/models", handlers.models, methods=["GET"]),
        Route("/chat_tokenize", _typed_errors(handlers.chat_tokenize), methods=["POST"]),
    ]


class _OpenAIHandlers:
    def __init__(self, state: RouterState) -> None:
        self._state = state
        self._config = state.config
        self._created = int(time.time())

    async def chat_completions(self, request: Request) -> Response:
        body = await _read_body(request, ChatCompletionRequest, self._config.payload_limit)
        params = chat_parameters(body, self._config)
        fanout = chat_fanout(body, self._config)
        prompt = await self._render(body)
        inputs = GenerateRequest(inputs=prompt, parameters=params, add_special_tokens=False)
        valid = await self._state.validator.validate(inputs, stream=body.stream)
        channels = self._state.engine.submit(candidates(valid, body.seed, fanout.num_candidates))
        meta = ResponseMeta.new("chatcmpl", body.model or self._config.model_id)
        options = _text_options(body)
        if body.stream:
            writer = ChatChunks(meta, len(channels), options, logprobs=body.logprobs)
            return _stream(channels, writer, valid.input_length, body)
        results = await _collect_unless_disconnected(request, channels)
        if results is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        answer = chat_completion(meta, results, valid.input_length, options, logprobs=body.logprobs)
        return JSONResponse(answer.model_dump(mode="json"))

    async def completions(self, request: Request) -> Response:
        body = await _read_body(request, CompletionRequest, self._config.payload_limit)
        prompts = prompt_list(body)
        params = completion_parameters(body, self._config)
        fanout = completion_fanout(body, self._config)
        valids = await asyncio.gather(
            *(
                self._state.validator.validate(
                    GenerateRequest(inputs=p, parameters=params), stream=body.stream
                )
                for p in prompts
            )
        )
        requests = [r for v in valids for r in candidates(v, body.seed, fanout.num_candidates)]
        channels = self._state.engine.submit(requests)
        prompt_tokens = sum(v.input_length for v in valids)
        meta = ResponseMeta.new("cmpl", body.model or self._config.model_id)
        options = _text_options(body)
        logprobs = body.logprobs is not None
        if body.stream:
            # Streams have no best_of: channel i is choice i, of prompt i // n.
            choice_prompts = [p for p in prompts for _ in range(fanout.num_choices)]
            writer = CompletionChunks(
                meta, choice_prompts, options, echo=body.echo, logprobs=logprobs
            )
            return _stream(channels, writer, prompt_tokens, body)
        results = await _collect_unless_disconnected(request, channels)
        if results is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        size = fanout.num_candidates
        chosen = [
            likeliest(results[p * size : (p + 1) * size], fanout.num_choices)
            for p in range(len(prompts))
        ]
        answer = completion(
            meta, prompts, chosen, prompt_tokens, options, echo=body.echo, logprobs=logprobs
        )
        return JSONResponse(answer.model_dump(mode="json"))

    async def models(self, request: Request) -> Response:
        card = ModelCard(id=self._config.model_id, created=self._created)
        return JSONResponse(ModelList(data=[card]).model_dump(mode="json"))

    async def chat_tokenize(self, request: Request) -> Response:
        body = await _read_body(request, ChatCompletionRequest, self._config.payload_limit)
        prompt = await self._render(body)
        tokens = await asyncio.to_thread(_token_spans, self._state.tokenizer, prompt)
        answer = ChatTokenizeResponse(tokenize_response=tokens, templated_text=prompt)
        return JSONResponse(answer.model_dump(mode="json"))

    async def _render(self, body: ChatCompletionRequest) -> str:
        # Asking to continue the last message implies no new assistant header,
        # unless the client explicitly asked for both (then it is told it cannot).
        implied = (
            body.continue_final_message and "add_generation_prompt" not in body.model_fields_set
        )
        # Templates are jinja: rendering long conversations is CPU work for a thread.
        return await asyncio.to_thread(
            render_chat,
            self._state.tokenizer,
            template_messages(body.messages),
            add_generation_prompt=body.add_generation_prompt and not implied,
            continue_final_message=body.continue_final_message,
        )


def _text_options(body: SamplingRequest) -> TextOptions:
    return TextOptions(stop=tuple(stop_sequences(body)), keep_stop=body.include_stop_str_in_output)


def _stream(
    channels: Sequence[Channel], writer: ChunkWriter, prompt_tokens: int, body: SamplingRequest
) -> Response:
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    frames = openai_frames(channels, writer, prompt_tokens, include_usage)
    return SseResponse(frames, on_disconnect=lambda: _cancel_all(channels))


def _cancel_all(channels: Sequence[Channel]) -> None:
    for channel in channels:
        channel.cancel()


async def _collect_unless_disconnected(
    request: Request, channels: Sequence[Channel]
) -> list[Generated] | None:
    """Every channel's result; None if the client left first (then all are cancelled).

    GenerationError if one fails; the others are cancelled then too.
    """
    tasks = [asyncio.ensure_future(collect(c)) for c in channels]
    results = asyncio.gather(*tasks)
    watch = asyncio.ensure_future(_disconnected(request.receive))
    first: set[asyncio.Future[Any]] = {results, watch}
    try:
        await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        # No-ops for finished requests; frees the shards from the others.
        _cancel_all(channels)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, watch, return_exceptions=True)
    if results.done() and not results.cancelled():
        return results.result()
    return None


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _read_body(request: Request, model: type[Body], limit: int) -> Body:
    """The JSON body as `model`; 413 over `limit` bytes, 422 when it does not fit the model."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(limit)
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise PayloadTooLargeError(limit)
    try:
        return model.model_validate_json(bytes(raw))
    except pydantic.ValidationError as exc:
        raise ValidationError(_describe(exc)) from exc


def _describe(exc: pydantic.ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    detail = f"{where}: {first['msg']}" if where else first["msg"]
    return f"Failed to deserialize the JSON body into the target type: {detail}"


def _token_spans(tokenizer: Any, text: str) -> list[SimpleToken]:
    """The tokens of `text` with the characters each covers (a fast tokenizer's offsets)."""
    try:
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    except (TypeError, KeyError, NotImplementedError) as exc:
        raise ValidationError(f"This tokenizer cannot report token offsets: {exc}") from exc
    return [
        SimpleToken(id=i, text=text[start:stop], start=start, stop=stop)
        for i, (start, stop) in zip(ids, offsets, strict=True)
    ]


def _typed_errors(handler: Handler) -> Handler:
    """`handler`, answering the pipeline's typed errors with TGI's body and status."""

    async def answer(request: Request) -> Response:
        try:
            return await handler(request)
        except (ValidationError, OverloadedError, GenerationError, PayloadTooLargeError) as exc:
            return error_response(str(exc), exc.error_type)

    return answer
