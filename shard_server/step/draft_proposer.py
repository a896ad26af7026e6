"""Draft-model speculation's proposals: a small model guesses a sequence's next tokens.

After a step, for each sequence the plan asked (`ScheduledRequest.num_proposed_tokens`),
the draft model (`--speculative-model`, e.g. an int8 copy of the served model) runs
greedily for k tokens; the router sends them back as the sequence's drafts in its next
step, where the target verifies them (docs/speculative.md). Greedy proposals are a
deterministic draft, so the verification rule that keeps n-gram drafts exact keeps these
exact too, for sampling as well.

The draft's KV cache mirrors the target's block layout: the same block ids, so the router's
allocator covers both and no second allocator exists. The draft's KV is computed lazily:
each block remembers which tokens the draft wrote in it, after which prefix (`_BlockKey`),
so a sequence reads as valid exactly the positions whose draft KV was written for its own
tokens, in any block, whoever wrote it (a prefix shared with another request, guesses that
turned out right), and nothing a block held for another sequence before it was given back
and handed out again (a recompute after preemption, a reused block). The first pass of a
call catches each sequence up from there (its prompt on its first guesses, at most
`max_catch_up` tokens a call; one or two tokens after a verified step), then guesses.
Positions past the sequence's blocks (its newest token's, the guesses') go to one scratch
block per row beyond the router's, so a guess never writes a block the router has not
given the sequence.

Only the guesses depend on the draft: what a sequence emits is the target's (a bad draft
costs speed, never correctness).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from textgate.kernels import AttentionMetadata
from textgate.shard_server.step.kv_cache import KVCache
from textgate.shard_server.step.sequence import Sequence

MAX_ROWS = 64
"""Most sequences one call guesses for (one scratch block each); the rest get none."""
MEASURED_TOKENS = 2
"""A pass is timed for the router's cost fit when no row feeds more tokens than this (a
prompt's catch-up is a one-off, not what each step of guessing costs)."""


@dataclass(frozen=True)
class _BlockKey:
    """What the draft's KV in a block holds."""

    prefix: int
    """`chain_hash` of the tokens of every block before it."""
    tokens: tuple[int, ...]
    """The tokens whose KV it holds, from the block's first position on."""


@dataclass(frozen=True)
class DraftOutput:
    """One call's guesses, and the timing the router costs guessing by."""

    guesses: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Request id -> its greedy guesses after its last token."""
    pass_ns: int = 0
    """Mean time of the call's timed passes (`MEASURED_TOKENS`); 0: none was."""
    pass_rows: float = 0.0
    """Their mean rows (sequences in a pass)."""


@dataclass
class _Row:
    """One sequence's part of a call."""

    seq: Sequence
    table: list[int]
    """The sequence's blocks, then its scratch block."""
    first: int
    """Position of the first token fed this call."""
    tokens: list[int]
    """What the next pass feeds."""
    num_wanted: int
    """Guesses wanted; 0: only catching up this call (the call's catch-up budget ran out)."""
    fed: list[int] = field(default_factory=list)
    """Everything fed so far, from position `first`."""
    guesses: list[int] = field(default_factory=list)


def chain_hash(prefix: int, tokens: Seq[int]) -> int:
    """The key of a block of `tokens` after the blocks keyed `prefix` (0 for the first)."""
    return hash((prefix, tuple(tokens)))


class DraftProposer:
    """A draft model, its paged cache (the target's block ids plus scratch blocks) and what
    each block of that cache holds."""

    def __init__(self, model: Any, block_size: int, max_positions: int) -> None:
        self.model = model
        self.block_size = block_size
        self.max_positions = max_positions
        self.kv_cache: KVCache | None = None
        self.num_blocks = 0
        """Blocks the router hands out (scratch blocks follow them)."""
        self.max_catch_up = 512
        """Most tokens one call feeds to catch sequences up (Warmup sets the prefill size)."""
        self._keys: dict[int, _BlockKey] = {}
        self._chains: dict[int, list[int]] = {}
        """Per sequence, `chain_hash` of each full block of its tokens."""

    def bytes_per_block(self) -> int:
        """Memory one block of the draft's cache takes."""
        return KVCache.bytes_per_block(
            num_layers=self.model.num_layers,
            block_size=self.block_size,
            num_kv_heads=self.model.num_kv_heads,
            head_dim=self.model.head_dim,
            dtype=self.model.kv_cache_dtype,
        )

    def reserved_bytes(self) -> int:
        """Memory of the scratch blocks, beside the router's."""
        return MAX_ROWS * self.bytes_per_block()

    def allocate(self, num_blocks: int, max_catch_up: int) -> None:
        """A cache for the target's `num_blocks` blocks and the scratch blocks."""
        self.kv_cache = None  # the old cache is freed before the new one is made
        self.kv_cache = self.model.allocate_kv_cache(num_blocks + MAX_ROWS, self.block_size)
        self.num_blocks = num_blocks
        self.max_catch_up = max(max_catch_up, 1)
        self.clear()

    def drop(self, request_id: int) -> None:
        self._chains.pop(request_id, None)

    def clear(self) -> None:
        """Forget what every block holds (and every sequence)."""
        self._keys.clear()
        self._chains.clear()

    def propose(self, wanted: Seq[tuple[Sequence, Seq[int], int]]) -> DraftOutput:
        """Up to k greedy guesses per (sequence, its block table, k), after its last token."""
        if self.kv_cache is None:
            raise RuntimeError("the draft's KV cache is not allocated: Warmup must run first")
        rows = self._rows(wanted)
        timed: list[tuple[int, int]] = []  # (ns, rows) of the passes timed
        active = rows
        while active:
            started = time.perf_counter_ns()
            picked = self._forward(active)
            if max(len(row.tokens) for row in active) <= MEASURED_TOKENS:
                timed.append((time.perf_counter_ns() - started, len(active)))
            for row, token in zip(active, picked, strict=True):
                if row.num_wanted:
                    row.guesses.append(token)
                row.tokens = [token]
            active = [row for row in active if len(row.guesses) < row.num_wanted]
        for row in rows:
            self._remember(row)
        guesses = {row.seq.id: tuple(row.guesses) for row in rows if row.guesses}
        if not timed:
            return DraftOutput(guesses)
        return DraftOutput(
            guesses,
            pass_ns=sum(ns for ns, _ in timed) // len(timed),
            pass_rows=sum(n for _, n in timed) / len(timed),
        )

    def _rows(self, wanted: Seq[tuple[Sequence, Seq[int], int]]) -> list[_Row]:
        """The call's rows: where each sequence's draft KV stops, what it feeds first."""
        rows, budget = [], self.max_catch_up
        for seq, table, num_wanted in wanted[:MAX_ROWS]:
            length = len(seq.all_ids)
            # Guess i (from 1) is fed at position length + i - 1, the last guess is not:
            # all inside the model's positions, and past the router's blocks by at most
            # one block (the newest token's slot is only given in the next step).
            num_wanted = min(num_wanted, self.block_size, self.max_positions - length + 1)
            if num_wanted < 1 or length - 1 > len(table) * self.block_size:
                continue
            first = min(self._num_valid(seq, table), length - 1)
            if length - first > budget:  # catch up as far as the budget goes, guess later
                num_wanted, length = 0, first + budget
            if length <= first:
                continue
            budget -= length - first
            scratch = self.num_blocks + len(rows)
            tokens = seq.all_ids[first:length]
            rows.append(_Row(seq, [*table, scratch], first, tokens, num_wanted))
        return rows

    def _num_valid(self, seq: Sequence, table: Seq[int]) -> int:
        """Positions of the sequence whose draft KV holds its own tokens (block by block:
        each must hold the sequence's tokens after the sequence's own prefix)."""
        ids, size = seq.all_ids, self.block_size
        chain = self._chain(seq)
        valid = 0
        for j, block in enumerate(table):
            key = self._keys.get(block)
            if key is None or key.prefix != (chain[j - 1] if j else 0):
                break
            own = ids[j * size : (j + 1) * size]
            same = 0
            while same < len(key.tokens) and same < len(own) and key.tokens[same] == own[same]:
                same += 1
            valid += same
            if same < size:
                break
        return valid

    def _chain(self, seq: Sequence) -> list[int]:
        """`chain_hash` of each full block of the sequence's tokens (kept, extended)."""
        chain = self._chains.setdefault(seq.id, [])
        ids, size = seq.all_ids, self.block_size
        while len(chain) < len(ids) // size:
            j = len(chain)
            chain.append(chain_hash(chain[j - 1] if j else 0, ids[j * size : (j + 1) * size]))
        return chain

    def _remember(self, row: _Row) -> None:
        """Key the router's blocks the call wrote for the row: the sequence's tokens before
        `first` (valid there already), then everything fed."""
        size = self.block_size
        written = [*row.seq.all_ids[: row.first], *row.fed]
        start_block = row.first // size
        prefix = self._chain(row.seq)[start_block - 1] if start_block else 0
        for j in range(start_block, -(-len(written) // size)):
            if j >= len(row.table) - 1:  # the scratch block: gone after the call
                break
            tokens = tuple(written[j * size : (j + 1) * size])
            self._keys[row.table[j]] = _BlockKey(prefix, tokens)
            prefix = chain_hash(prefix, tokens)

    def _forward(self, rows: list[_Row]) -> list[int]:
        """One draft pass: each row's `tokens` after what it fed before; the argmax after
        each row's last token."""
        assert self.kv_cache is not None
        device = self.model.device
        starts = [row.first + len(row.fed) for row in rows]
        for row in rows:
            row.fed.extend(row.tokens)
        ids = [token for row in rows for token in row.tokens]
        positions = [
            p for s, row in zip(starts, rows, strict=True) for p in range(s, s + len(row.tokens))
        ]
        metadata = AttentionMetadata.build(
            query_lens=[len(row.tokens) for row in rows],
            context_lens=starts,
            block_tables=[row.table for row in rows],
            block_size=self.block_size,
            device=device,
        )
        last = torch.tensor([len(row.tokens) for row in rows]).cumsum(0) - 1
        # Ids past the draft's vocabulary (a target's padded rows) cannot be embedded:
        # such a row guesses from a stand-in token; the target rejects what it guesses.
        vocab = self.model.config.vocab_size
        logits = self.model(
            torch.tensor(ids, dtype=torch.int64, device=device).clamp_(max=vocab - 1),
            torch.tensor(positions, dtype=torch.int64, device=device),
            self.kv_cache,
            metadata,
            last.to(device),
        )  # [rows, V]
        picked: list[int] = logits.argmax(dim=-1).tolist()
        return picked
