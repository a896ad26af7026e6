"""The soak's traffic: random requests of every API and how each answer is judged.

`plan_request` draws one request (route, streaming, sampling, length; a share invalid on
purpose, a share cancelled by their client); `run_one` sends it and gives an `Outcome`
whose `problem` says why it was unexpected (None: it was as it should be).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Once upon a time, in a small village,",
    "Explain continuous batching in one sentence.",
    "café naïve 東京 🙂 — unicode survives",
    "def fibonacci(n):",
]
CANCEL_SHARE = 0.10
INVALID_SHARE = 0.05
REQUEST_TIMEOUT_S = 300.0


@dataclass
class Outcome:
    kind: str
    status: int
    seconds: float
    tokens: int = 0
    cancelled: bool = False
    problem: str | None = None
    """Why this outcome was unexpected; None when it was as it should be."""


@dataclass
class Plan:
    kind: str
    path: str
    body: dict[str, Any]
    stream: bool
    invalid: bool = False
    cancel_after_s: float | None = None
    """Cancel the request after this long (streams: after their first event)."""


def plan_request(rng: random.Random) -> Plan:
    """One random request (route, streaming, sampling, length; maybe invalid or cancelled)."""
    prompt = rng.choice(PROMPTS)
    max_tokens = rng.randint(1, 24)
    stream = rng.random() < 0.5
    sampled = rng.random() < 0.5
    kind = rng.choice(("generate", "chat", "completions"))
    if kind == "generate":
        parameters: dict[str, Any] = {"max_new_tokens": max_tokens, "details": rng.random() < 0.5}
        if sampled:
            parameters |= {
                "do_sample": True,
                "temperature": round(rng.uniform(0.3, 1.5), 2),
                "top_p": round(rng.uniform(0.5, 0.99), 2),
                "top_k": rng.randint(1, 50),
                "seed": rng.randint(0, 2**31),
            }
        if rng.random() < 0.2:
            parameters["stop"] = [rng.choice([".", "\n", " the"])]
        body: dict[str, Any] = {"inputs": prompt, "parameters": parameters}
        path = "/generate_stream" if stream else "/generate"
    else:
        body = {"max_tokens": max_tokens, "stream": stream, "temperature": 0.0}
        if sampled:
            body |= {"temperature": round(rng.uniform(0.3, 1.5), 2), "seed": rng.randint(0, 2**31)}
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = prompt
            path = "/v1/completions"
    plan = Plan(f"{kind}{'-stream' if stream else ''}", path, body, stream)
    draw = rng.random()
    if draw < INVALID_SHARE:
        plan.invalid = True
        # Each breaks one rule TGI and OpenAI servers reject (a string for an int, a
        # negative temperature, a zero length).
        if kind == "generate":
            body["parameters"]["max_new_tokens"] = rng.choice(["5", 0, -1])
        else:
            body["max_tokens"] = rng.choice(["5", -1])
    elif draw < INVALID_SHARE + CANCEL_SHARE:
        plan.cancel_after_s = rng.uniform(0.0, 0.5)
    return plan


async def run_one(client: httpx.AsyncClient, plan: Plan) -> Outcome:
    started = time.monotonic()
    try:
        if plan.cancel_after_s is not None and not plan.stream:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(client.post(plan.path, json=plan.body), plan.cancel_after_s)
            return Outcome(plan.kind, 0, time.monotonic() - started, cancelled=True)
        if plan.stream:
            return await _stream(client, plan, started)
        response = await client.post(plan.path, json=plan.body)
        outcome = Outcome(plan.kind, response.status_code, time.monotonic() - started)
        outcome.problem = _check_answer(plan, response.status_code, response.text)
        if outcome.problem is None and not plan.invalid:
            outcome.tokens = _count_tokens(plan, response.json())
        return outcome
    except httpx.HTTPError as exc:
        return Outcome(
            plan.kind, 0, time.monotonic() - started, problem=f"{type(exc).__name__}: {exc}"
        )


async def _stream(client: httpx.AsyncClient, plan: Plan, started: float) -> Outcome:
    async with client.stream("POST", plan.path, json=plan.body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode()
            outcome = Outcome(plan.kind, response.status_code, time.monotonic() - started)
            outcome.problem = _check_answer(plan, response.status_code, text)
            return outcome
        events: list[str] = []
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            events.append(line[5:].strip())
            if plan.cancel_after_s is not None:
                await asyncio.sleep(plan.cancel_after_s)
                return Outcome(plan.kind, 200, time.monotonic() - started, cancelled=True)
    outcome = Outcome(plan.kind, 200, time.monotonic() - started)
    if plan.invalid:
        outcome.problem = "an invalid request was streamed"
    elif any('"error"' in event and "error_type" in event for event in events):
        outcome.problem = f"error event: {events[-1][:300]}"
    elif plan.kind == "generate-stream":
        last = json.loads(events[-1]) if events else {}
        outcome.tokens = len(events)
        if last.get("generated_text") is None:
            outcome.problem = "stream ended without its final event"
    else:
        outcome.tokens = len(events) - 1
        if not events or events[-1] != "[DONE]":
            outcome.problem = "stream ended without data: [DONE]"
    return outcome


def _check_answer(plan: Plan, status: int, text: str) -> str | None:
    if plan.invalid:
        return None if status == 422 else f"invalid request answered {status}: {text[:300]}"
    if status != 200:
        return f"{status}: {text[:300]}"
    return None


def _count_tokens(plan: Plan, body: Any) -> int:
    if plan.kind == "generate":
        details = body.get("details")
        return (
            int(details["generated_tokens"])
            if details
            else int(plan.body["parameters"]["max_new_tokens"])
        )
    return int(body["usage"]["completion_tokens"])
