"""The streaming APIs the benchmark speaks: how to ask for a stream, how to read each event.

- `tgi`: `POST /generate_stream`; each event carries exactly one token
  (`{"index", "token": {...}, "generated_text": null | str, "details": null | {...}}`),
  the last one has `generated_text` set; `details.generated_tokens` is the exact count.
- `openai-completions`: `POST /v1/completions` with `stream: true`; chunks carry text in
  `choices[0].text`, a usage chunk follows when `stream_options.include_usage` is honoured,
  and the stream ends with `data: [DONE]`. As in `vllm bench serve`, a choice's
  `finish_reason` already marks the generation complete and `[DONE]` is optional:
  `transformers serve` closes the stream right after the `finish_reason` chunk.
- `openai-chat`: `POST /v1/chat/completions`, the same with `choices[0].delta.content`.

Requests are greedy and, unless disabled, ask the server to ignore EOS so every request
produces exactly `output_len` tokens.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from textgate.bench.serving.workload import BenchRequest
from textgate.registry import Registry


@dataclass(frozen=True)
class GenerationSettings:
    """What every request asks the server to generate."""

    output_len: int
    ignore_eos: bool = True
    model: str = "tgi"
    json_schema: dict[str, Any] | None = None
    """Constrain the output to JSON matching this schema (structured output); None: free."""


@dataclass(frozen=True)
class StreamChunk:
    """What one stream event tells the client."""

    is_token: bool = False
    text: str = ""
    final: bool = False
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    error: str | None = None


class StreamBackend(ABC):
    """One streaming API: its route, its request body, its event format."""

    name: ClassVar[str]
    path: ClassVar[str]
    # True when each token-bearing event is exactly one token, so counting events counts tokens.
    one_token_per_event: ClassVar[bool] = False

    @abstractmethod
    def payload(self, request: BenchRequest, settings: GenerationSettings) -> dict[str, Any]:
        """The JSON body asking for a streamed, greedy generation of `request`."""

    @abstractmethod
    def parse(self, data: str) -> StreamChunk:
        """Interpret the data of one server-sent event."""


class _Backends(Registry[StreamBackend]):
    def entry(self, decorated: object) -> StreamBackend:
        assert isinstance(decorated, type) and issubclass(decorated, StreamBackend)
        return decorated()  # backends hold no state: one instance serves every run


BACKENDS = _Backends("backend")


def register(cls: type[StreamBackend]) -> type[StreamBackend]:
    """Class decorator adding a backend to `BACKENDS` under its name."""
    return BACKENDS.register(cls.name)(cls)


def get_backend(name: str) -> StreamBackend:
    """The backend called `name`; ValueError listing the known ones otherwise."""
    return BACKENDS.lookup(name)


def _error_text(error: Any, error_type: Any = None) -> str:
    if isinstance(error, dict):
        error_type = error.get("type", error_type)
        error = error.get("message", error)
    return f"{error_type}: {error}" if error_type else str(error)


@register
class TgiBackend(StreamBackend):
    name = "tgi"
    path = "/generate_stream"
    one_token_per_event = True

    def payload(self, request: BenchRequest, settings: GenerationSettings) -> dict[str, Any]:
        parameters: dict[str, Any] = {
            "max_new_tokens": settings.output_len,
            "do_sample": False,
            "details": True,
        }
        if settings.ignore_eos:
            parameters["ignore_eos"] = True
        if settings.json_schema is not None:
            parameters["grammar"] = {"type": "json", "value": settings.json_schema}
        return {"inputs": request.prompt, "parameters": parameters}

    def parse(self, data: str) -> StreamChunk:
        event = json.loads(data)
        if "error" in event:
            return StreamChunk(error=_error_text(event["error"], event.get("error_type")))
        token = event.get("token")
        details = event.get("details") or {}
        return StreamChunk(
            is_token=token is not None,
            text="" if token is None or token.get("special") else token.get("text", ""),
            final=event.get("generated_text") is not None,
            output_tokens=details.get("generated_tokens"),
        )


class _OpenAiBackend(StreamBackend):
    """What the two OpenAI routes share: sampling fields, usage, errors, the end marker."""

    def common_fields(self, settings: GenerationSettings) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "model": settings.model,
            "max_tokens": settings.output_len,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if settings.ignore_eos:
            fields["ignore_eos"] = True
        return fields

    def parse(self, data: str) -> StreamChunk:
        if data.strip() == "[DONE]":
            return StreamChunk(final=True)
        event = json.loads(data)
        if event.get("error"):
            return StreamChunk(error=_error_text(event["error"]))
        usage = event.get("usage") or {}
        choices = event.get("choices") or []
        is_token, text = self.token_of(choices[0]) if choices else (False, "")
        return StreamChunk(
            is_token=is_token,
            text=text,
            # Servers that skip `[DONE]` (transformers serve) end with the finish_reason chunk.
            final=any(choice.get("finish_reason") for choice in choices),
            output_tokens=usage.get("completion_tokens"),
            prompt_tokens=usage.get("prompt_tokens"),
        )

    @abstractmethod
    def token_of(self, choice: dict[str, Any]) -> tuple[bool, str]:
        """Whether a choice carries a generated token, and its text."""


@register
class OpenAiCompletionsBackend(_OpenAiBackend):
    name = "openai-completions"
    path = "/v1/completions"

    def payload(self, request: BenchRequest, settings: GenerationSettings) -> dict[str, Any]:
        if settings.json_schema is not None:
            raise ValueError("openai-completions has no JSON schema field: use tgi or openai-chat")
        return {"prompt": request.prompt, **self.common_fields(settings)}

    def token_of(self, choice: dict[str, Any]) -> tuple[bool, str]:
        text = choice.get("text")
        # A trailing empty chunk that only reports finish_reason carries no token.
        is_token = text is not None and (text != "" or choice.get("finish_reason") is None)
        return is_token, text or ""


@register
class OpenAiChatBackend(_OpenAiBackend):
    name = "openai-chat"
    path = "/v1/chat/completions"

    def payload(self, request: BenchRequest, settings: GenerationSettings) -> dict[str, Any]:
        messages = request.messages or [{"role": "user", "content": request.prompt}]
        fields = self.common_fields(settings)
        if settings.json_schema is not None:
            schema = {"name": "bench", "schema": settings.json_schema}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        return {"messages": messages, **fields}

    def token_of(self, choice: dict[str, Any]) -> tuple[bool, str]:
        delta = choice.get("delta") or {}
        content = delta.get("content")
        # The opening role announcement (`{"role": "assistant", "content": ""}`) and a closing
        # `{}` delta carry no token; an empty content without a role is a special token.
        is_token = content is not None and (content != "" or "role" not in delta)
        return is_token, content or ""
