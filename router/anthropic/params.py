"""Anthropic request fields to the canonical `GenerateParameters`, with Anthropic's ranges.

The validator then applies the router's own rules (token limits, stop count, top_k);
what is checked here is what only Anthropic's API says: `max_tokens` is required and
at least 1, `temperature` is in [0, 1] (0 decodes greedily), `top_p` in (0, 1].
"""

from __future__ import annotations

from textgate.router.anthropic.schemas import MessagesRequest
from textgate.router.generation.schemas import GenerateParameters
from textgate.router.generation.tools import ToolPlan
from textgate.router.generation.validation import ValidationError, Wording

WORDING = Wording("messages", "max_tokens", "truncate", templated=True)
"""How the validator names the request's fields in its messages."""


def generate_parameters(body: MessagesRequest, tools: ToolPlan | None) -> GenerateParameters:
    """The canonical parameters of a Messages request; ValidationError for Anthropic's ranges."""
    if body.max_tokens < 1:
        raise ValidationError(f"`max_tokens` must be >= 1. Given: {body.max_tokens}")
    if body.temperature is not None and not 0 <= body.temperature <= 1:
        raise ValidationError(f"`temperature` must be >= 0 and <= 1. Given: {body.temperature}")
    if body.top_p is not None and not 0 < body.top_p <= 1:
        raise ValidationError(f"`top_p` must be > 0 and <= 1. Given: {body.top_p}")
    greedy = body.temperature == 0
    return GenerateParameters(
        # Anthropic samples unless temperature is 0; the canonical request reads "no
        # warper set" as greedy, so greedy drops the warpers and sampling says so.
        do_sample=not greedy,
        temperature=None if greedy else body.temperature,
        top_p=None if greedy or body.top_p == 1 else body.top_p,
        top_k=None if greedy else body.top_k,
        max_new_tokens=body.max_tokens,
        stop=list(body.stop_sequences or []),
        grammar=None if tools is None else tools.grammar,
        timeout=body.timeout,
    )
