"""Speculation under a grammar: each draft row is masked from the state after the drafts
before it (across the end of a thinking too), a draft the grammar forbids is rejected, the
state follows the emitted tokens only, rows after a budget check are not verified, and a
paged shard verifying drafts gives the tokens plain steps give."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.loading.shard_loader import load_model
from textgate.shard_server.protocols.paged_model import CacheConfig, PagedModel
from textgate.shard_server.step.grammar import GrammarCompiler, GrammarState, MaskFiller
from textgate.shard_server.step.postprocess import SampleRows, append_tokens, sample
from textgate.shard_server.step.sampler import Sampler, SamplingTensors
from textgate.shard_server.step.sequence import Sequence, TokenizerInfo

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer) + 5, [tokenizer.eos_token_id])


def json_grammar(schema: Any) -> pb.Grammar:
    return pb.Grammar(type=pb.GRAMMAR_TYPE_JSON, value=json.dumps(schema))


def allowed_ids(state: GrammarState, vocab_size: int) -> set[int]:
    """The tokens `state`'s mask allows (filled on a fork: `state` is not changed)."""
    filler = MaskFiller()
    pending = filler.start([state.fork()], vocab_size)
    assert pending is not None
    masked = pending.result().apply(torch.zeros(1, vocab_size))[0]
    filler.close()
    return set((masked == 0).nonzero().flatten().tolist())


def state_after(compiler: GrammarCompiler, tokens: list[int]) -> GrammarState:
    state = compiler.state(json_grammar(SCHEMA))
    for token in tokens:
        assert state.accept(token)
    return state


def test_each_draft_row_is_masked_from_the_state_after_the_drafts_before_it(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    vocab = compiler.vocab_size
    drafts = tuple(tokenizer.encode('{"name": "fox", "ok": true}', add_special_tokens=False))
    assert len(drafts) >= 4
    state = compiler.state(json_grammar(SCHEMA))
    filler = MaskFiller()
    conditioned = [drafts[:k] for k in range(len(drafts) + 1)]
    pending = filler.start([state] * len(conditioned), vocab, conditioned)
    assert pending is not None
    masks = pending.result()
    filler.close()
    masked = masks.apply(torch.zeros(len(conditioned), vocab))
    for k, before in enumerate(conditioned):
        allowed = set((masked[k] == 0).nonzero().flatten().tolist())
        assert allowed == allowed_ids(state_after(compiler, list(before)), vocab), k
        if k < len(drafts):
            assert drafts[k] in allowed
    # The sequence's own state has not moved: only its forks accepted the drafts.
    assert masks.states[0] is state
    assert allowed_ids(state, vocab) == allowed_ids(state_after(compiler, []), vocab)


def test_a_draft_the_grammar_forbids_is_rejected_and_the_state_follows_the_output(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    vocab = compiler.vocab_size
    info = TokenizerInfo.from_tokenizer(tokenizer, None)
    request = pb.Request(
        id=0,
        input_ids=[1, 2],
        parameters=pb.NextTokenChooserParameters(seed=0),
        stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=64),
        grammar=json_grammar(SCHEMA),
    )
    seq = Sequence.from_pb(request, info, grammars=compiler)
    opening = tokenizer.encode("{", add_special_tokens=False)[0]
    after_opening = allowed_ids(state_after(compiler, [opening]), vocab)
    forbidden = min(set(range(len(tokenizer))) - after_opening)
    drafts = (opening, forbidden, opening)
    # Every row's likeliest token is its draft (the last row's is token 0): greedy
    # without a grammar would accept all three.
    logits = torch.zeros(len(drafts) + 1, vocab)
    for row, draft in enumerate(drafts):
        logits[row, draft] = 50.0
    logits[:, sorted(after_opening)[0]] += 10.0
    rows = SampleRows.expand([seq], [drafts])
    filler = MaskFiller()
    pending = filler.start([seq.grammar] * len(rows.sequences), vocab, rows.conditioned)
    assert pending is not None
    masks = pending.result()
    filler.close()
    assert masks.states[2] is None and masks.states[3] is None  # past the forbidden draft
    params = SamplingTensors.from_sequences(rows.sequences, CPU, rows.offsets)
    result = sample(Sampler(), logits, rows.sequences, params, info, masks, rows.conditioned)
    (generation,), running = append_tokens([seq], result, info, [drafts], masks)
    ids = list(generation.tokens.ids)
    assert ids[0] == opening and len(ids) == 2
    assert ids[1] != forbidden and ids[1] == sorted(after_opening)[0]
    assert running == [0]
    # The next step starts where the emitted tokens left the grammar.
    assert seq.grammar is masks.states[1]
    assert allowed_ids(seq.grammar, vocab) == allowed_ids(state_after(compiler, ids), vocab)


def test_rows_after_a_budget_check_are_not_verified(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    """Near its budget a row's mask depends on its own logits (the likeliest tokens are
    checked to fit), so the drafts after it wait for the next step. The shortest
    completion of this schema takes 23 of the tiny tokenizer's tokens: with 40 the check
    (16 tokens ahead of it) starts once the name's letters have grown it."""
    vocab = compiler.vocab_size
    drafts = tuple(tokenizer.encode('{"name": "abcdef', add_special_tokens=False))
    state = compiler.state(json_grammar(SCHEMA), max_new_tokens=40)
    conditioned = [drafts[:k] for k in range(len(drafts) + 1)]
    filler = MaskFiller()
    pending = filler.start([state] * len(conditioned), vocab, conditioned)
    assert pending is not None
    states = pending.result().states
    filler.close()
    checked = [k for k, s in enumerate(states) if s is not None and s.needs_check]
    assert checked and checked[0] > 0, checked
    assert all(s is None for s in states[checked[0] + 1 :])
    assert all(s is not None for s in states[: checked[0] + 1])


def test_drafts_that_end_a_thinking_unmask_it_only_before_the_end_token(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    """A reasoning model's drafts running past the token that ends its thinking: the rows
    up to that token are free, the ones after it the grammar's."""
    vocab, think_end = compiler.vocab_size, 101
    markers = pb.ThinkingMarkers(end_token_id=think_end, starts_inside=True)
    grammar = pb.Grammar(type=pb.GRAMMAR_TYPE_REGEX, value="ab", thinking=markers)
    a = tokenizer.encode("a", add_special_tokens=False)[0]
    drafts = (7, think_end, a)
    state = compiler.state(grammar)
    conditioned = [drafts[:k] for k in range(len(drafts) + 1)]
    filler = MaskFiller()
    pending = filler.start([state] * len(conditioned), vocab, conditioned)
    assert pending is not None
    masked = pending.result().apply(torch.zeros(len(conditioned), vocab))
    filler.close()
    allowed = [set((row == 0).nonzero().flatten().tolist()) for row in masked]
    assert allowed[0] == allowed[1] == set(range(vocab))
    grammar_start = compiler.state(pb.Grammar(type=pb.GRAMMAR_TYPE_REGEX, value="ab"))
    assert allowed[2] == allowed_ids(grammar_start, vocab) and a in allowed[2]
    assert grammar_start.accept(a)
    assert allowed[3] == allowed_ids(grammar_start, vocab)
    assert state.thinking  # the request's own state is still inside its thinking


def run(model: PagedModel, request: pb.Request, drafts_from: list[int] | None) -> list[int]:
    """Step `request` to its end; with `drafts_from`, each decode verifies the next four
    tokens of that list as drafts, the second of them replaced by a wrong one."""
    tokens = list(request.input_ids)
    computed = 0
    new = [request]
    num_accepted = 0
    while new or request.id in model.sequences:
        generated = len(tokens) - len(request.input_ids)
        drafts: list[int] = []
        if drafts_from is not None and generated:
            drafts = drafts_from[generated : generated + 4]
            if len(drafts) > 1:
                drafts[1] = (drafts[1] + 7) % 300
        scheduled = pb.ScheduledRequest(
            request_id=request.id,
            token_ids=tokens[computed:] + drafts,
            start_position=computed,
            block_table=list(range(32)),
            produces_token=True,
            num_draft_tokens=len(drafts),
        )
        answer = model.step(new, pb.StepPlan(scheduled=[scheduled]))
        new = []
        (generation,) = answer.generations
        assert not generation.error, generation.error
        ids = list(generation.tokens.ids)
        # The accepted drafts' KV stays: what is computed ends before the last token.
        computed = len(tokens) + len(ids) - 1
        num_accepted += len(ids) - 1
        tokens.extend(ids)
    if drafts_from is not None:
        assert num_accepted > 0, "no draft was accepted: the test verifies nothing"
    return tokens[len(request.input_ids) :]


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize(
    "grammar",
    [json_grammar(SCHEMA), pb.Grammar(type=pb.GRAMMAR_TYPE_REGEX, value="(fox|dog)-[a-z]{3,9}")],
    ids=["json", "regex"],
)
def test_a_shard_verifying_drafts_under_a_grammar_gives_the_plain_steps_tokens(
    tiny_model_dir: Path,
    request_factory: Callable[..., pb.Request],
    grammar: pb.Grammar,
    do_sample: bool,
) -> None:
    """Greedy and seeded sampling, with a budget small enough that its closing steers the
    end: the drafts (the plain output's own next tokens, one of them wrong) change
    nothing but how many tokens each step brings."""
    model = load_model(tiny_model_dir, "tiny", "float32", cache_config=CacheConfig(block_size=4))
    assert isinstance(model, PagedModel)
    model.warmup(pb.WarmupRequest(max_prefill_tokens=64))

    def request(request_id: int) -> pb.Request:
        made = request_factory(
            request_id, [5, 17, 42, 8], 48, ignore_eos=False, do_sample=do_sample, seed=3
        )
        made.grammar.CopyFrom(grammar)
        return made

    plain = run(model, request(1), None)
    assert run(model, request(2), plain) == plain
