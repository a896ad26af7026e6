"""The tokenizer the benchmark counts tokens with (the served model's, by default)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class BenchTokenizer:
    """Encode, decode and chat-render text the way the served model does."""

    def __init__(self, hf_tokenizer: Any, source: str) -> None:
        self._tok = hf_tokenizer
        self.source = source

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without added special tokens."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def model_input_ids(self, text: str) -> list[int]:
        """Token ids a server feeds the model for `text` (special tokens such as BOS added)."""
        return list(self._tok.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens kept (prompts are built from ordinary text)."""
        return str(self._tok.decode(ids))

    def count(self, text: str) -> int:
        """Number of tokens in `text`."""
        return len(self.encode(text))

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The prompt text a chat route would build from `messages` (generation prompt added)."""
        if not getattr(self._tok, "chat_template", None):
            return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"
        return str(
            self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        )


def default_model_dir() -> Path:
    """The embedded default model's folder (converted into the cache on first use)."""
    from textgate.shard_server.loading.model_source import resolve_model

    return resolve_model(None)


def load_tokenizer(path: str | Path | None = None) -> BenchTokenizer:
    """Load the tokenizer in `path` (a model or tokenizer folder); None = the embedded model's."""
    from transformers import AutoTokenizer

    folder = Path(path) if path is not None else default_model_dir()
    return BenchTokenizer(AutoTokenizer.from_pretrained(str(folder)), source=str(folder))
