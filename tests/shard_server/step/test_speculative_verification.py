"""Verifying speculation's drafts in the shard (postprocess.SampleRows, append_tokens):
the acceptance rule keeps the target's distribution (chi-square over many seeds), a seeded
verification draws what plain steps draw, penalties and stops see the drafts before each row,
and the step's inputs give a sequence with k drafts k + 1 logits rows."""

from __future__ import annotations

import pytest
import torch

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.step.postprocess import SampleRows, append_tokens, sample
from textgate.shard_server.step.sampler import Sampler, SamplingTensors
from textgate.shard_server.step.sequence import Sequence, TokenizerInfo
from textgate.shard_server.step.step_inputs import build_step_inputs

VOCAB = 5
CPU = torch.device("cpu")
# Row 0 scores the token after the prompt, row 1 the one after the draft.
P0 = torch.tensor([0.10, 0.40, 0.20, 0.25, 0.05])
P1 = torch.tensor([0.30, 0.05, 0.05, 0.20, 0.40])
DRAFT = 1
CHI2_DF4_P0001 = 18.47
"""The chi-square statistic with 4 degrees of freedom exceeded with probability 0.001."""


class DigitTokenizer:
    """Token i is the text "<i>"."""

    eos_token_id = None
    all_special_ids: tuple[int, ...] = ()

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f"<{i}>" for i in ids)


INFO = TokenizerInfo(DigitTokenizer(), frozenset(), frozenset())


def sequence(seed: int, max_new: int = 10, **stopping: object) -> Sequence:
    request = pb.Request(
        id=0,
        input_ids=[2, 3],
        parameters=pb.NextTokenChooserParameters(temperature=1.0, do_sample=True, seed=seed),
        stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=max_new, **stopping),  # type: ignore[arg-type]
    )
    return Sequence.from_pb(request, INFO)


def verify(seq: Sequence, drafts: tuple[int, ...], logits: torch.Tensor) -> pb.Generation:
    rows = SampleRows.expand([seq], [drafts])
    params = SamplingTensors.from_sequences(rows.sequences, CPU, rows.offsets)
    result = sample(Sampler(), logits, rows.sequences, params, INFO, None, rows.conditioned)
    (generation,), _ = append_tokens([seq], result, INFO, [drafts])
    return generation


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_the_acceptance_rule_keeps_the_targets_distribution() -> None:
    """First token ~ P0 (the draft accepted with probability P0[draft], else a draw from P0
    without it); after an accepted draft, the next ~ P1."""
    logits = torch.stack([P0.log(), P1.log()])
    first = torch.zeros(VOCAB)
    second = torch.zeros(VOCAB)
    for seed in range(2000):
        ids = list(verify(sequence(seed), (DRAFT,), logits).tokens.ids)
        first[ids[0]] += 1
        if ids[0] == DRAFT:
            assert len(ids) == 2
            second[ids[1]] += 1
        else:
            assert len(ids) == 1
    assert chi_square(first, P0) < CHI2_DF4_P0001
    assert chi_square(second, P1) < CHI2_DF4_P0001
    assert abs(first[DRAFT] / first.sum() - P0[DRAFT]) < 0.04


def test_a_seeded_verification_draws_what_plain_steps_draw() -> None:
    logits = torch.stack([P0.log(), P1.log()])
    for seed in range(40):
        speculated = list(verify(sequence(seed), (DRAFT,), logits).tokens.ids)
        plain_seq = sequence(seed)
        plain = [verify(plain_seq, (), logits[:1]).tokens.ids[0]]
        if plain[0] == DRAFT:
            plain.append(verify(plain_seq, (), logits[1:]).tokens.ids[0])
        assert speculated == plain, seed


def test_penalties_count_the_drafts_before_each_row() -> None:
    """A repetition penalty: the row after draft 4 sees 4 as already generated."""
    request = pb.Request(
        id=0,
        input_ids=[0],
        parameters=pb.NextTokenChooserParameters(repetition_penalty=100.0, seed=1),
        stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=5),
    )
    seq = Sequence.from_pb(request, INFO)
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 5.0], [0.0, 0.0, 0.0, 1.0, 5.0]])
    generation = verify(seq, (4,), logits)
    # Greedy: row 0 picks 4 (= the draft), row 1 would pick 4 again but its penalty
    # (the draft counts) makes it 3.
    assert list(generation.tokens.ids) == [4, 3]


def test_a_stop_among_accepted_drafts_ends_the_sequence_there() -> None:
    seq = sequence(0, stop_sequences=["<1><1>"])
    certain = torch.full((3, VOCAB), -30.0)
    certain[:, 1] = 30.0  # every row samples token 1: both drafts accepted
    generation = verify(seq, (1, 1), certain)
    assert list(generation.tokens.ids) == [1, 1]
    assert generation.generated_text.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    seq = sequence(0, max_new=1)
    generation = verify(seq, (1, 1), certain)
    assert list(generation.tokens.ids) == [1]
    assert generation.generated_text.finish_reason == pb.FINISH_REASON_LENGTH


def test_a_step_with_drafts_asks_for_a_logits_row_per_draft_and_one_more() -> None:
    seq = sequence(0)
    seq.all_ids.append(4)  # one generated token: the sequence decodes
    other = Sequence.from_pb(pb.Request(id=1, input_ids=[1, 2, 3]), INFO)
    scheduled = [
        pb.ScheduledRequest(
            request_id=0,
            token_ids=[4, 1, 2],
            start_position=2,
            block_table=[0],
            produces_token=True,
            num_draft_tokens=2,
        ),
        pb.ScheduledRequest(
            request_id=1,
            token_ids=[1, 2, 3],
            start_position=0,
            block_table=[1],
            produces_token=True,
        ),
    ]
    inputs = build_step_inputs(scheduled, {0: seq, 1: other}, 16, CPU, num_blocks=2)
    assert inputs.logits_indices.tolist() == [0, 1, 2, 5]
    assert inputs.sample_rows == [0, 1, 2, 3]
    assert inputs.drafts == [(1, 2), ()]
    assert inputs.positions.tolist() == [2, 3, 4, 0, 1, 2]
    bad = pb.ScheduledRequest(
        request_id=1, token_ids=[1, 2, 3], start_position=0, block_table=[1], num_draft_tokens=1
    )
    with pytest.raises(ValueError, match="drafts need a step that samples"):
        build_step_inputs([bad], {1: other}, 16, CPU, num_blocks=2)
