"""Chat messages to one prompt string with the model's own chat template.

The template is the tokenizer's (`tokenizer_config.json` / `chat_template.jinja`),
rendered by transformers' `apply_chat_template`, so prompts match what the model was
trained on. Anything wrong with the messages or the model's template is the client's
to fix or know about: it raises `ValidationError` (422), never a 500.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

from textgate.router.generation.validation import ValidationError

NO_TEMPLATE = (
    "This model has no chat template: use /v1/completions or /generate with a prompt "
    "you format yourself"
)


class ChatTokenizer(Protocol):
    """What rendering needs from a tokenizer (transformers' tokenizers fit)."""

    chat_template: str | None

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any: ...


def has_chat_template(tokenizer: object) -> bool:
    """Whether `tokenizer` can render chat messages (a transformers tokenizer with a template)."""
    return bool(getattr(tokenizer, "chat_template", None)) and callable(
        getattr(tokenizer, "apply_chat_template", None)
    )


def render_chat(
    tokenizer: object,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt for `messages`.

    `add_generation_prompt` ends it with the template's assistant header, so the model
    answers; `continue_final_message` instead leaves the last (assistant) message open,
    so the model continues it (prefill). The two exclude each other. `tools` (OpenAI's
    shape) go to a template that renders them in its own format.
    """
    _check_request(tokenizer, messages, add_generation_prompt, continue_final_message)
    extra = {} if tools is None else {"tools": tools}
    try:
        prompt = cast(ChatTokenizer, tokenizer).apply_chat_template(
            [dict(m) for m in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **extra,
        )
    except Exception as exc:
        # Templates raise on conversations they refuse (roles that do not alternate, a
        # missing system prompt, ...) with jinja, type or value errors alike; all of them
        # are about the request.
        raise ValidationError(f"The chat template could not render these messages: {exc}") from exc
    if not isinstance(prompt, str):
        raise ValidationError("The chat template did not render to text")
    return prompt


def _check_request(
    tokenizer: object,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    continue_final_message: bool,
) -> None:
    if not has_chat_template(tokenizer):
        raise ValidationError(NO_TEMPLATE)
    if not messages:
        raise ValidationError("`messages` cannot be empty")
    if continue_final_message and add_generation_prompt:
        raise ValidationError(
            "`continue_final_message` and `add_generation_prompt` cannot both be true: "
            "set `add_generation_prompt` to false to continue the last message"
        )
    if continue_final_message and messages[-1].get("role") != "assistant":
        raise ValidationError(
            "`continue_final_message` needs the last message to be the assistant's prefix"
        )
