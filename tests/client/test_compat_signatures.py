"""`Client`/`AsyncClient` accept the positional order and defaults of `text_generation` 0.7.0.

The expected signatures were read from text-generation 0.7.0 with `inspect.signature`
(its own venv, `.venv-compat/`); textgate may only add keyword-only parameters.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from textgate.client import AsyncClient, Client

GENERATE: list[tuple[str, Any]] = [
    ("prompt", inspect.Parameter.empty),
    ("do_sample", False),
    ("max_new_tokens", 20),
    ("best_of", None),
    ("repetition_penalty", None),
    ("frequency_penalty", None),
    ("return_full_text", False),
    ("seed", None),
    ("stop_sequences", None),
    ("temperature", None),
    ("top_k", None),
    ("top_p", None),
    ("truncate", None),
    ("typical_p", None),
    ("watermark", False),
    ("decoder_input_details", False),
    ("top_n_tokens", None),
    ("grammar", None),
]
STREAM_ONLY_DROPS = {"best_of", "decoder_input_details"}
TGI_0_7_0: dict[str, list[tuple[str, Any]]] = {
    "__init__": [
        ("base_url", inspect.Parameter.empty),
        ("headers", None),
        ("cookies", None),
        ("timeout", 10),
    ],
    "generate": GENERATE,
    "generate_stream": [p for p in GENERATE if p[0] not in STREAM_ONLY_DROPS],
    "chat": [("messages", inspect.Parameter.empty)]
    + [
        (name, None)
        for name in (
            "repetition_penalty",
            "frequency_penalty",
            "logit_bias",
            "logprobs",
            "top_logprobs",
            "max_tokens",
            "n",
            "presence_penalty",
        )
    ]
    + [("stream", False)]
    + [(name, None) for name in ("seed", "temperature", "top_p", "tools", "tool_choice")],
}


@pytest.mark.parametrize("cls", [Client, AsyncClient])
@pytest.mark.parametrize("method", sorted(TGI_0_7_0))
def test_signature_matches_text_generation(cls: type, method: str) -> None:
    parameters = list(inspect.signature(getattr(cls, method)).parameters.values())[1:]
    positional = [p for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in positional] == TGI_0_7_0[method]
    extras = [p for p in parameters if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extras)
