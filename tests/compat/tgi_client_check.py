"""Drive a server with TGI's own client, `text-generation==0.7.0`, and print a JSON report.

Runs with the compat venv's python, never the project's (see `tgi_venv.py`):

    .venv-compat/bin/python tests/compat/tgi_client_check.py http://127.0.0.1:8080

That client posts to the server root (`/`), so this also checks TGI's compat route. The
report is `{"ok": bool, "checks": {name: {"ok": bool, ...}}}`; exit status 0 when all pass.
Only the standard library and `text_generation` may be imported here.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

from text_generation import Client
from text_generation.errors import ValidationError
from text_generation.types import Message

PROMPT = "The capital of France is"
MAX_NEW_TOKENS = 8
TOP_N = 3
TIMEOUT_S = 120


class CheckFailed(AssertionError):
    """A check's expectation did not hold."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def visible_text(tokens: list[Any]) -> str:
    return "".join(token.text for token in tokens if not token.special)


def check_generate(client: Client) -> dict[str, Any]:
    response = client.generate(PROMPT, max_new_tokens=MAX_NEW_TOKENS)
    details = response.details
    expect(details.generated_tokens == len(details.tokens), "generated_tokens != len(tokens)")
    expect(1 <= details.generated_tokens <= MAX_NEW_TOKENS, "generated_tokens out of range")
    expect(details.seed is None, "greedy generation reported a seed")
    return {
        "generated_text": response.generated_text,
        "finish_reason": details.finish_reason.value,
        "generated_tokens": details.generated_tokens,
    }


def check_generate_details(client: Client) -> dict[str, Any]:
    response = client.generate(
        PROMPT, max_new_tokens=MAX_NEW_TOKENS, decoder_input_details=True, top_n_tokens=TOP_N
    )
    details = response.details
    expect(len(details.prefill) > 0, "decoder_input_details returned no prefill")
    expect(details.prefill[0].logprob is None, "first prefill token has a logprob")
    expect(all(t.logprob is not None for t in details.prefill[1:]), "prefill logprob missing")
    expect(details.top_tokens is not None, "top_n_tokens returned no top_tokens")
    top = details.top_tokens or []
    expect(len(top) == details.generated_tokens, "one top_tokens list per generated token")
    expect(all(len(step) >= TOP_N for step in top), f"fewer than {TOP_N} top tokens in a step")
    return {"prefill_tokens": len(details.prefill), "top_tokens_steps": len(top)}


def check_generate_stream(client: Client) -> dict[str, Any]:
    events = list(client.generate_stream(PROMPT, max_new_tokens=MAX_NEW_TOKENS))
    expect(len(events) >= 1, "empty stream")
    final = events[-1]
    expect(final.details is not None and final.generated_text is not None, "no final event")
    expect(all(e.details is None for e in events[:-1]), "details before the final event")
    expect(final.details.generated_tokens == len(events), "generated_tokens != number of events")
    streamed = visible_text([e.token for e in events])
    expect(streamed == final.generated_text, "joined tokens differ from generated_text")
    greedy = client.generate(PROMPT, max_new_tokens=MAX_NEW_TOKENS).generated_text
    expect(greedy == final.generated_text, "greedy stream differs from greedy generate")
    return {"events": len(events), "finish_reason": final.details.finish_reason.value}


def check_generate_stream_top_n(client: Client) -> dict[str, Any]:
    events = list(client.generate_stream(PROMPT, max_new_tokens=MAX_NEW_TOKENS, top_n_tokens=TOP_N))
    expect(events and events[-1].details is not None, "no final event")
    for event in events:
        expect(event.top_tokens is not None, "an event has no top_tokens")
        expect(len(event.top_tokens or []) >= TOP_N, f"fewer than {TOP_N} top tokens")
    return {"events": len(events)}


def _rejected(call: Callable[[], Any]) -> str:
    try:
        call()
    except ValidationError as err:
        return str(err)
    except Exception as err:
        raise CheckFailed(f"expected ValidationError, got {err!r}") from err
    raise CheckFailed("expected ValidationError, the request succeeded")


def check_validation_errors(client: Client) -> dict[str, Any]:
    """Requests the client lets through but a TGI server must reject with `validation`."""
    bad = {
        "max_new_tokens_too_large": lambda: client.generate(PROMPT, max_new_tokens=10**6),
        "top_n_tokens_too_large": lambda: client.generate(PROMPT, top_n_tokens=1000),
        "too_many_stop_sequences": lambda: client.generate(PROMPT, stop_sequences=["x"] * 64),
        "best_of_too_large": lambda: client.generate(PROMPT, do_sample=True, best_of=64),
        "stream_max_new_tokens_too_large": lambda: list(
            client.generate_stream(PROMPT, max_new_tokens=10**6)
        ),
    }
    return {name: _rejected(call) for name, call in bad.items()}


def check_chat(client: Client) -> dict[str, Any]:
    answer = client.chat([Message(role="user", content="Say hello.")], max_tokens=MAX_NEW_TOKENS)
    expect(len(answer.choices) == 1, "expected one choice")
    choice = answer.choices[0]
    expect(choice.message.role == "assistant", "answer role is not assistant")
    expect(bool(choice.message.content), "empty answer")
    return {"content": choice.message.content, "finish_reason": choice.finish_reason}


CHECKS: dict[str, Callable[[Client], dict[str, Any]]] = {
    "generate": check_generate,
    "generate_details": check_generate_details,
    "generate_stream": check_generate_stream,
    "generate_stream_top_n": check_generate_stream_top_n,
    "validation_errors": check_validation_errors,
    "chat": check_chat,
}


def run(base_url: str) -> dict[str, Any]:
    client = Client(base_url, timeout=TIMEOUT_S)
    checks: dict[str, Any] = {}
    for name, check in CHECKS.items():
        try:
            checks[name] = {"ok": True, **check(client)}
        except Exception as err:
            tail = traceback.format_exc().strip().splitlines()[-6:]
            checks[name] = {"ok": False, "error": repr(err), "traceback": tail}
    return {
        "base_url": base_url,
        "client": "text-generation==0.7.0",
        "ok": all(result["ok"] for result in checks.values()),
        "checks": checks,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: tgi_client_check.py BASE_URL", file=sys.stderr)
        return 2
    report = run(argv[0])
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
