"""Closing constrained text within its token budget, so that what a grammar starts it ends.

Left alone, a request with a grammar can reach `max_new_tokens` mid-value (an unbounded
number, a long string) and end with text that does not parse. A request's
`BudgetCloser` keeps a short completion of its text that the grammar accepts
(`short_completion`: the text the grammar forces, then closing characters first,
searched on a fork of the matcher) and the tokens it takes (`need`). With `remaining`
tokens left, the one about to be sampled included:

- `remaining > need + CHECK_AHEAD`: nothing changes;
- `need < remaining <= need + CHECK_AHEAD`: the model's `NUM_CANDIDATES` likeliest
  tokens (the grammar's mask applied) are checked: one is allowed only if the text it
  makes can still be completed within `remaining - 1` tokens. The tokens that start the
  completion always are. The model keeps saying what it says as long as it fits;
- `remaining <= need`: only the tokens that spell the completion (any of them that
  still fit): the model picks how to tokenize it, not what it says.

A text closed this way completes within its budget and the request reports `length`:
where it ended was the budget's choice, not the model's. Outside the checked window one
freely sampled token can add to `need`; one that adds more than `CHECK_AHEAD` (a nested
object with many required properties) can still leave the text cut, as can a budget
too small for the shortest completion from the start.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

CHECK_AHEAD = 16
"""Tokens before the budget's end, beyond the completion's own, from which the model's
likeliest tokens are checked to fit."""
NUM_CANDIDATES = 8
"""Likeliest tokens checked per step in that window (the others are not allowed there)."""
MAX_ATTEMPTS = 2048
"""Characters one search may try before it gives up (a grammar it cannot close cheaply
is then not steered at this step)."""
MAX_DEPTH = 512
"""Longest completion searched, in pieces (characters or forced runs)."""
RETRY_STEPS = 8
"""Steps a request waits after a search that found nothing, before searching again."""
SEARCH_AHEAD = 32
"""Far from its budget (more tokens left than the last completion's count, the checked
window and this), a request searches only every `REFRESH_STEPS` steps."""
REFRESH_STEPS = 16
"""Steps between searches far from the budget: in 16 steps a text's completion rarely
grows by the 32 tokens of `SEARCH_AHEAD` (one token seldom adds more than two)."""

# Closing characters first, then what values start with, then everything else: the
# first completion found is short for JSON (`"`, `}`, `]` close a string, an object,
# an array; `0` is the shortest number), and every byte is tried before giving up.
_FIRST = b'"}]0123456789,: '
_LETTERS = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_PUNCTUATION = b"-._@/+#$%&*=?!~^|'`<>;()"
_OPENING = b"{[\n\t\\"
_CANDIDATES: tuple[bytes, ...] = tuple(
    bytes([b])
    for b in dict.fromkeys(_FIRST + _LETTERS + _PUNCTUATION + _OPENING + bytes(range(256)))
)


class VocabIndex:
    """The vocabulary's ordinary tokens by their bytes: to count and pick the tokens that
    spell a completion (longest first, as xgrammar's jump-forward does)."""

    def __init__(self, decoded_vocab: Sequence[bytes], excluded: Iterable[int]) -> None:
        skip = set(excluded)
        self.token_bytes = list(decoded_vocab)
        """Each token id's bytes."""
        self._ids: dict[bytes, int] = {}
        for token_id, text in enumerate(decoded_vocab):
            if text and token_id not in skip:
                self._ids.setdefault(text, token_id)
        self._max_len = max((len(t) for t in self._ids), default=1)

    def count(self, text: bytes) -> int | None:
        """Tokens spelling `text`, longest token first; None when some byte has none."""
        num_tokens, start = 0, 0
        while start < len(text):
            length = self._longest(text, start)
            if length == 0:
                return None
            num_tokens += 1
            start += length
        return num_tokens

    def prefixes(self, text: bytes) -> list[tuple[int, int]]:
        """(token id, length) of every token whose bytes start `text`."""
        found = []
        for length in range(1, min(self._max_len, len(text)) + 1):
            token_id = self._ids.get(text[:length])
            if token_id is not None:
                found.append((token_id, length))
        return found

    def _longest(self, text: bytes, start: int) -> int:
        for length in range(min(self._max_len, len(text) - start), 0, -1):
            if text[start : start + length] in self._ids:
                return length
        return 0


def short_completion(matcher: Any, vocab_size: int) -> bytes | None:
    """A short text that completes what `matcher` has accepted; b"" when it is complete,
    None when none was found within `MAX_ATTEMPTS` tries. `matcher` is not changed.

    Depth first on a fork: the text the grammar forces, else the first character (in
    `_CANDIDATES` order) it accepts that leads somewhere new. "New" is told by the next
    token mask and the parser's items (`_parser_key`): a character that leaves both as
    they were (one more letter of a free string) is a loop, not progress.
    """
    search = _Search(matcher.fork(), vocab_size)
    pieces = search.node(0)
    return None if pieces is None else b"".join(pieces)


class _Search:
    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.scratch = torch.empty((1, -(-vocab_size // 32)), dtype=torch.int32)
        self.attempts = 0
        self.seen = {self.state_key()}

    def state_key(self) -> tuple[int, Any]:
        self.matcher.fill_next_token_bitmask(self.scratch, 0)
        return hash(self.scratch.numpy().tobytes()), _parser_key(self.matcher)

    def node(self, depth: int) -> list[bytes] | None:
        """The rest of a completion from here; the matcher is back where it was on None."""
        matcher = self.matcher
        if matcher.is_completed():
            return []
        if depth >= MAX_DEPTH:
            return None
        forced = matcher.find_jump_forward_string().encode()
        if forced and matcher.accept_string(forced):
            rest = self.node(depth + 1)
            if rest is None:
                matcher.rollback(1)
            return None if rest is None else [forced, *rest]
        # Characters that lead somewhere new first; those that lead to a state that looks
        # seen only if none of them completes: the key cannot always tell "one more
        # letter of a free string" from "one more of the three letters `minLength` needs".
        again: list[bytes] = []
        for char in _CANDIDATES:
            if not self.attempt(char):
                continue
            key = self.state_key()
            if key in self.seen:
                again.append(char)
                matcher.rollback(1)
                continue
            self.seen.add(key)
            rest = self.node(depth + 1)
            if rest is not None:
                return [char, *rest]
            matcher.rollback(1)
        for char in again:
            if not self.attempt(char):
                continue
            rest = self.node(depth + 1)
            if rest is not None:
                return [char, *rest]
            matcher.rollback(1)
        return None

    def attempt(self, char: bytes) -> bool:
        """Accept `char` if the grammar allows it and the search may still try."""
        if self.attempts >= MAX_ATTEMPTS:
            return False
        self.attempts += 1
        return bool(self.matcher.accept_string(char))


_STEPS = re.compile(r"There are (\d+) steps")
_ITEM = re.compile(r"ParserState\(([^)]*)\)")


def _parser_key(matcher: Any) -> Any:
    """The parser's current items, with "started here" for a rule that starts at the
    current byte (a free string restarts its character rule at every byte).

    Read from xgrammar's debug description of its state, which is not a stable format:
    where it cannot be read this is None and the mask alone tells states apart (more
    states then look alike, which costs the search tries, never correctness: every
    completion it returns was accepted by the grammar).
    """
    describe = getattr(matcher, "_debug_print_internal_state", None)
    if describe is None:
        return None
    head, _, last = str(describe()).partition("Last step:")
    steps = _STEPS.search(head)
    if steps is None:
        return None
    here = str(int(steps.group(1)) - 1)
    items = []
    for item in _ITEM.findall(last):
        fields = dict(field.strip().partition("=")[::2] for field in item.split(","))
        if fields.get("rule_start_pos") == here:
            fields["rule_start_pos"] = "here"
        items.append(tuple(sorted(fields.items())))
    return tuple(sorted(items))


class BudgetCloser:
    """One request's budget: counts its tokens and narrows its mask to what still fits
    once the budget comes close (see the module docstring)."""

    def __init__(
        self, index: VocabIndex, stop_token_ids: Sequence[int], max_tokens: int, vocab_size: int
    ) -> None:
        self._index = index
        self._stop_token_ids = list(stop_token_ids)
        self._max_tokens = max_tokens
        self._vocab_size = vocab_size
        self._num_accepted = 0
        self._path: bytes | None = None
        """The completion from the current state, while it is known."""
        self._need: int | None = None
        """Tokens of the last completion found."""
        self._search_at = 0
        """The step (tokens accepted) from which searching is due again."""
        self._closing: list[int] = []
        """This step's tokens that start the completion and fit the budget."""
        self._paths: dict[int, bytes] = {}
        """This step's checked candidates: the completion after each."""
        self.check = False
        """This step's likeliest tokens must be checked (`refine`) before sampling."""
        self.steered = False
        """The budget took a token away from the model at least once."""

    def fork(self) -> BudgetCloser:
        """An independent copy (its step's candidates and completion included)."""
        twin = copy.copy(self)
        twin._closing = list(self._closing)
        twin._paths = dict(self._paths)
        return twin

    @property
    def remaining(self) -> int:
        """Tokens the request may still generate, the one about to be sampled included."""
        return self._max_tokens - self._num_accepted

    def restrict(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        """Plan this step from row `row` of `bitmask` (already the grammar's mask): narrow
        it to the completion when nothing else fits, or ask for a `refine`."""
        self.check, self._closing, self._paths = False, [], {}
        path = self._completion(matcher)
        need = None if path is None else self._index.count(path)
        if path is None or need is None or self.remaining > need + CHECK_AHEAD:
            return
        fits = max(self.remaining, need) - 1
        self._closing = (
            [t for t, n in self._index.prefixes(path) if _fits(self._index.count(path[n:]), fits)]
            if path
            else self._stop_token_ids
        )
        if self.remaining > need:
            self.check = True
        elif _keep_only(bitmask[row], self._closing):
            self.steered = True

    def refine(
        self, matcher: Any, candidates: Sequence[int], first_only: bool = False
    ) -> list[int]:
        """The tokens allowed this step: those of `candidates` (the likeliest ones the
        grammar allows, likeliest first) after which the text can still be completed in
        time, and the ones that start the completion. `first_only` (a greedy request):
        the candidates after the first that fits are not looked at."""
        allowed = set(self._closing)
        for token_id in candidates:
            if token_id not in allowed:
                path = self._completion_after(matcher, token_id)
                if path is None or not _fits(self._index.count(path), self.remaining - 1):
                    self.steered = True
                    continue
                self._paths[token_id] = path
                allowed.add(token_id)
            if first_only:
                break
        return sorted(allowed)

    def accepted(self, token_id: int) -> None:
        """Record the sampled token: the known completion goes on past it when it spelled
        its start (or it was checked), and is searched again otherwise."""
        self._num_accepted += 1
        known = self._paths.get(token_id)
        if known is not None:
            self._path = known
            return
        if self._path is None:
            return
        data = self._index.token_bytes[token_id] if token_id < len(self._index.token_bytes) else b""
        self._path = self._path[len(data) :] if data and self._path.startswith(data) else None

    def _completion(self, matcher: Any) -> bytes | None:
        """The known completion, searched for when it is unknown and a search is due."""
        if self._path is not None or not self._search_due():
            return self._path
        self._path = short_completion(matcher, self._vocab_size)
        if self._path is None:
            self._need = None
            self._search_at = self._num_accepted + RETRY_STEPS
            return None
        self._need = self._index.count(self._path)
        self._search_at = self._num_accepted + REFRESH_STEPS
        return self._path

    def _completion_after(self, matcher: Any, token_id: int) -> bytes | None:
        fork = matcher.fork()
        if not fork.accept_token(token_id):
            return None
        return short_completion(fork, self._vocab_size)

    def _search_due(self) -> bool:
        if self._num_accepted >= self._search_at:
            return True
        # Between refreshes: only once the budget comes near the last completion's count.
        return self._need is not None and self.remaining <= self._need + CHECK_AHEAD + SEARCH_AHEAD


def _fits(num_tokens: int | None, limit: int) -> bool:
    return num_tokens is not None and num_tokens <= limit


def _keep_only(words: torch.Tensor, token_ids: Sequence[int]) -> bool:
    """Clear every bit of the mask row `words` but those of `token_ids` it already has set;
    False (the row untouched) when none of them is set."""
    bits = words.numpy().view(np.uint32)
    kept = [t for t in token_ids if t < bits.size * 32 and (int(bits[t // 32]) >> (t % 32)) & 1]
    if not kept:
        return False
    bits[:] = 0
    for token_id in kept:
        bits[token_id // 32] |= np.uint32(1 << (token_id % 32))
    return True
