"""Speculative decoding's bookkeeping in the router: who proposes how many tokens, and when.

Every step, before the scheduler plans, `Speculator.plan` takes each decoding sequence's
proposed tokens (drafts), up to `num_tokens`, and decides whether the step runs them. The
shards verify drafts in the same step that computes the sequence's next token (`proto`
`ScheduledRequest.num_draft_tokens`) and answer the accepted ones plus one of their own;
`record` learns from that. The drafts come from one of two proposers:

- n-gram (prompt lookup): the sequence's own n-gram index (`ngram_proposer.NgramIndex`),
  looked up in `plan`;
- a draft model in the shards (`--speculative-model`): `proposals` decides, while a step is
  planned, whose next tokens the draft model guesses after it
  (`ScheduledRequest.num_proposed_tokens`); the guesses come back with the step's tokens
  (`offer`) and are the drafts of the sequence's next step.

Adaptive, at two levels:

- per sequence: its per-token acceptance rate `alpha` is estimated from its verified steps
  (a decayed count of accepted drafts over accepted drafts plus rejections, starting at
  `PRIOR_ALPHA`). Its proposal length is `num_tokens` while alpha >= `FULL_ALPHA`, and
  shrinks in proportion below; under `MIN_ALPHA` it only probes with one token every
  `PROBE_INTERVAL` decode steps, so a sequence whose text stops copying stops paying for
  drafts, and one that starts again is found again.
- per step: the drafts run only if the batch controller's fitted step cost
  (`step_cost.StepCostModel`) predicts more tokens per second with them than without:

      (B + sum of expected accepted drafts) / predict(B, D) > (B / predict(B)) * MIN_GAIN

  with B the step's decodes and D its draft tokens (verified like prompt tokens, at the
  sequences' mean context). A draft token costs about a prompt token; a decode step's fixed
  part (reading the weights) is what speculation shares, so the test passes at a small
  batch and fails once the batch is large enough that per-token work dominates: the
  threshold batch follows the machine and the model, measured, not configured. Before the
  fit is ready, steps of at most `FALLBACK_MAX_BATCH` decodes speculate. A draft model's
  guesses cost time of their own, one draft pass per guessed position: `proposals` adds
  that (measured, `DraftPassCost`) to the step with drafts before asking for guesses.
  Its acceptance rate is the pair of models' more than the text's: a new sequence starts
  from the rate pooled over all sequences so far (`_pooled_prior`), not from
  `PRIOR_ALPHA`.

Pure Python, no I/O: a few dictionary operations per sequence and step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from textgate.router.engine.ngram_proposer import NgramIndex
from textgate.router.engine.step_cost import StepCostModel

PRIOR_ALPHA = 0.5
"""A new sequence's per-token acceptance rate (one pseudo-acceptance, one pseudo-rejection)."""
FULL_ALPHA = 0.5
"""At or above this acceptance rate a sequence proposes `num_tokens` drafts."""
MIN_ALPHA = 0.15
"""Below this acceptance rate a sequence only probes (one draft every `PROBE_INTERVAL` steps)."""
PROBE_INTERVAL = 8
"""Decode steps between two probes of a sequence whose acceptance rate is below `MIN_ALPHA`."""
DECAY = 0.9
"""Weight of a sequence's earlier verified steps against its latest one."""
MIN_GAIN = 1.05
"""Tokens per second with drafts must beat those without by this factor (a margin for the
cost fit's error: a step that would gain nothing measurable does not speculate)."""
FALLBACK_MAX_BATCH = 4
"""Before the cost fit is ready, steps with at most this many decodes speculate."""
POOLED_DECAY = 0.99
"""Weight of earlier verified steps in the acceptance rate pooled over all sequences."""
PASS_DECAY = 0.95
"""Weight of earlier draft-model passes in the fit of a pass's time."""


@dataclass(frozen=True)
class SpeculationConfig:
    """`--speculate` and `--speculative-ngram`, checked."""

    num_tokens: int
    """Most drafts per sequence and step."""
    min_ngram: int = 1
    max_ngram: int = 3
    draft_model: bool = False
    """Drafts come from the shards' draft model (`--speculative-model`), not n-grams."""

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be at least 1, got {self.num_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}:{self.max_ngram}"
            )


@dataclass(frozen=True)
class Candidate:
    """A decoding sequence the step could speculate for."""

    request_id: int
    token_ids: Sequence[int]
    """Prompt + generated so far."""
    max_drafts: int
    """Most drafts it may take (its budget leaves room for them and one more token)."""


@dataclass
class DraftPassCost:
    """Seconds of one draft-model pass by its rows (sequences guessing in it): a decayed
    least-squares line through the measured passes, since a pass's cost grows with its rows
    (its weights are read once, its activations per row)."""

    weight: float = 0.0
    """Decayed count of the passes measured; the sums below are decayed alike."""
    rows: float = 0.0
    seconds: float = 0.0
    rows_squared: float = 0.0
    rows_seconds: float = 0.0

    def add(self, rows: float, seconds: float) -> None:
        """A measured pass of `rows` sequences (a mean, for several passes) that took `seconds`."""
        d = PASS_DECAY
        self.weight = d * self.weight + 1.0
        self.rows = d * self.rows + rows
        self.seconds = d * self.seconds + seconds
        self.rows_squared = d * self.rows_squared + rows * rows
        self.rows_seconds = d * self.rows_seconds + rows * seconds

    def predict(self, rows: int) -> float:
        """A pass of `rows`; 0 before any was measured. Rows never measured beyond the
        ones seen cost in proportion (the line's slope is unknown: assume no fixed part)."""
        if self.weight == 0:
            return 0.0
        mean_rows, mean_s = self.rows / self.weight, self.seconds / self.weight
        spread = self.rows_squared / self.weight - mean_rows * mean_rows
        if spread < 0.25:  # (about) one row count seen
            return mean_s * max(1.0, rows / mean_rows)
        covariance = self.rows_seconds / self.weight - mean_rows * mean_s
        slope = max(0.0, covariance / spread)
        return max(0.0, mean_s + slope * (rows - mean_rows))

    def guessing(self, lengths: Iterable[int]) -> float:
        """Every pass of guesses of `lengths` (one per sequence; pass j has those of at
        least j)."""
        ordered = sorted(lengths, reverse=True)
        total, rows = 0.0, len(ordered)
        for j in range(1, (ordered[0] if ordered else 0) + 1):
            while rows and ordered[rows - 1] < j:
                rows -= 1
            total += self.predict(rows)
        return total


@dataclass
class _SequenceState:
    index: NgramIndex
    accepted: float = PRIOR_ALPHA
    """Decayed count of accepted drafts (with the prior's pseudo-count)."""
    rejected: float = 1.0 - PRIOR_ALPHA
    """Decayed count of verified steps that rejected a draft."""
    steps_since_probe: int = 0
    proposal: tuple[int, ...] = ()
    """The draft model's guesses (draft-model speculation) after the sequence's first
    `proposal_at` tokens: drafts while the sequence is that long."""
    proposal_at: int = 0

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


@dataclass
class SpeculationStats:
    """Totals since start, for /metrics (`textgate_speculative_*`)."""

    num_draft_tokens: int = 0
    """Drafts the shards verified."""
    num_accepted_tokens: int = 0
    """Drafts they accepted."""
    num_verify_steps: int = 0
    """Sequence-steps that verified drafts."""
    num_emitted_tokens: int = 0
    """Tokens those sequence-steps produced (accepted drafts plus the shards' own)."""


class Speculator:
    """Per-sequence n-gram indexes and acceptance rates, and the step-level decision."""

    def __init__(self, config: SpeculationConfig) -> None:
        self.config = config
        self.stats = SpeculationStats()
        self._sequences: dict[int, _SequenceState] = {}
        self.draft_passes = DraftPassCost()
        """Measured seconds of a draft-model pass by its rows (draft-model speculation)."""
        self._pooled = [PRIOR_ALPHA, 1.0 - PRIOR_ALPHA]
        """Decayed accepted drafts and rejecting steps over all sequences."""

    def plan(
        self, candidates: Sequence[Candidate], num_decodes: int, cost: StepCostModel
    ) -> dict[int, tuple[int, ...]]:
        """Drafts per request for this step; {} when the step is better off without.

        `num_decodes` counts every decode of the step (speculating or not)."""
        if not candidates or not self._batch_may_gain(candidates, num_decodes, cost):
            return {}
        drafts: dict[int, tuple[int, ...]] = {}
        for candidate in candidates:
            proposal = self._proposal(self._state(candidate.request_id), candidate)
            if proposal:
                drafts[candidate.request_id] = proposal
        lengths = {request_id: len(d) for request_id, d in drafts.items()}
        if not drafts or not self._pays(candidates, lengths, num_decodes, cost):
            return {}
        for request_id in drafts:
            self._sequences[request_id].steps_since_probe = 0
        return drafts

    def proposals(
        self, candidates: Sequence[Candidate], num_decodes: int, cost: StepCostModel
    ) -> dict[int, int]:
        """Draft-model speculation: how many tokens the draft model guesses after this step
        for each candidate (sequences this step gives a token; `max_drafts` the room their
        next step leaves); {} when even all of them accepted would not pay for the passes."""
        if not cost.is_ready and num_decodes > FALLBACK_MAX_BATCH:
            return {}
        lengths = {}
        for candidate in candidates:
            length = min(self._length(self._state(candidate.request_id)), candidate.max_drafts)
            if length > 0:
                lengths[candidate.request_id] = length
        draft_s = self.draft_passes.guessing(lengths.values())
        if not lengths or not self._pays(candidates, lengths, num_decodes, cost, draft_s):
            return {}
        for request_id in lengths:
            # Asking is the probe: the guesses are verified whatever the rate says then.
            self._sequences[request_id].steps_since_probe = 0
        return lengths

    def offer(self, request_id: int, tokens: Sequence[int], num_tokens: int) -> None:
        """The draft model's guesses after the request's first `num_tokens` tokens (all it
        has now): its drafts, while it has no more."""
        state = self._sequences.get(request_id)
        if state is not None:
            state.proposal, state.proposal_at = tuple(tokens), num_tokens

    def record(self, request_id: int, num_drafts: int, num_emitted: int) -> None:
        """A verified step: `num_drafts` proposed, `num_emitted` tokens came back (the
        accepted drafts plus one; fewer when a stop ended the request among them)."""
        accepted = max(0, min(num_emitted - 1, num_drafts))
        stats = self.stats
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += accepted
        stats.num_verify_steps += 1
        stats.num_emitted_tokens += num_emitted
        rejection = 1.0 if accepted < num_drafts else 0.0
        pooled = self._pooled
        pooled[0] = POOLED_DECAY * pooled[0] + accepted
        pooled[1] = POOLED_DECAY * pooled[1] + rejection
        state = self._sequences.get(request_id)
        if state is None:
            return
        state.accepted = DECAY * state.accepted + accepted
        state.rejected = DECAY * state.rejected + rejection

    def tick(self, request_ids: Sequence[int]) -> None:
        """These requests decoded a step without drafts (their probe clock runs)."""
        for request_id in request_ids:
            state = self._sequences.get(request_id)
            if state is not None:
                state.steps_since_probe += 1

    def drop(self, request_id: int) -> None:
        """Forget a request that left."""
        self._sequences.pop(request_id, None)

    def clear(self) -> None:
        """Forget every request (the scheduler that held them was rebuilt); stats stay."""
        self._sequences.clear()

    def alpha(self, request_id: int) -> float:
        """The request's estimated per-token acceptance rate."""
        return self._state(request_id).alpha

    def _state(self, request_id: int) -> _SequenceState:
        state = self._sequences.get(request_id)
        if state is None:
            index = NgramIndex(self.config.min_ngram, self.config.max_ngram)
            state = _SequenceState(index)
            if self.config.draft_model:
                state.accepted = self._pooled_prior()
                state.rejected = 1.0 - state.accepted
            self._sequences[request_id] = state
        return state

    def _pooled_prior(self) -> float:
        """A new sequence's acceptance rate under a draft model: the pooled one so far."""
        accepted, rejected = self._pooled
        return accepted / (accepted + rejected)

    def _proposal(self, state: _SequenceState, candidate: Candidate) -> tuple[int, ...]:
        """The sequence's drafts: the draft model's guesses (as many as were asked for,
        when `proposals` decided), or its n-gram lookup at its acceptance rate's length."""
        if self.config.draft_model:
            fresh = state.proposal_at == len(candidate.token_ids)
            return state.proposal[: candidate.max_drafts] if fresh else ()
        length = min(self._length(state), candidate.max_drafts)
        return state.index.propose(candidate.token_ids, length) if length > 0 else ()

    def _pays(
        self,
        candidates: Sequence[Candidate],
        lengths: dict[int, int],
        num_decodes: int,
        cost: StepCostModel,
        draft_s: float = 0.0,
    ) -> bool:
        """Whether drafts of `lengths` (by request) are predicted to raise the step's tokens
        per second, each accepted at its sequence's rate."""
        expected = sum(
            sum(self._sequences[r].alpha ** (i + 1) for i in range(n)) for r, n in lengths.items()
        )
        contexts = sum(len(c.token_ids) for c in candidates if c.request_id in lengths)
        context = contexts // len(lengths)
        num_drafts = sum(lengths.values())
        return self._gains(num_decodes, num_drafts, expected, context, cost, draft_s)

    def _length(self, state: _SequenceState) -> int:
        """How many drafts the sequence proposes at its acceptance rate."""
        alpha = state.alpha
        if alpha >= FULL_ALPHA:
            return self.config.num_tokens
        if alpha < MIN_ALPHA:
            return 1 if state.steps_since_probe >= PROBE_INTERVAL else 0
        return max(1, int(self.config.num_tokens * alpha / FULL_ALPHA))

    def _batch_may_gain(
        self, candidates: Sequence[Candidate], num_decodes: int, cost: StepCostModel
    ) -> bool:
        """A cheap first test, before any lookup: before the fit is ready, small batches
        only; after, whether even every candidate's full proposal, all accepted, would gain
        (a large batch is turned down without proposing anything)."""
        if not cost.is_ready:
            return num_decodes <= FALLBACK_MAX_BATCH
        most = sum(min(self.config.num_tokens, c.max_drafts) for c in candidates)
        context = sum(len(c.token_ids) for c in candidates) // len(candidates)
        return self._gains(num_decodes, most, float(most), context, cost)

    @staticmethod
    def _gains(
        num_decodes: int,
        num_drafts: int,
        expected: float,
        context: int,
        cost: StepCostModel,
        draft_s: float = 0.0,
    ) -> bool:
        """Whether the drafts are predicted to raise the step's tokens per second
        (`draft_s`: the time guessing them takes on top, a draft model's passes)."""
        if not cost.is_ready:
            return True
        plain = cost.predict(num_decodes)
        with_drafts = cost.predict(num_decodes, num_drafts, context) + draft_s
        if plain <= 0 or with_drafts <= 0:
            return True
        return (num_decodes + expected) / with_drafts > MIN_GAIN * num_decodes / plain
