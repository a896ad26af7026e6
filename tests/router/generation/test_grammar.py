"""TGI's `parameters.grammar` shapes to GrammarSpecs, and what the router refuses itself."""

from __future__ import annotations

import json
from typing import Any

import pytest

from textgate.router.engine.request import GrammarSpec
from textgate.router.generation.grammar import GrammarSpecError, parse_grammar

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    "grammar",
    [
        {"type": "json", "value": SCHEMA},
        {"type": "json", "value": json.dumps(SCHEMA)},
        {"type": "json_object", "value": SCHEMA},
        {"type": "json_schema", "value": {"name": "thing", "schema": SCHEMA}},
    ],
)
def test_json_grammars_carry_the_schema_as_json(grammar: dict[str, Any]) -> None:
    spec = parse_grammar(grammar)
    assert spec.kind == "json" and json.loads(spec.value) == SCHEMA


def test_regex_grammar_and_true_schema() -> None:
    assert parse_grammar({"type": "regex", "value": "a+"}) == GrammarSpec("regex", "a+")
    assert parse_grammar({"type": "json", "value": True}) == GrammarSpec("json", "{}")


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        ("json", "`grammar` must be"),
        ({"type": "json", "value": SCHEMA, "extra": 1}, "`grammar` must be"),
        ({"type": "lark", "value": "x"}, "unknown type 'lark'"),
        ({"type": "json", "value": "{oops"}, "not JSON"),
        ({"type": "json", "value": 5}, "schema object or a JSON string"),
        ({"type": "json", "value": {"type": "strin"}}, "not a valid JSON schema at type"),
        ({"type": "json", "value": {"minimum": "1"}}, "not a valid JSON schema at minimum"),
        ({"type": "json_schema", "value": SCHEMA}, '"schema": {...}'),
        ({"type": "regex", "value": ""}, "non-empty string"),
        ({"type": "regex", "value": "[a-"}, "not a valid regular expression"),
    ],
)
def test_malformed_grammars_are_refused(grammar: Any, message: str) -> None:
    with pytest.raises(GrammarSpecError, match=message.replace("{", r"\{").replace("(", r"\(")):
        parse_grammar(grammar)
