"""Speculation in /metrics: TGI's skipped tokens per request, textgate's acceptance rate and
tokens per step."""

from __future__ import annotations

from textgate.router.engine.channel import Channel, StepEvent, TokenInfo
from textgate.router.metrics import Metrics


def sample(metrics: Metrics, name: str) -> float:
    for line in metrics.render().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not exported")


def test_speculative_steps_give_acceptance_and_tokens_per_step() -> None:
    metrics = Metrics()
    metrics.speculative_step(num_drafts=8, num_accepted=6, num_emitted=8, num_sequences=2)
    metrics.speculative_step(num_drafts=4, num_accepted=0, num_emitted=1, num_sequences=1)
    assert sample(metrics, "textgate_speculative_draft_tokens") == 12
    assert sample(metrics, "textgate_speculative_accepted_tokens") == 6
    assert sample(metrics, "textgate_speculative_acceptance_rate") == 0.5
    assert sample(metrics, "textgate_speculative_tokens_per_step") == 3.0


def test_skipped_tokens_are_the_tokens_beyond_one_per_step() -> None:
    channel = Channel(input_length=3)
    token = TokenInfo(id=1, text="a", logprob=None)
    channel.push(StepEvent(tokens=[token]))
    channel.push(StepEvent(tokens=[token, token, token]))  # two accepted drafts
    channel.push(StepEvent(tokens=[token, token]))
    assert channel.num_skipped_tokens == 3
    metrics = Metrics()
    metrics.skipped_tokens([channel.num_skipped_tokens, 0])
    assert sample(metrics, "tgi_request_skipped_tokens_count") == 2
    assert sample(metrics, "tgi_request_skipped_tokens_sum") == 3
