"""End to end: TGI grammars (structured output) on the embedded default model.

Twenty JSON schemas run as one concurrent batch beside unconstrained greedy requests:
every constrained output parses and validates, and the unconstrained ones are exactly
what they are alone (on a float32 server: bfloat16, which `--dtype auto` may pick on a
CPU, rounds differently at other batch sizes, so greedy text can drift whatever the
grammars do). Schemas bound their strings, arrays and numbers, as a schema for a
135M model should: an unbounded string or integer lets it repeat one token until the
budget, which then closes the text (shard_server/step/grammar_budget.py) with what it had.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from huggingface_hub import InferenceClient

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 64

NAME = {"type": "string", "minLength": 1, "maxLength": 16}
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]}),
    ("a yes/no answer", {"type": "boolean"}),
    ("a color", {"enum": ["red", "green", "blue"]}),
    ("a rating", {"type": "integer", "minimum": 1, "maximum": 5}),
    ("a temperature", {"type": "number", "minimum": -50, "maximum": 50}),
    ("three tags", {"type": "array", "items": {"enum": ["news", "sports", "tech", "art"]}, "minItems": 3, "maxItems": 3}),
    ("a city", {"type": "object", "properties": {"city": NAME, "country": NAME, "capital": {"type": "boolean"}}, "required": ["city", "country", "capital"]}),
    ("an address", {"type": "object", "properties": {"street": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "geo": {"type": "object", "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90}, "lon": {"type": "integer", "minimum": -180, "maximum": 180}}, "required": ["lat", "lon"]}}, "required": ["street", "zip", "geo"]}),
    ("a list of scores", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 1, "maxItems": 4}),
    ("a product", {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "price": {"type": "number", "minimum": 0, "maximum": 999}, "stock": {"type": "integer", "minimum": 0, "maximum": 50}}, "required": ["sku", "price", "stock"]}),
    ("a task with an optional note", {"type": "object", "properties": {"title": NAME, "done": {"type": "boolean"}, "note": NAME}, "required": ["title", "done"]}),
    ("a nullable middle name", {"type": "object", "properties": {"first": NAME, "middle": {"type": ["string", "null"], "maxLength": 8}}, "required": ["first", "middle"]}),
    ("a traffic light", {"type": "object", "properties": {"state": {"enum": ["stop", "go", "wait"]}, "seconds": {"type": "integer", "minimum": 1, "maximum": 99}}, "required": ["state", "seconds"]}),
    ("a matrix", {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}),
    ("a team", {"type": "object", "properties": {"team": NAME, "members": {"type": "array", "items": {"type": "object", "properties": {"name": NAME, "lead": {"type": "boolean"}}, "required": ["name", "lead"]}, "minItems": 1, "maxItems": 2}}, "required": ["team", "members"]}),
    ("a constant version", {"type": "object", "properties": {"version": {"const": "1.0"}, "ok": {"type": "boolean"}}, "required": ["version", "ok"]}),
    ("a date", {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"}),
    ("a shape", {"anyOf": [{"type": "object", "properties": {"circle": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["circle"]}, {"type": "object", "properties": {"square": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["square"]}]}),
    ("a percentage", {"type": "object", "properties": {"label": {"enum": ["cpu", "memory"]}, "percent": {"type": "number", "minimum": 0, "maximum": 100}}, "required": ["label", "percent"]}),
    ("a reference", {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x", "y"]}}, "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}, "required": ["start", "end"]}),
]  # fmt: skip
UNCONSTRAINED = ["The capital of France is", "Once upon a time"]


def _prompt(what: str) -> str:
    return f"Write {what} as JSON.\nJSON:"


async def _generate(client: httpx.AsyncClient, inputs: str, **parameters: Any) -> str:
    body = {"inputs": inputs, "parameters": {"max_new_tokens": MAX_NEW_TOKENS, **parameters}}
    answer = await client.post("/generate", json=body)
    assert answer.status_code == 200, answer.text
    text: str = answer.json()["generated_text"]
    return text


@pytest.fixture(scope="module")
def float32_server(
    launch_server: Any, tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> Iterator[str]:
    server = launch_server(
        tmp_path_factory.mktemp("grammar"), "--dtype", "float32", "--max-concurrent-requests", "32"
    )
    try:
        server.wait_ready()
        yield server.url
    finally:
        server.stop()


async def _batch(url: str) -> tuple[list[str], list[str], list[str]]:
    """Unconstrained greedy requests alone, then the same ones beside the 20 schemas."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        alone = [await _generate(client, p) for p in UNCONSTRAINED]
        beside = [_generate(client, p) for p in UNCONSTRAINED]
        constrained = [
            _generate(client, _prompt(what), grammar={"type": "json", "value": schema})
            for what, schema in SCHEMAS
        ]
        results = await asyncio.gather(*beside, *constrained)
    return alone, list(results[: len(UNCONSTRAINED)]), list(results[len(UNCONSTRAINED) :])


def test_twenty_schemas_validate_beside_unchanged_greedy_requests(float32_server: str) -> None:
    assert len(SCHEMAS) == 20
    alone, beside, outputs = asyncio.run(_batch(float32_server))
    for (what, schema), text in zip(SCHEMAS, outputs, strict=True):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise AssertionError(f"{what}: not JSON: {text!r}") from exc
        jsonschema.validate(value, schema)
    assert beside == alone


def test_regex_grammar_is_matched_exactly(live_server: str) -> None:
    pattern = r"(Paris|Lyon|Nice), [0-9]{2}°C"
    answer = httpx.post(
        f"{live_server}/generate",
        json={
            "inputs": "The weather today:",
            "parameters": {"max_new_tokens": 20, "grammar": {"type": "regex", "value": pattern}},
        },
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    assert re.fullmatch(pattern, answer.json()["generated_text"])


def test_streamed_grammar_output_validates(live_server: str) -> None:
    schema = SCHEMAS[0][1]
    body = {
        "inputs": _prompt("a person"),
        "parameters": {"max_new_tokens": MAX_NEW_TOKENS, "details": True, "grammar": {"type": "json", "value": json.dumps(schema)}},
    }  # fmt: skip
    with httpx.stream("POST", f"{live_server}/generate_stream", json=body, timeout=120) as answer:
        lines = [line for line in answer.iter_lines() if line.startswith("data:")]
    final = json.loads(lines[-1].removeprefix("data:"))
    assert final["details"]["finish_reason"] == "eos_token"
    jsonschema.validate(json.loads(final["generated_text"]), schema)


def test_bad_grammars_are_422(live_server: str) -> None:
    def error(grammar: Any) -> dict[str, Any]:
        body = {"inputs": "x", "parameters": {"max_new_tokens": 4, "grammar": grammar}}
        answer = httpx.post(f"{live_server}/generate", json=body, timeout=120)
        assert answer.status_code == 422, answer.text
        payload: dict[str, Any] = answer.json()
        assert payload["error_type"] == "validation"
        return payload

    # The router can tell: not a JSON schema, not a regex, not a grammar shape.
    assert "not a valid JSON schema" in error({"type": "json", "value": {"type": "strin"}})["error"]
    assert "regular expression" in error({"type": "regex", "value": "(unclosed"})["error"]
    assert "`grammar` must be" in error({"type": "lark", "value": "x"})["error"]
    # Only the shard's engine can tell: a valid schema using what it does not support.
    lookbehind = {"type": "string", "pattern": "(?<=a)b"}
    assert "cannot be compiled" in error({"type": "json", "value": lookbehind})["error"]


def test_inference_client_text_generation_with_grammar(live_server: str) -> None:
    client = InferenceClient(base_url=live_server, timeout=120)
    schema = SCHEMAS[12][1]
    text = client.text_generation(
        _prompt("a traffic light"),
        max_new_tokens=MAX_NEW_TOKENS,
        return_full_text=False,
        grammar={"type": "json", "value": schema},
    )
    jsonschema.validate(json.loads(text), schema)


# Issue 31's reproduction: an unbounded integer, 120 new tokens. On the bf16 server the
# greedy answer was `{"city": "New York", "population": 2012000000000…` cut by the budget.
POPULATION = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer", "minimum": 0}},
    "required": ["city", "population"],
}
CITY_PROMPTS = ["What is the largest city in the USA? Answer in JSON.", _prompt("a city")]


async def _details(url: str, inputs: str, **parameters: Any) -> dict[str, Any]:
    body = {"inputs": inputs, "parameters": {"details": True, **parameters}}
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        answer = await client.post("/generate", json=body)
    assert answer.status_code == 200, answer.text
    payload: dict[str, Any] = answer.json()
    return payload


async def _closing_runs(url: str) -> list[tuple[str, dict[str, Any]]]:
    grammar = {"type": "json", "value": POPULATION}
    runs = [(p, {"max_new_tokens": 120, "grammar": grammar}) for p in CITY_PROMPTS]
    for seed in range(12):
        sampled = {"do_sample": True, "seed": seed, "max_new_tokens": 120, "grammar": grammar}
        runs.append((CITY_PROMPTS[seed % 2], sampled))
    # Tight budgets: the shortest answer takes 11 tokens.
    runs += [(CITY_PROMPTS[1], {"max_new_tokens": n, "grammar": grammar}) for n in (12, 16)]
    answers = await asyncio.gather(*(_details(url, p, **params) for p, params in runs))
    return [(json.dumps(params), answer) for (_, params), answer in zip(runs, answers, strict=True)]


def test_json_grammar_text_closes_before_the_budget_ends(live_server: str) -> None:
    runs = asyncio.run(_closing_runs(live_server))
    for params, answer in runs:
        text, details = answer["generated_text"], answer["details"]
        try:
            jsonschema.validate(json.loads(text), POPULATION)
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            raise AssertionError(f"{params}: {text!r}") from exc
        budget = json.loads(params)["max_new_tokens"]
        assert details["generated_tokens"] <= budget
        assert details["finish_reason"] in ("eos_token", "length")
    # The tight budgets end where the budget did, with a text that parses.
    assert all(answer["details"]["finish_reason"] == "length" for _, answer in runs[-2:])


def test_streamed_tokens_spell_the_generated_text(live_server: str) -> None:
    grammar = {"type": "json", "value": POPULATION}
    body = {"inputs": CITY_PROMPTS[0], "parameters": {"max_new_tokens": 40, "grammar": grammar}}
    with httpx.stream("POST", f"{live_server}/generate_stream", json=body, timeout=120) as answer:
        events = [
            json.loads(line.removeprefix("data:"))
            for line in answer.iter_lines()
            if line.startswith("data:")
        ]
    spelled = "".join(e["token"]["text"] for e in events if not e["token"]["special"])
    assert spelled == events[-1]["generated_text"]
    jsonschema.validate(json.loads(spelled), POPULATION)
