"""Admission: the requests an engine has accepted, and how shard answers reach them.

Every admitted request is an `Entry` in an `Admitted` table until it gets its final event
(or its client leaves); the table's size counts against max_concurrent_requests. The
table never calls back into its engine: `fail`, `release` and `route` change the table
and the requests' channels, and say what they did, so the engine frees what it holds for
those requests itself, in its own step.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from textgate.proto import generate_pb2 as pb
from textgate.router.engine.channel import Channel, ErrorEvent, Finished, StepEvent
from textgate.router.engine.quota import current_lease
from textgate.router.engine.request import ValidRequest
from textgate.router.request_record import RequestRecord, current_request
from textgate.router.tracing import RequestTrace
from textgate.router.tracing import current_request as current_trace


class OverloadedError(Exception):
    """More requests than max_concurrent_requests; answered 429."""

    error_type = "overloaded"

    def __init__(self) -> None:
        super().__init__("Model is overloaded")


@dataclass
class Entry:
    """An admitted request: waiting, or in the shards."""

    id: int
    request: ValidRequest
    channel: Channel
    trace: RequestTrace | None = None
    """The HTTP request's span (router/tracing.py); None while tracing is off."""
    record: RequestRecord | None = None
    """The HTTP request's access-log record (router/request_record.py), told how it ended."""
    out_of_time: bool = False
    """Its deadline passed while it ran: its next token is its last (finish reason length)."""

    @property
    def deadline(self) -> float | None:
        """When (time.monotonic()) its `timeout_s` from its arrival runs out; None: never."""
        timeout_s = self.request.timeout_s
        if timeout_s is None:
            return None
        received_at = self.request.received_at
        return (self.channel.queued_at if received_at is None else received_at) + timeout_s

    @property
    def input_length(self) -> int:
        return self.request.input_length

    @property
    def max_new_tokens(self) -> int:
        return self.request.max_new_tokens


@dataclass
class Routed:
    """What one step's answer did to the admitted requests."""

    sampled: dict[int, list[int]] = field(default_factory=dict)
    """Token ids each request received this step."""
    finished: set[int] = field(default_factory=set)
    """Requests that had their final event."""
    failed: list[Entry] = field(default_factory=list)
    """Requests the answer failed: refused by the shard, or lost (neither answered nor kept)."""
    adapter_tokens: dict[str, int] = field(default_factory=dict)
    """Tokens generated this step per LoRA adapter (requests on the base are not counted)."""
    skipped_tokens: list[int] = field(default_factory=list)
    """For each request that finished: its tokens beyond one per step (TGI's skipped
    tokens: those speculation's accepted drafts brought)."""


class Admitted:
    """The admitted requests, by id; at most `max_active` of them."""

    def __init__(self, max_active: int) -> None:
        self.max_active = max_active
        self.closed = False
        """Once set (the engine is closing), nothing more is admitted."""
        self._entries: dict[int, Entry] = {}
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def __getitem__(self, request_id: int) -> Entry:
        return self._entries[request_id]

    def get(self, request_id: int) -> Entry | None:
        return self._entries.get(request_id)

    def admit(self, requests: Sequence[ValidRequest], on_cancel: Callable[[], None]) -> list[Entry]:
        """An entry for each of `requests`, or none of them (OverloadedError; over the
        tenant's tokens per minute, QuotaExceededError); a client that leaves calls
        `on_cancel` (the engine's wake-up)."""
        if self.closed or len(self._entries) + len(requests) > self.max_active:
            raise OverloadedError()
        lease = current_lease()
        if lease is not None:
            lease.reserve(requests)
        entries = []
        record = current_request()
        if record is not None:
            record.prompt = requests[0].inputs if requests else None
        for request in requests:
            channel = Channel(request.input_length)
            entry = Entry(next(self._ids), request, channel, current_trace(), record)
            entry.channel.on_cancel(on_cancel)
            self._entries[entry.id] = entry
            entries.append(entry)
        if lease is not None:
            lease.watch([e.channel for e in entries])
        return entries

    def release(self, entry: Entry) -> None:
        """The request had its final event, or its client left: it no longer counts."""
        self._entries.pop(entry.id, None)

    def fail(
        self, entries: Iterable[Entry], message: str, error_type: str = "generation"
    ) -> list[Entry]:
        """Close each entry's channel with an error event and forget it; gives them back."""
        failed = list(entries)
        for entry in failed:
            entry.channel.push(ErrorEvent(message, error_type))
            if entry.trace is not None:
                entry.trace.failed(entry.channel, entry.input_length, message, error_type)
            self.release(entry)
        return failed

    def fail_ids(
        self, request_ids: Iterable[int], message: str, error_type: str = "generation"
    ) -> list[Entry]:
        """`fail` the requests among `request_ids` that are still admitted."""
        return self.fail(
            [self._entries[i] for i in request_ids if i in self._entries], message, error_type
        )

    def route(
        self,
        generations: Iterable[pb.Generation],
        expected_ids: Iterable[int],
        running: Collection[int] | None = None,
        num_drafts: Mapping[int, int] | None = None,
    ) -> Routed:
        """Send each Generation to its request, release the finished ones, and fail those
        `expected_ids` the shards neither finished nor keep `running` (default: the ones
        answered with a token), which would otherwise wait forever. `num_drafts`: the
        drafts each speculating request had verified in the step (its channel counts them,
        and the ones accepted, before it hears the step's tokens)."""
        drafts = num_drafts or {}
        routed = Routed()
        for generation in generations:
            entry = self._entries.get(generation.request_id)
            if entry is None:
                continue
            if generation.error:
                # The shard could not serve it (a grammar it cannot compile): the
                # request's own fault, as a 422 would have been.
                routed.failed += self.fail([entry], generation.error, "validation")
                continue
            event = StepEvent.from_pb(generation, entry.request.skip_special_tokens)
            if drafts.get(entry.id):
                entry.channel.verified(drafts[entry.id], len(generation.tokens.ids))
            if entry.out_of_time and event.finished is None and event.tokens:
                event = _ended_by_deadline(entry, event)
            entry.channel.push(event)
            routed.sampled[entry.id] = list(generation.tokens.ids)
            adapter = entry.request.adapter_id
            if adapter:
                tokens = routed.adapter_tokens
                tokens[adapter] = tokens.get(adapter, 0) + len(generation.tokens.ids)
            if event.finished is not None:
                if entry.trace is not None:
                    entry.trace.finished(entry.channel, entry.input_length, event.finished)
                if entry.record is not None:
                    entry.record.finish_reason = event.finished.finish_reason
                    entry.record.outputs.append(event.finished.text)
                routed.finished.add(entry.id)
                routed.skipped_tokens.append(entry.channel.num_skipped_tokens)
                self.release(entry)
        kept = routed.sampled.keys() if running is None else running
        lost = [i for i in expected_ids if i not in routed.finished and i not in kept]
        routed.failed += self.fail_ids(lost, "Incomplete generation", "incomplete_generation")
        return routed


def _ended_by_deadline(entry: Entry, event: StepEvent) -> StepEvent:
    """`event` as the request's last: finished by length with the tokens it has. The text
    is left to the readers, whose `TextLedger` spells the tokens' text into it."""
    finished = Finished(
        text="",
        generated_tokens=entry.channel.num_generated + len(event.tokens),
        finish_reason="length",
        seed=entry.request.sampling.seed,
    )
    return dataclasses.replace(event, finished=finished)
