"""Incremental detokenization: the text each new token adds, correct across token boundaries.

Decoding one token alone loses SentencePiece/BPE leading spaces and splits multi-byte
characters. Instead a short window of previous tokens is decoded with and without the new
ones; the difference is the delta. A delta ending in U+FFFD is an incomplete character:
nothing is emitted until the following tokens complete it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Tokens of context decoded before the first new token.
_CONTEXT_TOKENS = 5


@dataclass
class IncrementalDetokenizer:
    """Per-request offsets into the request's token ids (prompt + generated)."""

    prefix_offset: int
    read_offset: int

    @classmethod
    def for_prompt(cls, prompt_len: int) -> IncrementalDetokenizer:
        return cls(prefix_offset=max(prompt_len - _CONTEXT_TOKENS, 0), read_offset=prompt_len)

    def step(self, tokenizer: Any, all_ids: list[int]) -> str:
        """The text added by the tokens after read_offset ('' while a character is incomplete)."""
        prefix = tokenizer.decode(all_ids[self.prefix_offset : self.read_offset])
        text = tokenizer.decode(all_ids[self.prefix_offset :])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(all_ids)
            return text[len(prefix) :]
        return ""
