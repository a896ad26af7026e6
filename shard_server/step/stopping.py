"""When a request stops: eos, stop sequences on the decoded text, max_new_tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

from textgate.proto import generate_pb2 as pb


@dataclass
class StoppingCriteria:
    """Per-request stop rules, fed one generated token (and its text delta) at a time."""

    eos_token_ids: frozenset[int]
    max_new_tokens: int
    stop_sequences: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_new_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    """The request's own end-of-sequence ids (they stop it even when it ignores eos)."""
    num_generated: int = 0
    # Only the tail of the text that could still hold a stop sequence is kept.
    _tail: str = field(default="", repr=False)

    @classmethod
    def from_pb(
        cls, params: pb.StoppingCriteriaParameters, eos_token_ids: frozenset[int]
    ) -> StoppingCriteria:
        return cls(
            eos_token_ids=eos_token_ids,
            max_new_tokens=params.max_new_tokens,
            stop_sequences=tuple(s for s in params.stop_sequences if s),
            ignore_eos=params.ignore_eos_token,
            min_new_tokens=params.min_new_tokens,
            stop_token_ids=frozenset(params.stop_token_ids),
        )

    @property
    def suppress_eos(self) -> bool:
        """The sampler must not pick eos yet (min_new_tokens not reached)."""
        return self.suppresses_eos(0)

    def suppresses_eos(self, offset: int) -> bool:
        """Whether eos is suppressed for the token `offset` after the next one (a row
        verifying speculation's drafts)."""
        return self.num_generated + offset < self.min_new_tokens

    def __call__(self, token_id: int, text: str) -> pb.FinishReason.ValueType | None:
        """Record one generated token; return why the request finished, or None."""
        self.num_generated += 1
        if not self.ignore_eos and token_id in self.eos_token_ids:
            return pb.FINISH_REASON_EOS_TOKEN
        if token_id in self.stop_token_ids:
            return pb.FINISH_REASON_EOS_TOKEN
        if self.stop_sequences and text:
            longest = max(len(s) for s in self.stop_sequences)
            self._tail = (self._tail + text)[-(longest + len(text)) :]
            if any(s in self._tail for s in self.stop_sequences):
                return pb.FINISH_REASON_STOP_SEQUENCE
        if self.num_generated >= self.max_new_tokens:
            return pb.FINISH_REASON_LENGTH
        return None
