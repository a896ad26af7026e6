"""Draft-model speculation in the shard: a tiny model drafting for itself guesses exactly its
own greedy tokens, step after step, through blocks that only just hold the sequence (guesses
past them go to scratch), across a recompute in other blocks, and drafts verified with the
guesses emit the plain greedy text; the guesses respect the model's positions and the block
size, and a finished request gets none."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.loading.shard_loader import load_model
from textgate.shard_server.protocols.paged_model import CacheConfig, PagedModel

BLOCK = 4
PROMPT = [5, 17, 42, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def paged(tiny_model_dir: Path) -> PagedModel:
    model = load_model(
        tiny_model_dir,
        "tiny",
        "float32",
        cache_config=CacheConfig(block_size=BLOCK),
        speculative_model=tiny_model_dir,
    )
    model.warmup(pb.WarmupRequest(max_prefill_tokens=32))
    assert model.draft is not None and model.draft.num_blocks > 0
    return model


@pytest.fixture(scope="module")
def greedy(tiny_model_dir: Path) -> list[int]:
    """The tiny model's plain greedy continuation of PROMPT (transformers' own forward)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = list(PROMPT)
    with torch.inference_mode():
        for _ in range(24):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT) :]


def blocks(first: int, num_tokens: int) -> list[int]:
    """Just enough consecutive blocks for `num_tokens` positions."""
    return list(range(first, first + -(-num_tokens // BLOCK)))


def run(
    paged: PagedModel,
    request: pb.Request,
    num_guesses: int,
    first_block: int = 0,
    relocate_after: int | None = None,
) -> tuple[list[int], list[tuple[int, list[int]]]]:
    """Serve `request` as the router would with draft-model speculation: each step verifies
    the last step's guesses and asks for new ones, in the fewest blocks that hold the step.
    After `relocate_after` steps it is recomputed from position 0 in other blocks (a
    preemption). Returns the generated tokens and (tokens so far, guesses) per step."""
    tokens, computed, drafts = list(request.input_ids), 0, []
    guesses_seen: list[tuple[int, list[int]]] = []
    new = [request]
    for step in range(64):
        if step == relocate_after:
            computed, drafts, first_block = 0, [], first_block + 40
        known = tokens[computed:]
        plan = pb.ScheduledRequest(
            request_id=request.id,
            token_ids=known + drafts,
            start_position=computed,
            block_table=blocks(first_block, len(tokens) + len(drafts)),
            produces_token=True,
            num_draft_tokens=len(drafts),
            num_proposed_tokens=num_guesses,
        )
        response = paged.step(new, pb.StepPlan(scheduled=[plan]))
        new = []
        (generation,) = response.generations
        emitted = list(generation.tokens.ids)
        accepted = len(emitted) - 1
        computed = len(tokens) + min(accepted, len(drafts))
        tokens += emitted
        drafts = list(generation.proposed_token_ids)
        if generation.HasField("generated_text"):
            assert not drafts, "a finished request gets no guesses"
            return tokens[len(request.input_ids) :], guesses_seen
        guesses_seen.append((len(tokens), drafts))
        # The router costs the draft by its passes after the first, which it is told.
        assert (response.draft_pass_ns > 0) == (len(drafts) > 1)
    raise AssertionError("the request did not finish")


def test_a_model_drafting_for_itself_guesses_its_greedy_tokens(
    paged: PagedModel, greedy: list[int], request_factory: Callable[..., pb.Request]
) -> None:
    output, guesses = run(paged, request_factory(1, PROMPT, 20, do_sample=False), 3)
    assert output == greedy[:20]
    for num_tokens, guess in guesses:
        start = num_tokens - len(PROMPT)
        assert guess == greedy[start : start + len(guess)], (num_tokens, guess)
    # Every guess was right, so every step but the last brought four tokens.
    assert all(len(g) == 3 for _, g in guesses[:-2])
    assert len(guesses) <= 20 // 4 + 1


def test_guesses_survive_a_recompute_in_other_blocks(
    paged: PagedModel, greedy: list[int], request_factory: Callable[..., pb.Request]
) -> None:
    output, guesses = run(
        paged, request_factory(2, PROMPT, 20, do_sample=False), 2, relocate_after=2
    )
    assert output == greedy[:20]
    for num_tokens, guess in guesses:
        start = num_tokens - len(PROMPT)
        assert guess == greedy[start : start + len(guess)], (num_tokens, guess)


def test_seeded_sampling_with_guesses_equals_plain_steps(
    paged: PagedModel, request_factory: Callable[..., pb.Request]
) -> None:
    sampling = {"do_sample": True, "temperature": 1.5, "seed": 7}
    guessed, _ = run(paged, request_factory(3, PROMPT, 16, **sampling), 3, first_block=100)
    plain, _ = run(paged, request_factory(4, PROMPT, 16, **sampling), 0, first_block=100)
    assert guessed == plain


def test_guesses_are_capped_by_the_block_size_and_the_positions(
    paged: PagedModel, request_factory: Callable[..., pb.Request]
) -> None:
    assert paged.draft is not None
    positions = paged.draft.max_positions
    _, guesses = run(paged, request_factory(5, PROMPT, 6, do_sample=False), 9, first_block=200)
    assert guesses and all(len(g) == BLOCK for _, g in guesses)
    long_prompt = [3] * (positions - 2)
    request = request_factory(6, long_prompt, 1, do_sample=False)
    paged.draft.max_catch_up = positions  # the whole prompt in one call
    plan = pb.ScheduledRequest(
        request_id=6,
        token_ids=long_prompt,
        start_position=0,
        block_table=blocks(300, positions),
        produces_token=True,
        num_proposed_tokens=4,
    )
    request.stopping_parameters.max_new_tokens = 4
    (generation,) = paged.step([request], pb.StepPlan(scheduled=[plan])).generations
    paged.draft.max_catch_up = 32
    # The sequence is positions - 1 long: two guesses, the first fed at the last position.
    assert len(generation.proposed_token_ids) == 2
    paged.step([], pb.StepPlan(finished_ids=[6]))


def test_a_long_prompt_is_caught_up_over_several_calls(
    paged: PagedModel, request_factory: Callable[..., pb.Request]
) -> None:
    """The draft feeds at most `max_catch_up` (the warmup's prefill size, 32 here) tokens a
    call: a 90-token prompt gets its first guesses at the third call's end, and the tokens
    are the plain run's."""
    prompt = [(7 * i) % 50 + 1 for i in range(90)]
    guessed, steps = run(paged, request_factory(7, prompt, 12, do_sample=False), 3, first_block=400)
    plain, _ = run(paged, request_factory(8, prompt, 12, do_sample=False), 0, first_block=400)
    assert guessed == plain
    assert [len(g) for _, g in steps[:3]] == [0, 0, 3]


def step(
    paged: PagedModel, new: list[pb.Request], rows: list[tuple[int, list[int], int, int]]
) -> dict[int, tuple[list[int], list[int]]]:
    """One step of (request id, tokens, start position, guesses wanted) rows, each in blocks
    600 + 20 * (id % 2) on: request id -> (emitted tokens, guesses)."""
    plans = [
        pb.ScheduledRequest(
            request_id=rid,
            token_ids=tokens,
            start_position=start,
            block_table=blocks(600 + 20 * (rid % 2), 16),
            produces_token=True,
            num_proposed_tokens=num_guesses,
        )
        for rid, tokens, start, num_guesses in rows
    ]
    response = paged.step(new, pb.StepPlan(scheduled=plans))
    return {
        g.request_id: (list(g.tokens.ids), list(g.proposed_token_ids)) for g in response.generations
    }


def test_rows_guessing_different_lengths_and_blocks_other_tokens_overwrote(
    paged: PagedModel, greedy: list[int], request_factory: Callable[..., pb.Request]
) -> None:
    """Two sequences of one prompt guessing 1 and 4 tokens in one call get their greedy
    tokens. Then another prompt sharing only the first block runs in the second one's
    blocks and guesses (its draft KV overwrites theirs past that block), and the second
    is computed again from position 4, as after a preemption with a prefix-cache hit: its
    guesses are still its greedy tokens, since what a block holds is checked, not who had it."""
    new = [request_factory(rid, PROMPT, 12, do_sample=False) for rid in (20, 21)]
    got = step(paged, new, [(20, PROMPT, 0, 1), (21, PROMPT, 0, 4)])
    assert got == {20: ([greedy[0]], greedy[1:2]), 21: ([greedy[0]], greedy[1:5])}
    paged.step([], pb.StepPlan(finished_ids=[20]))
    other = [*PROMPT[:4], 9, 9, 9]
    got = step(paged, [request_factory(23, other, 4, do_sample=False)], [(23, other, 0, 4)])
    assert len(got[23][1]) == 4
    paged.step([], pb.StepPlan(finished_ids=[23]))
    again = step(paged, [], [(21, [*PROMPT[4:], greedy[0]], 4, 4)])
    assert again == {21: ([greedy[1]], greedy[2:6])}
