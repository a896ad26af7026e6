from __future__ import annotations

import argparse

import pytest

from textgate.bench.serving.tokenizer import load_tokenizer
from textgate.bench.serving.workload import (
    COPYING_PATH,
    WorkloadSpec,
    add_workload_args,
    build_requests,
    load_conversations,
    spec_from_args,
)


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return load_tokenizer(tiny_tokenizer_dir)


def test_shipped_conversations() -> None:
    chats = load_conversations()
    assert len(chats) >= 50
    for chat in chats:
        assert chat[-1]["role"] == "user"
        assert all(m["role"] in {"system", "user", "assistant"} and m["content"] for m in chat)


def test_synthetic_prompts_have_the_requested_length(tokenizer) -> None:
    requests = build_requests(WorkloadSpec(input_len=40), tokenizer, 6)
    assert [r.prompt_len for r in requests] == [40] * 6
    assert all(tokenizer.count(r.prompt) == 40 for r in requests)
    assert len({r.prompt for r in requests}) == 6  # distinct offsets
    assert all(r.messages is None for r in requests)


def test_prompts_longer_than_the_source_text_wrap_around(tokenizer) -> None:
    requests = build_requests(WorkloadSpec(input_len=3000), tokenizer, 2)
    assert [r.prompt_len for r in requests] == [3000, 3000]


def test_random_length_mix_stays_in_range(tokenizer) -> None:
    requests = build_requests(WorkloadSpec(input_len=40, input_len_range=0.5), tokenizer, 30)
    lengths = [r.prompt_len for r in requests]
    assert all(20 <= n <= 60 for n in lengths)
    assert len(set(lengths)) > 5


def test_prompt_sets_are_reproducible_per_stream(tokenizer) -> None:
    spec = WorkloadSpec(input_len=16, seed=3)
    assert build_requests(spec, tokenizer, 4, stream=1) == build_requests(spec, tokenizer, 4, 1)
    assert build_requests(spec, tokenizer, 4, stream=1) != build_requests(spec, tokenizer, 4, 2)


def test_conversation_requests_render_the_chat_template(tokenizer) -> None:
    requests = build_requests(WorkloadSpec(dataset="conversations"), tokenizer, 60)
    assert len(requests) == 60  # cycles through the ~50 chats
    first = requests[0]
    assert first.messages is not None
    assert first.prompt.endswith("assistant :")
    assert first.prompt_len == tokenizer.count(first.prompt)


def test_copying_requests_give_a_text_their_answer_copies(tokenizer) -> None:
    chats = load_conversations(COPYING_PATH)
    assert len(chats) >= 16
    requests = build_requests(WorkloadSpec(dataset="copying"), tokenizer, 20)
    assert len(requests) == 20  # cycles through the chats
    for request in requests:
        assert request.messages is not None and request.messages[-1]["role"] == "user"
        instruction, _, text = request.messages[-1]["content"].partition("\n\n")
        assert instruction.endswith(":") and len(text) > 80
        assert text in request.prompt


@pytest.mark.parametrize(
    "kwargs", [{"dataset": "sharegpt"}, {"input_len": 0}, {"input_len_range": 1.0}]
)
def test_spec_validation(kwargs) -> None:
    with pytest.raises(ValueError):
        WorkloadSpec(**kwargs)


def test_spec_from_args() -> None:
    parser = argparse.ArgumentParser()
    add_workload_args(parser)
    args = parser.parse_args(["--input-len", "40", "--input-len-range", "0.25", "--seed", "7"])
    assert spec_from_args(args) == WorkloadSpec("synthetic", 40, 0.25, 7)
    assert args.output_len == 64
