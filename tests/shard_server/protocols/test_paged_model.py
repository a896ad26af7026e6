"""The paged shard engine: router-style plans over a native model equal plain greedy decoding."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.loading.shard_loader import load_model
from textgate.shard_server.protocols.paged_model import CacheConfig, PagedModel

BLOCK = 4


@pytest.fixture(scope="module")
def paged(tiny_model_dir: Path) -> PagedModel:
    model = load_model(
        tiny_model_dir, "tiny", "float32", cache_config=CacheConfig(block_size=BLOCK)
    )
    assert isinstance(model, PagedModel)
    warm = model.warmup(pb.WarmupRequest(max_prefill_tokens=32))
    assert warm.num_blocks > 0 and warm.max_supported_total_tokens == warm.num_blocks * BLOCK
    return model


def reference_greedy(tiny_model_dir: Path, prompt: list[int], steps: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


class MiniPlanner:
    """Just enough of a scheduler: fixed blocks per request, chunks on demand."""

    def __init__(self, first_block: int = 0) -> None:
        self.next_block = first_block
        self.tables: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}

    def admit(self, request: pb.Request) -> None:
        total = len(request.input_ids) + request.stopping_parameters.max_new_tokens
        count = -(-total // BLOCK)
        self.tables[request.id] = list(range(self.next_block, self.next_block + count))
        self.next_block += count
        self.tokens[request.id] = list(request.input_ids)
        self.computed[request.id] = 0

    def chunk(self, request_id: int, limit: int = 10_000) -> pb.ScheduledRequest:
        start = self.computed[request_id]
        tokens = self.tokens[request_id][start : start + limit]
        self.computed[request_id] += len(tokens)
        return pb.ScheduledRequest(
            request_id=request_id,
            token_ids=tokens,
            start_position=start,
            block_table=self.tables[request_id],
            produces_token=self.computed[request_id] == len(self.tokens[request_id]),
        )

    def record(self, generations: list[pb.Generation]) -> None:
        for g in generations:
            self.tokens[g.request_id].extend(g.tokens.ids)


def test_chunked_prefill_and_joining_requests_match_greedy(
    paged: PagedModel, tiny_model_dir: Path, request_factory: Callable[..., pb.Request]
) -> None:
    prompts = {1: [5, 17, 42, 8, 9, 10, 11], 2: [9, 3], 3: [11, 12, 13, 14, 15, 16]}
    lengths = {1: 6, 2: 4, 3: 5}
    requests = {i: request_factory(i, prompts[i], lengths[i]) for i in prompts}
    planner = MiniPlanner()
    outputs: dict[int, list[int]] = {i: [] for i in prompts}
    for r in requests.values():
        planner.admit(r)

    def run(new: list[pb.Request], scheduled: list[pb.ScheduledRequest]) -> None:
        plan = pb.StepPlan(scheduled=scheduled)
        out = paged.step(new, plan)
        planner.record(out.generations)
        for g in out.generations:
            outputs[g.request_id].extend(g.tokens.ids)

    # Request 1's prompt in two chunks; request 2 joins during the second chunk.
    run([requests[1]], [planner.chunk(1, limit=4)])
    run([requests[2]], [planner.chunk(1), planner.chunk(2)])
    run([], [planner.chunk(1), planner.chunk(2)])
    run([requests[3]], [planner.chunk(1), planner.chunk(2), planner.chunk(3, limit=3)])
    while any(i in paged.sequences for i in prompts):
        scheduled = [planner.chunk(i) for i in prompts if i in paged.sequences]
        run([], scheduled)
    for i in prompts:
        assert outputs[i] == reference_greedy(tiny_model_dir, prompts[i], lengths[i])


def test_recompute_after_preemption_continues_the_same_tokens(
    paged: PagedModel, tiny_model_dir: Path, request_factory: Callable[..., pb.Request]
) -> None:
    prompt = [7, 8, 9, 10, 11]
    request = request_factory(20, prompt, 6)
    planner = MiniPlanner(first_block=100)
    planner.admit(request)
    tokens: list[int] = []
    out = paged.step([request], pb.StepPlan(scheduled=[planner.chunk(20)]))
    planner.record(out.generations)
    tokens += out.generations[0].tokens.ids
    out = paged.step([], pb.StepPlan(scheduled=[planner.chunk(20)]))
    planner.record(out.generations)
    tokens += out.generations[0].tokens.ids
    # Preempted: its blocks go elsewhere, everything known is recomputed in new blocks.
    planner.tables[20] = list(range(200, 204))
    planner.computed[20] = 0
    while 20 in paged.sequences:
        out = paged.step([], pb.StepPlan(scheduled=[planner.chunk(20)]))
        planner.record(out.generations)
        for g in out.generations:
            tokens += g.tokens.ids
    assert tokens == reference_greedy(tiny_model_dir, prompt, 6)


def test_prompt_logprobs_over_chunks_and_finished_ids(
    paged: PagedModel, tiny_model_dir: Path, request_factory: Callable[..., pb.Request]
) -> None:
    from transformers import AutoModelForCausalLM

    prompt = [11, 12, 13, 14, 15, 16, 17]
    request = request_factory(30, prompt, 3)
    request.prefill_logprobs = True
    request.top_n_tokens = 3
    planner = MiniPlanner(first_block=300)
    planner.admit(request)
    assert paged.step([request], pb.StepPlan(scheduled=[planner.chunk(30, 3)])).generations == []
    out = paged.step([], pb.StepPlan(scheduled=[planner.chunk(30)]))
    prefill = out.generations[0].prefill_tokens
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.inference_mode():
        logprobs = reference(input_ids=torch.tensor([prompt])).logits[0].log_softmax(-1)
    expected = [logprobs[i, t].item() for i, t in enumerate(prompt[1:])]
    assert list(prefill.ids) == prompt
    assert list(prefill.logprobs[1:]) == pytest.approx(expected, abs=1e-4)
    # With top_n_tokens, each prompt token but the first has its alternatives, over both
    # chunks (what OpenAI's completions give an echoed prompt).
    alternatives = out.generations[0].prefill_top_tokens
    assert len(alternatives) == len(prompt) and not alternatives[0].ids
    top_values, top_ids = logprobs[: len(prompt) - 1].topk(3, dim=-1)
    for i, top in enumerate(alternatives[1:]):
        assert list(top.ids) == top_ids[i].tolist()
        assert list(top.logprobs) == pytest.approx(top_values[i].tolist(), abs=1e-4)
        assert len(top.texts) == 3
    paged.step([], pb.StepPlan(finished_ids=[30]))
    assert 30 not in paged.sequences


def test_unknown_request_is_an_error(paged: PagedModel) -> None:
    plan = pb.StepPlan(scheduled=[pb.ScheduledRequest(request_id=999, token_ids=[1])])
    with pytest.raises(KeyError):
        paged.step([], plan)


def test_clear_forgets_every_sequence(
    paged: PagedModel, request_factory: Callable[..., pb.Request]
) -> None:
    paged.step([request_factory(50, [5, 6], 3)], pb.StepPlan())
    assert 50 in paged.sequences
    paged.clear()
    assert not paged.sequences


def test_stop_token_ids_end_a_request_and_min_new_tokens_suppresses_them(
    paged: PagedModel, tiny_model_dir: Path, request_factory: Callable[..., pb.Request]
) -> None:
    prompt = [5, 17, 42, 8]
    greedy = reference_greedy(tiny_model_dir, prompt, 6)
    stop, at = greedy[0], 0  # the greedy answer's first token

    def generate(request_id: int, min_new_tokens: int) -> tuple[list[int], int]:
        request = request_factory(request_id, prompt, 6)
        request.stopping_parameters.stop_token_ids.append(stop)
        request.stopping_parameters.min_new_tokens = min_new_tokens
        planner = MiniPlanner(first_block=request_id * 8)
        planner.admit(request)
        new, ids, reason = [request], [], None
        while request_id in paged.sequences or new:
            out = paged.step(new, pb.StepPlan(scheduled=[planner.chunk(request_id)]))
            new = []
            planner.record(out.generations)
            for g in out.generations:
                ids.extend(g.tokens.ids)
                if g.HasField("generated_text"):
                    reason = g.generated_text.finish_reason
        assert reason is not None
        return ids, reason

    # Ends at the stop token (even though the request ignores eos), as eos would.
    assert generate(10, 0) == (greedy[: at + 1], pb.FINISH_REASON_EOS_TOKEN)
    # Not before min_new_tokens: the token cannot be chosen until then.
    ids, _ = generate(11, at + 2)
    assert stop not in ids[: at + 2] and len(ids) >= at + 2
