"""Shared by the scheduler tests: a fake model that plays the shards and checks the KV
cache it is given, and small helpers that build a scheduler and drive its steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from textgate.router.engine.kv_tiers import KvTransfer, TransferKind
from textgate.router.engine.scheduler import Scheduler
from textgate.router.engine.step_types import ModelStepResult, SchedulerConfig, SchedulerOutput

VOCAB = 50


def next_token(request_id: int, position: int) -> int:
    """The fake model's deterministic choice for the token at `position`."""
    return (request_id * 31 + position * 7) % VOCAB


@dataclass
class FakeModel:
    """Plays the shards: keeps a fake KV cache and checks every step against it.

    A slot holds a key of the whole sequence up to and including its token, standing
    in for KV that depends on everything before it: reading a block that another
    request overwrote, or a prefix hit on the wrong block, fails the check.
    """

    block_size: int
    sequences: dict[int, list[int]] = field(default_factory=dict)
    num_prompt: dict[int, int] = field(default_factory=dict)
    finish_after: dict[int, int] = field(default_factory=dict)
    keys: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    kv: dict[int, tuple[int, int]] = field(default_factory=dict)
    # The KV tiers' blocks by hash (each block's slot keys); demoted ones stay restorable.
    host: dict[bytes, list[tuple[int, int] | None]] = field(default_factory=dict)
    disk: dict[bytes, list[tuple[int, int] | None]] = field(default_factory=dict)

    def add(self, request_id: int, prompt: list[int], finish_after: int = 1_000) -> None:
        self.sequences[request_id] = list(prompt)
        self.num_prompt[request_id] = len(prompt)
        self.finish_after[request_id] = finish_after
        self.keys[request_id] = []

    def outputs(self, request_id: int) -> list[int]:
        return self.sequences[request_id][self.num_prompt[request_id] :]

    def key(self, request_id: int, position: int) -> tuple[int, int]:
        keys, sequence = self.keys[request_id], self.sequences[request_id]
        while len(keys) <= position:
            parent = keys[-1] if keys else (0, 0)
            keys.append((len(keys), hash((parent, sequence[len(keys)]))))
        return keys[position]

    def slot(self, block_table: tuple[int, ...], position: int) -> int:
        size = self.block_size
        return block_table[position // size] * size + position % size

    def transfer(self, transfers: tuple[KvTransfer, ...]) -> None:
        """Run the step's KV-tier copies in plan order, as a shard does."""
        size = self.block_size
        for t in transfers:
            slots = range(t.block_id * size, (t.block_id + 1) * size)
            if t.kind is TransferKind.OFFLOAD:
                self.host[t.block_hash] = [self.kv.get(slot) for slot in slots]
            elif t.kind is TransferKind.RESTORE:
                keys = self.host.get(t.block_hash) or self.disk[t.block_hash]
                for slot, key in zip(slots, keys, strict=True):
                    if key is not None:
                        self.kv[slot] = key
            else:
                self.disk[t.block_hash] = self.host.pop(t.block_hash)

    def run(self, output: SchedulerOutput, latency: float | None = None) -> ModelStepResult:
        self.transfer(output.kv_transfers)
        sampled: dict[int, list[int]] = {}
        finished: set[int] = set()
        for step in output.scheduled:
            rid, sequence = step.request_id, self.sequences[step.request_id]
            assert step.token_ids == tuple(sequence[step.start_position : step.end_position])
            for position in range(step.start_position):
                assert self.kv[self.slot(step.block_table, position)] == self.key(rid, position)
            for offset, slot in enumerate(step.slot_mapping):
                assert slot == self.slot(step.block_table, step.start_position + offset)
                self.kv[slot] = self.key(rid, step.start_position + offset)
            assert step.produces_token == (step.end_position == len(sequence))
            if step.produces_token:
                sequence.append(next_token(rid, step.end_position))
                sampled[rid] = [sequence[-1]]
                if len(self.outputs(rid)) >= self.finish_after[rid]:
                    finished.add(rid)
        return ModelStepResult(sampled, frozenset(finished), latency)


def make_config(**overrides: Any) -> SchedulerConfig:
    values: dict[str, Any] = {
        "num_blocks": 16,
        "block_size": 4,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 8,
        "num_reserved_tokens": 0,
    }
    values.update(overrides)
    return SchedulerConfig(**values)


def make(**overrides: Any) -> tuple[Scheduler, FakeModel]:
    config = make_config(**overrides)
    return Scheduler(config), FakeModel(config.block_size)


def add(
    scheduler: Scheduler,
    model: FakeModel,
    rid: int,
    prompt: list[int],
    max_new: int = 8,
    copies: int | None = None,
    priority: int = 0,
    tenant: str = "",
    weight: float = 1.0,
) -> None:
    scheduler.add_request(
        rid, prompt, max_new, copies=copies, priority=priority, tenant=tenant, weight=weight
    )
    model.add(rid, prompt)


def step(scheduler: Scheduler, model: FakeModel, latency: float | None = None) -> SchedulerOutput:
    """One engine step, checking the limits every step must respect."""
    output = scheduler.schedule()
    assert output.num_scheduled_tokens <= output.token_budget
    assert len(output.scheduled) <= scheduler.config.max_num_seqs
    scheduler.update(model.run(output, latency))
    scheduler.check_invariants()
    return output


def spans(output: SchedulerOutput) -> dict[int, tuple[int, int, bool]]:
    return {
        s.request_id: (s.start_position, s.end_position, s.produces_token) for s in output.scheduled
    }
