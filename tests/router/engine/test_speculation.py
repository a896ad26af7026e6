"""Speculator: per-sequence proposal length follows its acceptance rate; a step speculates
only where the fitted step cost predicts more tokens per second."""

from __future__ import annotations

import pytest

from textgate.router.engine.speculation import (
    FALLBACK_MAX_BATCH,
    MIN_ALPHA,
    PROBE_INTERVAL,
    Candidate,
    DraftPassCost,
    SpeculationConfig,
    Speculator,
)
from textgate.router.engine.step_cost import StepCostModel

COPYING = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]  # "1 2 3" occurred: proposes 4 5 6 ...


def fitted(overhead_s: float, per_token_s: float) -> StepCostModel:
    """A cost fit of steps costing overhead + per_token per decode or prompt token."""
    cost = StepCostModel()
    for decodes, prompt in [(1, 0), (2, 0), (4, 0), (8, 0), (16, 0), (32, 0), (0, 64), (4, 32)]:
        for _ in range(3):
            cost.add(decodes, prompt, overhead_s + per_token_s * (decodes + prompt), 0.0)
    assert cost.is_ready
    return cost


def test_a_new_sequence_proposes_the_full_length() -> None:
    speculator = Speculator(SpeculationConfig(4))
    drafts = speculator.plan([Candidate(0, COPYING, 10)], 1, StepCostModel())
    assert drafts == {0: (4, 5, 6, 7)}
    # Its own room caps it (max_new_tokens leaves room for drafts plus one token).
    assert speculator.plan([Candidate(0, COPYING, 2)], 1, StepCostModel()) == {0: (4, 5)}


def test_low_acceptance_turns_a_sequence_down_then_to_probes() -> None:
    speculator = Speculator(SpeculationConfig(4))
    cost = StepCostModel()
    lengths = []
    for _ in range(6):
        drafts = speculator.plan([Candidate(0, COPYING, 10)], 1, cost)
        lengths.append(len(drafts.get(0, ())))
        if 0 in drafts:
            speculator.record(0, len(drafts[0]), 1)  # every draft rejected
        else:
            speculator.tick([0])
    assert lengths[0] == 4 and lengths[1] < 4
    assert speculator.alpha(0) < MIN_ALPHA
    assert 0 in lengths  # it stopped proposing
    probes = 0
    for _ in range(PROBE_INTERVAL * 2):
        drafts = speculator.plan([Candidate(0, COPYING, 10)], 1, cost)
        if drafts:
            assert len(drafts[0]) == 1
            probes += 1
            speculator.record(0, 1, 1)
        else:
            speculator.tick([0])
    assert 1 <= probes <= 2
    # Accepted probes bring it back up.
    for _ in range(40):
        drafts = speculator.plan([Candidate(0, COPYING, 10)], 1, cost)
        if drafts:
            speculator.record(0, len(drafts[0]), len(drafts[0]) + 1)
        else:
            speculator.tick([0])
    assert len(speculator.plan([Candidate(0, COPYING, 10)], 1, cost)[0]) == 4


def test_the_cost_fit_decides_whether_a_step_speculates() -> None:
    candidates = [Candidate(i, COPYING, 10) for i in range(2)]
    # Weight-bound (a decode step's fixed part dominates): drafts are nearly free.
    assert Speculator(SpeculationConfig(4)).plan(candidates, 2, fitted(0.030, 0.0005))
    # Compute-bound (every token costs as much as the step's fixed part): no gain.
    assert Speculator(SpeculationConfig(4)).plan(candidates, 2, fitted(0.001, 0.010)) == {}
    # A large batch of the weight-bound machine: 64 decodes already fill the step.
    many = [Candidate(i, COPYING, 10) for i in range(64)]
    assert Speculator(SpeculationConfig(4)).plan(many, 64, fitted(0.030, 0.0005)) == {}


def test_before_the_fit_is_ready_only_small_batches_speculate() -> None:
    candidates = [Candidate(0, COPYING, 10)]
    cost = StepCostModel()
    assert Speculator(SpeculationConfig(2)).plan(candidates, FALLBACK_MAX_BATCH, cost)
    assert Speculator(SpeculationConfig(2)).plan(candidates, FALLBACK_MAX_BATCH + 1, cost) == {}


def test_a_dropped_sequence_starts_afresh_and_config_is_checked() -> None:
    speculator = Speculator(SpeculationConfig(3))
    speculator.plan([Candidate(0, COPYING, 10)], 1, StepCostModel())
    speculator.record(0, 3, 1)
    assert speculator.alpha(0) < 0.5
    speculator.drop(0)
    assert speculator.alpha(0) == 0.5
    with pytest.raises(ValueError, match="num_tokens"):
        SpeculationConfig(0)
    with pytest.raises(ValueError, match="min_ngram"):
        SpeculationConfig(2, 3, 1)


def test_a_draft_model_is_asked_for_guesses_that_become_the_next_drafts() -> None:
    speculator = Speculator(SpeculationConfig(4, draft_model=True))
    cost = StepCostModel()
    tokens = [7, 8, 9]
    assert speculator.proposals([Candidate(0, tokens, 10), Candidate(1, tokens, 2)], 2, cost) == {
        0: 4,
        1: 2,
    }
    # No n-gram lookup: without guesses there are no drafts, even for copying text.
    assert speculator.plan([Candidate(0, COPYING, 10)], 1, cost) == {}
    speculator.offer(0, (11, 12, 13, 14), num_tokens=len(tokens))
    assert speculator.plan([Candidate(0, tokens, 3)], 1, cost) == {0: (11, 12, 13)}
    # Guesses are for the tokens they were made after: once the sequence moved, they are stale.
    assert speculator.plan([Candidate(0, [*tokens, 11], 10)], 1, cost) == {}
    # A batch too large before the fit is ready asks for none.
    many = [Candidate(i, tokens, 10) for i in range(FALLBACK_MAX_BATCH + 1)]
    assert speculator.proposals(many, FALLBACK_MAX_BATCH + 1, cost) == {}


def test_the_draft_models_measured_time_can_turn_guessing_off() -> None:
    candidates = [Candidate(0, COPYING, 10)]
    cheap = Speculator(SpeculationConfig(4, draft_model=True))
    cheap.draft_passes.add(1, 0.001)  # a pass: 1 ms, beside 30 ms steps
    assert cheap.proposals(candidates, 1, fitted(0.030, 0.0005)) == {0: 4}
    dear = Speculator(SpeculationConfig(4, draft_model=True))
    dear.draft_passes.add(1, 0.030)  # a pass as long as a target step
    assert dear.proposals(candidates, 1, fitted(0.030, 0.0005)) == {}


def test_a_draft_models_new_sequences_start_from_the_pooled_acceptance() -> None:
    speculator = Speculator(SpeculationConfig(4, draft_model=True))
    assert speculator.alpha(0) == pytest.approx(0.5)
    for request_id in range(1, 20):
        speculator.alpha(request_id)
        speculator.record(request_id, 4, 5 if request_id % 4 else 3)  # mostly all accepted
    assert speculator.alpha(100) > 0.8
    # N-gram drafts depend on the text: every sequence starts from the prior.
    ngram = Speculator(SpeculationConfig(4))
    for request_id in range(1, 20):
        ngram.alpha(request_id)
        ngram.record(request_id, 4, 5)
    assert ngram.alpha(100) == pytest.approx(0.5)


def test_a_draft_pass_costs_more_with_more_rows() -> None:
    cost = DraftPassCost()
    assert cost.predict(4) == 0.0
    cost.add(1, 0.004)
    assert cost.predict(1) == pytest.approx(0.004)
    assert cost.predict(4) == pytest.approx(0.016)  # one row count seen: in proportion
    for rows, seconds in [(1, 0.004), (2, 0.006), (4, 0.008), (8, 0.012)] * 5:
        cost.add(rows, seconds)
    assert 0.0095 < cost.predict(6) < 0.0105  # the line through 1-8 rows (10 ms at 6)
    # Guesses of 4, 2 and 1 tokens: a pass of 3 rows, one of 2, two of 1.
    assert cost.guessing([4, 2, 1]) == pytest.approx(
        cost.predict(3) + cost.predict(2) + 2 * cost.predict(1)
    )


def test_a_draft_models_probe_of_a_low_rate_sequence_is_verified() -> None:
    speculator = Speculator(SpeculationConfig(4, draft_model=True))
    tokens, cost = [7, 8, 9], StepCostModel()
    speculator.alpha(0)
    for _ in range(3):
        speculator.record(0, 4, 1)  # every guess rejected
    assert speculator.alpha(0) < MIN_ALPHA
    assert speculator.proposals([Candidate(0, tokens, 10)], 1, cost) == {}
    speculator.tick([0] * PROBE_INTERVAL)
    assert speculator.proposals([Candidate(0, tokens, 10)], 1, cost) == {0: 1}
    # The probe's guess is verified in the next step (asking was the probe).
    speculator.offer(0, (5,), num_tokens=len(tokens))
    assert speculator.plan([Candidate(0, tokens, 10)], 1, cost) == {0: (5,)}
