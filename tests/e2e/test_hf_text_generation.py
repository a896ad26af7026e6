"""End to end: `huggingface_hub.InferenceClient.text_generation` against the embedded model.

That client posts to the server root (`/`), TGI's compat route.
"""

from __future__ import annotations

import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"


def test_text_generation_with_details(live_server: str) -> None:
    client = InferenceClient(base_url=live_server, timeout=120)
    answer = client.text_generation(
        PROMPT, max_new_tokens=8, details=True, return_full_text=False, decoder_input_details=True
    )
    assert answer.details is not None
    assert answer.details.generated_tokens == len(answer.details.tokens)
    assert answer.details.seed is None
    assert answer.details.prefill and answer.details.prefill[0].logprob is None
    assert answer.details.finish_reason in ("length", "eos_token")
    plain = client.text_generation(PROMPT, max_new_tokens=8, return_full_text=False)
    assert plain == answer.generated_text


def test_text_generation_stream_with_details(live_server: str) -> None:
    client = InferenceClient(base_url=live_server, timeout=120)
    events = list(
        client.text_generation(
            PROMPT, max_new_tokens=8, stream=True, details=True, return_full_text=False
        )
    )
    final = events[-1]
    assert final.details is not None and final.generated_text is not None
    assert final.details.generated_tokens == len(events)
    assert "".join(e.token.text for e in events if not e.token.special) == final.generated_text
    # Without details only token texts come (special ones too); `/` prepends the prompt.
    tokens = list(client.text_generation(PROMPT, max_new_tokens=8, stream=True))
    full_text = client.text_generation(PROMPT, max_new_tokens=8)
    assert full_text.startswith(PROMPT)
    assert (PROMPT + "".join(tokens)).startswith(full_text)


def test_text_generation_maps_validation_errors(live_server: str) -> None:
    client = InferenceClient(base_url=live_server, timeout=120)
    with pytest.raises(ValidationError):
        client.text_generation(PROMPT, max_new_tokens=10**6)
