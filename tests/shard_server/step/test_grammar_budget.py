"""Closing constrained text within its budget: short completions, the checked window, and
a property over schemas, budgets and seeds on the tiny and the embedded tokenizers."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.step.grammar import GrammarCompiler, GrammarState, MaskFiller
from textgate.shard_server.step.grammar_budget import VocabIndex, short_completion
from textgate.shard_server.step.sequence import Sequence, TokenizerInfo

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer", "minimum": 0}},
    "required": ["city", "population"],
}
TEAM = {
    "type": "object",
    "properties": {
        "team": {"type": "string"},
        "members": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "lead": {"type": "boolean"}},
                "required": ["name", "lead"],
            },
        },
    },
    "required": ["team", "members"],
}
CODES = {
    "type": "object",
    "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
        "email": {"type": "string", "pattern": "^[a-z]+@x\\.com$"},
        "note": {"type": "string"},
    },
    "required": ["sku", "email"],
}
ANY_OBJECT = {"type": "object", "additionalProperties": True}
SCHEMAS = [CITY, TEAM, CODES, ANY_OBJECT]


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The masks' tensors are one row: on a busy 2-core machine, two threads for them
    spend ten times longer waiting for each other than working."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=["tiny", "default"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    """The tiny test tokenizer (320 tokens, mostly single bytes) and the embedded model's."""
    fixture = "tiny_model_dir" if request.param == "tiny" else "default_model_dir"
    path: Path = request.getfixturevalue(fixture)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def json_grammar(schema: Any) -> pb.Grammar:
    return pb.Grammar(type=pb.GRAMMAR_TYPE_JSON, value=json.dumps(schema))


@pytest.mark.parametrize(
    ("schema", "prefix", "completion"),
    [
        (CITY, '{"city": "Ne', b'", "population": 0}'),  # a string, then a required integer
        (CITY, '{"city": "x", "population": 12', b"}"),  # a number
        (CITY, "", b'{"city": "", "population": 0}'),
        (
            {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
            "[[1], [3",
            b"]]",
        ),
        (ANY_OBJECT, '{"a": [{"b": "x', b'"}]}'),
        (ANY_OBJECT, '{"a": tr', b"ue}"),
        (CODES, '{"sku": "Q', b'AA-000", "email": "a@x.com"}'),  # patterns
    ],
)
def test_short_completion_closes_what_is_open(
    compiler: GrammarCompiler, schema: Any, prefix: str, completion: bytes
) -> None:
    state = compiler.state(json_grammar(schema))
    assert state._matcher.accept_string(prefix)
    assert short_completion(state._matcher, compiler.vocab_size) == completion
    assert state._matcher.accept_string(completion) and state._matcher.is_completed()


def test_short_completion_of_a_regex_and_of_a_complete_text(compiler: GrammarCompiler) -> None:
    state = compiler.state(pb.Grammar(type=pb.GRAMMAR_TYPE_REGEX, value="[0-9]{3}-[0-9]{4}"))
    assert state._matcher.accept_string("12")
    assert short_completion(state._matcher, compiler.vocab_size) == b"0-0000"
    assert state._matcher.accept_string("3-4567")
    assert short_completion(state._matcher, compiler.vocab_size) == b""


def test_vocab_index_counts_longest_first_and_lists_prefixes() -> None:
    index = VocabIndex([b"<s>", b"a", b"b", b"ab", b'"', b'"}', b"}"], excluded=[0])
    assert index.count(b'ab"}') == 2
    assert index.count(b"") == 0 and index.count(b"c") is None
    assert index.prefixes(b'"}x') == [(4, 1), (5, 2)]
    assert index.prefixes(b"<s>") == []  # excluded (special) tokens spell nothing


def generate(state: GrammarState, vocab: int, budget: int, seed: int, greedy: bool) -> list[int]:
    """Tokens chosen by random logits under the state's masks (a model that wanders)."""
    filler = MaskFiller()
    generator = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for _ in range(budget):
        pending = filler.start([state], vocab)
        assert pending is not None
        logits = torch.randn(1, vocab, generator=generator) * 3
        token = int(pending.result().apply(logits, [not greedy])[0].argmax())
        assert state.accept(token)
        ids.append(token)
        if state.terminated:
            break
    filler.close()
    return ids


def test_every_text_that_can_close_within_its_budget_does(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    """60 requests per tokenizer: random schemas, budgets and wandering models; every one
    whose budget admits the shortest completion ends parsing and matching its schema."""
    num_feasible = num_closed = 0
    for seed in range(60):
        rng = random.Random(seed)
        schema, budget = rng.choice(SCHEMAS), rng.randint(5, 60)
        state = compiler.state(json_grammar(schema), budget)
        shortest = short_completion(state._matcher, compiler.vocab_size)
        assert shortest is not None and state._closer is not None
        need = state._closer._index.count(shortest)
        assert need is not None
        ids = generate(state, compiler.vocab_size, budget, seed, greedy=seed % 2 == 0)
        if budget < need:
            continue  # no text of this schema fits: cut, as before
        num_feasible += 1
        num_closed += state.closed_by_budget
        text = tokenizer.decode([i for i in ids if i != tokenizer.eos_token_id])
        assert len(ids) <= budget
        try:
            jsonschema.validate(json.loads(text), schema)
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            raise AssertionError(f"seed {seed}, budget {budget}: {text!r}") from exc
    assert num_feasible > 30 and num_closed > 15  # the budget did decide many endings


def test_far_from_its_budget_the_mask_is_the_grammars(compiler: GrammarCompiler) -> None:
    def allowed(state: GrammarState) -> list[int]:
        pending = MaskFiller().start([state], compiler.vocab_size)
        assert pending is not None
        masked = pending.result().apply(torch.zeros(1, compiler.vocab_size))
        return masked[0].isfinite().nonzero().flatten().tolist()

    free, budgeted = compiler.state(json_grammar(CITY)), compiler.state(json_grammar(CITY), 500)
    for state in (free, budgeted):
        assert state._matcher.accept_string('{"city": "Ro')
    assert allowed(budgeted) == allowed(free) and not budgeted.closed_by_budget


def test_a_text_the_budget_closed_finishes_as_length(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    info = TokenizerInfo.from_tokenizer(tokenizer, None)

    def run(max_new_tokens: int) -> pb.Generation:
        request = pb.Request(
            id=1,
            input_ids=[1, 2],
            parameters=pb.NextTokenChooserParameters(seed=0),
            stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=max_new_tokens),
            grammar=json_grammar(CITY),
        )
        seq = Sequence.from_pb(request, info, grammars=compiler)
        assert seq.grammar is not None
        filler, generator = MaskFiller(), torch.Generator().manual_seed(1)
        while True:
            pending = filler.start([seq.grammar], compiler.vocab_size)
            assert pending is not None
            logits = torch.randn(1, compiler.vocab_size, generator=generator)
            token = int(pending.result().apply(logits, [False])[0].argmax())
            generation, finished = seq.append(token, 0.0, ([], []), info)
            if finished:
                filler.close()
                return generation

    start = compiler.state(json_grammar(CITY), 1)
    shortest = short_completion(start._matcher, compiler.vocab_size)
    assert shortest is not None and start._closer is not None
    budget = (start._closer._index.count(shortest) or 0) + 4  # room for 4 tokens of a city
    done = run(budget).generated_text
    assert done.finish_reason == pb.FINISH_REASON_LENGTH and done.generated_tokens <= budget
    jsonschema.validate(json.loads(done.text), CITY)
