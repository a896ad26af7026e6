"""The scheduler with n-gram speculation, against a fake model that verifies drafts: the
same tokens as without speculation; rejected drafts rolled back (their KV never read as
computed, their blocks never published to the prefix cache); drafts within max_new_tokens,
never preempting; a request cancelled mid-speculation leaves the allocator consistent."""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.router.engine.scheduler_helpers import make_config
from textgate.router.engine.scheduler import Scheduler
from textgate.router.engine.speculation import SpeculationConfig
from textgate.router.engine.step_types import ModelStepResult, SchedulerOutput

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


def truth(prompt: list[int], position: int) -> int:
    """The fake model's token at `position`: the prompt over again, but every 7th position
    differs, so drafts copied from the prompt are accepted in runs and then rejected."""
    token = prompt[position % len(prompt)]
    return token + 10 if position % 7 == 0 else token


def kv_key(tokens: list[int], position: int) -> int:
    """What a slot holds: a key of every token up to `position` (KV depends on all of them)."""
    return hash(tuple(tokens[: position + 1]))


@dataclass
class VerifyingModel:
    """Plays the shards: checks every position read against the KV written for it, writes
    the step's (drafts too), and answers accepted drafts plus its own token."""

    block_size: int
    prompts: dict[int, list[int]] = field(default_factory=dict)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    max_new: dict[int, int] = field(default_factory=dict)
    kv: dict[int, int] = field(default_factory=dict)
    num_drafts: int = 0
    num_accepted: int = 0

    def add(self, rid: int, prompt: list[int], max_new: int) -> None:
        self.prompts[rid], self.tokens[rid], self.max_new[rid] = prompt, list(prompt), max_new

    def slot(self, table: tuple[int, ...], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def run(self, output: SchedulerOutput) -> ModelStepResult:
        sampled: dict[int, list[int]] = {}
        for step in output.scheduled:
            rid, tokens = step.request_id, self.tokens[step.request_id]
            known = len(step.token_ids) - step.num_draft_tokens
            assert step.token_ids[:known] == tuple(tokens[step.start_position :][:known])
            for position in range(step.start_position):
                assert self.kv[self.slot(step.block_table, position)] == kv_key(tokens, position)
            written = tokens[: step.start_position] + list(step.token_ids)
            for offset, slot in enumerate(step.slot_mapping):
                self.kv[slot] = kv_key(written, step.start_position + offset)
            if step.produces_token:
                sampled[rid] = self._verify(rid, step.token_ids[known:])
        return ModelStepResult(sampled)

    def _verify(self, rid: int, drafts: tuple[int, ...]) -> list[int]:
        tokens, emitted = self.tokens[rid], []
        for i in range(len(drafts) + 1):
            emitted.append(truth(self.prompts[rid], len(tokens) + i))
            if i == len(drafts) or emitted[-1] != drafts[i]:
                break
        self.num_drafts += len(drafts)
        self.num_accepted += len(emitted) - 1
        generated = len(tokens) - len(self.prompts[rid])
        assert generated + len(emitted) <= self.max_new[rid], "drafts past max_new_tokens"
        tokens += emitted
        return emitted


def make(speculate: int = 4, **overrides: object) -> tuple[Scheduler, VerifyingModel]:
    values: dict[str, object] = {"num_blocks": 32, "num_reserved_tokens": 0}
    values.update(overrides)
    config = make_config(
        speculation=SpeculationConfig(speculate, 1, 3) if speculate else None, **values
    )
    return Scheduler(config), VerifyingModel(config.block_size)


def run(scheduler: Scheduler, model: VerifyingModel, limit: int = 500) -> None:
    for _ in range(limit):
        if not scheduler.has_unfinished_requests():
            return
        output = scheduler.schedule()
        assert output.num_scheduled_tokens <= output.token_budget
        scheduler.update(model.run(output))
        scheduler.check_invariants()
    raise AssertionError("requests did not finish")


def outputs(
    speculate: int, max_new: list[int], guessing: bool = False
) -> tuple[dict[int, list[int]], VerifyingModel]:
    """Each request's generated tokens, and the model that verified them (`guessing`: a
    draft model's guesses instead of n-grams)."""
    if guessing:
        config = make_config(
            speculation=SpeculationConfig(speculate, draft_model=True),
            num_blocks=32,
            num_reserved_tokens=0,
        )
        scheduler, model = Scheduler(config), GuessingModel(config.block_size)
    else:
        scheduler, model = make(speculate)
    for rid, n in enumerate(max_new):
        prompt = PROMPT[rid:] + PROMPT[:rid]
        scheduler.add_request(rid, prompt, n)
        model.add(rid, prompt, n)
    run(scheduler, model)
    scheduler.allocator.check_invariants()
    assert scheduler.allocator.num_used_blocks == 0
    return {rid: model.tokens[rid][len(PROMPT) :] for rid in model.tokens}, model


def test_same_tokens_as_without_and_drafts_both_accepted_and_rejected() -> None:
    max_new = [30, 17, 9, 25, 2, 1]
    plain, _ = outputs(0, max_new)
    speculated, model = outputs(4, max_new)
    assert speculated == plain
    assert all(len(speculated[rid]) == n for rid, n in enumerate(max_new))
    assert 0 < model.num_accepted < model.num_drafts


def test_rejected_drafts_are_never_published_to_the_prefix_cache() -> None:
    """A second request whose prompt is the first's prompt and output hits the prefix cache
    on the first's blocks; the model checks every position it reads, so a block published
    with a rejected draft's KV in it would fail the check."""
    scheduler, model = make(4, block_size=2)
    scheduler.add_request(0, PROMPT, 40)
    model.add(0, PROMPT, 40)
    run(scheduler, model)
    assert model.num_accepted < model.num_drafts
    follow = model.tokens[0][:-1]
    scheduler.add_request(1, follow, 5)
    model.add(1, follow, 5)
    hits = scheduler.allocator.num_prefix_hit_tokens
    run(scheduler, model)
    assert scheduler.allocator.num_prefix_hit_tokens - hits >= len(follow) - 2


def test_a_request_cancelled_mid_speculation_leaves_the_allocator_consistent() -> None:
    scheduler, model = make(4)
    for rid in range(3):
        scheduler.add_request(rid, PROMPT, 40)
        model.add(rid, PROMPT, 40)
    cancelled = False
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        result = model.run(output)
        if not cancelled and any(s.num_draft_tokens for s in output.scheduled if s.request_id == 1):
            assert scheduler.abort(1)  # the step is in flight; its answer comes after
            cancelled = True
        scheduler.update(result)
        scheduler.check_invariants()
    assert cancelled and not scheduler.has_unfinished_requests()
    scheduler.allocator.check_invariants()
    assert scheduler.allocator.num_used_blocks == 0


def test_drafts_never_preempt_a_request() -> None:
    """A pool just large enough for two requests without drafts: drafts that need a block
    nobody has are left out, and nobody is preempted for them."""
    scheduler, model = make(8, num_blocks=8, block_size=4)
    for rid in range(2):
        scheduler.add_request(rid, PROMPT[:6], 10)
        model.add(rid, PROMPT[:6], 10)
    run(scheduler, model)
    assert scheduler.num_preemptions == 0


def test_acceptance_feeds_the_speculators_stats() -> None:
    scheduler, model = make(4)
    scheduler.add_request(0, PROMPT, 30)
    model.add(0, PROMPT, 30)
    run(scheduler, model)
    speculator = scheduler.speculator
    assert speculator is not None
    stats = speculator.stats
    assert stats.num_draft_tokens == model.num_drafts
    assert stats.num_accepted_tokens == model.num_accepted
    assert stats.num_emitted_tokens == stats.num_verify_steps + stats.num_accepted_tokens


@dataclass
class GuessingModel(VerifyingModel):
    """Plays shards with a draft model that guesses the truth except every 5th position."""

    asked: int = 0

    def run(self, output: SchedulerOutput) -> ModelStepResult:
        result = super().run(output)
        guesses = {}
        for step in output.scheduled:
            if step.num_proposed_tokens and step.request_id in result.sampled_token_ids:
                self.asked += 1
                start = len(self.tokens[step.request_id])
                guesses[step.request_id] = [
                    truth(self.prompts[step.request_id], p) + (p % 5 == 0)
                    for p in range(start, start + step.num_proposed_tokens)
                ]
        return ModelStepResult(result.sampled_token_ids, proposed_token_ids=guesses, draft_s=1e-4)


def test_a_draft_models_guesses_are_verified_in_the_next_step() -> None:
    max_new = [30, 17, 9, 3, 2]
    plain, _ = outputs(0, max_new)
    guessed, model = outputs(4, max_new, guessing=True)
    assert guessed == plain
    assert isinstance(model, GuessingModel) and model.asked > 0
    assert 0 < model.num_accepted < model.num_drafts


def test_no_guesses_while_a_prompt_is_computed_or_waits() -> None:
    """Two seats and three requests: while the third waits, and in
    steps that compute a prompt, the draft model is asked for nothing."""
    config = make_config(
        speculation=SpeculationConfig(4, draft_model=True),
        num_blocks=32,
        num_reserved_tokens=0,
        max_num_seqs=2,
    )
    scheduler, model = Scheduler(config), GuessingModel(config.block_size)
    for rid in range(3):
        scheduler.add_request(rid, PROMPT, 12)
        model.add(rid, PROMPT, 12)
    asked_alone = False
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        waiting = scheduler.num_waiting
        output = scheduler.schedule()
        prompt_step = any(s.start_position < len(PROMPT) for s in output.scheduled)
        asked = any(s.num_proposed_tokens for s in output.scheduled)
        assert not asked or (waiting == 0 and not prompt_step), output
        asked_alone |= asked
        scheduler.update(model.run(output))
    assert asked_alone and not scheduler.has_unfinished_requests()
