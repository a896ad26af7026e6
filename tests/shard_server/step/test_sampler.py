from __future__ import annotations

import pytest
import torch

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.step.sampler import (
    Sampler,
    SamplingTensors,
    apply_logit_bias,
    apply_penalties,
    apply_warpers,
)
from textgate.shard_server.step.sequence import Sequence, TokenizerInfo


def params(**kwargs: object) -> pb.NextTokenChooserParameters:
    base: dict[str, object] = {
        "temperature": 1.0,
        "top_p": 1.0,
        "typical_p": 1.0,
        "repetition_penalty": 1.0,
    }
    base.update(kwargs)
    return pb.NextTokenChooserParameters(**base)  # type: ignore[arg-type]


def tensors(*rows: pb.NextTokenChooserParameters, top_n: int = 0) -> SamplingTensors:
    info = TokenizerInfo(tokenizer=None, eos_token_ids=frozenset(), special_ids=frozenset())
    requests = [pb.Request(input_ids=[1], parameters=p, top_n_tokens=top_n) for p in rows]
    sequences = [Sequence.from_pb(r, info) for r in requests]
    return SamplingTensors.from_sequences(sequences, torch.device("cpu"))


def test_greedy_rows_take_the_argmax_and_report_logprobs() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    out = Sampler()(logits, tensors(params(), params(), top_n=2))
    assert out.next_ids == [1, 0]
    expected = torch.log_softmax(logits, -1)
    assert out.logprobs == pytest.approx([expected[0, 1].item(), expected[1, 0].item()])
    assert out.top_ids == [[1, 2], [0, 2]]


def test_any_warper_turns_sampling_on_as_tgi_does() -> None:
    sampling = tensors(params(), params(temperature=0.5), params(top_k=3), params(do_sample=True))
    assert sampling.do_sample == [False, True, True, True]


def test_seeded_sampling_is_the_same_alone_and_in_a_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    seeded = params(do_sample=True, seed=1234)
    alone = Sampler()(logits[1:2], tensors(seeded))
    batch = Sampler()(logits, tensors(params(), seeded, params(do_sample=True, seed=7)))
    assert batch.next_ids[1] == alone.next_ids[0]


def test_top_k_and_top_p_keep_only_the_head() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    warped = apply_warpers(logits, tensors(params(top_k=2), params(top_p=0.7)))
    assert torch.isfinite(warped[0]).tolist() == [True, True, False, False]
    assert torch.isfinite(warped[1]).tolist() == [True, True, False, False]


def test_typical_p_drops_the_atypical_tail() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    warped = apply_warpers(logits, tensors(params(typical_p=0.5)))
    assert torch.isfinite(warped[0]).sum() < 4
    assert torch.isfinite(warped[0]).any()


def test_sampling_only_draws_allowed_tokens() -> None:
    logits = torch.zeros(1, 10)
    sampling = tensors(params(top_k=2, seed=3))
    logits[0, 4] = logits[0, 7] = 5.0
    draws = {Sampler()(logits, sampling).next_ids[0] for _ in range(20)}
    assert draws <= {4, 7}


def test_penalties() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    counts = torch.tensor([[1.0, 1.0, 0.0]])
    out = apply_penalties(logits, counts, tensors(params(repetition_penalty=2.0)))
    assert out.tolist() == [[1.0, -4.0, 1.0]]
    out = apply_penalties(logits, counts * 2, tensors(params(frequency_penalty=0.5)))
    assert out.tolist() == [[1.0, -3.0, 1.0]]
    # Presence: the same for every token seen, whatever its count.
    counts = torch.tensor([[3.0, 1.0, 0.0]])
    out = apply_penalties(logits, counts, tensors(params(presence_penalty=0.5)))
    assert out.tolist() == [[1.5, -2.5, 1.0]]


def test_logit_bias_is_added_per_row_before_choosing() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0], [3.0, 2.0, 1.0], [3.0, 2.0, 1.0]])
    biased = params(logit_bias={2: 5.0})
    banned = params(logit_bias={0: -100.0, 7: 9.0})  # 7 is past the vocabulary: left out
    sampling = tensors(params(), biased, banned)
    out = Sampler()(logits, sampling)
    assert out.next_ids == [0, 2, 1]
    assert apply_logit_bias(logits, sampling.logit_bias)[1].tolist() == [3.0, 2.0, 6.0]
    assert logits[1].tolist() == [3.0, 2.0, 1.0], "the caller's logits stay as they were"
    kept = SamplingTensors.concatenate([sampling.select([2]), sampling.select([1])])
    assert kept.logit_bias == [{0: -100.0, 7: 9.0}, {2: 5.0}]


def test_suppressed_tokens_are_never_chosen() -> None:
    logits = torch.tensor([[0.0, 9.0, 1.0]])
    suppress = torch.tensor([[False, True, False]])
    assert Sampler()(logits, tensors(params()), suppress_ids=suppress).next_ids == [2]


def test_greedy_results_come_back_as_python_values() -> None:
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)) * 4
    out = Sampler()(logits, tensors(*[params()] * 5))
    expected = torch.log_softmax(logits, -1)
    assert out.next_ids == expected.argmax(-1).tolist()
    chosen = expected.gather(1, torch.tensor(out.next_ids)[:, None]).squeeze(1)
    assert out.logprobs == pytest.approx(chosen.tolist(), abs=1e-5)
    assert all(isinstance(i, int) for i in out.next_ids)
    assert out.top_ids == out.top_logprobs == [[]] * 5


def test_penalty_flags_follow_rows() -> None:
    sampling = tensors(
        params(),
        params(repetition_penalty=1.3),
        params(frequency_penalty=0.5),
        params(presence_penalty=-0.5),
    )
    assert sampling.penalized == [False, True, True, True]
    assert sampling.any_penalty
    assert not sampling.select([0]).any_penalty
    assert SamplingTensors.concatenate([sampling.select([0]), sampling.select([2])]).penalized == [
        False,
        True,
    ]


def test_min_p_keeps_tokens_near_the_likeliest_after_temperature() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    rows = tensors(params(min_p=0.5), params(min_p=0.2), params(min_p=0.5, temperature=4.0))
    warped = apply_warpers(logits, rows)
    assert torch.isfinite(warped[0]).tolist() == [True, True, False, False]  # 0.3 >= 0.25
    assert torch.isfinite(warped[1]).tolist() == [True, True, True, False]  # 0.15 >= 0.1
    # Temperature 4 flattens the distribution first: everything is within half the top.
    assert torch.isfinite(warped[2]).all()


def test_min_p_alone_does_not_make_a_row_sample() -> None:
    sampling = tensors(params(min_p=0.9), params(min_p=0.9, do_sample=True))
    assert sampling.do_sample == [False, True]
    logits = torch.tensor([[0.0, 1.0, 0.9], [0.0, 1.0, 0.9]])
    draws = {Sampler()(logits, sampling).next_ids[1] for _ in range(10)}
    assert Sampler()(logits, sampling).next_ids[0] == 1 and draws == {1, 2}
