"""vLLM's tokenizer routes: `POST /tokenize` with a `prompt` or `messages` body, and
`POST /detokenize`.

    POST /tokenize    {"prompt": ...} or {"messages": [...]} -> {"tokens", "count", "max_model_len"}
    POST /detokenize  {"tokens": [...]} -> {"prompt": "..."}

TGI's `/tokenize` (an `inputs` body, a list of tokens with their spans) keeps the path:
the app sends each body to the API its shape belongs to (`http.body_dispatch`: a
`prompt` or `messages` body without `inputs` is vLLM's). Messages
go through the chat template as a chat completion's would (tools included), without the
tokenizer's special tokens unless asked, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from textgate.router.generation.schemas import GenerateRequest
from textgate.router.generation.validation import ValidationError
from textgate.router.http.body_dispatch import body_keys
from textgate.router.http.request_io import parse_json, read_body, read_json
from textgate.router.http.state import RouterState
from textgate.router.openai.schemas import ChatCompletionRequest, NullMeansUnset

Templated = Callable[[ChatCompletionRequest], Awaitable[str]]
"""A chat request's prompt, as `/v1/chat/completions` renders it."""


class TokenizePrompt(NullMeansUnset):
    """vLLM's POST /tokenize body of a prompt."""

    model: str = ""
    prompt: str
    add_special_tokens: bool = True
    """Add the tokenizer's special tokens (BOS)."""
    return_token_strs: bool = False
    """Also return each token as the tokenizer spells it (`token_strs`)."""


class TokenizeChat(ChatCompletionRequest):
    """vLLM's POST /tokenize body of chat messages: a chat completion's fields that shape
    its prompt (`tools`, `add_generation_prompt`, `continue_final_message`)."""

    add_special_tokens: bool = False
    """Add the tokenizer's special tokens too (the template holds those it needs)."""
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    """Answer of vLLM's POST /tokenize."""

    count: int
    max_model_len: int
    """The most tokens a request may hold (`--max-total-tokens`)."""
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(NullMeansUnset):
    """Body of POST /detokenize."""

    model: str = ""
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    """Answer of POST /detokenize."""

    prompt: str


VLLM_TOKENIZE = "vllm_tokenize"
"""The name of vLLM's POST /tokenize route, which shares TGI's path (`is_vllm_tokenize`)."""


def is_vllm_tokenize(body: bytes) -> bool:
    """Whether a POST /tokenize body is vLLM's (`prompt` or `messages`, no TGI `inputs`)."""
    keys = body_keys(body)
    return "inputs" not in keys and bool(keys & {"prompt", "messages"})


class VllmTokenizer:
    """The handlers of vLLM's tokenizer routes over `state`; `templated` renders messages."""

    def __init__(self, state: RouterState, templated: Templated) -> None:
        self._state = state
        self._templated = templated

    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize (vLLM's body): the token ids of a prompt or of chat messages."""
        raw = await read_body(request, self._state.config.payload_limit)
        body: TokenizePrompt | TokenizeChat
        if "messages" in body_keys(raw):
            body = parse_json(raw, TokenizeChat)
            text = await self._templated(body)
        else:
            body = parse_json(raw, TokenizePrompt)
            text = body.prompt
        inputs = GenerateRequest(inputs=text, add_special_tokens=body.add_special_tokens)
        ids = [t.id for t in await self._state.validator.tokenize(inputs)] if text else []
        answer = TokenizeResponse(
            count=len(ids),
            max_model_len=self._state.config.max_total_tokens,
            tokens=ids,
            token_strs=self._token_strs(ids) if body.return_token_strs else None,
        )
        return JSONResponse(answer.model_dump(mode="json", exclude_none=True))

    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize (vLLM): the text of token ids."""
        body = await read_json(request, DetokenizeRequest, self._state.config.payload_limit)
        self._state.validator.check_token_ids(body.tokens, "tokens")
        prompt = self._state.validator.decode(body.tokens)
        return JSONResponse(DetokenizeResponse(prompt=prompt).model_dump(mode="json"))

    def _token_strs(self, ids: list[int]) -> list[str]:
        spell = getattr(self._state.tokenizer, "convert_ids_to_tokens", None)
        if spell is None:
            raise ValidationError("`return_token_strs` needs a tokenizer that spells its tokens")
        return [str(token) for token in spell(ids)]
