"""Structured output: grammars compiled once per schema, enforced as token masks.

A request's grammar (a JSON schema, a regular expression, or an EBNF grammar the router
built for tool calls) is compiled by xgrammar against the tokenizer's vocabulary into a
`CompiledGrammar`, cached by its text (LRU), so a schema sent again costs a dict lookup.
Each request then gets a `GrammarState` (an xgrammar `GrammarMatcher`): where its text
is in the grammar. Before every step that samples for it, the state fills one row of a
token bitmask (bit set = the token may come next); the sampler sets every other token's
logit to -inf. The accepted token advances the state. Once the text is complete the
grammar allows only the end-of-sequence tokens, so the request ends there. Near the end
of its token budget, a request's mask is narrowed to the tokens after which its text can
still be completed in time (shard_server/step/grammar_budget.py), so the text it ends with
parses.

A reasoning model on a chat route thinks before it answers: its grammar carries the
thinking's markers (`pb.ThinkingMarkers`), and the state leaves the text unconstrained
until the token that ends the thinking, then constrains what follows (as vLLM does with
a reasoning parser). A text that may or may not think (Qwen3) thinks only when its first
token opens the thinking; any other first token is the grammar's.

Masks are filled on a worker thread (`MaskFiller`) while the model's forward pass runs:
both release the GIL, so for batches of a few grammar requests the masks cost no step
time. Requests without a grammar have no row in the bitmask and are sampled unchanged.

Speculation (docs/speculative.md): a request verifying drafts has a row per draft and one
more; row k is masked from a fork of its state that accepted drafts 0..k-1, so it allows
what a plain step after those drafts would. A draft the grammar does not allow ends the
chain (the rows after it are never reached: the draft's own row cannot sample it), and so
does a row whose budget check needs its logits (`GrammarState.needs_check`): the rows
after it are not verified this step. The request's state then becomes the fork of the row
its last token came from; the forks of rejected rows are dropped, which is the rollback.
"""

from __future__ import annotations

import copy
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from threading import Lock
from typing import Any

import torch

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.step.grammar_budget import NUM_CANDIDATES, BudgetCloser, VocabIndex

DEFAULT_CACHE_SIZE = 128
"""Compiled grammars kept (least recently used dropped first)."""
BITS = 32
"""Tokens per bitmask word (xgrammar's int32 layout: token t is bit t % 32 of word t // 32)."""


class GrammarError(ValueError):
    """A grammar the engine cannot compile; the message says which part and why."""


@dataclass(frozen=True)
class GrammarMasks:
    """The step's token masks: row r of `bitmask` constrains sampled row r, for r in `rows`."""

    bitmask: torch.Tensor  # [B, ceil(V / 32)] int32, bit set = allowed; a row per sampled row
    rows: list[int]  # [G] the rows with a grammar (the others' masks are not read)
    states: Sequence[GrammarState | None] = ()
    """[G] the state each row was masked from (for a row after drafts, its sequence's state
    after them); None for a draft row left unmasked, which speculation does not verify."""

    def by_row(self) -> dict[int, GrammarState]:
        """The masked rows' states by row."""
        return {
            row: state
            for row, state in zip(self.rows, self.states, strict=True)
            if state is not None
        }

    def apply(self, logits: torch.Tensor, sampled: Sequence[bool] | None = None) -> torch.Tensor:
        """logits [B, V] float32 with every token a row's grammar forbids at -inf (a new
        tensor; rows without a grammar are copied unchanged). `sampled[r]`: row r samples
        (else it is greedy: of its likeliest tokens only the first that fits matters)."""
        import xgrammar as xgr

        masked = logits.contiguous().clone()
        # xgrammar's kernel (C++ on CPU, CUDA/Triton on GPU): ~10x faster here than
        # unpacking the bits with torch ops.
        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(masked, bitmask, indices=self.rows)
        if not self.states:
            return masked
        checked = [
            (row, state)
            for row, state in zip(self.rows, self.states, strict=True)
            if state is not None and state.needs_check
        ]
        if checked:
            _keep_fitting(masked, checked, sampled)
        return masked


def _keep_fitting(
    masked: torch.Tensor,
    checked: Sequence[tuple[int, GrammarState]],
    sampled: Sequence[bool] | None,
) -> None:
    """Leave each checked row only its likeliest tokens that fit its budget (and those
    that start its completion). One host transfer for all of them, near budgets only."""
    rows = [row for row, _ in checked]
    num = min(NUM_CANDIDATES, masked.shape[1])
    values, ids = masked[rows].topk(num, dim=-1)  # [C, num] each
    for (row, state), row_values, row_ids in zip(
        checked, values.tolist(), ids.tolist(), strict=True
    ):
        candidates = [t for t, v in zip(row_ids, row_values, strict=True) if v != float("-inf")]
        greedy = sampled is not None and not sampled[row]
        allowed = state.refine(candidates, first_only=greedy)
        keep = torch.tensor(allowed, dtype=torch.int64, device=masked.device)
        drop = torch.ones(masked.shape[1], dtype=torch.bool, device=masked.device)
        drop[keep] = False
        masked[row].masked_fill_(drop, float("-inf"))


def _allow(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Set token `token_id`'s bit in row `row` (int32 words: bit 31 is the sign bit)."""
    bit = 1 << (token_id % BITS)
    word = bitmask[row, token_id // BITS]
    bitmask[row, token_id // BITS] = word | (bit - (1 << 32) if bit >= 1 << 31 else bit)


class GrammarState:
    """One request's position in its grammar (and, with a `closer`, in its token budget;
    with `thinking`, in a reasoning model's thinking before it)."""

    def __init__(
        self,
        matcher: Any,
        closer: BudgetCloser | None = None,
        thinking: pb.ThinkingMarkers | None = None,
    ) -> None:
        self._matcher = matcher
        self._closer = closer
        self._thinking = thinking
        self._phase = "grammar"
        """"grammar" (constrained), "thinking" (free until the end token), or "first"
        (the first token may open the thinking)."""
        if thinking is not None:
            self._phase = "thinking" if thinking.starts_inside else "first"

    def fork(self) -> GrammarState:
        """An independent copy at the same point (grammar, budget and thinking)."""
        twin = copy.copy(self)
        twin._matcher = self._matcher.fork()
        twin._closer = None if self._closer is None else self._closer.fork()
        return twin

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens that may come next into row `row` of `bitmask`: the grammar's,
        narrowed to a completion of the text when the budget is close (every token while
        thinking; the grammar's and the opening tag for a first token that may think)."""
        if self._phase == "thinking":
            bitmask[row] = -1  # every bit set
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._phase == "first" and self._thinking is not None:
            _allow(bitmask, row, self._thinking.start_token_id)
        if self._closer is not None:
            # A budget too short for thinking and an answer takes the opening tag away.
            self._closer.restrict(self._matcher, bitmask, row)

    @property
    def needs_check(self) -> bool:
        """This step's likeliest tokens must be checked against the budget (`refine`)."""
        return self._phase != "thinking" and self._closer is not None and self._closer.check

    def refine(self, candidates: Sequence[int], first_only: bool = False) -> list[int]:
        """Which tokens may be sampled this step, given the likeliest `candidates`."""
        assert self._closer is not None
        return self._closer.refine(self._matcher, candidates, first_only)

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False when the grammar does not allow it here."""
        if self._closer is not None:
            self._closer.accepted(token_id)
        thinking = self._thinking
        if self._phase == "first":
            assert thinking is not None
            self._phase = "thinking" if token_id == thinking.start_token_id else "grammar"
        if self._phase == "thinking":
            assert thinking is not None
            if token_id == thinking.end_token_id:
                self._phase = "grammar"
            return True
        return bool(self._matcher.accept_token(token_id))

    @property
    def thinking(self) -> bool:
        """The text is inside its thinking: nothing constrains it yet."""
        return self._phase == "thinking"

    @property
    def closed_by_budget(self) -> bool:
        """The budget narrowed the mask to a completion: where the text ended was the
        budget's choice (the request reports `length`), not the model's."""
        return self._closer is not None and self._closer.steered

    @property
    def terminated(self) -> bool:
        """The text is complete and its end-of-sequence token was accepted."""
        return self._phase == "grammar" and bool(self._matcher.is_terminated())


class GrammarCompiler:
    """Compiles `pb.Grammar`s for one tokenizer; compiled grammars are cached (LRU).

    xgrammar is imported and the vocabulary indexed on the first grammar, so shards
    that never see one pay nothing for it.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be at least 1, got {cache_size}")
        self.vocab_size = vocab_size
        """Logits columns; tokens past the tokenizer's own are never allowed."""
        self._tokenizer = tokenizer
        self._stop_token_ids = sorted(stop_token_ids)
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple[int, str], Any] = OrderedDict()
        self._compiler: Any = None
        self._vocab_index: VocabIndex | None = None
        self._tokenizer_info: Any = None
        self._lock = Lock()
        self.num_compiled = 0
        """Grammars compiled (cache misses), for tests and logs."""

    def state(self, grammar: pb.Grammar, max_new_tokens: int | None = None) -> GrammarState:
        """A fresh state at the start of `grammar`; GrammarError when it does not compile.

        With `max_new_tokens` (the request's budget) the state closes its text before the
        budget runs out (shard_server/step/grammar_budget.py).
        """
        import xgrammar as xgr

        compiled = self.compile(grammar)
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=self._stop_token_ids or None)
        closer = None
        if max_new_tokens:
            index = self._index()
            closer = BudgetCloser(index, self._stop_token_ids, max_new_tokens, self.vocab_size)
        thinking = grammar.thinking if grammar.HasField("thinking") else None
        return GrammarState(matcher, closer, thinking)

    def compile(self, grammar: pb.Grammar) -> Any:
        """The compiled grammar, from the cache when this exact grammar was seen."""
        key = (int(grammar.type), grammar.value)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
            compiled = self._compile(grammar)
            self.num_compiled += 1
            self._cache[key] = compiled
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return compiled

    def _compile(self, grammar: pb.Grammar) -> Any:
        compiler = self._xgrammar_compiler()
        compile_one: dict[int, tuple[str, Callable[[str], Any]]] = {
            # Compact JSON (no free whitespace): small models otherwise tend to emit
            # newlines and spaces until max_new_tokens runs out.
            pb.GRAMMAR_TYPE_JSON: ("JSON schema", _json_schema_compiler(compiler)),
            pb.GRAMMAR_TYPE_REGEX: ("regular expression", compiler.compile_regex),
            pb.GRAMMAR_TYPE_EBNF: ("EBNF grammar", compiler.compile_grammar),
        }
        if grammar.type not in compile_one:
            raise GrammarError(f"unknown grammar type {grammar.type}")
        what, compile_text = compile_one[grammar.type]
        try:
            return compile_text(grammar.value)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(f"the {what} cannot be compiled: {_first_line(exc)}") from exc

    def _index(self) -> VocabIndex:
        """The vocabulary by bytes (built once, on the first state with a budget)."""
        with self._lock:
            if self._vocab_index is None:
                self._xgrammar_compiler()
                info = self._tokenizer_info
                special = set(getattr(self._tokenizer, "all_special_ids", ()))
                special.update(info.special_token_ids, self._stop_token_ids)
                self._vocab_index = VocabIndex(info.decoded_vocab, special)
            return self._vocab_index

    def _xgrammar_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer,
                vocab_size=self.vocab_size,
                stop_token_ids=self._stop_token_ids or None,
            )
            self._tokenizer_info = info
            # Our own LRU decides what stays; xgrammar's cache would keep everything.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


def _json_schema_compiler(compiler: Any) -> Callable[[str], Any]:
    def compile_schema(value: str) -> Any:
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from exc
        if schema is True or schema == {}:
            return compiler.compile_builtin_json_grammar()
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema is an object (or true)")
        return compiler.compile_json_schema(value, any_whitespace=False)

    return compile_schema


def _first_line(exc: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    _, sep, rest = text.partition(".cc:")
    if sep:
        text = rest.split(":", 1)[-1].strip() or text
    return text


class MaskFiller:
    """Fills a step's grammar masks on a worker thread, while the forward pass runs.

    `start` takes the states of the rows about to be sampled and returns at once; the
    sampler waits for `PendingMasks.result()` after the forward pass.
    """

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None

    def start(
        self,
        states: Sequence[GrammarState | None],
        vocab_size: int,
        conditioned: Sequence[tuple[int, ...]] | None = None,
    ) -> PendingMasks | None:
        """Begin filling the masks of the rows that have a grammar; None when none does.

        `states[r]`: row r's sequence's state; `conditioned[r]`: the drafts row r follows
        (speculation: a sequence's rows are consecutive, each one draft longer).
        """
        rows = [row for row, state in enumerate(states) if state is not None]
        if not rows:
            return None
        after = list(conditioned) if conditioned is not None else [()] * len(states)
        bitmask = torch.full((len(states), -(-vocab_size // BITS)), -1, dtype=torch.int32)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        future = self._executor.submit(_fill, list(states), after, bitmask)
        return PendingMasks(future, bitmask, rows)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)


@dataclass(frozen=True)
class PendingMasks:
    """Masks being filled; `result()` waits for them."""

    future: Future[list[GrammarState | None]]
    bitmask: torch.Tensor
    rows: list[int]

    def result(self) -> GrammarMasks:
        filled = self.future.result()
        return GrammarMasks(self.bitmask, self.rows, [filled[row] for row in self.rows])


def _fill(
    states: Sequence[GrammarState | None],
    conditioned: Sequence[tuple[int, ...]],
    bitmask: torch.Tensor,
) -> list[GrammarState | None]:
    """Fill each row's mask; return the state each row was masked from (a row after
    drafts: a fork of the previous row's state past its draft, or None, left unmasked,
    when that row ends the chain)."""
    filled: list[GrammarState | None] = []
    for row, state in enumerate(states):
        if state is not None and conditioned[row]:
            state = _past_draft(filled[row - 1], conditioned[row][-1])
        if state is not None:
            state.fill(bitmask, row)
        filled.append(state)
    return filled


def _past_draft(state: GrammarState | None, draft: int) -> GrammarState | None:
    """A fork of `state` (already filled for its row) past `draft`; None when the grammar
    does not allow the draft, the draft ends the text (its row ends the sequence), or the
    row's budget check needs its logits (which the fork's budget would have to see, as a
    plain step's does, before the draft)."""
    if state is None or state.needs_check:
        return None
    fork = state.fork()
    return fork if fork.accept(draft) and not fork.terminated else None
