"""Draft-model speculation's proposals: a small model guesses a sequence's next tokens.

After a step, for each sequence the plan asked (`ScheduledRequest.num_proposed_tokens`),
the draft model (`--speculative-model`, e.g. an int8 copy of the served model) runs
greedily for k tokens; the router sends them back as the sequence's drafts in its next
step, where the target verifies them (docs/speculative.md). Greedy proposals are a
deterministic draft, so the verification rule that keeps n-gram drafts exact keeps these
exact too, for sampling as well.

The draft's KV cache mirrors the target's block layout: the same block ids, so the router's
allocator covers both and no second allocator exists. Each sequence's draft KV is computed
lazily: the draft remembers how many positions of it hold the sequence's own tokens
(`_DraftState`), and its first pass of a call catches up from there (the prompt on the first
call, one or two tokens after a verified step). Positions past the sequence's blocks (the
newest tokens, the guesses) go to one scratch block per row beyond the router's blocks,
so a guess never writes a block the router has not given the sequence.

Only the guessed tokens and the draft cache depend on the draft: what the sequence emits is
the target's (a bad draft costs speed, never correctness).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from textgate.kernels import AttentionMetadata
from textgate.shard_server.step.kv_cache import KVCache
from textgate.shard_server.step.sequence import Sequence

MAX_ROWS = 64
"""Most sequences one call proposes for (scratch blocks kept: one per row); the rest get none."""


@dataclass
class _DraftState:
    """Where a sequence's draft KV stands."""

    num_valid: int
    """Positions [0, num_valid) hold the draft KV of the sequence's own tokens."""
    blocks: tuple[int, ...]
    """The blocks those positions (and the tail's) were written in."""
    computed: int
    """Positions the target had computed when the draft last ran: a later step that starts
    below is a recompute (after preemption), whose blocks may have served others since."""
    tail: tuple[int, ...] = ()
    """Guesses whose KV follows position num_valid, in those blocks: valid as far as the
    sequence's tokens turned out to agree with them."""


@dataclass
class _Row:
    seq: Sequence
    table: list[int]
    """The sequence's blocks, then its scratch block."""
    start: int
    num_tokens: int
    """Proposals wanted."""
    capacity: int
    """Positions the router's blocks hold."""


class DraftProposer:
    """A draft model, its paged cache (the target's block ids plus scratch blocks) and how
    far each sequence's draft KV is computed."""

    def __init__(self, model: Any, block_size: int, max_positions: int) -> None:
        self.model = model
        self.block_size = block_size
        self.max_positions = max_positions
        self.kv_cache: KVCache | None = None
        self.num_blocks = 0
        """Blocks the router hands out (scratch blocks follow them)."""
        self._states: dict[int, _DraftState] = {}
        self.pass_ns = 0
        """The last call's mean time of a pass after its first (0: it made one pass)."""

    def bytes_per_block(self) -> int:
        """Memory one block of the draft's cache takes."""
        return KVCache.bytes_per_block(
            num_layers=self.model.num_layers,
            block_size=self.block_size,
            num_kv_heads=self.model.num_kv_heads,
            head_dim=self.model.head_dim,
            dtype=self.model.kv_cache_dtype,
        )

    def allocate(self, num_blocks: int) -> None:
        """A cache for the target's `num_blocks` blocks and the scratch blocks."""
        self.kv_cache = None
        self.kv_cache = self.model.allocate_kv_cache(num_blocks + MAX_ROWS, self.block_size)
        self.num_blocks = num_blocks
        self._states.clear()

    def seen(self, request_id: int, start_position: int) -> None:
        """The target computes the request from `start_position` this step. Below what it
        had computed, this is a recompute: the blocks from there on were given back and
        may have held other sequences' draft KV since, so only what lies before is kept
        (a prefix-cache hit's blocks hold the same tokens, whoever wrote them)."""
        state = self._states.get(request_id)
        if state is not None and start_position < state.computed:
            state.tail = ()
            state.num_valid = min(state.num_valid, start_position)
            state.computed = start_position

    def drop(self, request_id: int) -> None:
        self._states.pop(request_id, None)

    def clear(self) -> None:
        self._states.clear()

    def propose(self, wanted: Seq[tuple[Sequence, Seq[int], int]]) -> dict[int, tuple[int, ...]]:
        """Up to k greedy guesses per (sequence, its block table, k), after its last token."""
        if self.kv_cache is None:
            raise RuntimeError("the draft's KV cache is not allocated: Warmup must run first")
        rows = [row for row in (self._row(*each, i) for i, each in enumerate(wanted)) if row]
        if not rows:
            return {}
        guesses: list[list[int]] = [[] for _ in rows]
        active = list(range(len(rows)))
        tokens = [row.seq.all_ids[row.start :] for row in rows]
        starts = [row.start for row in rows]
        num_passes, after_first = 0, time.perf_counter_ns()
        while active:
            if num_passes == 1:
                after_first = time.perf_counter_ns()
            num_passes += 1
            picked = self._forward([rows[i] for i in active], tokens, starts)
            for i, token in zip(active, picked, strict=True):
                guesses[i].append(token)
            starts = [starts[j] + len(tokens[j]) for j, i in enumerate(active)]
            keep = [j for j, i in enumerate(active) if len(guesses[i]) < rows[i].num_tokens]
            active = [active[j] for j in keep]
            starts = [starts[j] for j in keep]
            tokens = [[guesses[i][-1]] for i in active]
        later = num_passes - 1
        self.pass_ns = (time.perf_counter_ns() - after_first) // later if later else 0
        for row, guess in zip(rows, guesses, strict=True):
            self._remember(row, guess)
        return {row.seq.id: tuple(guess) for row, guess in zip(rows, guesses, strict=True)}

    def _row(self, seq: Sequence, table: Seq[int], num_tokens: int, index: int) -> _Row | None:
        """The sequence's share of the call, or None when it cannot be proposed for."""
        length = len(seq.all_ids)
        capacity = len(table) * self.block_size
        # Guess i (from 1) is fed at position length + i - 1, the last guess is not: all
        # inside the model's positions, and past the router's blocks by at most one block
        # (the newest token's slot is only given in the next step).
        num_tokens = min(num_tokens, self.block_size, self.max_positions - length + 1)
        if num_tokens < 1 or index >= MAX_ROWS or length - 1 > capacity:
            return None
        start = min(self._num_valid(seq, table), length - 1)
        return _Row(seq, [*table, self.num_blocks + index], start, num_tokens, capacity)

    def _num_valid(self, seq: Sequence, table: Seq[int]) -> int:
        """Positions of the sequence whose draft KV can be read as it is."""
        state = self._states.get(seq.id)
        if state is None:
            return 0
        same = 0
        while same < len(state.blocks) and same < len(table) and state.blocks[same] == table[same]:
            same += 1
        valid = state.num_valid
        ids = seq.all_ids
        for token in state.tail:
            if valid >= len(ids) or ids[valid] != token:
                break
            valid += 1
        return min(valid, same * self.block_size)

    def _remember(self, row: _Row, guesses: list[int]) -> None:
        """After a call: the sequence's own tokens and all guesses but the last were fed,
        and those in the router's blocks keep their KV."""
        length = len(row.seq.all_ids)
        num_valid = min(length, row.capacity)
        tail = tuple(guesses[:-1][: max(0, row.capacity - length)])
        blocks = tuple(row.table[: len(row.table) - 1])
        self._states[row.seq.id] = _DraftState(num_valid, blocks, length - 1, tail)

    def _forward(self, rows: list[_Row], tokens: list[list[int]], starts: list[int]) -> list[int]:
        """One draft pass: each row's `tokens` from position `starts`; the argmax after each
        row's last token."""
        assert self.kv_cache is not None
        device = self.model.device
        ids = [token for row_tokens in tokens for token in row_tokens]
        positions = [p for s, t in zip(starts, tokens, strict=True) for p in range(s, s + len(t))]
        metadata = AttentionMetadata.build(
            query_lens=[len(t) for t in tokens],
            context_lens=starts,
            block_tables=[row.table for row in rows],
            block_size=self.block_size,
            device=device,
        )
        last = torch.tensor([len(t) for t in tokens]).cumsum(0) - 1
        logits = self.model(
            torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            self.kv_cache,
            metadata,
            last.to(device),
        )  # [rows, V]
        picked: list[int] = logits.argmax(dim=-1).tolist()
        return picked
