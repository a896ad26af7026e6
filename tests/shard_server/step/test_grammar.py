"""Grammars: compiling and caching, masks in the sampler, states advancing to end-of-sequence."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.loading.shard_loader import load_model
from textgate.shard_server.protocols.paged_model import CacheConfig, PagedModel
from textgate.shard_server.step.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarMasks,
    GrammarState,
    MaskFiller,
)
from textgate.shard_server.step.sampler import Sampler, SamplingTensors
from textgate.shard_server.step.sequence import Sequence, TokenizerInfo

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def compiler(tokenizer: Any) -> GrammarCompiler:
    # A vocabulary wider than the tokenizer's, as models pad theirs.
    return GrammarCompiler(tokenizer, len(tokenizer) + 5, [tokenizer.eos_token_id])


def json_grammar(schema: Any) -> pb.Grammar:
    return pb.Grammar(type=pb.GRAMMAR_TYPE_JSON, value=json.dumps(schema))


def allowed_ids(state: GrammarState, vocab_size: int) -> set[int]:
    filler = MaskFiller()
    pending = filler.start([state], vocab_size)
    assert pending is not None
    masked = pending.result().apply(torch.zeros(1, vocab_size))[0]
    filler.close()
    return set((masked == 0).nonzero().flatten().tolist())


def test_a_grammar_is_compiled_once_and_evicted_least_recent_first(tokenizer: Any) -> None:
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [], cache_size=2)
    first, second, third = (json_grammar({"const": n}) for n in (1, 2, 3))
    compiler.compile(first)
    compiler.compile(second)
    compiler.compile(first)  # hit: `second` is now the least recent
    assert compiler.num_compiled == 2
    compiler.compile(third)  # evicts `second`
    compiler.compile(first)
    assert compiler.num_compiled == 3
    compiler.compile(second)
    assert compiler.num_compiled == 4


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        (json_grammar({"type": "string", "pattern": "(?<=a)b"}), "JSON schema cannot be compiled"),
        (pb.Grammar(type=pb.GRAMMAR_TYPE_JSON, value="{nope"), "not JSON"),
        (pb.Grammar(type=pb.GRAMMAR_TYPE_REGEX, value="(a"), "regular expression cannot"),
        (pb.Grammar(type=pb.GRAMMAR_TYPE_EBNF, value="root ::= undefined_rule"), "EBNF"),
        (pb.Grammar(type=pb.GRAMMAR_TYPE_UNSPECIFIED, value="x"), "unknown grammar type"),
    ],
)
def test_what_does_not_compile_is_a_grammar_error(
    compiler: GrammarCompiler, grammar: pb.Grammar, message: str
) -> None:
    with pytest.raises(GrammarError, match=message):
        compiler.compile(grammar)


def test_the_state_allows_only_what_the_grammar_does_then_only_eos(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    state = compiler.state(pb.Grammar(type=pb.GRAMMAR_TYPE_REGEX, value="ab"))
    vocab = compiler.vocab_size
    first = allowed_ids(state, vocab)
    assert first and all(tokenizer.decode([i]) in ("a", "ab") for i in first)
    assert not any(i >= len(tokenizer) for i in first)  # padded vocabulary rows stay masked
    for token in tokenizer.encode("ab", add_special_tokens=False):
        assert state.accept(token)
    assert allowed_ids(state, vocab) == {tokenizer.eos_token_id}
    assert not state.terminated
    assert state.accept(tokenizer.eos_token_id)
    assert state.terminated


def _thinking_grammar(starts_inside: bool) -> pb.Grammar:
    markers = pb.ThinkingMarkers(end_token_id=THINK_END, starts_inside=starts_inside)
    if not starts_inside:
        markers.start_token_id = THINK_START
    return pb.Grammar(type=pb.GRAMMAR_TYPE_REGEX, value="ab", thinking=markers)


THINK_START, THINK_END = 100, 101


def test_thinking_is_free_until_its_end_token_then_the_grammar_holds(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    vocab = compiler.vocab_size
    grammar_first = allowed_ids(
        compiler.state(pb.Grammar(type=pb.GRAMMAR_TYPE_REGEX, value="ab")), vocab
    )
    state = compiler.state(_thinking_grammar(starts_inside=True), max_new_tokens=20)
    assert state.thinking and allowed_ids(state, vocab) == set(range(vocab))
    for token in (7, 8, THINK_START, 9):  # anything, the opening tag included, is thinking
        assert state.accept(token) and state.thinking
    assert state.accept(THINK_END) and not state.thinking
    assert allowed_ids(state, vocab) == grammar_first
    for token in tokenizer.encode("ab", add_special_tokens=False):
        assert state.accept(token)
    assert allowed_ids(state, vocab) == {tokenizer.eos_token_id}
    assert state.accept(tokenizer.eos_token_id) and state.terminated


def test_a_first_token_may_open_the_thinking_or_start_the_grammar(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    vocab = compiler.vocab_size
    grammar_first = allowed_ids(
        compiler.state(pb.Grammar(type=pb.GRAMMAR_TYPE_REGEX, value="ab")), vocab
    )
    opened = compiler.state(_thinking_grammar(starts_inside=False))
    assert not opened.thinking
    assert allowed_ids(opened, vocab) == grammar_first | {THINK_START}
    assert opened.accept(THINK_START) and opened.thinking
    assert allowed_ids(opened, vocab) == set(range(vocab))
    assert opened.accept(THINK_END) and allowed_ids(opened, vocab) == grammar_first
    # A first token of the grammar's: no thinking, and the opening tag is not allowed after.
    straight = compiler.state(_thinking_grammar(starts_inside=False))
    (a,) = tokenizer.encode("a", add_special_tokens=False)
    assert straight.accept(a) and not straight.thinking
    assert THINK_START not in allowed_ids(straight, vocab)


def test_masks_are_filled_on_the_grammar_thread(compiler: GrammarCompiler) -> None:
    seen: list[str] = []

    class Recording(GrammarState):
        def fill(self, bitmask: torch.Tensor, row: int) -> None:
            seen.append(threading.current_thread().name)
            super().fill(bitmask, row)

    inner = compiler.state(json_grammar(SCHEMA))
    filler = MaskFiller()
    assert filler.start([None, None], compiler.vocab_size) is None  # nothing to fill
    pending = filler.start([None, Recording(inner._matcher)], compiler.vocab_size)
    assert pending is not None and pending.result().rows == [1]
    filler.close()
    assert seen and seen[0].startswith("grammar")


def test_sampler_masks_grammar_rows_and_leaves_the_others(compiler: GrammarCompiler) -> None:
    vocab = compiler.vocab_size
    torch.manual_seed(0)
    logits = torch.randn(3, vocab)
    params = _greedy_params(3)
    plain = Sampler()(logits, params)
    state = compiler.state(json_grammar(SCHEMA))
    filler = MaskFiller()
    pending = filler.start([None, state, None], vocab)
    assert pending is not None
    masks = pending.result()
    filler.close()
    constrained = Sampler()(logits, params, grammar=masks)
    assert constrained.next_ids[0] == plain.next_ids[0]
    assert constrained.next_ids[2] == plain.next_ids[2]
    assert constrained.logprobs[0] == plain.logprobs[0]
    assert constrained.next_ids[1] in allowed_ids(compiler.state(json_grammar(SCHEMA)), vocab)


def test_bitmask_words_unpack_to_token_rows() -> None:
    # Token t is bit t % 32 of word t // 32; the sign bit is token 31.
    words = torch.tensor([[0, 0], [1 | (1 << 31) - (1 << 32), 0b100]], dtype=torch.int32)
    masked = GrammarMasks(words, [1]).apply(torch.zeros(2, 40))
    assert (masked[1] == 0).nonzero().flatten().tolist() == [0, 31, 34]
    assert masked[0].eq(0).all()  # a row without a mask is unchanged


def test_a_sequence_finishes_when_its_grammar_is_complete(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    info = TokenizerInfo.from_tokenizer(tokenizer, None)
    request = pb.Request(
        id=1,
        input_ids=[1, 2],
        parameters=pb.NextTokenChooserParameters(seed=0),
        # ignore_eos: the grammar's end still ends the request.
        stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=10, ignore_eos_token=True),
        grammar=pb.Grammar(type=pb.GRAMMAR_TYPE_REGEX, value="ab"),
    )
    seq = Sequence.from_pb(request, info, grammars=compiler)
    finished = False
    for token in [*tokenizer.encode("ab", add_special_tokens=False), tokenizer.eos_token_id]:
        generation, finished = seq.append(token, 0.0, ([], []), info)
    assert finished
    assert generation.generated_text.finish_reason == pb.FINISH_REASON_EOS_TOKEN
    with pytest.raises(GrammarError, match="paged shard"):
        Sequence.from_pb(request, info)


def _greedy_params(rows: int) -> SamplingTensors:
    ones = torch.ones(rows)
    return SamplingTensors(
        temperature=ones,
        top_k=torch.zeros(rows, dtype=torch.int64),
        top_p=ones,
        typical_p=ones,
        min_p=torch.zeros(rows),
        repetition_penalty=ones,
        frequency_penalty=torch.zeros(rows),
        presence_penalty=torch.zeros(rows),
        logit_bias=[{} for _ in range(rows)],
        do_sample=[False] * rows,
        penalized=[False] * rows,
        generators=[torch.Generator() for _ in range(rows)],
        top_n=0,
    )


def test_paged_step_serves_grammar_plain_and_refused_requests_together(
    tiny_model_dir: Path, tokenizer: Any, request_factory: Callable[..., pb.Request]
) -> None:
    model = load_model(tiny_model_dir, "tiny", "float32", cache_config=CacheConfig(block_size=4))
    assert isinstance(model, PagedModel)
    model.warmup(pb.WarmupRequest(max_prefill_tokens=32))
    prompt = [5, 17, 42, 8]

    def run(requests: list[pb.Request]) -> dict[int, list[pb.Generation]]:
        outputs: dict[int, list[pb.Generation]] = {r.id: [] for r in requests}
        tokens = {r.id: list(r.input_ids) for r in requests}
        computed = dict.fromkeys(tokens, 0)
        tables = {r.id: list(range(8 * i, 8 * i + 8)) for i, r in enumerate(requests)}
        new = requests
        while new or any(i in model.sequences for i in tokens):
            scheduled = [
                pb.ScheduledRequest(
                    request_id=i,
                    token_ids=tokens[i][computed[i] :],
                    start_position=computed[i],
                    block_table=tables[i],
                    produces_token=True,
                )
                for i in tokens
                if new or i in model.sequences
            ]
            answer = model.step(new, pb.StepPlan(scheduled=scheduled))
            new = []
            for i in tokens:
                computed[i] = len(tokens[i])
            for g in answer.generations:
                outputs[g.request_id].append(g)
                tokens[g.request_id].extend(g.tokens.ids)
        return outputs

    plain = request_factory(1, prompt, 6, do_sample=False)
    alone = run([plain])[1]
    pattern = pb.Grammar(type=pb.GRAMMAR_TYPE_REGEX, value="(fox|dog) [0-9]{2}")
    constrained = request_factory(2, prompt, 12, ignore_eos=False, do_sample=False)
    constrained.grammar.CopyFrom(pattern)
    refused = request_factory(3, prompt, 6, do_sample=False)
    refused.grammar.CopyFrom(pb.Grammar(type=pb.GRAMMAR_TYPE_REGEX, value="(a"))
    together = run([plain, constrained, refused])
    assert [g.tokens.ids for g in together[1]] == [g.tokens.ids for g in alone]
    text = together[2][-1].generated_text.text
    assert re.fullmatch("(fox|dog) [0-9]{2}", text), text
    (error,) = together[3]
    assert "regular expression cannot be compiled" in error.error and not error.tokens.ids
