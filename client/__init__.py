"""textgate's Python client: TGI's routes and OpenAI's, sync and async.

Code written for Hugging Face's `text_generation` client switches by changing its import:
`from text_generation import Client` becomes `from textgate.client import Client`; the
constructor, method names, keyword arguments, answer types and error classes are the same.
"""

from __future__ import annotations

from textgate.client.async_client import AsyncClient
from textgate.client.client import Client
from textgate.client.errors import (
    BadRequestError,
    ClientTimeoutError,
    ConnectionFailedError,
    GenerationError,
    IncompleteGenerationError,
    NotFoundError,
    OverloadedError,
    RateLimitExceededError,
    ShardNotReadyError,
    ShardTimeoutError,
    TextGateError,
    UnauthorizedError,
    UnknownError,
    ValidationError,
)
from textgate.client.openai_types import (
    ChatComplete,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    Message,
    Tool,
)
from textgate.client.types import (
    BestOfSequence,
    Details,
    FinishReason,
    Grammar,
    GrammarType,
    InputToken,
    Parameters,
    Response,
    StreamDetails,
    StreamResponse,
    Token,
)

__all__ = [
    "AsyncClient",
    "BadRequestError",
    "BestOfSequence",
    "ChatComplete",
    "ChatCompletion",
    "ChatCompletionChunk",
    "Client",
    "ClientTimeoutError",
    "Completion",
    "ConnectionFailedError",
    "Details",
    "FinishReason",
    "GenerationError",
    "Grammar",
    "GrammarType",
    "IncompleteGenerationError",
    "InputToken",
    "Message",
    "NotFoundError",
    "OverloadedError",
    "Parameters",
    "RateLimitExceededError",
    "Response",
    "ShardNotReadyError",
    "ShardTimeoutError",
    "StreamDetails",
    "StreamResponse",
    "TextGateError",
    "Token",
    "Tool",
    "UnauthorizedError",
    "UnknownError",
    "ValidationError",
]
