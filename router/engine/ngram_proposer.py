"""N-gram speculation's proposals (prompt lookup): a sequence's next tokens guessed from itself.

The sequence's last n tokens (n from `max_n` down to `min_n`, longest first) are looked up
among its earlier tokens, prompt and output alike; the tokens that followed their latest
earlier occurrence are the proposal. Text that copies from its prompt (an edit, a summary
quoting it, code repeating its identifiers) is proposed correctly for long runs; other text
mostly finds nothing, which costs nothing. No model: the target verifies every proposal
(docs/speculative.md).

Each sequence's index is kept incrementally (`NgramIndex.extend`), so a step costs a few
dictionary operations per sequence, not a scan of its tokens. Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """One sequence's n-grams, `min_n` to `max_n` tokens, each mapped to the position just
    after its latest occurrence (where a continuation starts)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._next: dict[tuple[int, ...], int] = {}
        self._num_indexed = 0
        """Tokens whose ending n-grams are in `_next` (a prefix of the sequence)."""

    def extend(self, token_ids: Sequence[int], end: int) -> None:
        """Index every n-gram that ends before position `end` (and after the last call's)."""
        for stop in range(self._num_indexed + 1, end + 1):
            for n in range(self.min_n, min(self.max_n, stop) + 1):
                self._next[tuple(token_ids[stop - n : stop])] = stop
        self._num_indexed = max(self._num_indexed, end)

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> tuple[int, ...]:
        """Up to `max_tokens` tokens that followed the latest earlier occurrence of the
        sequence's longest matching suffix; () when no suffix occurred before.

        The suffix itself is never its own match: only n-grams ending before the last token
        are indexed (a continuation must exist)."""
        length = len(token_ids)
        if max_tokens < 1 or length < self.min_n + 1:
            return ()
        self.extend(token_ids, length - 1)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self._next.get(tuple(token_ids[length - n :]))
            if start is not None:
                return tuple(token_ids[start : start + max_tokens])
        return ()
